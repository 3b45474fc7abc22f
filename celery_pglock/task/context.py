"""The running task's lock handle, per execution, and what this process holds.

Each ``SingletonTask.__call__`` opens an :class:`Execution` in a ContextVar, so the
handle is right per thread and per greenlet (gevent >= 20.12 gives each greenlet its own
context), and nested calls (a task body calling another task eagerly or directly) each see
their own. Nothing is keyed by Celery task id: a redelivered message or an explicit
``task_id`` can make two executions share one id, and a retry attempt shares its
predecessor's id, so an id-keyed registry would let one execution release another's lock.

The process-wide registry of held locks exists only for worker shutdown.
"""

from __future__ import annotations

import contextvars
import threading
from typing import TYPE_CHECKING

from celery_pglock import exceptions

if TYPE_CHECKING:
    from celery_pglock.lock import AdvisoryLock


class Execution:
    """One run of a SingletonTask: its lock once granted, and how it ends."""

    # A plain class with slots: one is built per run (a dataclass __init__ costs more).
    __slots__ = ("ended_with", "lock", "release_at_postrun", "task_id")

    def __init__(self, task_id: str | None, lock: AdvisoryLock | None = None) -> None:
        self.task_id = task_id
        self.lock = lock
        #: The body published a retry (self.retry()): the lock is released by the
        #: task_postrun hook, after Celery has stored RETRY, not when the body ends.
        self.release_at_postrun = False
        #: With release_at_postrun: the exception the body ended with (None: returned).
        self.ended_with: BaseException | None = None


_current: contextvars.ContextVar[Execution | None] = contextvars.ContextVar(
    "celery_pglock_execution", default=None
)
_held: set[AdvisoryLock] = set()
_held_guard = threading.Lock()


def current_lock() -> AdvisoryLock:
    """The lock of the SingletonTask body running in this thread/greenlet.

    Its ``key`` says which lock; in transaction scope its ``connection`` is the open
    transaction to do the protected database work in.

    Raises:
        PgLockError: no SingletonTask body is running here.
    """
    execution = _current.get()
    if execution is None or execution.lock is None:
        raise exceptions.PgLockError(
            "current_lock() was called outside a running SingletonTask body."
        )
    return execution.lock


def current_execution() -> Execution | None:
    """The innermost SingletonTask execution of this thread/greenlet, if any."""
    return _current.get()


def begin(task_id: str | None) -> tuple[Execution, contextvars.Token[Execution | None]]:
    """Open an execution; pass the token to :func:`end`."""
    execution = Execution(task_id)
    return execution, _current.set(execution)


def end(token: contextvars.Token[Execution | None]) -> None:
    """Close the execution opened with ``token``."""
    _current.reset(token)


def hold(lock: AdvisoryLock) -> None:
    """Register a lock this process holds (for the worker-shutdown safety net)."""
    with _held_guard:
        _held.add(lock)


def drop(lock: AdvisoryLock) -> None:
    """Forget a released lock (idempotent)."""
    with _held_guard:
        _held.discard(lock)


def all_held() -> list[AdvisoryLock]:
    """Every lock SingletonTasks of this process hold right now."""
    with _held_guard:
        return list(_held)
