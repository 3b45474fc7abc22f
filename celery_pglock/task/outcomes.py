"""Each lock outcome of a run, reported once: to the signals, the log and the metrics sink.
acquired() and released() build nothing unless asked. Levels: docs/operations/monitoring.md."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from celery import states
from celery.exceptions import Ignore, Reject, Retry

from celery_pglock import metrics, signals

if TYPE_CHECKING:
    from celery_pglock.lock import AdvisoryLock
    from celery_pglock.task.surface import LockedTask

logger = logging.getLogger(__name__)
_metrics_warned = False


def run_name(task: LockedTask, task_id: str | None) -> str:
    """How messages name a run: ``task[id]``, or the task and "direct call" (no id)."""
    return f"{task.name}[{task_id}]" if task_id else f"{task.name} (direct call)"


def acquired(task: LockedTask, task_id: str | None, lock: AdvisoryLock) -> None:
    wait = lock.wait_seconds or 0.0
    if metrics.sink is not None:
        _count("acquired", task.name, wait)
    if signals.lock_acquired.receivers:
        signals.lock_acquired.send(**_payload(task, task_id, lock, wait_seconds=wait))
    if logger.isEnabledFor(logging.DEBUG):
        logger.debug(
            "Acquired lock %s (key %s) for %s in %.3fs",
            lock.key.name,
            lock.key,
            run_name(task, task_id),
            wait,
            extra=_extra("lock_acquired", lock, task_id),
        )


#: Skip reasons of a free key: a refused start (counted as throttled too).
THROTTLES = ("rate", "period", "group")


def skipped(
    task: LockedTask,
    task_id: str | None,
    lock: AdvisoryLock,
    *,
    action: str,
    message: str,
    details: dict[str, Any],
    celery_logs: bool,
    shadow: bool = False,
) -> None:
    """``celery_logs``: Celery's task line carries ``message``, so ours is DEBUG;
    ``shadow``: a would-be skip, the body runs anyway."""
    wait = lock.wait_seconds or 0.0
    reason = details.get("reason")
    if metrics.sink is not None:
        _count("skipped", task.name, action, wait)
        # Optional in a custom Metrics (added after the protocol was published).
        if reason in THROTTLES and hasattr(metrics.sink, "throttled"):
            _count("throttled", task.name, reason)
    holder = details.get("holder")
    if signals.lock_skipped.receivers:
        signals.lock_skipped.send(
            **_payload(task, task_id, lock, wait_seconds=wait),
            action=action,
            holder=holder,
            shadow=shadow,
            reason=reason,
            details=details,
        )
    level = logging.DEBUG if celery_logs else logging.INFO
    if logger.isEnabledFor(level):
        logger.log(
            level,
            "%s Policy: %s%s.",
            message,
            action,
            " (shadow mode: the body runs anyway)" if shadow else "",
            extra={
                **_extra("lock_skipped", lock, task_id),
                "on_busy": action,
                "holder": holder,
                "holder_pid": details.get("holder_pid"),
                "shadow": shadow,
                "reason": details.get("reason"),
            },
        )


def released(
    task: LockedTask,
    task_id: str | None,
    lock: AdvisoryLock,
    *,
    failed: bool,
    exception: BaseException | None,
) -> None:
    """The run ended (its lock released, or its release already reported as failed)."""
    state = _state_of(exception) if failed else states.SUCCESS
    held = (lock.released_at or 0.0) - (lock.acquired_at or 0.0)
    if metrics.sink is not None:
        _count("released", task.name, state, held)
    signal = signals.lock_failed if failed else signals.lock_completed
    if signal.receivers:
        more = {"exception": exception} if failed else {}
        signal.send(
            **_payload(task, task_id, lock, held_seconds=held, state=state, **more)
        )
    if logger.isEnabledFor(logging.DEBUG):
        logger.debug(
            "Lock %s (key %s) of %s: %s after %.3fs held",
            lock.key.name,
            lock.key,
            run_name(task, task_id),
            state,
            held,
            extra={
                **_extra("lock_failed" if failed else "lock_completed", lock, task_id),
                "state": state,
            },
        )


_STATES = ((Retry, states.RETRY), (Ignore, states.IGNORED), (Reject, states.REJECTED))


def _state_of(exc: BaseException | None) -> str:
    return next((s for kind, s in _STATES if isinstance(exc, kind)), states.FAILURE)


def release_failed(
    task: LockedTask, task_id: str | None, lock: AdvisoryLock, error: BaseException
) -> None:
    if metrics.sink is not None:
        _count("release_failed", task.name)
    logger.error(
        "Releasing lock %s (key %s) of %s failed: %s. PostgreSQL no longer holds "
        "the lock.",
        lock.key.name,
        lock.key,
        run_name(task, task_id),
        str(error).rstrip("."),
        extra=_extra("lock_release_failed", lock, task_id),
    )
    if signals.lock_release_failed.receivers:
        signals.lock_release_failed.send(
            **_payload(task, task_id, lock), exception=error
        )


def lost(task: LockedTask, task_id: str | None, lock: AdvisoryLock, cause: str) -> None:
    """Called from the watcher thread (body running), or before the body (no token)."""
    if metrics.sink is not None:
        _count("lost", task.name)
    logger.error(
        "Lock %s (key %s) of %s was lost: %s. Another run may hold it now; the run "
        "will end FAILURE with LockLostError.",
        lock.key.name,
        lock.key,
        run_name(task, task_id),
        cause,
        extra={**_extra("lock_lost", lock, task_id), "cause": cause},
    )
    if signals.lock_lost.receivers:
        signals.lock_lost.send(**_payload(task, task_id, lock), cause=cause)


def database_error(
    task: LockedTask,
    task_id: str | None,
    error: BaseException,
    countdown: float,
    max_retries: int | None,
) -> None:
    logger.warning(
        "%s could not take its lock: %s. The lock database looks unavailable; the "
        "run is re-queued in %gs (retry %d of %s), and its body has not run.",
        run_name(task, task_id),
        error,
        countdown,
        task.request.retries + 1,
        "unlimited" if max_retries is None else max_retries,
        extra={"action": "lock_database_error", "task_id": task_id},
    )


def enqueued(
    task: LockedTask,
    outcome: str,
    task_id: str,
    key: object,
    queued_task_id: str | None = None,
) -> None:
    # Optional in a custom Metrics (added after the protocol was published).
    if metrics.sink is not None and hasattr(metrics.sink, "enqueued"):
        _count("enqueued", task.name, outcome)
    if signals.lock_enqueued.receivers:
        signals.lock_enqueued.send(
            sender=task,
            task_id=task_id,
            task_name=task.name,
            key=key,
            outcome=outcome,
            queued_task_id=queued_task_id,
        )


def _count(event: str, *args: Any) -> None:
    # A metrics sink must never fail a task: log (once per process) and go on.
    global _metrics_warned
    try:
        getattr(metrics.sink, event)(*args)
    except Exception as exc:
        if not _metrics_warned:
            _metrics_warned = True
            logger.error(
                "celery-pglock: the metrics sink failed; tasks go on, counts may be lost",
                exc_info=exc,
            )


def _payload(
    task: LockedTask, task_id: str | None, lock: AdvisoryLock, **more: Any
) -> dict[str, Any]:
    return {
        "sender": task,
        "task_id": task_id,
        "task_name": task.name,
        "key": lock.key,
        "wait_seconds": lock.wait_seconds,
        **more,
    }


def _extra(action: str, lock: AdvisoryLock, task_id: str | None) -> dict[str, Any]:
    return {
        "action": action,
        "lock_key": str(lock.key),
        "lock_name": lock.key.name,
        "task_id": task_id,
    }
