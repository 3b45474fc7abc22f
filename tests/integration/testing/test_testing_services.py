"""celery_pglock.testing against the real thing: servers, a worker, the overlap detector."""

from __future__ import annotations

import os
import shutil
import signal
import stat
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import psutil  # type: ignore[import-untyped, unused-ignore]  # no stubs
import pytest
import redis
import sqlalchemy as sa
from celery import Celery

from celery_pglock.testing import (
    BROKER_URL_ENV,
    DATABASE_URL_ENV,
    RESULT_BACKEND_ENV,
    EmbeddedPostgres,
    EmbeddedRedis,
    OverlapRecorder,
    ServiceError,
    _root,
    _support,
    start_services,
)

if TYPE_CHECKING:
    from collections.abc import Iterable, Iterator

TRIVIAL_APP = "tests.acceptance.trivial_app"
only_as_root = pytest.mark.skipif(
    not _root.is_root(), reason="tests the root path (run as root in CI)"
)


@pytest.fixture
def reachable_tmp() -> Iterator[Path]:
    """A temporary directory the embedded server can use even when we are root.

    pytest's tmp_path lives under /tmp/pytest-of-<user>, which pytest keeps at mode
    0700: as root, the server's unprivileged user could not enter it (by design).
    """
    path = Path(tempfile.mkdtemp(prefix="celery-pglock-test-"))
    path.chmod(0o711)  # created here: others may traverse it, not list it
    yield path
    shutil.rmtree(path, ignore_errors=True)


def server_version(url: str) -> str:
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    try:
        with engine.connect() as connection:
            return str(connection.execute(sa.text("SHOW server_version")).scalar_one())
    finally:
        engine.dispose()


def alive(pids: Iterable[int]) -> list[int]:
    """The pids among ``pids`` that still exist as live (non-zombie) processes."""
    result = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                result.append(pid)
        except psutil.NoSuchProcess:
            pass
    return result


# -- EmbeddedPostgres ---------------------------------------------------------------------


def test_embedded_postgres_serves_18_and_survives_crash_and_restart(private_postgres):
    """A crash kills every session; restart() brings the server back on the same URL."""
    url = private_postgres.url()
    assert (
        f"postgresql+{_support.driver()}://postgres@127.0.0.1:{private_postgres.port}/postgres"
        == url
    )
    assert private_postgres.running
    assert private_postgres.server_version.startswith("18.")
    assert private_postgres.server_version == server_version(url)

    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    try:
        with engine.connect() as connection:
            settings = connection.execute(
                sa.text(
                    "SELECT name, setting FROM pg_settings WHERE name IN "
                    "('fsync', 'synchronous_commit', 'full_page_writes', 'max_connections')"
                )
            ).all()
            assert {
                "fsync": "off",
                "full_page_writes": "off",
                "max_connections": "200",
                "synchronous_commit": "off",
            } == dict(settings)

            private_postgres.crash()
            assert not private_postgres.running
            with pytest.raises(sa.exc.OperationalError):
                connection.execute(sa.text("SELECT 1"))

        private_postgres.restart()
        assert private_postgres.running
        assert url == private_postgres.url()
        with engine.connect() as connection:
            assert 1 == connection.execute(sa.text("SELECT 1")).scalar_one()
    finally:
        engine.dispose()


def test_embedded_postgres_context_manager_stops_and_deletes_everything():
    """Leaving the with block stops the server and deletes its temporary directory."""
    with EmbeddedPostgres() as server:
        root = server.data_dir.parent
        pid = int((server.data_dir / "postmaster.pid").read_text().split()[0])
        assert [pid] == alive([pid])
        server.stop()
        assert [] == alive([pid])
        server.start()  # a plain stop() keeps the data: start again from it
        pid = int((server.data_dir / "postmaster.pid").read_text().split()[0])
    assert [] == alive([pid])
    assert not root.exists()


def test_embedded_postgres_start_failure_shows_the_log(reachable_tmp):
    """A server that cannot start raises ServiceError carrying its log tail."""
    data_dir = reachable_tmp / "data"
    with EmbeddedPostgres(data_dir=data_dir) as server:
        server.stop()
    (data_dir / "postgresql.auto.conf").write_text("max_connections = 'lots'\n")
    broken = EmbeddedPostgres(data_dir=data_dir)
    try:
        with pytest.raises(ServiceError) as caught:
            broken.start(timeout=20)
        assert "max_connections" in str(caught.value)
        assert not broken.running
    finally:
        broken.cleanup()
    assert data_dir.exists()  # a caller's data directory is never deleted


@only_as_root
def test_embedded_postgres_as_root_runs_unprivileged_from_the_binary_cache(
    private_postgres,
):
    """As root, the server runs as an existing unprivileged user from the cached copy."""
    user = _root.server_user()
    pid = int((private_postgres.data_dir / "postmaster.pid").read_text().split()[0])
    postmaster = psutil.Process(pid)
    assert user.pw_uid == postmaster.uids().real
    cache = _root.cache_dir().resolve()
    assert cache in Path(postmaster.exe()).resolve().parents
    assert 0 == stat.S_IMODE(cache.stat().st_mode) & 0o022


def test_embedded_postgres_that_fails_to_start_in_with_leaves_nothing(
    monkeypatch, reachable_tmp
):
    """A start that fails in ``with EmbeddedPostgres()`` still deletes its directory."""
    temporary = reachable_tmp / "tmp"
    temporary.mkdir(mode=0o711)
    monkeypatch.setattr(tempfile, "tempdir", str(temporary))
    data_dir = reachable_tmp / "data"
    data_dir.mkdir()
    (data_dir / "PG_VERSION").write_text("not a data directory\n")
    with pytest.raises(ServiceError), EmbeddedPostgres(data_dir=data_dir):
        pass
    assert [] == list(temporary.iterdir())
    assert data_dir.exists()  # a caller's data directory is never deleted


@only_as_root
def test_embedded_postgres_as_root_refuses_an_unreachable_data_dir(tmp_path):
    """A data_dir the server's user cannot enter is an error, never a chmod."""
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    private.chmod(0o700)
    server = EmbeddedPostgres(data_dir=private / "data")
    try:
        with pytest.raises(ServiceError, match="cannot enter") as caught:
            server.start(timeout=20)
    finally:
        server.cleanup()
    assert str(private) in str(caught.value)
    assert 0o700 == stat.S_IMODE(private.stat().st_mode)


@only_as_root
def test_embedded_postgres_as_root_refuses_a_cache_others_can_write(
    monkeypatch, reachable_tmp
):
    """Root starts programs from the cache, so a cache others can write is refused."""
    shared = reachable_tmp / "cache"
    shared.mkdir()
    shared.chmod(0o777)
    monkeypatch.setenv(_root.CACHE_DIR_ENV, str(shared))
    server = EmbeddedPostgres()
    try:
        with pytest.raises(ServiceError, match="writable by no one else"):
            server.start(timeout=20)
    finally:
        server.cleanup()
    assert [] == list(shared.iterdir())


# -- EmbeddedRedis --------------------------------------------------------------------------


def test_embedded_redis_answers_ping_and_stops():
    """EmbeddedRedis serves redis://127.0.0.1:PORT/0 until stop()."""
    server = EmbeddedRedis().start()
    try:
        assert f"redis://127.0.0.1:{server.port}/0" == server.url()
        client = redis.Redis.from_url(server.url(), socket_timeout=5)
        with client:
            assert client.ping()
            assert {"save": ""} == client.config_get("save")
    finally:
        server.stop()
    assert not server.running
    client = redis.Redis.from_url(server.url(), socket_connect_timeout=1)
    with client, pytest.raises(redis.ConnectionError):
        client.ping()


def test_embedded_redis_on_a_taken_port_fails_instead_of_using_the_other_server():
    """A fixed port already served by another Redis is an error with the log tail."""
    with EmbeddedRedis() as first:
        second = EmbeddedRedis(port=first.port)
        with pytest.raises(ServiceError) as caught:
            second.start(timeout=10)
        assert "Address already in use" in str(caught.value)
        assert not second.running
        assert first.running


# -- start_services ------------------------------------------------------------------------


def test_unreachable_configured_database_is_an_error_naming_the_variable(monkeypatch):
    """A configured URL that does not answer is an error (password masked), never a fallback."""
    monkeypatch.setenv(
        DATABASE_URL_ENV, "postgresql+psycopg2://app:s3cret@127.0.0.1:1/app"
    )
    with pytest.raises(ServiceError) as caught:
        start_services(timeout=0.5)
    message = str(caught.value)
    assert DATABASE_URL_ENV in message
    assert "app:***@127.0.0.1:1/app" in message
    assert "s3cret" not in message


def test_unreachable_configured_broker_is_an_error_naming_the_variable(
    database_url, monkeypatch
):
    """The broker check names CELERY_PGLOCK_TEST_BROKER_URL and masks its password."""
    monkeypatch.setenv(DATABASE_URL_ENV, database_url)
    monkeypatch.setenv(BROKER_URL_ENV, "redis://:s3cret@127.0.0.1:1/0")
    with pytest.raises(ServiceError) as caught:
        start_services(timeout=0.5)
    message = str(caught.value)
    assert BROKER_URL_ENV in message
    assert "s3cret" not in message


def test_session_services_describe_themselves(services):
    """The session's services are reachable and say which ones the session started."""
    assert services.postgres_version == server_version(services.database_url).split()[0]
    assert set(services.started) <= {"postgres", "redis"}
    assert ("postgres" in services.started) == (services.postgres is not None)
    assert ("redis" in services.started) == (services.redis is not None)
    assert services.database_url == os.environ[DATABASE_URL_ENV]
    assert services.result_backend_url == services.env()[RESULT_BACKEND_ENV]


# -- OverlapRecorder -----------------------------------------------------------------------


def test_overlap_recorder_finds_a_deliberate_overlap(overlap, namespace):
    """Two intervals of one key that intersect are reported, with both task ids."""
    first = overlap.begin(namespace, "k", "task-1")
    second = overlap.begin(namespace, "k", "task-2")
    overlap.end(first)
    overlap.end(second)
    with overlap.record(namespace, "other-key", "task-3"):  # same time, other key: fine
        pass

    found = overlap.overlaps(namespace)
    assert [("task-1", "task-2")] == [
        (o.first.task_id, o.second.task_id) for o in found
    ]
    assert "key 'k'" in str(found[0])
    assert 3 == overlap.count(namespace)
    assert 2 == overlap.count(namespace, "k")


def test_overlap_recorder_sees_no_overlap_in_disjoint_intervals(overlap, namespace):
    """Back-to-back intervals of one key and overlapping ones of different keys are fine."""
    for task_id in ("a", "b", "c"):
        with overlap.record(namespace, "k", task_id):
            pass
    left = overlap.begin(namespace, "left")
    right = overlap.begin(namespace, "right")
    overlap.end(left)
    overlap.end(right)

    assert [] == overlap.overlaps(namespace)
    intervals = overlap.intervals(namespace)
    assert ["a", "b", "c", None, None] == [i.task_id for i in intervals]
    assert all(i.started_at <= i.ended_at for i in intervals)
    assert [] == overlap.unfinished(namespace)
    assert [] == overlap.overlaps(f"{namespace}-other-run")


def test_overlap_recorder_works_in_a_forked_child_without_breaking_the_parent(
    database_url, namespace
):
    """A child inherits the recorder: it reconnects, and the parent's session survives."""
    recorder = OverlapRecorder(database_url)
    recorder.setup()
    try:
        row = recorder.begin(namespace, "k", "parent")
        pid = os.fork()
        if pid == 0:  # child: record, then leave without running any cleanup
            code = 1
            try:
                with recorder.record(namespace, "k", "child"):
                    pass
                code = 0
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert 0 == os.waitstatus_to_exitcode(status)
        recorder.end(row)  # the parent's connection still works
        assert 1 == len(recorder.overlaps(namespace))
        assert {"parent", "child"} == {i.task_id for i in recorder.intervals(namespace)}
    finally:
        recorder.close()


def test_overlap_recorder_peak_counts_the_bodies_running_at_once(overlap, namespace):
    """peak(): the most intervals of one key at one instant; an unfinished one counts as
    running, back-to-back ones do not add up, other keys do not count."""
    assert 0 == overlap.peak(namespace, "k")
    first = overlap.begin(namespace, "k")
    second = overlap.begin(namespace, "k")
    overlap.end(first)
    third = overlap.begin(namespace, "k")  # with the second: 2 at once, never 3
    overlap.end(second)
    overlap.end(third)
    with overlap.record(namespace, "other"), overlap.record(namespace, "other"):
        pass
    assert 2 == overlap.peak(namespace, "k")
    assert 2 == overlap.peak(namespace, "other")
    overlap.begin(namespace, "killed")  # never ended: still running for peak()
    with overlap.record(namespace, "killed"):
        pass
    assert 2 == overlap.peak(namespace, "killed")


def test_overlap_recorder_reports_unfinished_intervals(overlap, namespace):
    """A body that never ended (a killed worker) is listed by unfinished(), not overlaps()."""
    overlap.begin(namespace, "k", "killed")
    with overlap.record(namespace, "k", "later"):
        pass
    assert ["killed"] == [i.task_id for i in overlap.unfinished(namespace)]
    assert [] == overlap.overlaps(namespace)


def test_overlap_recorder_heartbeat_writes_only_instants_the_body_read_back(
    overlap, namespace
):
    """A heartbeat ends the row at the server time the previous one returned, never at its
    own: one in flight when its worker is killed can execute after the death, once the
    next run took the freed lock, and would record an overlap that never happened."""
    row = overlap.begin(namespace, "k", "body")
    overlap.heartbeat(row)
    (body,) = overlap.intervals(namespace)
    assert body.started_at == body.ended_at  # only begin()'s time was read back yet

    # A later begin() is a server instant after the first heartbeat's reply was read.
    clock = overlap.begin(namespace, "clock")
    overlap.heartbeat(row)
    body, marker = overlap.intervals(namespace)
    assert body.started_at < body.ended_at < marker.started_at

    overlap.end(row)  # a body that ends normally records the current time
    body, marker = overlap.intervals(namespace)
    assert marker.started_at < body.ended_at
    overlap.end(clock)


# -- WorkerProcess ------------------------------------------------------------------------


def client(broker_url: str, result_backend_url: str) -> Celery:
    return Celery(
        "client", broker=broker_url, backend=result_backend_url, set_as_current=False
    )


@pytest.mark.worker
def test_worker_runs_a_task_and_stops_without_leftovers(
    worker_factory, broker_url, result_backend_url, namespace
):
    """A real worker runs a task; a warm shutdown exits 0 and leaves no process behind."""
    worker = worker_factory(TRIVIAL_APP, concurrency=2, queues=[namespace])
    assert f"{worker.hostname} ready." in worker.log_text()
    children = worker.child_pids()
    assert 2 == len(children)

    app = client(broker_url, result_backend_url)
    try:
        result = app.send_task("trivial.add", (2, 3), queue=namespace)
        assert 5 == result.get(timeout=20)
    finally:
        app.close()

    assert 0 == worker.stop(timeout=20)
    assert [] == alive([worker.pid, *children])
    assert not worker.running


@pytest.mark.worker
def test_worker_kill_takes_the_pool_with_it(worker_factory, namespace):
    """kill() is a crash: SIGKILL reaches the main process and every pool child."""
    worker = worker_factory(TRIVIAL_APP, concurrency=1, queues=[namespace])
    children = worker.child_pids()
    assert 1 == len(children)
    assert -signal.SIGKILL == worker.kill()
    assert [] == alive([worker.pid, *children])


@pytest.mark.worker
def test_worker_that_cannot_start_fails_fast_with_its_log(worker_factory):
    """A worker that exits during startup raises ServiceError with the log tail."""
    with pytest.raises(ServiceError) as caught:
        worker_factory("tests.acceptance.no_such_app_module", timeout=30)
    assert "no_such_app_module" in str(caught.value)
    assert "exited with code" in str(caught.value)
