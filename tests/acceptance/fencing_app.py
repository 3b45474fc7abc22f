"""Fenced tasks for tests/acceptance/test_fencing.py, on the acceptance app.

A module of its own (the worker runs ``-A tests.acceptance.fencing_app``), so the shared
acceptance app stays as it is. Each body records its interval and returns its token.
"""

from __future__ import annotations

import time

from celery_pglock import SingletonTask, current_lock
from tests.acceptance.app import app, recorder

__all__ = ["app", "fenced", "fenced_in_transaction"]


@app.task(
    base=SingletonTask,
    bind=True,
    lock_args=("run", "key"),
    lock_fencing=True,
    lock_on_busy="wait",
    lock_wait_timeout=60,
)
def fenced(self, run: str, key: str, hold: float = 0.0) -> int | None:
    """Wait for the key, then hold it for ``hold`` seconds; returns the run's token."""
    with recorder.record(run, key, self.request.id):
        time.sleep(hold)
        return current_lock().fencing_token


@app.task(
    base=SingletonTask,
    bind=True,
    lock_args=("run", "key"),
    lock_fencing=True,
    lock_on_busy="wait",
    lock_wait_timeout=60,
    lock_scope="transaction",
)
def fenced_in_transaction(
    self, run: str, key: str, hold: float = 0.0, fail: bool = False
) -> int | None:
    """Transaction scope; ``fail`` raises after recording, so the lock's transaction
    rolls back. The token is stored as the interval's task id suffix so a failed run's
    token is known too."""
    token = current_lock().fencing_token
    with recorder.record(run, key, f"{self.request.id}:{token}"):
        time.sleep(hold)
    if fail:
        raise RuntimeError(f"roll back (token {token})")
    return token
