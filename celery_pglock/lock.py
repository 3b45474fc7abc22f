"""AdvisoryLock: one PostgreSQL advisory lock held on its own pooled connection.

Lifetimes (see the design article):

- ``session`` scope: ``pg_try_advisory_lock`` on a connection that stays checked out
  (pinned) from acquire to release, in autocommit mode; released with
  ``pg_advisory_unlock``, whose result is checked. If the unlock says "not held" or fails,
  the connection is invalidated (closed) rather than returned to the pool: closing the
  session is the one release PostgreSQL always honours.
- ``transaction`` scope: ``pg_try_advisory_xact_lock`` inside a transaction on the lock's
  connection, which the caller may use for its own work; ``release()`` commits (or rolls
  back), and that ends the lock. There is no other way to release a transaction lock.

A timeline for two workers on one key, session scope::

    time  worker A                         worker B
    0     acquire() -> True (pinned conn)
    1                                      acquire() -> False (busy; skip/raise/retry)
    2     release() -> unlock returns t
    3                                      acquire() -> True

Not thread-safe: one AdvisoryLock belongs to one thread (or greenlet) at a time. Separate
AdvisoryLock objects on separate connections are safe in any number of threads; that is
what makes PostgreSQL's per-session re-entrancy harmless here (two tasks never share a
session).
"""

from __future__ import annotations

import functools
import logging
import math
import time
from typing import TYPE_CHECKING, Any

from celery_pglock import _server, _sql, db, exceptions
from celery_pglock.config import LockScope

if TYPE_CHECKING:
    from types import TracebackType

    import sqlalchemy as sa

    from celery_pglock.keys import LockKey

logger = logging.getLogger(__name__)


@functools.lru_cache(maxsize=4096)
def _application_name(prefix: str, *parts: object) -> str:
    # Per-task hot path: the same few names are built over and over.
    return db.application_name(prefix, *parts)


class AdvisoryLock:
    """One advisory lock on a dedicated connection from ``engine``'s pool.

    Args:
        engine: A lock engine (see ``celery_pglock.db.create_engine``); its pool
            must be used for lock connections only.
        key: The advisory key.
        scope: ``LockScope.SESSION`` (default) or ``LockScope.TRANSACTION``.
        label: Shown in ``pg_stat_activity.application_name`` while the lock is held,
            after the application_name prefix and ``host:pid``; defaults to the key and
            lock name.
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
        self.scope = LockScope(scope)
        prefix, tag = (
            db.engine_info(engine)["application_name_prefix"],
            db.process_tag(),
        )
        # str(key): the ids only. The LockKey itself would pin its key text (the
        # argument values, possibly megabytes) in the cache below.
        self._holding_name = _application_name(prefix, tag, str(key), label or key.name)
        self._idle_name = _application_name(prefix, tag, "idle")
        self._pooled: Any = None  # the pool's proxied DBAPI connection while held
        self._connection: sa.Connection | None = None  # transaction scope only
        self._transaction: sa.RootTransaction | None = None
        self._discard_connection = False  # set by _wait when a session can't be trusted
        self._lent = False  # transaction scope: did anyone take .connection?
        #: time.monotonic() when the lock was granted, or None.
        self.acquired_at: float | None = None
        #: time.monotonic() when the lock was released, or None.
        self.released_at: float | None = None
        #: Seconds acquire() took, including any bounded wait.
        self.wait_seconds: float | None = None
        #: This hold's fencing token (celery_pglock.fencing), or None when fencing is off.
        self.fencing_token: int | None = None

    # -- public verbs -------------------------------------------------------------------

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
        # A standby or a multiplexing pooler: refused. Probes once per engine, then
        # costs a dict lookup.
        _server.check(self.engine, self.scope, self.key.name)
        asked_at = time.monotonic()
        try:
            granted = self._do_acquire(timeout_ms)
        except exceptions.DatabaseError as error:
            # A failed connect had no pooled session to lose: nothing to replace.
            cause = error.__cause__
            if not db.is_disconnect(cause) or db.is_connect_failure(cause):
                raise
            # The pooled session was already dead (server restart, failover, idle
            # timeout, cut network), so it held nothing. Its idle siblings are likely
            # dead too: drop them all (close=False: no goodbye on dead sockets) and try
            # once more on a fresh connection, instead of failing one task per corpse.
            logger.warning(
                "Lock connection to %s was dead (%s); reconnecting once",
                db.engine_info(self.engine)["masked_url"],
                error.__cause__,
                extra={"action": "lock_reconnect", "lock_key": str(self.key)},
            )
            self.engine.dispose(close=False)
            granted = self._do_acquire(timeout_ms)
        self.wait_seconds = time.monotonic() - asked_at
        if granted:
            self.acquired_at = asked_at + self.wait_seconds
            self.released_at = None
            self.fencing_token = (
                None  # issued after the grant, by celery_pglock.fencing
            )
        return granted

    def release(self, *, commit: bool = True) -> None:
        """Release the lock and return the connection to the pool.

        Args:
            commit: transaction scope only: commit (default) or roll back the lock's
                transaction, which is what releases a transaction lock.

        Raises:
            LockNotOwnedError: this object does not hold the lock, or PostgreSQL says the
                session no longer held it (the connection is then closed, not pooled).
            LockLostError: transaction scope: the transaction was already ended by someone
                else (e.g. the task body committed), so the lock ended early.
            DatabaseError: the database failed; the connection is closed, which frees
                any session lock it held.
        """
        if not self.owned():
            raise exceptions.LockNotOwnedError(
                f"Cannot release lock {self.key.name!r} (key {self.key}): it is not held by this AdvisoryLock.",
                key=str(self.key),
                name=self.key.name,
            )
        try:
            if self.scope is LockScope.SESSION:
                self._do_release_session()
            else:
                self._do_release_transaction(commit)
        finally:
            self.released_at = time.monotonic()

    def owned(self) -> bool:
        """True while this object holds the lock (no database round trip)."""
        return self._pooled is not None

    def locked(self) -> bool:
        """True if any session in this database holds the key (one ``pg_locks`` query)."""
        with (
            db.wrap_db_errors("read pg_locks", self.engine),
            self.engine.connect() as connection,
        ):
            result = connection.exec_driver_sql(
                _sql.IS_LOCKED, self.key.pg_locks_ids
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
        if self._connection is None:
            raise exceptions.PgLockError(
                f"Lock {self.key.name!r} (key {self.key}) is not held."
            )
        self._lent = True
        return self._connection

    def __enter__(self) -> AdvisoryLock:
        if not self.acquire():
            raise exceptions.LockBusy(
                f"Lock {self.key.name!r} (key {self.key}) is held by another session.",
                key=str(self.key),
                name=self.key.name,
            )
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if self.owned():
            self.release(commit=exc_type is None)

    def __repr__(self) -> str:
        state = "held" if self.owned() else "not held"
        return f"<AdvisoryLock {self.key.name!r} key={self.key} scope={self.scope.value} {state}>"

    # -- primitives ---------------------------------------------------------------------

    def _do_acquire(self, timeout_ms: int | None) -> bool:
        if self.scope is LockScope.SESSION:
            return self._do_acquire_session(timeout_ms)
        return self._do_acquire_transaction(timeout_ms)

    def _do_acquire_session(self, timeout_ms: int | None) -> bool:
        arity = len(self.key.ids)
        try:
            pooled = self.engine.raw_connection()
        except Exception:
            with db.wrap_db_errors(f"acquire lock {self.key.name!r}", self.engine):
                raise
        try:
            # psycopg2, typed loosely by SQLAlchemy.
            dbapi: Any = pooled.dbapi_connection
            dbapi.autocommit = True
            with dbapi.cursor() as cursor:
                granted = self._lock_statement(
                    cursor,
                    _sql.TRY_LOCK_SESSION[arity],
                    _sql.WAIT_LOCK_SESSION[arity],
                    timeout_ms,
                )
        except BaseException as exc:
            # Unknown state (e.g. interrupted mid-statement): closing is the only safe release.
            pooled.invalidate()
            pooled.close()
            if isinstance(exc, Exception):
                with db.wrap_db_errors(f"acquire lock {self.key.name!r}", self.engine):
                    raise
            raise
        if not granted:
            if self._discard_connection:
                self._discard_connection = False
                pooled.invalidate()
            pooled.close()
            return False
        db.held_keys(pooled.info)[self.key.ids] += 1
        pooled.info[db.IDLE_NAME] = self._idle_name
        self._pooled = pooled
        return True

    def _lock_statement(
        self, cursor: Any, try_sql: str, wait_sql: str, timeout_ms: int | None
    ) -> bool:
        """Try once (one round trip) or wait at most ``timeout_ms``; True if granted."""
        if timeout_ms is None:
            cursor.execute(try_sql, (*self.key.ids, self._holding_name))
            row = cursor.fetchone()
            return row is not None and row[0] is not None
        return self._wait(
            cursor, wait_sql, (str(timeout_ms), self._holding_name, *self.key.ids)
        )

    def _wait(self, cursor: Any, statement: str, params: tuple[Any, ...]) -> bool:
        """Run a bounded blocking lock statement; False if lock_timeout expired."""
        try:
            cursor.execute(statement, params)
        except Exception as exc:
            code = db.sqlstate(exc)
            if code not in (_sql.LOCK_NOT_AVAILABLE, _sql.QUERY_CANCELED):
                raise
            if not cursor.connection.autocommit:
                # Transaction scope: the rollback ends the transaction and the wait.
                cursor.connection.rollback()
                return False
            if code == _sql.QUERY_CANCELED:
                # A cancel (statement_timeout, pg_cancel_backend) may land after the
                # session lock was granted, and a session lock outlives the aborted
                # transaction: this session cannot be trusted. The caller closes it.
                self._discard_connection = True
                return False
            # lock_timeout fired inside pg_advisory_lock: nothing was granted. psycopg2's
            # rollback() is a no-op in autocommit mode, so end the aborted BEGIN by hand.
            cursor.execute(_sql.ROLLBACK)
            return False
        return True

    def _do_release_session(self) -> None:
        pooled, self._pooled = self._pooled, None
        arity = len(self.key.ids)
        held = db.held_keys(pooled.info)
        try:
            with pooled.dbapi_connection.cursor() as cursor:
                cursor.execute(
                    _sql.UNLOCK_SESSION[arity], (*self.key.ids, self._idle_name)
                )
                row = cursor.fetchone()
            unlocked = bool(row and row[0])
        except BaseException as exc:
            held.clear()
            pooled.invalidate()  # the session's end frees whatever it held
            pooled.close()
            if isinstance(exc, Exception):
                with db.wrap_db_errors(f"release lock {self.key.name!r}", self.engine):
                    raise
            raise
        held[self.key.ids] -= 1
        if held[self.key.ids] <= 0:
            del held[self.key.ids]
        if not unlocked:
            held.clear()
            pooled.invalidate()
            pooled.close()
            raise exceptions.LockNotOwnedError(
                f"PostgreSQL says the session no longer held lock {self.key.name!r} (key {self.key}) "
                "at release; the connection was closed instead of being pooled.",
                key=str(self.key),
                name=self.key.name,
            )
        pooled.close()

    def _do_acquire_transaction(self, timeout_ms: int | None) -> bool:
        arity = len(self.key.ids)
        with db.wrap_db_errors(f"acquire lock {self.key.name!r}", self.engine):
            connection = self.engine.connect()
        try:
            pooled = connection.connection
            # psycopg2, typed loosely by SQLAlchemy.
            dbapi: Any = pooled.dbapi_connection
            dbapi.autocommit = False
            transaction = connection.begin()
            with dbapi.cursor() as cursor:
                granted = self._lock_statement(
                    cursor,
                    _sql.TRY_LOCK_TRANSACTION[arity],
                    _sql.WAIT_LOCK_TRANSACTION[arity],
                    timeout_ms,
                )
            if not granted:
                transaction.rollback()
                connection.close()
                return False
        except BaseException as exc:
            connection.invalidate()
            connection.close()
            if isinstance(exc, Exception):
                with db.wrap_db_errors(f"acquire lock {self.key.name!r}", self.engine):
                    raise
            raise
        self._connection, self._transaction, self._pooled = (
            connection,
            transaction,
            pooled,
        )
        return True

    def _do_release_transaction(self, commit: bool) -> None:
        connection, transaction = self._connection, self._transaction
        self._connection = self._transaction = self._pooled = None
        if connection is None or transaction is None:  # release() checked owned()
            raise exceptions.LockNotOwnedError(
                f"Lock {self.key.name!r} has no open transaction."
            )
        try:
            if not transaction.is_active:
                raise exceptions.LockLostError(
                    f"The transaction of lock {self.key.name!r} (key {self.key}) was ended before "
                    "release (committed or rolled back by the task?), so the lock ended early.",
                    key=str(self.key),
                    name=self.key.name,
                )
            with db.wrap_db_errors(
                f"{'commit' if commit else 'roll back'} lock {self.key.name!r}",
                self.engine,
            ):
                if commit:
                    transaction.commit()
                else:
                    transaction.rollback()
                if self._lent:
                    # The body had this connection: wipe what it may have left on the
                    # session (SET search_path, its own advisory locks, temp tables)
                    # before pooling it. Not needed (one round trip saved) otherwise.
                    self._lent = False
                    dbapi: Any = connection.connection.dbapi_connection
                    dbapi.autocommit = True
                    with dbapi.cursor() as cursor:
                        cursor.execute(_sql.DISCARD_ALL)
        except BaseException:
            connection.invalidate()
            raise
        finally:
            connection.close()
