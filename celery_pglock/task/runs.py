"""The current run (a ContextVar, never keyed by task id: docs/design.md, Decisions), the
locks this process holds for its runs, and the nets that release what a run left."""

from __future__ import annotations

import contextvars
import logging
import os
from typing import TYPE_CHECKING

from celery_pglock import exceptions
from celery_pglock.db import forks
from celery_pglock.task import outcomes
from celery_pglock.watch import loss_watcher

if TYPE_CHECKING:
    from celery_pglock.lock import AdvisoryLock
    from celery_pglock.task.singleton_task import Execution
    from celery_pglock.task.surface import LockedTask

logger = logging.getLogger(__name__)

current: contextvars.ContextVar[Execution | None] = contextvars.ContextVar(
    "celery_pglock_execution", default=None
)
held: set[AdvisoryLock] = set()  #: Locks held here, for the worker-shutdown net.
held_guard = forks.safe_lock(held)  # a child holds none of these


def current_lock() -> AdvisoryLock:
    """The lock of the SingletonTask body running in this thread or greenlet.

    In transaction scope, its ``connection`` is the transaction to do the body's work in.

    Raises:
        PgLockError: no SingletonTask body is running here.
    """
    execution = current.get()
    if execution is None or execution.lock is None:
        raise exceptions.PgLockError(
            "current_lock() was called outside a running SingletonTask body."
        )
    return execution.lock


def held_locks() -> list[AdvisoryLock]:
    with held_guard:
        return list(held)


def release_unrun(task: LockedTask, lock: AdvisoryLock, task_id: str | None) -> None:
    """Release a lock whose body will not run; a failure is reported, never raised."""
    try:
        lock.release(commit=False)
    except exceptions.PgLockError as error:
        if not lock.lost:  # a lost lock's release fails; lock_lost said it all
            outcomes.release_failed(task, task_id, lock, error)


def release_leftover(lock: AdvisoryLock, where: str) -> None:
    """A lock still held where its run has ended (a safety net): release it, loudly."""
    logger.warning(
        "Lock %s (key %s) was still held at %s; releasing it",
        lock.key.name,
        lock.key,
        where,
        extra={"action": "lock_leftover_released", "lock_key": str(lock.key)},
    )
    with held_guard:
        held.discard(lock)
    try:
        lock.release(commit=False)
    except exceptions.PgLockError:
        logger.exception(
            "Releasing leftover lock %s failed; PostgreSQL no longer holds it", lock.key
        )


def release_direct_leftover(execution: Execution) -> None:
    """A direct call's lock still held as it returns (an interrupt landed between its
    grant and its release): task_postrun only sees the worker run's own, so release it."""
    lock = execution.lock
    if lock is None or not lock.owned() or lock.owner_pid != os.getpid():
        return
    for watched in filter(None, (lock, execution.group_lock)):
        loss_watcher.unwatch(watched)
    release_leftover(lock, "the end of a direct call")
