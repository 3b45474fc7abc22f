"""Worker signal hooks: configuration checks at start, and the lock-release safety nets.

Connected once per process, the first time a SingletonTask is bound (celery signals are
global, and the receivers work for any app). None of these is the normal release path:
``SingletonTask.__call__`` releases in its own ``finally``. They catch what that cannot:

- ``task_postrun`` / ``task_revoked``: a lock still registered for a finished or revoked
  task id (a bug or an unexpected exit path) is released. Both are idempotent, which
  matters because ``task_revoked`` can fire twice (celery#3805).
- ``worker_process_shutdown`` / ``worker_shutdown``: anything still held is released and
  every lock connection closed, so a stopping worker frees its locks before it exits.
- ``worker_init``: a missing or invalid database URL, or an unknown ``pglock_*`` setting,
  stops the worker at start with a message naming the setting and the environment
  variable, instead of failing every locked task later. (It exits: Celery logs and
  swallows ordinary exceptions raised by signal receivers.)
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from celery import signals as celery_signals

from celery_pglock import config, context, db, exceptions

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
            _release_after_task, weak=False, dispatch_uid="celery_pglock.task_postrun"
        )
        celery_signals.task_revoked.connect(
            _release_revoked, weak=False, dispatch_uid="celery_pglock.task_revoked"
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
        celery_signals.task_revoked.disconnect(
            dispatch_uid="celery_pglock.task_revoked"
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


def _release_after_task(task_id: str | None = None, **_: Any) -> None:
    if task_id is not None:
        _release_leftover(task_id, "task_postrun")


def _release_revoked(request: Any = None, **_: Any) -> None:
    task_id = getattr(request, "id", None)
    if task_id is not None:
        _release_leftover(task_id, "task_revoked")


def _release_leftover(task_id: str, hook: str) -> None:
    lock = context.held_by_task(task_id)
    if lock is None or not lock.owned():
        return
    logger.warning(
        "Lock %s (key %s) of task %s was still held at %s; releasing it",
        lock.key.name,
        lock.key,
        task_id,
        hook,
        extra={
            "action": "lock_leftover_released",
            "lock_key": str(lock.key),
            "task_id": task_id,
        },
    )
    try:
        lock.release(commit=False)
    except exceptions.PgLockError:
        logger.exception(
            "Releasing leftover lock %s failed; its connection was closed", lock.key
        )


def _release_everything(**_: Any) -> None:
    for task_id, _lock in context.all_held():
        _release_leftover(task_id, "worker shutdown")
    db.dispose_all()
