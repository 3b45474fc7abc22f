"""Tasks sent the ways real code re-sends messages (tests/acceptance/test_resends.py):
custom task ids, retries, a lock_period start with a reused id, shared lock names. Run by
``celery -A tests.acceptance.resend_app worker``; bodies recorded as in app.py."""

from __future__ import annotations

import os

from celery_pglock import SingletonTask
from celery_pglock.db import row_writer
from tests.acceptance.app import _body, app, recorder

__all__ = ["app", "recorder"]

if "PGLOCK_TEST_WRITER_BATCH_WAIT" in os.environ:
    # A row change still pending when a pool child exits (test_resends.py).
    row_writer.RowWriter.BATCH_WAIT = float(os.environ["PGLOCK_TEST_WRITER_BATCH_WAIT"])


@app.task(
    base=SingletonTask,
    shared=False,
    bind=True,
    lock_args=("run", "key"),
    lock_enqueue="until_finished",
)
def finished(self, run: str, key: str, hold: float = 0.0) -> str:
    return _body(self, run, key, hold, None)


@app.task(
    base=SingletonTask,
    shared=False,
    bind=True,
    lock_args=("run", "key"),
    lock_enqueue="until_started",
    max_retries=10,
)
def retrying(self, run: str, key: str, tries: int = 0, countdown: float = 1.0) -> str:
    """Run ``tries`` retries of ``countdown`` seconds each, then return."""
    _body(self, run, key, 0.2, None)
    if self.request.retries < tries:
        raise self.retry(countdown=countdown)
    return key


@app.task(
    base=SingletonTask,
    shared=False,
    bind=True,
    lock_args=("run",),
    lock_period=5.0,
)
def periodic(self, run: str) -> str:
    return _body(self, run, "periodic", 0.0, None)


@app.task(shared=False)
def publish_finished(run: str, key: str, queue: str) -> str:
    """Sends ``finished`` from inside a worker child (a task that fans out)."""
    return str(finished.apply_async((run, key), queue=queue).id)
