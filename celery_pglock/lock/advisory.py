"""AdvisoryLock: one PostgreSQL advisory lock, on the session :mod:`.sessions` picks.
Why: docs/design.md and docs/guide/how-it-works.md.
"""

from __future__ import annotations

import logging
import math
import os
import time
from typing import TYPE_CHECKING

from celery_pglock import exceptions
from celery_pglock.config import LockScope
from celery_pglock.db import driver_errors, engines, sql_text
from celery_pglock.lock import fencing_tokens, sessions

if TYPE_CHECKING:
    import sqlalchemy as sa

    from celery_pglock.keys import LockKey

logger = logging.getLogger(__name__)


class AdvisoryLock:
    """One advisory lock of ``engine``'s database.

    Not thread-safe: one AdvisoryLock belongs to one thread (or greenlet) at a time;
    separate AdvisoryLock objects are safe in any number of threads.

    Args:
        engine: A lock engine (see ``celery_pglock.db.engines.create_engine``); its pool
            must be used for lock connections only.
        key: The advisory key.
        scope: ``LockScope.SESSION`` (default) or ``LockScope.TRANSACTION``.
        label: Shown in ``pg_stat_activity.application_name`` of the lock's session,
            after the application_name prefix and ``host:pid`` (per-lock connections
            also show the key); defaults to the lock name.
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
        #: Backend pid of the session holding the lock, while held (lock-loss watching).
        self.backend_pid: int | None = None
        #: os.getpid() of the process that took the lock: the only one that may release it.
        self.owner_pid: int | None = None
        self.lost_cause: str | None = None  #: Why the lock was lost while held.
        #: Longest one round trip (acquire beyond its ``timeout``, or release) may wait
        #: on the database before its socket is shut down.
        self.round_trip_timeout: float = sessions.DEFAULT_ROUND_TRIP_TIMEOUT
        #: A shadow-mode run without this lock: ensure_held() passes, fencing is off.
        self.shadowed = False
        self.fencing_token: int | None = None  #: This hold's token (fencing on).
        #: A run lock held beside the key (keys.run_key; acks_late runs), or None.
        self.run_key: LockKey | None = None

    def acquire(self, *, timeout: float | None = None) -> bool:
        """Take the lock; True if granted, False if another session holds it.

        Args:
            timeout: None to try once and return at once; a positive number of seconds
                to wait at most that long, enforced by PostgreSQL's ``lock_timeout``
                (never an unbounded wait).

        Raises:
            PgLockError: this object already holds the lock.
            ConfigurationError: ``timeout`` is not a positive finite number; or the
                lock database is a standby, or a pooler between us and it breaks this
                scope (checked at the first acquire on an engine).
            DatabaseError: the database failed (the lock is then not held).
        """
        if self.owned():
            raise exceptions.PgLockError(
                f"Lock {self.key.name!r} (key {self.key}) is already held by this AdvisoryLock; "
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
            # A failed connect had no session to lose: not retried (lock_on_error is).
            # A session found dead (restart, failover, cut network) held nothing, and
            # its sessions object closed it: try once more on a fresh connection.
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
            # No round trip (libpq knows it). None if another thread's failure closed
            # the shared session meanwhile: the lock is lost (hold.lost) then.
            try:
                self.backend_pid = hold.connection.info.backend_pid
            except Exception:
                self.backend_pid = None
            self.owner_pid = pid
            self.lost_cause = None
            self.fencing_token = None  # issued after the grant (celery_pglock.fencing)
        return granted

    def release(self, *, commit: bool = True) -> None:
        """Release the lock (and give back the connection it pinned, if any).

        Args:
            commit: transaction scope only: commit (default) or roll back the lock's
                transaction, which is what releases a transaction lock.

        Raises:
            LockNotOwnedError: this object does not hold the lock, PostgreSQL says the
                session no longer held it (a pinned connection is then closed, not
                pooled), its session ended while it was held, or it belongs to another
                process (a fork; that session is left untouched).
            LockLostError: transaction scope: the transaction was already ended by someone
                else (e.g. the task body committed), so the lock ended early.
            DatabaseError: the database failed; the lock's session is closed, which
                frees its locks (the process's session: every lock on it).
        """
        hold, self._hold = self._hold, None
        if hold is None:
            raise exceptions.LockNotOwnedError(
                f"Cannot release lock {self.key.name!r} (key {self.key}): it is not held by this AdvisoryLock.",
                key=str(self.key),
                name=self.key.name,
            )
        if hold.pid != os.getpid():
            # A forked child's copy: forgotten without a word on the parent's session.
            raise exceptions.LockNotOwnedError(
                f"Lock {self.key.name!r} (key {self.key}) belongs to process {hold.pid}, "
                f"not to this one ({os.getpid()}, a fork?); its session was left untouched.",
                key=str(self.key),
                name=self.key.name,
            )
        try:
            hold.session.release(hold, self.key, commit, self.round_trip_timeout)
        finally:
            self.released_at = time.monotonic()

    def issue_fencing_token(self) -> int:
        """Issue this held lock its next fencing token (``fencing.issue_token`` calls this).

        The token is issued only while the lock's own session holds the key, so a run
        that lost its lock since the grant never gets one (docs/guide/fencing.md).

        Raises:
            PgLockError: the lock is not held by this object.
            LockLostError: its session no longer held the key; the lock is released.
            DatabaseError: the token could not be issued; the lock is released.
        """
        hold = self._hold
        if hold is None:
            raise exceptions.PgLockError(
                f"Lock {self.key.name!r} (key {self.key}) is not held: a fencing token is "
                "only issued to the holder."
            )
        try:
            fencing_tokens.ensure_table(self.engine)
            bound = self.round_trip_timeout
            holder = hold.session.fencing_holder(hold, self.key, bound=bound)
            token = None
            if holder is not None:
                token = fencing_tokens.issue(self.engine, self.key, holder, bound)
            if token is None:
                self.mark_lost(
                    "its session no longer held it when its fencing token was issued, "
                    "before the body started"
                )
                raise exceptions.LockLostError(
                    f"Lock {self.key.name!r} (key {self.key}) was lost between its grant "
                    "and its fencing token (its session ended); no token was issued, and "
                    "the body did not run.",
                    key=str(self.key),
                    name=self.key.name,
                )
        except BaseException:
            # A fenced run never runs without its token; a lost session freed it anyway.
            if self.owned():
                try:
                    self.release(commit=False)
                except exceptions.PgLockError:
                    logger.debug("Release after a failed fencing token", exc_info=True)
            raise
        self.fencing_token = token
        return token

    def owned(self) -> bool:
        """True while this object holds the lock (no database round trip)."""
        return self._hold is not None

    @property
    def lost(self) -> bool:
        """True once the lock was found lost while held (see ``lost_cause``)."""
        return self.lost_cause is not None

    def ensure_held(self) -> None:
        """Raise unless the lock is still held, as far as this process knows.

        Call it before each side effect of a long body. No round trip: it reads what the
        lock watcher last found (checks run every ``lock_watch_interval`` seconds), so it
        narrows the window, it does not close it (fencing tokens do; see
        docs/operations/lock-loss.md).

        Raises:
            LockLostError: the lock was lost (the message says why).
            LockNotOwnedError: the lock is not held, or not by this process (a forked
                child).
        """
        if self.lost_cause is not None:
            raise self.lost_error()
        if self.shadowed:
            return  # shadow mode promises to run the body whatever the lock says
        if not self.owned() or self.owner_pid != os.getpid():
            raise exceptions.LockNotOwnedError(
                f"Lock {self.key.name!r} (key {self.key}) is not held by this process.",
                key=str(self.key),
                name=self.key.name,
            )

    @property
    def session(self) -> sessions.ProcessSession | sessions.PerLockSessions:
        """The sessions object this lock takes its key on."""
        return self._session

    def run_alive(self, run_key: LockKey) -> bool | None:
        """Is ``run_key`` (keys.run_key) held by some session? None when unknown."""
        return self._session.run_alive(run_key, bound=self.round_trip_timeout)

    @property
    def holding_name(self) -> str | None:
        """The application_name the lock's session showed when it was granted (the
        watcher uses it once to learn the real backend pid behind PgBouncer)."""
        hold = self._hold
        return hold.holding_name if hold is not None else None

    def mark_lost(self, cause: str) -> bool:
        """Record that the lock was lost; True the first time (the watcher reports it)."""
        if self.lost_cause is not None or not self.owned():
            return False
        self.lost_cause = cause
        return True

    def lost_error(self) -> exceptions.LockLostError:
        return exceptions.LockLostError(
            f"Lock {self.key.name!r} (key {self.key}) was lost while its body ran: "
            f"{self.lost_cause}.",
            key=str(self.key),
            name=self.key.name,
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
        """The lock's connection, inside the lock's open transaction (transaction scope).

        Use it for the protected database work: it is committed with the lock. Do not
        commit or roll it back yourself: that would end the lock early.

        Raises:
            PgLockError: session scope (the pinned connection is not for application
                work), or the lock is not held.
        """
        if self.scope is not LockScope.TRANSACTION:
            raise exceptions.PgLockError(
                f"Lock {self.key.name!r} uses session scope, whose pinned connection is not "
                "shared with the task; set lock_scope='transaction' to work inside the lock's transaction."
            )
        hold = self._hold
        if hold is None or hold.sa_connection is None:
            raise exceptions.PgLockError(
                f"Lock {self.key.name!r} (key {self.key}) is not held."
            )
        hold.lent = True
        return hold.sa_connection

    def __enter__(self) -> AdvisoryLock:
        if not self.acquire():
            raise exceptions.LockBusy(
                f"Lock {self.key.name!r} (key {self.key}) is held by another session.",
                key=str(self.key),
                name=self.key.name,
            )
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *rest: object) -> None:
        if self.owned():
            self.release(commit=exc_type is None)

    def __repr__(self) -> str:
        state = "held" if self.owned() else "not held"
        return f"<AdvisoryLock {self.key.name!r} key={self.key} scope={self.scope.value} {state}>"

    def _do_acquire(self, timeout_ms: int | None) -> bool:
        transaction = self.scope is LockScope.TRANSACTION
        hold = self._session.acquire(
            self.key,
            self._label,
            timeout_ms,
            transaction,
            self.round_trip_timeout,
            self.run_key,
            self._granted,
        )
        self._hold = hold
        return hold is not None

    def _granted(self, hold: sessions.Hold) -> None:
        # Owned from the moment the session recorded the grant (ProcessSession.acquire).
        self._hold = hold
