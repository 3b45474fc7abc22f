"""A Celery app whose locks go through a PgBouncer: real workers in tests/acceptance/test_pooler.py.

PGLOCK_TEST_LOCK_DATABASE_URL is the lock database URL (the PgBouncer in front of the
test database); PGLOCK_TEST_SCOPE the app-wide lock scope. Intervals are recorded on the
test database directly, never through the pooler, so the overlap check does not depend on
what it checks.
"""

from __future__ import annotations

import os
import time

from celery import Celery

from celery_pglock import SingletonTask, current_lock
from celery_pglock.testing import (
    BROKER_URL_ENV,
    DATABASE_URL_ENV,
    RESULT_BACKEND_ENV,
    OverlapRecorder,
)

LOCK_URL_ENV = "PGLOCK_TEST_LOCK_DATABASE_URL"
SCOPE_ENV = "PGLOCK_TEST_SCOPE"
QUEUE_ENV = "PGLOCK_TEST_QUEUE"

database_url = os.environ[DATABASE_URL_ENV]
broker_url = os.environ[BROKER_URL_ENV]

app = Celery(
    "pooler",
    broker=broker_url,
    backend=os.environ.get(RESULT_BACKEND_ENV) or broker_url,
)
app.conf.update(
    pglock_database_url=os.environ.get(LOCK_URL_ENV) or database_url,
    pglock_scope=os.environ.get(SCOPE_ENV, "transaction"),
    pglock_namespace="acceptance-pooler",
    task_default_queue=os.environ.get(QUEUE_ENV, "pglock-acceptance-pooler"),
    worker_prefetch_multiplier=1,
    result_expires=3600,
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=False,
)

recorder = OverlapRecorder(database_url)


@app.task(base=SingletonTask, bind=True, lock_args=("run", "key"))
def pooled(self, run: str, key: str, hold: float = 0.0) -> str:
    """Record the run's interval; in transaction scope, also use the lock's connection."""
    with recorder.record(run, key, self.request.id):
        lock = current_lock()
        if lock is not None and lock.scope.value == "transaction":
            lock.connection.exec_driver_sql("SELECT 1")
        if hold:
            time.sleep(hold)
    return key
