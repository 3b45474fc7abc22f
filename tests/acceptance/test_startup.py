"""What a real ``celery worker`` says at start about its lock database.

Both records come from ``worker_ready``, after Celery configured logging, so they reach
the worker's log; a database that does not answer is an ERROR at start (the worker keeps
running: see celery_pglock.task.worker_hooks), and the first failed connection of a task is reported
as a failed connection, not as a dead pooled session. A database that refuses the worker
for a reason waiting does not fix (a wrong password, a missing database) stops it at start
with a non-zero exit, unless pglock_on_misconfigured_database='run'.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from typing import TYPE_CHECKING

import pytest

from celery_pglock import config
from celery_pglock.testing import BROKER_URL_ENV, _support
from tests.conftest import PASSWORD_ROLE, REPO_ROOT, ROLE_PASSWORD

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
    """An ERROR with the masked URL and what to check; tasks then fail at once (no
    autoretry_for: Celery's default) without a 'reconnecting' warning, because nothing
    pooled had died."""
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
    # The result backend can record FAILURE before the worker logs the traceback.
    wait_until(
        lambda: "Could not acquire lock" in worker.log_text(),
        timeout=10,
        what="the worker to log the failure",
    )
    log = worker.log_text()
    assert "reconnecting" not in log
    assert PASSWORD not in log


def test_database_outage_defers_the_run_until_the_database_is_back(
    worker_factory, private_postgres
):
    """autoretry_for=(DatabaseError,): a run that cannot reach the lock database is
    re-queued by Celery's retry, not failed, and runs (locked) once PostgreSQL is back."""
    queue = _queue()
    worker = worker_factory(
        APP,
        pool="solo",
        concurrency=1,
        env={
            config.DATABASE_URL_ENV: private_postgres.url(),
            "PGLOCK_TEST_QUEUE": queue,
            "PGLOCK_TEST_AUTORETRY": "0.5",
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


def test_wrong_password_fails_a_task_at_once_with_advice(
    worker_factory, password_postgres
):
    """With pglock_on_misconfigured_database='run', a wrong password is no outage: the
    start-up ERROR says what the server refused and what to fix (not "check that
    PostgreSQL runs"), and a task fails at once even with autoretry_for=(DatabaseError,),
    instead of being re-queued for ever."""
    wrong = "wrong-pw-never-logged"
    url = (
        f"postgresql+psycopg2://{PASSWORD_ROLE}:{wrong}@{_support.HOST}:"
        f"{password_postgres.port}/postgres"
    )
    queue = _queue()
    worker = worker_factory(
        APP,
        pool="solo",
        concurrency=1,
        env={
            config.DATABASE_URL_ENV: url,
            "PGLOCK_TEST_QUEUE": queue,
            "PGLOCK_TEST_AUTORETRY": "0.5",
            "PGLOCK_TEST_ON_MISCONFIGURED": "run",
        },
    )
    log = worker.log_text()
    errors = [line for line in log.splitlines() if "refused this worker" in line]
    assert 1 == len(errors), log
    assert "ERROR" in errors[0]
    assert "password authentication failed" in errors[0]
    assert "SQLSTATE 28P01" in errors[0]
    assert "Check the user name and password" in errors[0]
    assert "pglock_on_misconfigured_database='run'" in errors[0]
    assert "PostgreSQL runs" not in log

    from tests.acceptance import startup_app

    sent = time.monotonic()
    result = startup_app.noop.apply_async(queue=queue)
    wait_until(lambda: result.state == "FAILURE", timeout=30, what="the task to fail")
    took = time.monotonic() - sent
    assert took < 5, f"the task failed after {took:.1f} s"
    assert "DatabaseError" == type(result.result).__name__
    assert "not retried" in str(result.result)
    result.forget()
    log = worker.log_text()
    assert "re-queued" not in log
    assert wrong not in log


@pytest.mark.parametrize(
    ("database", "password", "cause", "advice"),
    [
        (
            "postgres",
            "wrong-pw-never-logged",
            "password authentication failed (SQLSTATE 28P01)",
            "Check the user name and password",
        ),
        (
            "no_such_db",
            ROLE_PASSWORD,
            "the database does not exist (SQLSTATE 3D000)",
            "Fix the database name",
        ),
    ],
    ids=["wrong-password", "missing-database"],
)
def test_a_refusing_lock_database_stops_the_worker_at_start(
    services: Services, password_postgres, database, password, cause, advice
):
    """A real ``celery worker`` whose lock database refuses it for a reason waiting does
    not fix exits non-zero before "ready", its stderr naming the cause, the fix and the
    setting that would keep it running, the URL's password masked."""
    url = (
        f"postgresql+psycopg2://{PASSWORD_ROLE}:{password}@{_support.HOST}:"
        f"{password_postgres.port}/{database}"
    )
    completed = _run_worker(
        {
            **os.environ,
            **services.env(),
            "PYTHONPATH": str(REPO_ROOT),
            config.DATABASE_URL_ENV: url,
            "PGLOCK_TEST_QUEUE": _queue(),
        }
    )
    output = completed.stdout + completed.stderr
    assert 0 != completed.returncode, output
    assert " ready." not in output
    (line,) = [
        line for line in output.splitlines() if "refused this worker at start" in line
    ]
    assert cause in line
    assert advice in line
    assert f"{PASSWORD_ROLE}:***@" in line
    assert "pglock_on_misconfigured_database='run'" in line
    assert password not in output


def test_a_missing_database_url_is_said_once():
    """The start-up refusal of a missing URL reaches stderr once, and the worker exits."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in (config.DATABASE_URL_ENV, "CELERY_PGLOCK_TEST_DATABASE_URL")
    }
    env.update(
        {
            BROKER_URL_ENV: "memory://",
            "PYTHONPATH": str(REPO_ROOT),
            "PGLOCK_TEST_QUEUE": _queue(),
        }
    )
    completed = _run_worker(env)
    output = completed.stdout + completed.stderr
    assert 0 != completed.returncode
    assert 1 == output.count("No lock database configured"), output


def _run_worker(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """Run a solo ``celery worker`` of APP in ``env`` to its end (expected: a stop at
    start)."""
    return subprocess.run(
        [sys.executable, "-m", "celery", "-A", APP, "worker", "--pool", "solo"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd=REPO_ROOT,
    )


def _queue() -> str:
    return f"pglock-startup-{uuid.uuid4().hex[:8]}"
