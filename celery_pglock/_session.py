"""Lock sessions: which PostgreSQL session carries a lock, and the SQL on it.

Two strategies implement :class:`LockSession`; :class:`~celery_pglock.lock.AdvisoryLock`
picks one per lock (:func:`for_lock`) and never sees the difference, and
``SingletonTask`` never sees either.

- :class:`ProcessSession` (``pglock_session_mode='per_process'``, the default): one
  long-lived connection per process and engine carries every session-scope try-lock of
  the process. It is opened on first use and kept for the life of the process (a prefork
  child: no pool checkout per task; a threads/gevent worker: one connection, not one per
  in-flight task). PostgreSQL session locks are re-entrant *within* a session, so
  exclusion between the tasks of one process is done here, per key, under the mutex that
  also serialises every statement on the connection (a psycopg2 connection runs one
  statement at a time; its cursors are not thread-safe). A key already held in this
  process is refused without a round trip.
- :class:`PerLockSessions` (transaction scope always, bounded waits always, and
  ``pglock_session_mode='per_lock'``): a pooled connection pinned from acquire to
  release, as before. Transaction scope lends its connection to the body, and a
  blocking ``pg_advisory_lock`` on the shared session would stall every task of the
  process, so both need a connection of their own.

A hold carries the process id and the session generation it was granted on: a forked
child never touches its parent's session, and a hold whose shared session was closed
since (an error on the connection, a dead server) is reported lost at release instead of
unlocking someone else's key. Lock-loss detection (issue 8) plugs in at
:meth:`ProcessSession.holds` and :meth:`ProcessSession.lose`: one session to watch per
process.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import weakref
from typing import TYPE_CHECKING, Any

from celery_pglock import _sql, config, db, exceptions

if TYPE_CHECKING:
    import sqlalchemy as sa

    from celery_pglock.keys import LockKey

logger = logging.getLogger(__name__)


class Hold:
    """One granted lock: the session it lives on, for its release."""

    __slots__ = (
        "connection",
        "generation",
        "idle_name",
        "ids",
        "lent",
        "lost",
        "pid",
        "pooled",
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
        self.pid = os.getpid()
        #: The psycopg2 connection the lock lives on.
        self.connection: Any = None
        #: PerLockSessions: the pool's proxied connection, pinned until release.
        self.pooled: Any = None
        #: Transaction scope: the SQLAlchemy connection and transaction lent to the body.
        self.sa_connection: sa.Connection | None = None
        self.transaction: sa.RootTransaction | None = None
        self.lent = False
        #: ProcessSession: the session generation the lock was granted on.
        self.generation = 0
        #: Why the lock was lost before its release (its session ended), or None.
        self.lost: str | None = None


class LockSession:
    """Where locks of one engine live: take one, and give it back."""

    engine: sa.Engine

    def acquire(
        self,
        key: LockKey,
        *,
        label: str,
        timeout_ms: int | None,
        transaction: bool,
    ) -> Hold | None:
        """Take ``key``; the hold, or None when another session (or task) holds it.

        ``label`` (a task name) goes into the session's application_name.
        """
        raise NotImplementedError

    def release(self, hold: Hold, key: LockKey, *, commit: bool) -> None:
        """Give ``hold`` back; raises LockNotOwnedError/LockLostError/DatabaseError."""
        raise NotImplementedError

    def after_disconnect(self) -> None:
        """An acquire found its session dead: forget the connections that may be too."""


# -- dedicated connections ---------------------------------------------------------------


class PerLockSessions(LockSession):
    """A pooled connection per held lock, pinned from acquire to release."""

    def __init__(self, engine: sa.Engine) -> None:
        self.engine = engine

    def acquire(
        self,
        key: LockKey,
        *,
        label: str,
        timeout_ms: int | None,
        transaction: bool,
    ) -> Hold | None:
        prefix = db.engine_info(self.engine)["application_name_prefix"]
        tag = db.process_tag()
        holding_name = _application_name(prefix, tag, key, label)
        idle_name = _application_name(prefix, tag, "idle")
        if transaction:
            return self._acquire_transaction(key, holding_name, idle_name, timeout_ms)
        return self._acquire_session(key, holding_name, idle_name, timeout_ms)

    def release(self, hold: Hold, key: LockKey, *, commit: bool) -> None:
        if hold.pid != os.getpid():
            raise _foreign(hold, key)
        if hold.sa_connection is not None:
            self._release_transaction(hold, key, commit)
        else:
            self._release_session(hold, key)

    def after_disconnect(self) -> None:
        # Idle siblings of a dead pooled session are likely dead too (server restart):
        # drop them (close=False: no goodbye on dead sockets) instead of failing one
        # task per corpse.
        self.engine.dispose(close=False)

    def _acquire_session(
        self, key: LockKey, holding_name: str, idle_name: str, timeout_ms: int | None
    ) -> Hold | None:
        arity = len(key.ids)
        try:
            pooled = self.engine.raw_connection()
        except Exception:
            with db.wrap_db_errors(f"acquire lock {key.name!r}", self.engine):
                raise
        discard = False
        try:
            dbapi: Any = (
                pooled.dbapi_connection
            )  # psycopg2, typed loosely by SQLAlchemy
            dbapi.autocommit = True
            with dbapi.cursor() as cursor:
                if timeout_ms is None:
                    granted = try_lock(
                        cursor, _sql.TRY_LOCK_SESSION[arity], key, holding_name
                    )
                else:
                    granted, discard = wait_lock(
                        cursor,
                        _sql.WAIT_LOCK_SESSION[arity],
                        key,
                        holding_name,
                        timeout_ms,
                    )
        except BaseException as exc:
            # Unknown state (e.g. interrupted mid-statement): closing is the only safe release.
            pooled.invalidate()
            pooled.close()
            if isinstance(exc, Exception):
                with db.wrap_db_errors(f"acquire lock {key.name!r}", self.engine):
                    raise
            raise
        if not granted:
            if discard:
                pooled.invalidate()
            pooled.close()
            return None
        db.held_keys(pooled.info)[key.ids] += 1
        pooled.info[db.IDLE_NAME] = idle_name
        hold = Hold(self, key.ids, idle_name)
        hold.pooled, hold.connection = pooled, dbapi
        return hold

    def _release_session(self, hold: Hold, key: LockKey) -> None:
        pooled = hold.pooled
        arity = len(key.ids)
        held = db.held_keys(pooled.info)
        try:
            with hold.connection.cursor() as cursor:
                cursor.execute(_sql.UNLOCK_SESSION[arity], (*key.ids, hold.idle_name))
                row = cursor.fetchone()
            unlocked = bool(row and row[0])
        except BaseException as exc:
            held.clear()
            pooled.invalidate()  # the session's end frees whatever it held
            pooled.close()
            if isinstance(exc, Exception):
                with db.wrap_db_errors(f"release lock {key.name!r}", self.engine):
                    raise
            raise
        held[key.ids] -= 1
        if held[key.ids] <= 0:
            del held[key.ids]
        if not unlocked:
            held.clear()
            pooled.invalidate()
            pooled.close()
            raise exceptions.LockNotOwnedError(
                f"PostgreSQL says the session no longer held lock {key.name!r} (key {key}) "
                "at release; the connection was closed instead of being pooled.",
                key=str(key),
                name=key.name,
            )
        pooled.close()

    def _acquire_transaction(
        self, key: LockKey, holding_name: str, idle_name: str, timeout_ms: int | None
    ) -> Hold | None:
        arity = len(key.ids)
        with db.wrap_db_errors(f"acquire lock {key.name!r}", self.engine):
            connection = self.engine.connect()
        try:
            pooled = connection.connection
            dbapi: Any = (
                pooled.dbapi_connection
            )  # psycopg2, typed loosely by SQLAlchemy
            dbapi.autocommit = False
            transaction = connection.begin()
            with dbapi.cursor() as cursor:
                if timeout_ms is None:
                    granted = try_lock(
                        cursor, _sql.TRY_LOCK_TRANSACTION[arity], key, holding_name
                    )
                else:
                    granted, _ = wait_lock(
                        cursor,
                        _sql.WAIT_LOCK_TRANSACTION[arity],
                        key,
                        holding_name,
                        timeout_ms,
                    )
            if not granted:
                transaction.rollback()
                connection.close()
                return None
        except BaseException as exc:
            connection.invalidate()
            connection.close()
            if isinstance(exc, Exception):
                with db.wrap_db_errors(f"acquire lock {key.name!r}", self.engine):
                    raise
            raise
        hold = Hold(self, key.ids, idle_name)
        hold.pooled, hold.connection = pooled, dbapi
        hold.sa_connection, hold.transaction = connection, transaction
        return hold

    def _release_transaction(self, hold: Hold, key: LockKey, commit: bool) -> None:
        connection, transaction = hold.sa_connection, hold.transaction
        if connection is None or transaction is None:  # a session-scope hold
            raise exceptions.LockNotOwnedError(
                f"Lock {key.name!r} has no open transaction.",
                key=str(key),
                name=key.name,
            )
        try:
            if not transaction.is_active:
                raise exceptions.LockLostError(
                    f"The transaction of lock {key.name!r} (key {key}) was ended before "
                    "release (committed or rolled back by the task?), so the lock ended early.",
                    key=str(key),
                    name=key.name,
                )
            with db.wrap_db_errors(
                f"{'commit' if commit else 'roll back'} lock {key.name!r}", self.engine
            ):
                if commit:
                    transaction.commit()
                else:
                    transaction.rollback()
                if hold.lent:
                    # The body had this connection: wipe what it may have left on the
                    # session (SET search_path, its own advisory locks, temp tables)
                    # before pooling it. Not needed (one round trip saved) otherwise.
                    hold.connection.autocommit = True
                    with hold.connection.cursor() as cursor:
                        cursor.execute(_sql.DISCARD_ALL)
        except BaseException:
            connection.invalidate()
            raise
        finally:
            connection.close()


# -- one session per process -------------------------------------------------------------


class ProcessSession(LockSession):
    """One connection per process carrying every session-scope try-lock of the process.

    Thread-safe: one mutex serialises the exclusion table and every statement on the
    connection. Bounded waits go to ``waits`` (a connection of their own).
    """

    def __init__(self, engine: sa.Engine) -> None:
        self.engine = engine
        self.pid = os.getpid()
        self.waits = PerLockSessions(engine)
        self._mutex = threading.Lock()
        self._pooled: Any = None  # the detached pool proxy owning the connection
        self._connection: Any = None
        self._cursor: Any = None
        self._generation = 0
        self._prefix = db.engine_info(engine)["application_name_prefix"]
        self._names: dict[str, str] = {}  # task label -> application_name
        self._shown: str | None = None  # the application_name the session shows
        #: key ids -> the hold of the task of this process holding it.
        self._owners: dict[tuple[int, ...], Hold] = {}

    # -- LockSession ----------------------------------------------------------------------

    def acquire(
        self,
        key: LockKey,
        *,
        label: str,
        timeout_ms: int | None,
        transaction: bool,
    ) -> Hold | None:
        if transaction or timeout_ms is not None:
            return self.waits.acquire(
                key, label=label, timeout_ms=timeout_ms, transaction=transaction
            )
        ids = key.ids
        with self._mutex:
            if ids in self._owners:
                return None  # held by another task of this process: no round trip
            cursor = self._cursor if self._cursor is not None else self._connect(key)
            name = self._names.get(label)
            if name is None:
                if len(self._names) >= 1024:  # labels are task names: few; stay bounded
                    self._names.clear()
                name = self._names[label] = db.application_name(
                    self._prefix, db.process_tag(), label
                )
            try:
                if name == self._shown:
                    # The session already shows this task: no relabel (relabelling
                    # costs the server about as much as the lock statements).
                    cursor.execute(_sql.TRY_LOCK_SESSION_BARE[len(ids)], ids)
                    row = cursor.fetchone()
                    granted = row is not None and row[0] is True
                else:
                    cursor.execute(_sql.TRY_LOCK_SESSION[len(ids)], (*ids, name))
                    row = cursor.fetchone()
                    granted = row is not None and row[0] is not None
                    if granted:
                        self._shown = name
            except BaseException as exc:
                self._close(f"acquiring lock {key.name!r} failed: {exc!r}")
                if isinstance(exc, Exception):
                    with db.wrap_db_errors(f"acquire lock {key.name!r}", self.engine):
                        raise
                raise
            if not granted:
                return None
            hold = Hold(self, ids)
            hold.connection, hold.generation = self._connection, self._generation
            self._owners[ids] = hold
            return hold

    def release(self, hold: Hold, key: LockKey, *, commit: bool) -> None:
        if hold.pid != os.getpid():
            raise _foreign(hold, key)
        ids = hold.ids
        with self._mutex:
            if self._owners.get(ids) is not hold:
                raise exceptions.LockNotOwnedError(
                    f"The process's lock session ended while lock {key.name!r} (key {key}) was "
                    f"held ({hold.lost or 'closed'}), so PostgreSQL had already freed the lock.",
                    key=str(key),
                    name=key.name,
                )
            del self._owners[ids]
            try:
                self._cursor.execute(_sql.UNLOCK_SESSION_KEEP_NAME[len(ids)], ids)
                row = self._cursor.fetchone()
            except BaseException as exc:
                self._close(f"releasing lock {key.name!r} failed: {exc!r}")
                if isinstance(exc, Exception):
                    with db.wrap_db_errors(f"release lock {key.name!r}", self.engine):
                        raise
                raise
        if not (row and row[0]):
            # Someone unlocked our key behind our back (pg_advisory_unlock_all on this
            # session is ours only). The other keys of the session are unaffected, so the
            # session is kept: closing it would free every other task's lock mid-body.
            raise exceptions.LockNotOwnedError(
                f"PostgreSQL says the process's lock session no longer held lock {key.name!r} "
                f"(key {key}) at release.",
                key=str(key),
                name=key.name,
            )

    # -- for lock-loss detection and shutdown ---------------------------------------------

    def holds(self) -> list[Hold]:
        """The locks held on this session right now."""
        with self._mutex:
            return list(self._owners.values())

    def lose(self, cause: str) -> list[Hold]:
        """Close the session (which frees all its locks) and mark its holds lost."""
        with self._mutex:
            return self._close(cause)

    def close(self) -> None:
        """Close the connection; any lock still held is freed by PostgreSQL and lost."""
        lost = self.lose("the process's lock session was closed")
        if lost:
            logger.warning(
                "The lock session was closed still holding %d lock(s); PostgreSQL freed them",
                len(lost),
                extra={"action": "lock_checkin_unlock_all"},
            )

    # -- internals ------------------------------------------------------------------------

    def _connect(self, key: LockKey) -> Any:
        if self.pid != os.getpid():
            raise exceptions.PgLockError(
                "A lock session was used in a process it does not belong to (a fork)."
            )
        try:
            # Detached: the connection belongs to this process session, not to the pool,
            # so no pool reset or check-in ever touches it, and the pool's size does not
            # count it.
            pooled = self.engine.raw_connection()
            pooled.detach()
            dbapi: Any = pooled.dbapi_connection
            dbapi.autocommit = True
            cursor = dbapi.cursor()
        except Exception:
            with db.wrap_db_errors(f"acquire lock {key.name!r}", self.engine):
                raise
        self._pooled, self._connection, self._cursor = pooled, dbapi, cursor
        self._shown = None
        return cursor

    def _close(self, cause: str) -> list[Hold]:
        """Under the mutex: end the session; every hold on it is lost."""
        connection, self._connection = self._connection, None
        self._pooled = self._cursor = None
        self._generation += 1
        lost = list(self._owners.values())
        self._owners.clear()
        for hold in lost:
            hold.lost = cause
        if connection is not None and self.pid == os.getpid():
            try:
                connection.close()  # ends the session: the release PostgreSQL always honours
            except Exception:  # a dead socket may complain; it is gone either way
                logger.debug("Closing the lock session failed", exc_info=True)
        return lost


def _foreign(hold: Hold, key: LockKey) -> exceptions.LockNotOwnedError:
    return exceptions.LockNotOwnedError(
        f"Lock {key.name!r} (key {key}) belongs to process {hold.pid}, not to this one "
        f"({os.getpid()}, a fork?); its session was left untouched.",
        key=str(key),
        name=key.name,
    )


# -- statements shared by both strategies -------------------------------------------------


@functools.lru_cache(maxsize=4096)
def _application_name(prefix: str, *parts: object) -> str:
    # Per-lock hot path (per_lock mode, transaction scope): the same names recur.
    return db.application_name(prefix, *parts)


def try_lock(cursor: Any, statement: str, key: LockKey, holding_name: str) -> bool:
    """Try once (one round trip); True if granted."""
    cursor.execute(statement, (*key.ids, holding_name))
    row = cursor.fetchone()
    return row is not None and row[0] is not None


def wait_lock(
    cursor: Any, statement: str, key: LockKey, holding_name: str, timeout_ms: int
) -> tuple[bool, bool]:
    """Run a bounded blocking lock statement: (granted, the session must be discarded)."""
    try:
        cursor.execute(statement, (str(timeout_ms), holding_name, *key.ids))
    except Exception as exc:
        code = db.sqlstate(exc)
        if code not in (_sql.LOCK_NOT_AVAILABLE, _sql.QUERY_CANCELED):
            raise
        if not cursor.connection.autocommit:
            # Transaction scope: the rollback ends the transaction and the wait.
            cursor.connection.rollback()
            return False, False
        if code == _sql.QUERY_CANCELED:
            # A cancel (statement_timeout, pg_cancel_backend) may land after the session
            # lock was granted, and a session lock outlives the aborted transaction: this
            # session cannot be trusted. The caller closes it.
            return False, True
        # lock_timeout fired inside pg_advisory_lock: nothing was granted. psycopg2's
        # rollback() is a no-op in autocommit mode, so end the aborted BEGIN by hand.
        cursor.execute(_sql.ROLLBACK)
        return False, False
    return True, False


# -- which strategy a lock gets ----------------------------------------------------------

_per_lock: weakref.WeakKeyDictionary[sa.Engine, PerLockSessions] = (
    weakref.WeakKeyDictionary()
)
_process: dict[sa.Engine, ProcessSession] = {}
_process_pid = os.getpid()
_registry_guard = threading.Lock()
#: A forked child's copies of its parent's sessions: kept referenced, never used or
#: closed, so no finaliser of the child ever writes to the parent's socket.
_inherited: list[ProcessSession] = []


def for_lock(engine: sa.Engine, *, transaction: bool) -> LockSession:
    """The strategy a lock of ``engine`` uses (a cheap lookup: once per lock)."""
    if _process_pid == os.getpid():
        session = _process.get(engine)
        if session is not None and not transaction:
            return session
    if transaction or (
        db.engine_info(engine)["session_mode"] == config.SessionMode.PER_LOCK.value
    ):
        per_lock = _per_lock.get(engine)
        if per_lock is None:
            per_lock = _per_lock[engine] = PerLockSessions(engine)
        return per_lock
    return process_session(engine)


def process_session(engine: sa.Engine) -> ProcessSession:
    """This process's session for ``engine`` (created on first use, not at import)."""
    with _registry_guard:
        _forget_after_fork()
        session = _process.get(engine)
        if session is None:
            session = _process[engine] = ProcessSession(engine)
        return session


def sessions() -> list[ProcessSession]:
    """This process's lock sessions (for lock-loss detection and shutdown)."""
    with _registry_guard:
        _forget_after_fork()
        return list(_process.values())


def close_all() -> None:
    """Close this process's lock sessions (worker shutdown, tests)."""
    for session in sessions():
        session.close()
    with _registry_guard:
        _process.clear()


def close_for(engine: sa.Engine) -> None:
    """Close this process's session of ``engine``, if any (before disposing of it).

    Not tied to ``engine.dispose()``: the per-lock reconnect path disposes of the pool
    when a pooled session is found dead, and that must not end the locks of every
    other task of the process.
    """
    with _registry_guard:
        _forget_after_fork()
        session = _process.pop(engine, None)
    if session is not None:
        session.close()


def _forget_after_fork() -> None:
    global _process_pid
    if _process_pid == os.getpid():
        return
    _inherited.extend(_process.values())
    _process.clear()
    _per_lock.clear()
    _process_pid = os.getpid()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_after_fork)
