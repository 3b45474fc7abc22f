"""celery-pglock: singleton Celery tasks on PostgreSQL advisory locks (docs/index.md)."""

from __future__ import annotations

from celery_pglock import fencing, metrics, signals
from celery_pglock.config import (
    Enqueue,
    LockConfig,
    LockScope,
    OnBusy,
    OnLost,
    SkipResult,
)
from celery_pglock.exceptions import (
    AlreadyQueued,
    ConfigurationError,
    DatabaseError,
    EnqueueUnavailable,
    LockBusy,
    LockError,
    LockKeyError,
    LockLostError,
    LockNotOwnedError,
    LockSkipped,
    PgLockError,
    TaskReplaced,
)
from celery_pglock.keys import KEY_FORMAT, LockKey, make_key
from celery_pglock.lock import AdvisoryLock
from celery_pglock.task import SingletonTask
from celery_pglock.task.busy_policy import SKIPPED, skip_info
from celery_pglock.task.runs import current_lock

__all__ = [
    "KEY_FORMAT",
    "SKIPPED",
    "AdvisoryLock",
    "AlreadyQueued",
    "ConfigurationError",
    "DatabaseError",
    "Enqueue",
    "EnqueueUnavailable",
    "LockBusy",
    "LockConfig",
    "LockError",
    "LockKey",
    "LockKeyError",
    "LockLostError",
    "LockNotOwnedError",
    "LockScope",
    "LockSkipped",
    "OnBusy",
    "OnLost",
    "PgLockError",
    "SingletonTask",
    "SkipResult",
    "TaskReplaced",
    "current_lock",
    "fencing",
    "make_key",
    "metrics",
    "signals",
    "skip_info",
]
