"""Worker signal hooks: configuration checks at start, and the lock-release safety nets.

Connected once per process, the first time a SingletonTask is bound (celery signals are
global, and the receivers work for any app). None of these is the normal release path:
``SingletonTask.__call__`` releases in its own ``finally``. They catch what that cannot:

- ``task_postrun``: if the execution that just ended still holds its lock (a bug or an
  unexpected exit path), it is released. The lock is found on the tracer's request, i.e.
  per execution and per thread, never by task id: two executions can share an id (a
  redelivery, an explicit task_id, a retry attempt) and must not release each other's
  lock. Releasing is idempotent. It also publishes a retry that ``self.retry()``
  deferred: this is the first moment after both the release and Celery's store of the
  attempt's RETRY state.
- ``task_revoked`` needs no hook: a task revoked before it starts holds nothing, and
  ``terminate=True`` kills the prefork child, whose session end frees the lock. (The
  signal fires in the worker's main process, and can fire twice, celery#3805.)
- ``worker_process_shutdown`` / ``worker_shutdown``: anything still held is released and
  every lock connection (the process's lock session included) closed, so a stopping
  worker frees its locks before it exits.
- ``worker_init``: a missing or invalid database URL or ``pglock_session_mode``, or an
  unknown ``pglock_*`` setting,
  stops the worker at start with a message naming the setting and the environment
  variable, instead of failing every locked task later. (It exits: Celery logs and
  swallows ordinary exceptions raised by signal receivers.)
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from celery import Task
from celery import signals as celery_signals

from celery_pglock import _session, config, context, db, exceptions

logger = logging.getLogger(__name__)

_SHUTDOWN_SIGNALS = {
    "worker_process_shutdown": celery_signals.worker_process_shutdown,
    "worker_shutdown": celery_signals.worker_shutdown,
}
_connected = False
_connect_guard = threading.Lock()


def connect() -> None:
    """Connect the receivers (idempotent)."""
    global _connected
    with _connect_guard:
        if _connected:
            return
        celery_signals.worker_init.connect(
            _check_worker_config, weak=False, dispatch_uid="celery_pglock.worker_init"
        )
        celery_signals.task_postrun.connect(
            _after_task, weak=False, dispatch_uid="celery_pglock.task_postrun"
        )
        for name, signal in _SHUTDOWN_SIGNALS.items():
            signal.connect(
                _release_everything, weak=False, dispatch_uid=f"celery_pglock.{name}"
            )
        _connected = True


def disconnect() -> None:
    """Disconnect the receivers (tests; a worker never needs this)."""
    global _connected
    with _connect_guard:
        celery_signals.worker_init.disconnect(dispatch_uid="celery_pglock.worker_init")
        celery_signals.task_postrun.disconnect(
            dispatch_uid="celery_pglock.task_postrun"
        )
        for name, signal in _SHUTDOWN_SIGNALS.items():
            signal.disconnect(dispatch_uid=f"celery_pglock.{name}")
        _connected = False


def check_app(app: Any) -> None:
    """Check the lock settings of ``app`` if it has SingletonTasks.

    Raises:
        ConfigurationError: naming the setting (and environment variable) at fault.
    """
    from celery_pglock.task import SingletonTask

    if not any(isinstance(task, SingletonTask) for task in app.tasks.values()):
        return
    config.check_unknown_settings(app.conf)
    config.session_mode(app.conf)
    url = config.database_url(app.conf)
    db.check_url(url)
    logger.info(
        "celery-pglock: lock database %s",
        db.mask_url(url),
        extra={"action": "lock_config"},
    )


def _check_worker_config(sender: Any = None, **_: Any) -> None:
    app = getattr(sender, "app", None)
    if app is None:
        return
    try:
        check_app(app)
    except exceptions.ConfigurationError as error:
        logger.critical("celery-pglock: %s", error)
        raise SystemExit(f"celery-pglock: {error}") from error


def _after_task(task: Any = None, **_: Any) -> None:
    execution = getattr(getattr(task, "request", None), "_pglock_execution", None)
    if execution is None:
        return
    lock = execution.lock
    if lock is not None and lock.owned():
        _release_leftover(lock, f"task_postrun of {execution.task_id}")
    deferred, execution.deferred_retry = execution.deferred_retry, None
    if deferred is not None:
        _publish_retry(task, execution.task_id, deferred)


def _publish_retry(task: Any, task_id: str | None, deferred: dict[str, Any]) -> None:
    """Publish the retry a SingletonTask body asked for, now that its lock is released.

    This runs after Celery stored the attempt's RETRY state, so the retry attempt's own
    outcome cannot be overwritten by it. Celery's retry() raises Reject when the broker
    refuses the message; here that can only be logged (signal receivers cannot fail a
    task), and the task's state stays RETRY.
    """
    try:
        Task.retry(task, throw=False, **deferred)
    except Exception:
        logger.exception(
            "The retry of %s[%s] could not be published; the retry is lost",
            getattr(task, "name", "?"), task_id,
            extra={"action": "lock_retry_publish_failed", "task_id": task_id},
        )  # fmt: skip


def _release_leftover(lock: Any, where: str) -> None:
    logger.warning(
        "Lock %s (key %s) was still held at %s; releasing it", lock.key.name, lock.key, where,
        extra={"action": "lock_leftover_released", "lock_key": str(lock.key)},
    )  # fmt: skip
    context.drop(lock)
    try:
        lock.release(commit=False)
    except exceptions.PgLockError:
        logger.exception(
            "Releasing leftover lock %s failed; its connection was closed", lock.key
        )


def _release_everything(**_: Any) -> None:
    for lock in context.all_held():
        if lock.owned():
            _release_leftover(lock, "worker shutdown")
    _session.close_all()
    db.dispose_all()
