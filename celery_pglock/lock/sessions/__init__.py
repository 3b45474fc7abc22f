"""The sessions that carry a key from acquire to release, picked by :func:`for_lock`.
Why: docs/design.md ("One lock session per process", "A key stays claimed")."""

from __future__ import annotations

from celery_pglock.lock.sessions.base import (
    DEFAULT_ROUND_TRIP_TIMEOUT,
    AcquireRequest,
    Claims,
    Hold,
    LockSessions,
)
from celery_pglock.lock.sessions.per_lock import PerLockSessions
from celery_pglock.lock.sessions.process import (
    ProcessSession,
    SessionBusyError,
    close_all,
    close_for,
    for_lock,
    open_process_session,
    process_session,
)

__all__ = [
    "DEFAULT_ROUND_TRIP_TIMEOUT",
    "AcquireRequest",
    "Claims",
    "Hold",
    "LockSessions",
    "PerLockSessions",
    "ProcessSession",
    "SessionBusyError",
    "close_all",
    "close_for",
    "for_lock",
    "open_process_session",
    "process_session",
]
