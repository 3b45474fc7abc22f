"""Fenced tasks for tests/acceptance/test_fencing.py, on the acceptance app.

A module of its own (the worker runs ``-A tests.acceptance.fencing_app``), so the shared
acceptance app stays as it is. Each body records its interval and returns its token.
"""

from __future__ import annotations

import time

import sqlalchemy as sa

from celery_pglock import SingletonTask, current_lock, fencing
from tests.acceptance.app import app, database_url, recorder, wait_gate

__all__ = [
    "app",
    "fenced",
    "fenced_in_transaction",
    "fenced_write",
    "fenced_write_waiting",
]

WRITES_TABLE = "pglock_test_fenced_writes"
_writes: dict[str, sa.Engine] = {}


def writes_engine() -> sa.Engine:
    """The 'resource' a fenced body writes to (one engine per process, made lazily)."""
    if "engine" not in _writes:
        _writes["engine"] = sa.create_engine(database_url, poolclass=sa.NullPool)
    return _writes["engine"]


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


# lock_on_lost='signal': a body the watcher could not end (gevent, C code) is what the
# guard exists for; the paused-holder test makes one and needs its late write to happen.
@app.task(
    base=SingletonTask,
    bind=True,
    lock_args=("run", "key"),
    lock_fencing=True,
    lock_on_lost="signal",
)
def fenced_write(self, run: str, key: str, body: str, gate: str | None = None) -> bool:
    """Take a token, wait on ``gate`` (if any), then write ``body`` through the guard;
    returns whether the write was applied."""
    return _write(self.request.id, run, key, body, gate)


@app.task(
    base=SingletonTask,
    bind=True,
    lock_args=("run", "key"),
    lock_fencing=True,
    lock_on_busy="wait",
    lock_wait_timeout=60,
)
def fenced_write_waiting(self, run: str, key: str, body: str) -> bool:
    """fenced_write's body under the wait policy: waits for the key, then writes."""
    return _write(self.request.id, run, key, body, None)


def _write(task_id: str, run: str, key: str, body: str, gate: str | None) -> bool:
    token = current_lock().fencing_token
    with recorder.record(run, key, f"{task_id}:{token}") as row_id:
        if gate:
            wait_gate(gate, row_id)
        with writes_engine().begin() as connection:
            return fencing.fenced_upsert(
                connection,
                WRITES_TABLE,
                key={"run": run},
                values={"body": body},
                token=token,
            )
