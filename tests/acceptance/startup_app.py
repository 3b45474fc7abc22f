"""A Celery app for the worker start-up tests: one SingletonTask, configured like a user's.

The broker and result backend come from the test services' variables; the lock database
only from CELERY_PGLOCK_DATABASE_URL, the variable celery-pglock reads by itself, so a test
can point a worker at an unreachable database (or one it stops and starts again). PGLOCK_TEST_QUEUE keeps the tests' tasks
to their own worker.
"""

from __future__ import annotations

import os

from celery import Celery

from celery_pglock import DatabaseError, SingletonTask
from celery_pglock.testing import BROKER_URL_ENV, RESULT_BACKEND_ENV

broker_url = os.environ[BROKER_URL_ENV]
app = Celery(
    "startup_app",
    broker=broker_url,
    backend=os.environ.get(RESULT_BACKEND_ENV) or broker_url,
)
app.conf.update(
    task_default_queue=os.environ.get("PGLOCK_TEST_QUEUE", "pglock-startup"),
    pglock_namespace="startup",
    broker_connection_retry_on_startup=True,
)
#: PGLOCK_TEST_ON_MISCONFIGURED=<stop|run>: pglock_on_misconfigured_database (unset: default).
if on_misconfigured := os.environ.get("PGLOCK_TEST_ON_MISCONFIGURED"):
    app.conf.pglock_on_misconfigured_database = on_misconfigured
#: PGLOCK_TEST_AUTORETRY=<seconds>: retry a DatabaseError at acquire with Celery's own
#: options, that many seconds apart, without limit (unset: Celery's default, no retry).
delay = os.environ.get("PGLOCK_TEST_AUTORETRY")
retry = (
    {"autoretry_for": (DatabaseError,), "default_retry_delay": float(delay)}
    if delay
    else {}
)


@app.task(base=SingletonTask, name="startup.noop", max_retries=None, **retry)
def noop() -> str:
    """Do nothing under the lock."""
    return "ran"
