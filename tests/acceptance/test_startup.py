"""What a real ``celery worker`` says at start about its lock database.

Both records come from ``worker_ready``, after Celery configured logging, so they reach
the worker's log; a database that does not answer is an ERROR at start (the worker keeps
running: see celery_pglock._hooks), and the first failed connection of a task is reported
as a failed connection, not as a dead pooled session.
"""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING

from celery_pglock import config
from celery_pglock.testing import _support

from .conftest import wait_until

if TYPE_CHECKING:
    from celery_pglock.testing import Services

APP = "tests.acceptance.startup_app"
PASSWORD = "never-logged-pw"


def test_worker_logs_its_lock_configuration_once_before_ready(worker_factory):
    """One lock_config line with the server version, after logging setup, before ready."""
    worker = worker_factory(
        APP, pool="solo", concurrency=1, env={"PGLOCK_TEST_QUEUE": _queue()}
    )
    lines = worker.log_text().splitlines()
    configured = [i for i, line in enumerate(lines) if "lock database" in line]
    ready = [i for i, line in enumerate(lines) if line.endswith(" ready.")]
    assert 1 == len(configured), worker.log_text()
    line = lines[configured[0]]
    assert "INFO" in line
    assert "(PostgreSQL " in line
    assert "1 SingletonTasks" in line
    assert "pglock_namespace='startup'" in line
    assert configured[0] < ready[0]


def test_unreachable_lock_database_is_an_error_at_start_and_no_reconnect(
    worker_factory, services: Services
):
    """An ERROR with the masked URL and what to check; tasks then fail without a
    'reconnecting' warning, because nothing pooled had died."""
    port = _support.free_port()
    url = f"postgresql+psycopg2://app:{PASSWORD}@127.0.0.1:{port}/locks"
    queue = _queue()
    worker = worker_factory(
        APP,
        pool="solo",
        concurrency=1,
        env={
            config.DATABASE_URL_ENV: url,
            "PGLOCK_TEST_QUEUE": queue,
            "PGLOCK_TEST_ON_ERROR": "raise",
        },
    )
    log = worker.log_text()
    errors = [
        line for line in log.splitlines() if "unreachable at worker start" in line
    ]
    assert 1 == len(errors), log
    assert "ERROR" in errors[0]
    assert f"app:***@127.0.0.1:{port}/locks" in errors[0]
    assert config.DATABASE_URL_ENV in errors[0]
    assert log.index(errors[0]) < log.index(" ready.")

    from tests.acceptance import startup_app

    result = startup_app.noop.apply_async(queue=queue)
    wait_until(lambda: result.state == "FAILURE", timeout=30, what="the task to fail")
    assert "DatabaseError" == type(result.result).__name__
    result.forget()
    log = worker.log_text()
    assert "Could not acquire lock" in log
    assert "reconnecting" not in log
    assert PASSWORD not in log


def test_database_outage_defers_the_run_until_the_database_is_back(
    worker_factory, private_postgres
):
    """lock_on_error='retry' (the default): a run that cannot reach the lock database is
    re-queued with backoff, not failed, and runs (locked) once PostgreSQL is back."""
    queue = _queue()
    worker = worker_factory(
        APP,
        pool="solo",
        concurrency=1,
        env={
            config.DATABASE_URL_ENV: private_postgres.url(),
            "PGLOCK_TEST_QUEUE": queue,
            "PGLOCK_TEST_ERROR_BACKOFF": "0.5",
        },
    )
    from tests.acceptance import startup_app

    private_postgres.stop()
    result = startup_app.noop.apply_async(queue=queue)
    wait_until(
        lambda: "could not take its lock" in worker.log_text(),
        timeout=30,
        what="the run to meet the outage",
    )
    assert result.state in ("PENDING", "RETRY")  # re-queued, never FAILURE
    private_postgres.start()
    assert "ran" == result.get(timeout=60)
    log = worker.log_text()
    assert "re-queued in" in log
    assert "its body has not run" in log


def _queue() -> str:
    return f"pglock-startup-{uuid.uuid4().hex[:8]}"
