"""The Celery app of tests/acceptance/test_security.py, run in real ``celery worker``s.

Separate from app.py so that its tasks (big arguments, a key refused on purpose) never
share a worker with the exclusivity tests. ``SECURITY_DB_URL`` overrides the lock
database URL (a test starts a worker with a malformed one).
"""

from __future__ import annotations

import gc
import os

import psutil  # type: ignore[import-untyped, unused-ignore]  # no stubs
from celery import Celery

from celery_pglock import SingletonTask
from celery_pglock.testing import BROKER_URL_ENV, DATABASE_URL_ENV, RESULT_BACKEND_ENV

QUEUE_ENV = "PGLOCK_SECURITY_QUEUE"
DB_URL_ENV = "SECURITY_DB_URL"

broker_url = os.environ[BROKER_URL_ENV]
app = Celery(
    "security",
    broker=broker_url,
    backend=os.environ.get(RESULT_BACKEND_ENV) or broker_url,
)
app.conf.update(
    pglock_database_url=os.environ.get(DB_URL_ENV) or os.environ[DATABASE_URL_ENV],
    pglock_namespace=os.environ.get("PGLOCK_TEST_NAMESPACE", "security"),
    task_default_queue=os.environ.get(QUEUE_ENV, "pglock-security"),
    worker_prefetch_multiplier=1,
    result_expires=3600,
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=False,
)


@app.task(base=SingletonTask, name="security.locked_blob", lock_args=("blob",))
def locked_blob(blob: str) -> int:
    """A lock per (possibly huge) argument: what the key cache must not pin."""
    return len(blob)


@app.task(name="security.plain_blob")
def plain_blob(blob: str) -> int:
    """The same body as a plain Celery task: the memory baseline."""
    return len(blob)


@app.task(name="security.rss")
def rss() -> int:
    """Resident set size of the pool child that runs this, after a full collection."""
    gc.collect()
    return int(psutil.Process().memory_info().rss)


@app.task(base=SingletonTask, name="security.keyed", lock_args=("payload",))
def keyed(payload: object) -> str:
    """Never runs with a refused payload: the key fails first."""
    return "ran"
