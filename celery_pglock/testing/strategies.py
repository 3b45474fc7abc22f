"""Which session strategy new locks of this process use: for tests of the per-lock one
(the strategy waits and transaction scope use), without a switch in the lock layer."""

from __future__ import annotations

from typing import TYPE_CHECKING

from celery_pglock.lock import sessions
from celery_pglock.lock.sessions import process

if TYPE_CHECKING:
    import sqlalchemy as sa


def use_per_lock_sessions(enabled: bool = True) -> None:
    """Put each new lock of this process on a pinned connection of its own, or (False)
    back on the process session for session-scope tries."""
    # AdvisoryLock looks its strategy up per lock, through the package.
    sessions.for_lock = _per_lock if enabled else process.for_lock


def _per_lock(
    engine: sa.Engine, *, transaction: bool = False
) -> sessions.ProcessSession | sessions.PerLockSessions:
    return process.process_session(engine).waits
