"""The running task's lock handle, and what this process holds, for the safety nets.

``current_lock()`` uses a ContextVar, so it is right per thread and per greenlet (gevent
>= 20.12 gives each greenlet its own context). The held-lock registry is keyed by Celery
task id; task_postrun, task_revoked and worker shutdown use it to release anything a task
left behind. Releasing is idempotent: ``task_revoked`` can fire twice (celery#3805).
"""

from __future__ import annotations

import contextvars
import threading
from typing import TYPE_CHECKING

from celery_pglock import exceptions

if TYPE_CHECKING:
    from celery_pglock.lock import AdvisoryLock

_current: contextvars.ContextVar[AdvisoryLock | None] = contextvars.ContextVar(
    "celery_pglock_current", default=None
)
_held: dict[str, AdvisoryLock] = {}
_held_guard = threading.Lock()


def current_lock() -> AdvisoryLock:
    """The lock of the SingletonTask running in this thread/greenlet.

    Its ``key`` says which lock; in transaction scope its ``connection`` is the open
    transaction to do the protected database work in.

    Raises:
        PgLockError: no SingletonTask body is running here.
    """
    lock = _current.get()
    if lock is None:
        raise exceptions.PgLockError(
            "current_lock() was called outside a running SingletonTask body."
        )
    return lock


def enter(
    lock: AdvisoryLock, task_id: str | None
) -> contextvars.Token[AdvisoryLock | None]:
    """Make ``lock`` the current lock and remember it under ``task_id``."""
    if task_id is not None:
        with _held_guard:
            _held[task_id] = lock
    return _current.set(lock)


def leave(token: contextvars.Token[AdvisoryLock | None], task_id: str | None) -> None:
    """Undo :func:`enter`."""
    _current.reset(token)
    if task_id is not None:
        with _held_guard:
            _held.pop(task_id, None)


def peek() -> AdvisoryLock | None:
    """The current lock, or None (no exception)."""
    return _current.get()


def held_by_task(task_id: str) -> AdvisoryLock | None:
    """The lock a running task of this process holds, if any."""
    with _held_guard:
        return _held.get(task_id)


def all_held() -> list[tuple[str, AdvisoryLock]]:
    """Every (task id, lock) this process holds right now."""
    with _held_guard:
        return list(_held.items())
