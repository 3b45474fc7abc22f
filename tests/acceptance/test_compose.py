"""docker-compose.yml's wiring without Docker: its setup, worker and beat commands with its
environment, against the session's PostgreSQL and Redis, and a scrape of the worker's
/metrics as its Prometheus does.

Only the addresses change: the compose file's service hosts become the test services, the
metrics port a free one on 127.0.0.1, and the example's tables, queue and tick get this
test's own (EXAMPLE_TABLE_SUFFIX, EXAMPLE_QUEUE, SETTLEMENT_EVERY). The worker must pass
the compose file's own health check before the beat starts, as ``depends_on`` says.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import subprocess
import sys
import urllib.request
import uuid
from typing import TYPE_CHECKING

import pytest
import sqlalchemy as sa
import yaml
from prometheus_client.parser import text_string_to_metric_families

from celery_pglock.testing import _support
from tests.conftest import REPO_ROOT

from .conftest import wait_until

if TYPE_CHECKING:
    from collections.abc import Iterator

    from celery_pglock.testing import Services

pytestmark = pytest.mark.timeout(120)

TASK = "settlement.daily_settlement"
ROWS = 5


@pytest.fixture(scope="module")
def compose():
    return yaml.safe_load((REPO_ROOT / "docker-compose.yml").read_text())


def _command(argv: list[str], port: str, metrics_port: int, tmp_path) -> list[str]:
    """The compose command run here: this interpreter, the free port, tmp_path."""
    head = {"celery": [sys.executable, "-m", "celery"], "python": [sys.executable]}
    out = [*head.get(argv[0], [argv[0]])]
    for previous, arg in itertools.pairwise(argv):
        if previous == "--schedule":  # the beat's schedule file
            arg = str(tmp_path / "beat-schedule")
        out.append(arg.replace(f":{port}/", f":{metrics_port}/"))
    return out


@pytest.fixture
def stack_env(compose, services: Services) -> Iterator[dict[str, str]]:
    """The compose file's app environment, pointed at the test services."""
    environment = dict(compose["services"]["worker"]["environment"])
    assert "postgres:5432" in environment["CELERY_PGLOCK_DATABASE_URL"]
    assert "redis://redis:6379/0" == environment["CELERY_PGLOCK_BROKER_URL"]
    suffix = f"_c{uuid.uuid4().hex[:8]}"
    environment.update(
        CELERY_PGLOCK_DATABASE_URL=services.database_url,
        CELERY_PGLOCK_BROKER_URL=services.broker_url,
        CELERY_PGLOCK_RESULT_BACKEND=services.result_backend_url,
        PGLOCK_METRICS_PORT=str(_support.free_port()),
        PGLOCK_METRICS_ADDRESS="127.0.0.1",  # the container binds every interface
        EXAMPLE_TABLE_SUFFIX=suffix,
        EXAMPLE_QUEUE=f"pglock-compose-{suffix}",
        SETTLEMENT_EVERY="1",
    )
    yield environment
    engine = sa.create_engine(services.database_url, poolclass=sa.NullPool)
    try:
        with engine.begin() as connection:
            for table in ("settlements", "settlement_runs"):
                connection.execute(sa.text(f"DROP TABLE IF EXISTS {table}{suffix}"))
    finally:
        engine.dispose()


@contextlib.contextmanager
def _running(
    argv: list[str], env: dict[str, str], log_path
) -> Iterator[subprocess.Popen]:
    """Run ``argv`` in a process group of its own; stop it (then kill it) afterwards."""
    with log_path.open("w") as log:
        process = subprocess.Popen(
            argv,
            cwd=REPO_ROOT,
            env={**os.environ, "PYTHONPATH": str(REPO_ROOT), **env},
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            yield process
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(timeout=10)


def _healthy(check: list[str], env: dict[str, str]) -> bool:
    completed = subprocess.run(
        check, env=env, capture_output=True, check=False, timeout=10
    )
    return 0 == completed.returncode


def test_the_compose_stack_runs_without_docker(compose, stack_env, tmp_path):
    services = compose["services"]
    port = services["worker"]["environment"]["PGLOCK_METRICS_PORT"]
    metrics_port = int(stack_env["PGLOCK_METRICS_PORT"])

    def command(name: str) -> list[str]:
        return _command(services[name]["command"], port, metrics_port, tmp_path)

    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), **stack_env}
    subprocess.run(command("setup"), cwd=REPO_ROOT, env=env, check=True, timeout=60)
    test = services["worker"]["healthcheck"]["test"]
    assert "CMD" == test[0]
    check = _command(test[1:], port, metrics_port, tmp_path)
    with _running(command("worker"), stack_env, tmp_path / "worker.log") as worker:
        wait_until(
            lambda: worker.poll() is not None or _healthy(check, env),
            timeout=60,
            what="the worker's health check (its /metrics)",
        )
        assert worker.poll() is None, (tmp_path / "worker.log").read_text()
        with _running(command("beat"), stack_env, tmp_path / "beat.log"):
            wait_until(
                lambda: _settled(stack_env) == ROWS,
                timeout=60,
                what="the beat's ticks to settle every row",
            )
            families = _scrape(services, stack_env, metrics_port)
    acquired = families["celery_pglock_acquired"]
    assert "counter" == acquired.type
    assert 1 <= _value(acquired, "celery_pglock_acquired_total", task=TASK)
    (info,) = families["celery_pglock_info"].samples
    assert 1 == info.value
    assert info.labels["version"]
    assert (
        0
        <= _value(
            families["celery_pglock_held_locks"], "celery_pglock_held_locks", task=TASK
        )
        <= 1
    )
    assert 0 == _value(
        families["celery_pglock_lost"], "celery_pglock_lost_total", task=TASK
    )


def _settled(env: dict[str, str]) -> int:
    engine = sa.create_engine(env["CELERY_PGLOCK_DATABASE_URL"], poolclass=sa.NullPool)
    try:
        with engine.connect() as connection:
            return int(
                connection.execute(
                    sa.text(
                        f"SELECT count(*) FROM settlements{env['EXAMPLE_TABLE_SUFFIX']} "
                        "WHERE status = 'processed'"
                    )
                ).scalar_one()
            )
    finally:
        engine.dispose()


def _scrape(services, env, metrics_port):
    """GET the target of the compose file's Prometheus job, as Prometheus asks for it."""
    prometheus = yaml.safe_load(
        (REPO_ROOT / "examples/deploy/prometheus.yml").read_text()
    )
    (target,) = prometheus["scrape_configs"][0]["static_configs"][0]["targets"]
    host, _, port = target.partition(":")
    assert "worker" == host
    assert services["worker"]["environment"]["PGLOCK_METRICS_PORT"] == port
    request = urllib.request.Request(
        f"http://127.0.0.1:{metrics_port}/metrics",
        headers={"Accept": "text/plain;version=0.0.4;q=0.9,*/*;q=0.1"},
    )
    # A literal http:// URL on loopback (S310 warns of file: and custom schemes).
    with urllib.request.urlopen(request, timeout=10) as response:  # noqa: S310
        assert response.headers["Content-Type"].startswith("text/plain")
        text = response.read().decode()
    return {family.name: family for family in text_string_to_metric_families(text)}


def _value(family, name, **labels):
    (value,) = [
        s.value for s in family.samples if s.name == name and s.labels == labels
    ]
    return value


@pytest.mark.parametrize("fault", ["unreachable", "missing-database"])
def test_the_worker_health_check_fails_when_it_cannot_use_its_lock_database(
    compose, stack_env, tmp_path, fault
):
    """The compose file's worker health check is true: with the lock database refusing
    connections (an outage: the worker keeps running and serves /metrics) or naming a
    database that does not exist (the worker stops at start), it fails."""
    services = compose["services"]
    port = services["worker"]["environment"]["PGLOCK_METRICS_PORT"]
    metrics_port = int(stack_env["PGLOCK_METRICS_PORT"])
    database = sa.make_url(stack_env["CELERY_PGLOCK_DATABASE_URL"])
    if fault == "unreachable":
        database = database.set(port=_support.free_port())
    else:
        database = database.set(database=f"missing_{uuid.uuid4().hex[:8]}")
    stack_env["CELERY_PGLOCK_DATABASE_URL"] = database.render_as_string(
        hide_password=False
    )
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), **stack_env}
    check = _command(
        services["worker"]["healthcheck"]["test"][1:], port, metrics_port, tmp_path
    )
    worker_argv = _command(services["worker"]["command"], port, metrics_port, tmp_path)
    log_path = tmp_path / "worker.log"
    with _running(worker_argv, stack_env, log_path) as worker:
        if fault == "unreachable":
            url = f"http://127.0.0.1:{metrics_port}/metrics"
            wait_until(
                lambda: worker.poll() is not None or _serves(url),
                timeout=60,
                what="the worker's /metrics",
            )
            assert worker.poll() is None, log_path.read_text()
        else:
            assert 0 != worker.wait(timeout=60), log_path.read_text()
        completed = subprocess.run(
            check, env=env, capture_output=True, text=True, check=False, timeout=10
        )
    assert 0 != completed.returncode
    assert completed.stderr.startswith("unhealthy: "), completed.stderr
    if database.password:
        assert database.password not in completed.stderr


def _serves(url: str) -> bool:
    try:
        # A literal http:// URL on loopback (S310 warns of file: and custom schemes).
        with urllib.request.urlopen(url, timeout=3):  # noqa: S310
            return True
    except OSError:
        return False
