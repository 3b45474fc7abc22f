"""lock_enqueue tasks whose lock database is a private PostgreSQL that a test stops
(tests/acceptance/test_resends.py): ``celery -A tests.acceptance.outage_app worker``.
Bodies are recorded on the session's PostgreSQL (app.py's recorder), which stays up."""

from __future__ import annotations

import os

from celery import Celery

from celery_pglock import DatabaseError, SingletonTask
from tests.acceptance.app import _body, broker_url, recorder

__all__ = ["app", "recorder"]

LOCK_DB_ENV = "PGLOCK_TEST_OUTAGE_DB"  #: The private PostgreSQL's URL.
QUEUE_ENV = "PGLOCK_TEST_OUTAGE_QUEUE"

app = Celery("outage", broker=broker_url, backend=broker_url)
app.conf.update(
    pglock_database_url=os.environ.get(LOCK_DB_ENV),
    pglock_db_timeout=2,
    pglock_watch_interval=1,
    task_default_queue=os.environ.get(QUEUE_ENV, "pglock-outage"),
    worker_prefetch_multiplier=1,
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=False,
)


@app.task(
    base=SingletonTask,
    bind=True,
    lock_args=("run", "key"),
    lock_enqueue="until_finished",
    autoretry_for=(DatabaseError,),
    retry_kwargs={"countdown": 1},
    max_retries=60,
)
def retried(self, run: str, key: str) -> str:
    """Celery's autoretry on the lock database's errors: re-queued while it is down."""
    return _body(self, run, key, 0.0, None)


@app.task(
    base=SingletonTask,
    bind=True,
    lock_args=("run", "key"),
    lock_enqueue="until_finished",
)
def failed(self, run: str, key: str) -> str:
    """No retry: a message due while the database is down fails unrun."""
    return _body(self, run, key, 0.0, None)


#: lock_rate of ``rated``: 3 starts per 10 s (tests/acceptance/test_rate.py).
RATE = (3, 10.0)


@app.task(
    base=SingletonTask,
    bind=True,
    lock_args=("run", "key"),
    lock_rate=RATE,
    autoretry_for=(DatabaseError,),
    retry_kwargs={"countdown": 1},
    max_retries=60,
)
def rated(self, run: str, key: str) -> str:
    """At most 3 starts per 10 s; re-queued while the lock database is down."""
    return _body(self, run, key, 0.0, None)
