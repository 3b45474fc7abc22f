"""Shared test infrastructure: services, markers by directory, namespaces, leak check.

Services come from ``--pg-url`` / ``--broker-url`` (or the environment variables
CELERY_PGLOCK_TEST_DATABASE_URL / CELERY_PGLOCK_TEST_BROKER_URL); whatever is not given
is started privately for the session by :func:`celery_pglock.testing.start_services`.
So ``pytest`` passes on a bare machine, and CI points it at its service containers.

Markers follow the directory: tests/integration -> postgres + redis; tests/acceptance ->
worker + postgres + redis. ``pytest -m "not postgres and not redis and not worker"`` is
the fast inner loop (no services are started for it).
"""

from __future__ import annotations

import contextlib
import os
import re
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil  # type: ignore[import-untyped, unused-ignore]  # no stubs
import pytest

from celery_pglock import config
from celery_pglock.db import engines
from celery_pglock.lock import sessions
from celery_pglock.testing import (
    BROKER_URL_ENV,
    DATABASE_URL_ENV,
    EmbeddedPostgres,
    OverlapRecorder,
    ServiceError,
    Services,
    WorkerProcess,
    _support,
    pgbouncer,
    start_services,
    strategies,
)
from celery_pglock.testing.pgbouncer import PgBouncer
from celery_pglock.testing.postgres import SUPERUSER as SUPERUSER_NAME
from tests.integration import netns

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator, Mapping

    import sqlalchemy as sa

TESTS_DIR = Path(__file__).resolve().parent
REPO_ROOT = TESTS_DIR.parent
DIRECTORY_MARKERS = {
    "integration": ("postgres", "redis"),
    "acceptance": ("worker", "postgres", "redis"),
}
#: application_name prefix of lock sessions; see celery_pglock.db.engines.
LOCK_APPLICATION_PREFIX = engines.DEFAULT_APPLICATION_NAME
#: How long the leak check waits for asynchronous releases (worker processes).
LEAK_CHECK_SECONDS = 2.0
LEAKED_LOCKS_SQL = """
    SELECT l.pid, l.classid, l.objid, l.objsubid, a.application_name, a.state, a.query
    FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
    WHERE l.locktype = 'advisory' AND l.granted
      AND a.application_name LIKE %s AND l.pid <> pg_backend_pid()
    ORDER BY l.pid
"""
#: Set to 1 (CI) to fail, rather than deselect, PgBouncer tests without the binary.
REQUIRE_PGBOUNCER_ENV = "CELERY_PGLOCK_REQUIRE_PGBOUNCER"
#: Warnings for the summary: tests deselected for want of something on this machine.
_DESELECTED_NOTICES: list[str] = []
#: "host:pid" inside a lock session's application_name (see engines.process_tag()).
PROCESS_TAG = re.compile(r"(\S+):(\d+)")


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("celery-pglock")
    group.addoption(
        "--pg-url",
        default=os.environ.get(DATABASE_URL_ENV),
        help=f"SQLAlchemy URL of a PostgreSQL to test against (env {DATABASE_URL_ENV}); "
        "default: start an embedded one",
    )
    group.addoption(
        "--broker-url",
        default=os.environ.get(BROKER_URL_ENV),
        help=f"Celery broker URL (env {BROKER_URL_ENV}); default: start an embedded Redis",
    )


def pytest_configure(config: pytest.Config) -> None:
    # Options win over the environment, and go back into it so that subprocesses
    # (workers, helper scripts) see the same services.
    for option, variable in (
        ("--pg-url", DATABASE_URL_ENV),
        ("--broker-url", BROKER_URL_ENV),
    ):
        value = config.getoption(option)
        if value:
            os.environ[variable] = value


def pytest_collection_modifyitems(
    config: pytest.Config, items: list[pytest.Item]
) -> None:
    for item in items:
        try:
            tier = item.path.resolve().relative_to(TESTS_DIR).parts[0]
        except (ValueError, IndexError):
            continue
        for marker in DIRECTORY_MARKERS.get(tier, ()):
            item.add_marker(marker)
    _deselect_pgbouncer_tests_without_pgbouncer(config, items)
    _deselect_netns_tests_without_netns(config, items)


def _deselect_pgbouncer_tests_without_pgbouncer(
    config: pytest.Config, items: list[pytest.Item]
) -> None:
    """Without the pgbouncer binary, deselect its tests, loudly; unless CI requires them.

    PgBouncer is the one service the test session cannot bring itself (no wheel ships
    it), and the test command must pass on a bare laptop. So its tests are deselected
    there with a warning in the summary; CI installs the Debian package and sets
    REQUIRE_PGBOUNCER_ENV=1, which turns a missing binary back into failures.
    """
    if pgbouncer.find_binary() is not None:
        return
    if os.environ.get(REQUIRE_PGBOUNCER_ENV) == "1":
        return  # the tests run, and fail naming the missing binary
    needing = [item for item in items if item.get_closest_marker("pgbouncer")]
    if not needing:
        return
    items[:] = [item for item in items if item not in needing]
    config.hook.pytest_deselected(items=needing)
    _DESELECTED_NOTICES.append(
        f"{len(needing)} PgBouncer tests were NOT run: no pgbouncer binary on this "
        f"machine (apt-get install pgbouncer to run them; CI sets "
        f"{REQUIRE_PGBOUNCER_ENV}=1 and requires them)."
    )


def _deselect_netns_tests_without_netns(
    config: pytest.Config, items: list[pytest.Item]
) -> None:
    """Without root, ``ip`` or network namespaces, deselect the tests that build a client
    host of their own, loudly; unless CI requires them (netns.REQUIRE_ENV=1), where they
    run and fail naming what is missing."""
    needing = [item for item in items if item.get_closest_marker("netns")]
    if not needing or os.environ.get(netns.REQUIRE_ENV) == "1":
        return
    missing = netns.missing()
    if not missing:
        return
    items[:] = [item for item in items if item not in needing]
    config.hook.pytest_deselected(items=needing)
    _DESELECTED_NOTICES.append(
        f"{len(needing)} network-namespace tests were NOT run: this machine lacks "
        f"{', '.join(missing)} (CI sets {netns.REQUIRE_ENV}=1 and requires them)."
    )


def pytest_terminal_summary(terminalreporter: Any) -> None:
    for notice in _DESELECTED_NOTICES:
        terminalreporter.write_sep("!", notice, yellow=True, bold=True)


# -- services ---------------------------------------------------------------------------


@pytest.fixture(scope="session")
def services() -> Iterator[Services]:
    """The session's PostgreSQL, broker and result backend (embedded unless configured).

    $CELERY_PGLOCK_TEST_DRIVER (psycopg2 or psycopg) picks the lock driver: the embedded
    server's URLs name it, and a configured URL gets it too.
    """
    with pytest.MonkeyPatch.context() as patch:
        configured = os.environ.get(DATABASE_URL_ENV)
        if configured and os.environ.get(_support.DRIVER_ENV):
            patch.setenv(
                DATABASE_URL_ENV, _support.with_driver(configured, _support.driver())
            )
        started = start_services()
        for variable, value in started.env().items():
            if variable != config.DATABASE_URL_ENV:  # tests of "no URL" need it unset
                patch.setenv(variable, value)
        try:
            yield started
        finally:
            started.stop()


@pytest.fixture(scope="session")
def database_url(services: Services) -> str:
    return services.database_url


@pytest.fixture(scope="session")
def broker_url(services: Services) -> str:
    return services.broker_url


@pytest.fixture(scope="session")
def result_backend_url(services: Services) -> str:
    return services.result_backend_url


@pytest.fixture
def namespace() -> str:
    """A lock namespace of this test's own: tests never contend for each other's keys."""
    return f"t-{uuid.uuid4().hex[:8]}"


@pytest.fixture(params=["per_process", "per_lock"])
def session_mode(request: pytest.FixtureRequest) -> Iterator[str]:
    """Both lock-session strategies: every test using this runs once per mode
    (``per_lock``: session-scope try-locks too on a pooled connection of their own)."""
    strategies.use_per_lock_sessions(request.param == "per_lock")
    yield str(request.param)
    strategies.use_per_lock_sessions(False)


@pytest.fixture
def lock_engine(database_url: str, session_mode: str) -> Iterator[sa.Engine]:
    """A lock engine (celery_pglock.db.engines.create_engine) in each session mode, disposed after."""
    engine = engines.create_engine(database_url)
    yield engine
    sessions.close_for(engine)
    engine.dispose()


@pytest.fixture
def private_postgres() -> Iterator[EmbeddedPostgres]:
    """A PostgreSQL of this test's own, for tests that crash or restart the server."""
    server = EmbeddedPostgres()
    try:
        yield server.start()
    finally:
        server.cleanup()


#: The role of :func:`password_postgres`, its password, and a role pg_hba.conf trusts
#: but that does not exist (so the server says so, where password methods hide it).
PASSWORD_ROLE = "app"
ROLE_PASSWORD = "right-pw-never-logged"
GHOST_ROLE = "ghost"


@pytest.fixture
def password_postgres(private_postgres: EmbeddedPostgres) -> EmbeddedPostgres:
    """A private PostgreSQL that asks for passwords over TCP: role ``app`` has one (the
    trusted superuser of ``url()`` still gets in), and role ``ghost`` is trusted but
    does not exist."""
    (private_postgres.data_dir / "pg_hba.conf").write_text(
        "local all all trust\n"
        f"host all {SUPERUSER_NAME} {_support.HOST}/32 trust\n"
        f"host all {GHOST_ROLE} {_support.HOST}/32 trust\n"
        f"host all all {_support.HOST}/32 scram-sha-256\n"
    )
    connection = _support.connect(private_postgres.url(), application_name="test setup")
    try:
        with connection.cursor() as cursor:
            cursor.execute(
                f"CREATE ROLE {PASSWORD_ROLE} LOGIN PASSWORD %s", (ROLE_PASSWORD,)
            )
            cursor.execute("SELECT pg_reload_conf()")
    finally:
        connection.close()
    # pg_reload_conf() only signals the postmaster; a new connection shows it took effect.
    wrong = private_postgres.url().replace(
        f"//{SUPERUSER_NAME}@", f"//{PASSWORD_ROLE}:wrong@"
    )
    assert _support.wait_until(lambda: _refused(wrong), timeout=10)
    return private_postgres


def _refused(url: str) -> bool:
    try:
        _support.connect(url, application_name="test setup").close()
    except Exception:
        return True
    return False


@pytest.fixture
def overlap(database_url: str) -> Iterator[OverlapRecorder]:
    """An OverlapRecorder on the test database, its table created."""
    recorder = OverlapRecorder(database_url)
    recorder.setup()
    yield recorder
    recorder.close()


@pytest.fixture
def worker_factory(
    services: Services, tmp_path: Path
) -> Iterator[Callable[..., WorkerProcess]]:
    """Start ``celery worker`` subprocesses: ``worker_factory("tests.acceptance.app", ...)``.

    Keyword arguments go to WorkerProcess, plus ``timeout`` for start(). The worker's
    environment points at the session's services and puts the repository root on
    PYTHONPATH. Every worker is stopped (then killed) at teardown; their log tails are
    printed, which pytest shows when the test failed.
    """
    workers: list[WorkerProcess] = []
    pythonpath = os.pathsep.join(
        filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])
    )

    def start(
        app: str,
        *,
        timeout: float = 60.0,
        env: Mapping[str, str] | None = None,
        **options: Any,
    ) -> WorkerProcess:
        options.setdefault("log_path", tmp_path / f"worker-{len(workers) + 1}.log")
        worker = WorkerProcess(
            app,
            env={**services.env(), "PYTHONPATH": pythonpath, **(env or {})},
            **options,
        )
        workers.append(worker)
        return worker.start(timeout)

    yield start
    errors: list[Exception] = []
    for worker in reversed(workers):
        try:
            worker.stop(timeout=15)
        except Exception as exc:  # stop the others anyway
            errors.append(exc)
        with contextlib.suppress(ServiceError):  # never started: no log
            print(_support.with_log(f"worker {worker.hostname}", worker.log_path))
    if errors:
        raise errors[0]


@pytest.fixture
def pgbouncer_factory(database_url: str) -> Iterator[Callable[..., PgBouncer]]:
    """Start PgBouncers in front of the test database: ``pgbouncer_factory("transaction")``.

    Keyword arguments are more ``[pgbouncer]`` settings. All are stopped at teardown.
    """
    started: list[PgBouncer] = []

    def start(pool_mode: str, **settings: str) -> PgBouncer:
        bouncer = PgBouncer(database_url, pool_mode=pool_mode, settings=settings)
        started.append(bouncer)
        return bouncer.start()

    yield start
    for bouncer in reversed(started):
        bouncer.stop()


# -- leak check -------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def _no_leaked_advisory_locks(request: pytest.FixtureRequest) -> Iterator[None]:
    """After each postgres test: no granted advisory lock is left in a session of ours.

    Releases by worker processes are asynchronous to the test, so the check retries for
    up to LEAK_CHECK_SECONDS. Only sessions opened by this process or its descendants
    count (by the host:pid in their application_name), so test runs sharing one server
    do not fail each other.
    """
    if request.node.get_closest_marker("postgres") is None:
        yield
        return
    database_url = request.getfixturevalue("database_url")
    yield
    rows: list[tuple[Any, ...]] = []
    deadline = time.monotonic() + LEAK_CHECK_SECONDS
    while True:
        rows = _leaked_locks(database_url)
        if not rows or time.monotonic() >= deadline:
            break
        time.sleep(0.1)
    if rows:
        lines = "\n".join(
            "  pid={} classid={} objid={} objsubid={} application_name={!r} state={} query={!r}".format(
                *row
            )
            for row in rows
        )
        pytest.fail(
            f"Advisory locks still held after the test:\n{lines}", pytrace=False
        )


def _leaked_locks(database_url: str) -> list[tuple[Any, ...]]:
    connection = _support.connect(
        database_url, application_name="celery_pglock tests leak-check"
    )
    try:
        with connection.cursor() as cursor:
            cursor.execute(LEAKED_LOCKS_SQL, (LOCK_APPLICATION_PREFIX + "%",))
            rows = cursor.fetchall()
    finally:
        connection.close()
    family = _our_process_tags()
    return [row for row in rows if _is_ours(row[4], family)]


def _our_process_tags() -> tuple[str, set[int]]:
    """This host's tag (as engines.process_tag() writes it) and this process tree's pids."""
    host = engines.process_tag().rsplit(":", 1)[0]
    me = psutil.Process()
    return host, {me.pid, *(child.pid for child in me.children(recursive=True))}


def _is_ours(application_name: str | None, family: tuple[str, set[int]]) -> bool:
    """A session of this test run: opened by our process tree, or by a process of this
    host that is gone (its session outlived it; the retry gives it time to end)."""
    match = PROCESS_TAG.search(application_name or "")
    if match is None:
        return True
    host, pids = family
    pid = int(match.group(2))
    return match.group(1) == host and (pid in pids or not psutil.pid_exists(pid))
