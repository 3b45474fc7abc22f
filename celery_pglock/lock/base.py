"""What a lock-session strategy hands out (a Hold), the interface strategies implement,
and the table of keys held in the process (Claims) that both of them share.

See :mod:`celery_pglock.lock.strategy` for the two strategies and which one a lock gets.
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any, NoReturn, Protocol

from celery_pglock import exceptions
from celery_pglock.db import driver_errors

if TYPE_CHECKING:
    from collections.abc import Callable

    import sqlalchemy as sa

    from celery_pglock.keys import LockKey
    from celery_pglock.lock import fencing_tokens


#: Seconds one lock round trip (acquire, beyond any lock_timeout wait, or release) may
#: wait on the database before its socket is shut down (db/deadlines.py).
DEFAULT_ROUND_TRIP_TIMEOUT = 5.0


class Hold:
    """One granted lock: the session it lives on, for its release."""

    __slots__ = (
        "__weakref__",  # Claims refers to holds weakly
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
        #: The DBAPI (psycopg2 or psycopg 3) connection the lock lives on.
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


class Claims:
    """The keys held by runs of this process (per engine), from acquire until release.

    PostgreSQL excludes sessions, not runs. When a session ends under a body (a
    terminated backend, a restart, an idle timeout, a closed or reconnected process
    session), the server frees its locks while the body goes on, and another connection
    of the same process could take the key beside it. A key stays here until its hold is
    released (the body has ended), whatever became of its session, so a run that lost
    its lock can overlap only with a run of another process (lock_on_lost's business),
    never with one beside it. Both strategies share one Claims per engine and process
    (kept by :mod:`~celery_pglock.lock.strategy`), and consult it before their round trip: a
    key held in the process is refused (or waited for, by a bounded wait) without one.

    A claim refers to its hold weakly: a hold dropped without a release (an AdvisoryLock
    garbage-collected while held) frees its key here, as the pool's check-in frees its
    lock in PostgreSQL. A running body keeps its lock, and so its hold, alive.

    Thread-safe; gevent/eventlet patch the lock and condition it uses.
    """

    __slots__ = ("_cond", "_held", "_mutex", "_waiting")

    #: Longest a bounded wait sleeps before looking again (a dropped hold sends no
    #: notification).
    POLL = 0.25

    def __init__(self) -> None:
        #: key ids -> the hold claiming it (identity: a late release of a hold whose
        #: claim was already given back never frees another run's).
        self._held: dict[tuple[int, ...], weakref.ref[Hold]] = {}
        # Taken bare on the hot path (C code, unlike Condition.__enter__); waits use
        # the Condition over it.
        self._mutex = threading.Lock()
        self._cond = threading.Condition(self._mutex)
        self._waiting = 0  #: Bounded waits parked in claim(): release() notifies them.

    def claim(self, hold: Hold, deadline: float | None = None) -> bool:
        """Claim ``hold.ids`` for ``hold``; False if another run of the process holds it.

        ``deadline`` (``time.monotonic()``): wait until then for the key to be released
        in the process (a bounded wait); None: try once. The caller gives the claim back
        with :meth:`release`, whether or not PostgreSQL then grants the lock.
        """
        ids = hold.ids
        with self._mutex:
            if self._holder(ids) is None:
                self._held[ids] = weakref.ref(hold)
                return True
            if deadline is None:
                return False
            self._waiting += 1
            try:
                # Bounded: by the caller's deadline.
                while self._holder(ids) is not None:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        return False
                    self._cond.wait(min(remaining, self.POLL))
            finally:
                self._waiting -= 1
            self._held[ids] = weakref.ref(hold)
            return True

    def release(self, hold: Hold) -> None:
        """``hold``'s run has ended (or was not granted the lock): free its key."""
        with self._mutex:
            if self._holder(hold.ids) is hold:
                del self._held[hold.ids]
                if self._waiting:
                    self._cond.notify_all()

    def held(self, ids: tuple[int, ...]) -> bool:
        """Is ``ids`` claimed by a run of this process (tests, diagnostics)?"""
        with self._mutex:
            return self._holder(ids) is not None

    def _holder(self, ids: tuple[int, ...]) -> Hold | None:
        """The live hold claiming ``ids`` (under the lock)."""
        ref = self._held.get(ids)
        return None if ref is None else ref()


class LockSession(Protocol):
    """Where locks of one engine live: take one, and give it back.

    Implemented by ``per_lock.PerLockSessions`` and ``per_process.ProcessSession``.
    """

    engine: sa.Engine
    #: The keys held by runs of this process (shared by every strategy of ``engine``).
    claims: Claims

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

        A key claimed in :attr:`claims` (held by another run of this process, even one
        whose session is gone) is refused without a round trip, or waited for within
        ``timeout_ms``; a granted key stays claimed until ``release``.

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

        The key's claim is given back whatever the outcome (the run has ended).

        ``timeout`` bounds the round trip client-side (``deadlines.bounded``): past it
        the socket is shut down and the session closed, which frees the lock.
        """
        ...

    def fencing_holder(
        self, hold: Hold, key: LockKey, *, bound: float
    ) -> fencing_tokens.Holder | None:
        """Who holds ``key`` for ``hold``, as PostgreSQL names it (fencing tokens are
        issued to that holder only, see :mod:`celery_pglock.lock.fencing_tokens`): None when its
        session has ended. Raises DatabaseError when it cannot be asked.
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


def reraise(exc: BaseException, action: str, engine: sa.Engine) -> NoReturn:
    """Raise ``exc`` (being handled) again: a driver error as the DatabaseError
    driver_errors.wrap_db_errors makes of it, anything else unchanged. For the error
    paths of both strategies, after they have cleaned up."""
    if isinstance(exc, Exception):
        with driver_errors.wrap_db_errors(action, engine):
            raise exc
    raise exc
