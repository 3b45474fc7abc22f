"""AdvisoryLock: one PostgreSQL advisory lock, on the session :mod:`.sessions` picks.
Why: docs/guide/how-it-works.md and docs/design.md (Decisions)."""

from __future__ import annotations

import logging
import math
import os
import time
from typing import TYPE_CHECKING, Any, TypeVar

from celery_pglock import exceptions
from celery_pglock.config import LockScope
from celery_pglock.db import driver_errors, engines, sql_text
from celery_pglock.lock import identity, rider, sessions

if TYPE_CHECKING:
    import sqlalchemy as sa

    from celery_pglock.keys import LockKey
    from celery_pglock.lock.sessions import base

logger = logging.getLogger(__name__)
LockErrorT = TypeVar("LockErrorT", bound=exceptions.LockError)

#: lock_limit's wait polls: the first pause and the longest (docs/guide/limits.md).
SLOT_POLL_FIRST, SLOT_POLL_MAX = 0.05, 1.0


class AdvisoryLock:
    """One advisory lock of ``engine``'s database, for one thread at a time.

    Args:
        engine: A lock engine (``celery_pglock.db.create_engine``), its pool for locks only.
        key: The advisory key.
        scope: ``LockScope.SESSION`` (default) or ``LockScope.TRANSACTION``.
        label: Shown in the session's ``application_name``; defaults to the lock name.
    """

    def __init__(
        self,
        *,
        engine: sa.Engine,
        key: LockKey,
        scope: LockScope | str = LockScope.SESSION,
        label: str | None = None,
    ) -> None:
        self.engine = engine
        self.key = key
        self.scope = scope if type(scope) is LockScope else LockScope(scope)
        self._label = label or key.name
        self._session = sessions.for_lock(
            engine, transaction=self.scope is LockScope.TRANSACTION
        )
        self._hold: sessions.Hold | None = None
        self.acquired_at: float | None = None  #: time.monotonic() of the grant.
        self.released_at: float | None = None  #: time.monotonic() of the release.
        self.wait_seconds: float | None = None  #: What acquire() took, waits included.
        self.backend_pid: int | None = None  #: The holding session's pid, while held.
        self.owner_pid: int | None = None  #: The taker's pid: only it may release.
        self.lost_cause: str | None = None  #: Why the lock was lost while held.
        #: Max seconds per round trip, past any acquire timeout, before the socket is shut.
        self.round_trip_timeout: float = sessions.DEFAULT_ROUND_TRIP_TIMEOUT
        self.shadowed = False  #: Shadow run, not held: ensure_held() passes; no fencing
        self.fencing_token: int | None = None  #: This hold's token (fencing on).
        self.run_key: LockKey | None = None  #: acks_late: the run lock (keys.run_key).
        #: A feature's statement sent with the grant and the release (lock.rider).
        self.rider: rider.Rider | None = None
        #: lock_limit: ``keys.slot_keys(key, N)``; the first free one taken is ``key``.
        self.slots: tuple[LockKey, ...] = (key,)
        #: Keys of which one more is taken with the key, in its statement, where the
        #: session can (a try on the process session), and released with it.
        self.companions: tuple[LockKey, ...] = ()

    def acquire(self, *, timeout: float | None = None) -> bool:
        """Take the lock; True if granted, False if another session holds it.

        Args:
            timeout: None to try once; else wait at most this many seconds (lock_timeout).

        Raises:
            PgLockError: this object already holds the lock.
            ConfigurationError: bad ``timeout``; a standby or a pooler breaking the scope.
            DatabaseError: the database failed; the lock is not held.
        """
        if self.owned():
            raise exceptions.PgLockError(
                f"Lock {self._about} is already held by this AdvisoryLock; "
                "use a new AdvisoryLock for a nested hold."
            )
        timeout_ms: int | None = None
        if timeout is not None:
            if (
                isinstance(timeout, bool)
                or not isinstance(timeout, (int, float))
                or not (0 < timeout < math.inf)
            ):
                raise exceptions.ConfigurationError(
                    f"timeout={timeout!r} is invalid; expected None (try once) or a positive number of seconds."
                )
            # lock_timeout = 0 would mean "wait forever": never round a small bound to 0.
            timeout_ms = max(1, math.ceil(timeout * 1000))
        pid = os.getpid()
        if self._session.pid != pid:  # made before a fork: this process's own sessions
            self._session = sessions.for_lock(
                self.engine, transaction=self.scope is LockScope.TRANSACTION
            )
        asked_at = time.monotonic()
        try:
            granted = self._do_acquire(timeout_ms)
        except exceptions.DatabaseError as error:
            # A dead session held nothing and is closed: retry once (not a failed connect).
            if not driver_errors.is_dead_session(error):
                raise
            logger.warning(
                "Lock connection to %s was dead (%s); reconnecting once",
                engines.engine_info(self.engine)["masked_url"],
                error.__cause__,
                extra={"action": "lock_reconnect", "lock_key": str(self.key)},
            )
            granted = self._do_acquire(timeout_ms)
        self.wait_seconds = time.monotonic() - asked_at
        hold = self._hold
        if granted and hold is not None:
            self.acquired_at = asked_at + self.wait_seconds
            self.released_at = None
            # No round trip; fails if another thread's failure closed the session (lost).
            try:
                self.backend_pid = hold.connection.info.backend_pid
            except Exception:
                self.backend_pid = None
            self.owner_pid = pid
            self.lost_cause = None
            self.fencing_token = None  # issued after the grant (celery_pglock.fencing)
        return granted

    def release(self, *, commit: bool = True) -> None:
        """Release the lock and give back any connection it pinned.

        Args:
            commit: transaction scope: commit (default) or roll back its transaction.

        Raises:
            LockNotOwnedError: not held by this object, or by this process (a fork: its
                session is left untouched), or its session ended or lost the key.
            LockLostError: transaction scope: its transaction ended early (by the body?).
            DatabaseError: the database failed; closing the session freed every lock on it.
        """
        hold = self._hold
        if hold is None:
            raise self._error(
                exceptions.LockNotOwnedError,
                f"Cannot release lock {self._about}: it is not held by this AdvisoryLock.",
            )
        if hold.pid != os.getpid():
            self._hold = None
            raise self._error(
                exceptions.LockNotOwnedError,
                f"Lock {self._about} belongs to process {hold.pid}, not to this one "
                f"({os.getpid()}, a fork?); its session was left untouched.",
            )
        try:
            hold.session.release(hold, self.key, commit, self.round_trip_timeout)
        except exceptions.PgLockError:
            self._hold = None  # an outcome: released, or its session ended
            raise
        except BaseException:
            # Interrupted (a soft time limit landing here): still held, it stays this
            # object's, so that task_postrun releases it; a lost hold would leak the key.
            if not hold.session.still_holds(hold):
                self._hold = None
            raise
        else:
            self._hold = None
        finally:
            self.released_at = time.monotonic()

    def holder_identity(self) -> identity.Identity | None:
        """Who holds the lock, as PostgreSQL names it (a round trip, bounded by
        ``round_trip_timeout``, once per session); None once its session has ended.

        Raises:
            PgLockError: the lock is not held.
            DatabaseError: the database failed.
        """
        hold = self._hold
        if hold is None:
            raise exceptions.PgLockError(f"Lock {self._about} is not held.")
        return hold.session.identity(hold, self.key, bound=self.round_trip_timeout)

    def on_holding_session(
        self, action: str, work: base.Work
    ) -> tuple[Any, ...] | None:
        """``work(dbapi_connection, cursor)`` on the session holding the lock, bounded by
        ``round_trip_timeout``; None in transaction scope (it would commit with the lock's
        transaction). Raises LockLostError if the session has ended since the grant."""
        hold = self._hold
        if hold is None:
            return None
        row = hold.session.on_holder(hold, action, self.round_trip_timeout, work)
        if row is None and self.scope is LockScope.SESSION:
            self.mark_lost(hold.lost or "its session ended before " + action)
            raise self.lost_error()
        return row

    def drop_rider(self) -> None:
        """Send nothing more with the release (its feature's row now has another owner)."""
        self.rider = None
        if self._hold is not None:
            self._hold.rider = None

    def owned(self) -> bool:
        """True while this object holds the lock (no database round trip)."""
        return self._hold is not None

    @property
    def companion_taken(self) -> bool | None:
        """While held: True if one of ``companions`` was taken with the key, False if
        none was free, None if they were not tried (the session could not)."""
        hold = self._hold
        if hold is None or not hold.companions_tried:
            return None
        return hold.companion is not None

    @property
    def lost(self) -> bool:
        """True once the lock was found lost while held (see ``lost_cause``)."""
        return self.lost_cause is not None

    def ensure_held(self) -> None:
        """Raise unless the lock is still held, as the watcher last found (no round trip;
        docs/operations/lock-loss.md): call it before each side effect of a long body.

        Raises:
            LockLostError: the lock was lost (the message says why).
            LockNotOwnedError: not held, or not by this process (a forked child).
        """
        if self.lost_cause is not None:
            raise self.lost_error()
        if self.shadowed:
            return  # shadow mode promises to run the body whatever the lock says
        if not self.owned() or self.owner_pid != os.getpid():
            raise self._error(
                exceptions.LockNotOwnedError,
                f"Lock {self._about} is not held by this process.",
            )

    @property
    def session(self) -> sessions.ProcessSession | sessions.PerLockSessions:
        return self._session

    def run_alive(self, run_key: LockKey) -> bool | None:
        """Is ``run_key`` (keys.run_key) held? None when unknown; never raises."""
        return self._session.run_alive(run_key, bound=self.round_trip_timeout)

    @property
    def holding_name(self) -> str | None:
        """application_name shown at the grant (the watcher's pid lookup via PgBouncer)."""
        hold = self._hold
        return hold.holding_name if hold is not None else None

    def mark_lost(self, cause: str) -> bool:
        """Record that the lock was lost; True the first time (the watcher reports it)."""
        if self.lost_cause is not None or not self.owned():
            return False
        self.lost_cause = cause
        return True

    def lost_error(self) -> exceptions.LockLostError:
        return self._error(
            exceptions.LockLostError,
            f"Lock {self._about} was lost while its body ran: {self.lost_cause}.",
        )

    def locked(self) -> bool:
        """True if any session in this database holds the key (one ``pg_locks`` query)."""
        with (
            driver_errors.wrap_db_errors("read pg_locks", self.engine),
            self.engine.connect() as connection,
        ):
            result = connection.exec_driver_sql(
                sql_text.IS_LOCKED, self.key.pg_locks_ids
            ).scalar()
            return bool(result)

    @property
    def connection(self) -> sa.Connection:
        """The lock's connection, in its open transaction (transaction scope).

        Do the protected work on it; ending its transaction yourself ends the lock early.

        Raises:
            PgLockError: session scope, or the lock is not held.
        """
        if self.scope is not LockScope.TRANSACTION:
            raise exceptions.PgLockError(
                f"Lock {self.key.name!r} uses session scope, whose pinned connection is not "
                "shared with the task; set lock_scope='transaction' to work inside the lock's transaction."
            )
        hold = self._hold
        if hold is None or hold.sa_connection is None:
            raise exceptions.PgLockError(f"Lock {self._about} is not held.")
        hold.lent = True
        return hold.sa_connection

    def __enter__(self) -> AdvisoryLock:
        if not self.acquire():
            raise self._error(
                exceptions.LockBusy, f"Lock {self._about} is held by another session."
            )
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *rest: object) -> None:
        if self.owned():
            self.release(commit=exc_type is None)

    def __repr__(self) -> str:
        state = "held" if self.owned() else "not held"
        return f"<AdvisoryLock {self.key.name!r} key={self.key} scope={self.scope.value} {state}>"

    def _do_acquire(self, timeout_ms: int | None) -> bool:
        """Take the key, or the first free of lock_limit's slots (polled: SLOT_POLL_*)."""
        slots = self.slots
        polled = len(slots) > 1
        request = sessions.AcquireRequest(
            slots if polled else (self.key,),
            self._label,
            None if polled else timeout_ms,
            self.scope is LockScope.TRANSACTION,
            self.round_trip_timeout,
            self.run_key,
            None if polled else self.rider,  # not sent with the slots' statement
            self._granted_slot if polled else self._granted,
            () if polled else self.companions,
        )
        # on_granted records the hold; one a failed first attempt recorded is gone.
        self._hold = None
        if not polled:
            return self._session.acquire(request) is not None
        self.key = slots[0]
        deadline = None if timeout_ms is None else time.monotonic() + timeout_ms / 1000
        pause = SLOT_POLL_FIRST
        while True:
            if self._session.acquire(request) is not None:
                return True
            remaining = 0.0 if deadline is None else deadline - time.monotonic()
            if remaining <= 0:
                return False
            time.sleep(min(pause, remaining))
            pause = min(pause * 2, SLOT_POLL_MAX)

    @property
    def _about(self) -> str:
        """How messages name this lock."""
        return f"{self.key.name!r} (key {self.key})"

    def _error(self, kind: type[LockErrorT], message: str) -> LockErrorT:
        return kind(message, key=str(self.key), name=self.key.name)

    def _granted(self, hold: sessions.Hold) -> None:
        self._hold = hold

    def _granted_slot(self, hold: sessions.Hold) -> None:
        self._hold, self.key = hold, self.slots[hold.slot]
