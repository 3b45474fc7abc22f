"""The acceptance app's lock_enqueue tasks (tests/acceptance/test_enqueue.py): run by
``celery -A tests.acceptance.enqueue_app worker``, bodies recorded as in app.py."""

from __future__ import annotations

from celery_pglock import SingletonTask
from tests.acceptance.app import _body, app, open_gate, protected, recorder

__all__ = ["app", "open_gate", "protected", "recorder"]


@app.task(
    base=SingletonTask,
    shared=False,  # this app only: an app-wide setting in another test must not meet it
    bind=True,
    lock_args=("run", "key"),
    lock_enqueue="until_finished",
)
def until_finished(
    self, run: str, key: str, hold: float = 0.0, gate: str | None = None
) -> str:
    return _body(self, run, key, hold, gate)


@app.task(
    base=SingletonTask,
    shared=False,  # this app only: an app-wide setting in another test must not meet it
    bind=True,
    lock_args=("run", "key"),
    lock_enqueue="until_started",
)
def until_started(
    self, run: str, key: str, hold: float = 0.0, gate: str | None = None
) -> str:
    return _body(self, run, key, hold, gate)


@app.task(
    base=SingletonTask,
    shared=False,  # this app only: an app-wide setting in another test must not meet it
    bind=True,
    lock_args=("run", "key"),
    lock_enqueue="until_finished",
    lock_enqueue_lost_after=2,
)
def soon_lost(self, run: str, key: str) -> str:
    return _body(self, run, key, 0.0, None)


@app.task(
    base=SingletonTask,
    shared=False,  # this app only: an app-wide setting in another test must not meet it
    bind=True,
    lock_args=("run", "key"),
    lock_enqueue="until_finished",
    lock_on_busy="wait",
    lock_wait_timeout=30,
)
def until_finished_waits(
    self, run: str, key: str, hold: float = 0.0, gate: str | None = None
) -> str:
    """until_finished that waits for a busy key (test_enqueue_guards.py): its refused
    try keeps its message's row as it was."""
    return _body(self, run, key, hold, gate)


@app.task(
    base=SingletonTask,
    shared=False,  # this app only: an app-wide setting in another test must not meet it
    bind=True,
    lock_args=("run", "key"),
    lock_enqueue="until_started",
    lock_enqueue_on_duplicate="replace",
    acks_late=True,  # a killed run's message comes back (test_latest_wins.py)
    reject_on_worker_lost=True,
)
def latest(
    self,
    run: str,
    key: str,
    value: int,
    hold: float = 0.0,
    gate: str | None = None,
) -> int:
    """Latest wins: the value of the send that ran."""
    _body(self, run, key, hold, gate)
    return value


@app.task(
    base=SingletonTask,
    shared=False,  # this app only: an app-wide setting in another test must not meet it
    bind=True,
    lock_args=("run", "key"),
    lock_enqueue="until_started",
    lock_debounce=1,
    lock_debounce_max=5,
    acks_late=True,  # a killed run's message comes back (test_debounce.py)
    reject_on_worker_lost=True,
)
def debounced(
    self,
    run: str,
    key: str,
    value: int,
    hold: float = 0.0,
    gate: str | None = None,
) -> int:
    """Debounced: the value of the send that ran."""
    _body(self, run, key, hold, gate)
    return value
