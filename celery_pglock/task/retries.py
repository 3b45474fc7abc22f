"""A run's retries: the lock a retried run keeps until Celery has stored RETRY, and a
database error retried as Celery's autoretry_for would. Why: docs/guide/retries.md."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, NoReturn

from celery_pglock import celery_compat
from celery_pglock.db import driver_errors
from celery_pglock.task import outcomes, queued, queued_writes, runs

if TYPE_CHECKING:
    from celery_pglock import exceptions
    from celery_pglock.lock import AdvisoryLock
    from celery_pglock.task.singleton_task import SingletonTask


def keep_lock_for_the_retry(task: SingletonTask, max_retries: int | None) -> None:
    """Before ``task.retry()`` publishes: this run's lock is released at task_postrun,
    and its queued row is the retry's (a direct, eager or last attempt: as usual)."""
    execution = runs.current.get()
    if (
        execution is not None
        and execution.lock is not None
        and execution.lock.owned()
        and execution.task_id is not None  # not a direct (or recursive) call
        and not task.request.is_eager
        and celery_compat.retry_publishes(task, max_retries)
    ):
        execution.release_at_postrun = True
        execution.lock.drop_rider()  # the retry is the key's queued message now


def wait_for_predecessor(lock: AdvisoryLock, timeout: float) -> float:
    """A retry of a lock_limit key: its predecessor keeps its slot until task_postrun,
    but another slot may be free; wait (within ``timeout``) for the predecessor's run
    lock instead. The seconds left for the slot's own wait."""
    run = lock.run_key
    deadline = time.monotonic() + timeout
    if run is None or len(lock.slots) < 2:
        return timeout
    pause = 0.05
    while lock.run_alive(run) is not False:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        time.sleep(min(pause, left))
        pause = min(pause * 2, 1.0)
    return max(deadline - time.monotonic(), 0.001)


def on_database_error(
    task: SingletonTask, error: exceptions.DatabaseError, *, direct: bool
) -> NoReturn:
    """Retry as Celery's autoretry_for would, else raise: the message ends unrun, so its
    lock_enqueue row is freed, later if the database is down."""
    request = task.request
    if (
        direct
        or request.is_eager  # eager retries run inline, without the countdown
        or not celery_compat.autoretries(task, error)
        or not driver_errors.is_transient(error.__cause__)
    ):
        _free_queued_row_later(task)
        raise error
    retry_kwargs = celery_compat.autoretry_options(task)
    limit = retry_kwargs.get("max_retries", task.max_retries)
    if not celery_compat.retry_publishes(task, limit):
        _free_queued_row_later(task)
        raise error
    countdown = retry_kwargs.get("countdown", task.default_retry_delay)
    outcomes.database_error(task, request.id, error, countdown, limit)
    try:
        raise task.retry(exc=error, **retry_kwargs)
    finally:
        celery_compat.forget_max_retries_override(task)


def _free_queued_row_later(task: SingletonTask) -> None:
    execution = runs.current.get()
    row = None if execution is None else queued.row_of(execution.lock)
    if row is not None:
        queued_writes.free_later(task, row.row, row.task_id)
