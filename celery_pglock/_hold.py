"""What a lock-session strategy hands out (a Hold) and the interface strategies implement.

See :mod:`celery_pglock._session` for the two strategies and which one a lock gets.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Protocol

from celery_pglock import exceptions

if TYPE_CHECKING:
    from collections.abc import Callable

    import sqlalchemy as sa

    from celery_pglock.keys import LockKey


#: Seconds one lock round trip (acquire, beyond any lock_timeout wait, or release) may
#: wait on the database before its socket is shut down (_deadline.py).
DEFAULT_ROUND_TRIP_TIMEOUT = 5.0


class Hold:
    """One granted lock: the session it lives on, for its release."""

    __slots__ = (
        "connection",
        "holding_name",
        "idle_name",
        "ids",
        "lent",
        "lost",
        "pid",
        "pooled",
        "run_ids",
        "sa_connection",
        "session",
        "transaction",
    )

    def __init__(
        self, session: LockSession, ids: tuple[int, ...], idle_name: str = ""
    ) -> None:
        self.session = session
        self.ids = ids
        #: PerLockSessions: the application_name its connection shows once released.
        self.idle_name = idle_name
        #: The application_name the session showed when the lock was granted.
        self.holding_name: str | None = None
        self.pid = os.getpid()
        #: The psycopg2 connection the lock lives on.
        self.connection: Any = None
        #: PerLockSessions: the pool's proxied connection, pinned until release.
        self.pooled: Any = None
        #: Transaction scope: the SQLAlchemy connection and transaction lent to the body.
        self.sa_connection: sa.Connection | None = None
        self.transaction: sa.RootTransaction | None = None
        self.lent = False
        #: Why the lock was lost before its release (its session ended), or None.
        self.lost: str | None = None
        #: The run lock held beside the key (keys.run_key), released with it, or None.
        self.run_ids: tuple[int, ...] | None = None


class LockSession(Protocol):
    """Where locks of one engine live: take one, and give it back.

    Implemented by ``_per_lock.PerLockSessions`` and ``_process_session.ProcessSession``.
    """

    engine: sa.Engine

    def acquire(
        self,
        key: LockKey,
        *,
        label: str,
        timeout_ms: int | None,
        transaction: bool,
        bound: float = DEFAULT_ROUND_TRIP_TIMEOUT,
        run: LockKey | None = None,
        on_granted: Callable[[Hold], None] | None = None,
    ) -> Hold | None:
        """Take ``key``; the hold, or None when another session (or task) holds it.

        ``label`` (a task name) goes into the session's application_name. ``bound``
        limits the round trip client-side, beyond a ``timeout_ms`` wait: a frozen link or
        server gives a DatabaseError instead of a hang. ``run``: a run lock to take with
        the key (``hold.run_ids`` when granted) and to release with it. ``on_granted``
        gets the hold as soon as it is recorded, inside the strategy's own failure
        handling: an exception landing before ``acquire`` returns (a soft time limit)
        cannot leave a granted key its owner does not know.
        """
        ...

    def run_alive(self, run: LockKey, *, bound: float) -> bool | None:
        """Does some session hold the run lock ``run`` (its run is still going)?

        None when that cannot be found out (never raises).
        """
        ...

    def release(
        self,
        hold: Hold,
        key: LockKey,
        *,
        commit: bool,
        timeout: float = DEFAULT_ROUND_TRIP_TIMEOUT,
    ) -> None:
        """Give ``hold`` back; raises LockNotOwnedError/LockLostError/DatabaseError.

        ``timeout`` bounds the round trip client-side (``_deadline.bounded``): past it
        the socket is shut down and the session closed, which frees the lock.
        """
        ...

    def issue_token(self, hold: Hold, key: LockKey, *, bound: float) -> int | None:
        """Issue ``key``'s next fencing token to ``hold`` if its session holds ``key`` now.

        None when it does not (the lock was lost since its grant); raises DatabaseError
        when the token could not be issued (see :mod:`celery_pglock._fencing`).
        """
        ...

    def holder_of(self, key: LockKey, *, bound: float) -> str | None:
        """``"<backend pid> <application_name>"`` of the session holding ``key`` now.

        None when nobody holds it or it could not be found out (never raises: not
        knowing the holder must never change how a skip ends). ``bound`` limits the
        round trip as for ``acquire``.
        """
        ...


def foreign(hold: Hold, key: LockKey) -> exceptions.LockNotOwnedError:
    return exceptions.LockNotOwnedError(
        f"Lock {key.name!r} (key {key}) belongs to process {hold.pid}, not to this one "
        f"({os.getpid()}, a fork?); its session was left untouched.",
        key=str(key),
        name=key.name,
    )
