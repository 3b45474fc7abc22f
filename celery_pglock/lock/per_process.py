"""ProcessSession: one connection per process carrying all its session-scope try-locks.

Opened on first use and kept for the life of the process (a prefork child: no pool
checkout per task; a threads/gevent worker: one connection, not one per in-flight task).
PostgreSQL session locks are re-entrant *within* a session, so exclusion between the
tasks of one process is done in the process, per key (``base.Claims``, shared with the
engine's PerLockSessions, which keeps a key whose session was lost excluded until its
body ends), and every statement on the connection is serialised under one mutex (a
psycopg2 connection runs one statement at a time; its cursors are not thread-safe). A
key already held in the process is refused without a round trip. Transaction scope and
bounded waits go to a PerLockSessions of their own.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import TYPE_CHECKING, Any

from celery_pglock import exceptions
from celery_pglock.db import deadlines, driver_errors, engines, sql_text
from celery_pglock.lock import base, fencing_tokens, per_lock

if TYPE_CHECKING:
    from collections.abc import Callable

    import sqlalchemy as sa

    from celery_pglock.keys import LockKey

logger = logging.getLogger(__name__)


class SessionBusyError(Exception):
    """The lock session was kept busy by other statements until a check's deadline."""


class ProcessSession(base.LockSession):
    """One connection per process carrying every session-scope try-lock of the process.

    Thread-safe: one mutex serialises the exclusion table and every statement on the
    connection. Bounded waits go to ``waits`` (a connection of their own).
    """

    def __init__(self, engine: sa.Engine, claims: base.Claims) -> None:
        self.engine = engine
        self.claims = claims
        self.pid = os.getpid()
        self.waits = per_lock.PerLockSessions(engine, claims)
        self._mutex = threading.Lock()
        self._pooled: Any = None  # the detached pool proxy owning the connection
        self._connection: Any = None
        self._cursor: Any = None
        #: Who this session is (fencing tokens), asked once per connection.
        self._holder: fencing_tokens.Holder | None = None
        self._prefix = engines.engine_info(engine)["application_name_prefix"]
        self._names: dict[str, str] = {}  # task label -> application_name
        self._shown: str | None = None  # the application_name the session shows
        #: key ids -> the hold living on the current connection (a hold lost with its
        #: connection leaves; its key stays in ``claims`` until its release).
        self._owners: dict[tuple[int, ...], base.Hold] = {}
        #: run lock ids -> the hold that carries it (see keys.run_key).
        self._runs: dict[tuple[int, ...], base.Hold] = {}

    # -- LockSession ----------------------------------------------------------------------

    def acquire(
        self,
        key: LockKey,
        *,
        label: str,
        timeout_ms: int | None,
        transaction: bool,
        bound: float = base.DEFAULT_ROUND_TRIP_TIMEOUT,
        run: LockKey | None = None,
        on_granted: Callable[[base.Hold], None] | None = None,
    ) -> base.Hold | None:
        if transaction or timeout_ms is not None:
            return self.waits.acquire(
                key,
                label=label,
                timeout_ms=timeout_ms,
                transaction=transaction,
                bound=bound,
                run=run,
                on_granted=on_granted,
            )
        ids = key.ids
        with self._mutex:
            hold = base.Hold(self, ids)
            try:
                # Inside the try: an exception landing just after the claim (a soft
                # time limit) must not leave the key claimed by nobody.
                if not self.claims.claim(hold):
                    # Held by another run of this process, even one that lost its
                    # session: no round trip.
                    return None
                self._acquire(hold, key, label, bound, run, on_granted)
            finally:
                # Granted means recorded on the session (whatever lands after that):
                # only a key this session does not hold goes back.
                if self._owners.get(ids) is not hold:
                    self.claims.release(hold)  # a no-op if the claim was refused
            return hold if self._owners.get(ids) is hold else None

    def _acquire(
        self,
        hold: base.Hold,
        key: LockKey,
        label: str,
        bound: float,
        run: LockKey | None,
        on_granted: Callable[[base.Hold], None] | None,
    ) -> bool:
        """Under the mutex, ``hold`` claimed: the try-lock round trip and its record."""
        ids = hold.ids
        # A run lock already held in this process (the same task id running twice in
        # it) would re-enter on this session: not taken again, so that its release
        # cannot end the other run's.
        run_ids = None if run is None or run.ids in self._runs else run.ids
        cursor = self._cursor if self._cursor is not None else self._connect(key)
        name = self._names.get(label)
        if name is None:
            if len(self._names) >= 1024:  # labels are task names: few; stay bounded
                self._names.clear()
            name = self._names[label] = engines.application_name(
                self._prefix, engines.process_tag(), label
            )
        try:
            # Bounded: a frozen link or server would otherwise hold the mutex, and
            # with it every lock statement of the process, for as long as TCP waits.
            with deadlines.bounded(self._connection, bound):
                granted, run_granted = self._try(cursor, ids, name, run_ids)
            if not granted:
                return False
            # Recorded (and handed to on_granted) inside the try: an exception
            # landing here (a soft time limit) must not leave a granted key that
            # nobody in the process knows.
            hold.connection = self._connection
            hold.holding_name = self._shown
            self._owners[ids] = hold
            if run_granted and run_ids is not None:
                hold.run_ids = run_ids
                self._runs[run_ids] = hold
            if on_granted is not None:
                on_granted(hold)
        except BaseException as exc:
            self._fail(f"acquiring lock {key.name!r} failed: {exc!r}", exc)
            base.reraise(exc, f"acquire lock {key.name!r}", self.engine)
        return True

    def _try(
        self,
        cursor: Any,
        ids: tuple[int, ...],
        name: str,
        run_ids: tuple[int, ...] | None,
    ) -> tuple[bool, bool]:
        """One try-lock round trip (under the mutex): (granted, run lock granted)."""
        arity = len(ids)
        if name == self._shown:
            # The session already shows this task: no relabel (relabelling costs the
            # server about as much as the lock statements).
            if run_ids is None:
                cursor.execute(sql_text.TRY_LOCK_SESSION_BARE[arity], ids)
                row = cursor.fetchone()
                return row is not None and row[0] is True, False
            cursor.execute(sql_text.TRY_LOCK_SESSION_BARE_RUN[arity], (*ids, *run_ids))
            row = cursor.fetchone()
            return row is not None and row[0] is not None, bool(row and row[0])
        if run_ids is None:
            cursor.execute(sql_text.TRY_LOCK_SESSION[arity], (*ids, name))
            row = cursor.fetchone()
            run_granted = False
        else:
            cursor.execute(sql_text.TRY_LOCK_SESSION_RUN[arity], (*ids, name, *run_ids))
            row = cursor.fetchone()
            run_granted = bool(row and row[0] is not None and row[0][1] == "true")
        granted = row is not None and row[0] is not None
        if granted:
            self._shown = name
        return granted, run_granted

    def release(
        self,
        hold: base.Hold,
        key: LockKey,
        *,
        commit: bool,
        timeout: float = base.DEFAULT_ROUND_TRIP_TIMEOUT,
    ) -> None:
        if hold.pid != os.getpid():
            raise base.foreign(hold, key)
        ids = hold.ids
        with self._mutex:
            # The run has ended, whatever became of its lock: its key is free in the
            # process again. Under the mutex, so no try-lock of the process runs
            # before the unlock below.
            self.claims.release(hold)
            if self._owners.get(ids) is not hold:
                raise exceptions.LockNotOwnedError(
                    f"The process's lock session ended while lock {key.name!r} (key {key}) was "
                    f"held ({hold.lost or 'closed'}), so PostgreSQL had already freed the lock.",
                    key=str(key),
                    name=key.name,
                )
            del self._owners[ids]
            run_ids = hold.run_ids
            if run_ids is not None:
                del self._runs[run_ids]
            bound: deadlines.Bound | None = None
            try:
                # Bounded: a cut or frozen link would otherwise block this release, and
                # with it (the mutex) every lock statement of the process.
                with deadlines.bounded(self._connection, timeout) as bound:
                    if run_ids is None:
                        self._cursor.execute(
                            sql_text.UNLOCK_SESSION_KEEP_NAME[len(ids)], ids
                        )
                    else:
                        self._cursor.execute(
                            sql_text.UNLOCK_SESSION_KEEP_NAME_RUN[len(ids)],
                            (*ids, *run_ids),
                        )
                    row = self._cursor.fetchone()
            except BaseException as exc:
                self._fail(f"releasing lock {key.name!r} failed: {exc!r}", exc)
                base.reraise(
                    exc,
                    f"release lock {key.name!r}{deadlines.explain(bound)}",
                    self.engine,
                )
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

    def fencing_holder(
        self, hold: base.Hold, key: LockKey, *, bound: float
    ) -> fencing_tokens.Holder | None:
        with self._mutex:
            if (
                self._owners.get(hold.ids) is not hold
                or hold.lost is not None
                or hold.connection is not self._connection
            ):
                return None  # the session that was granted the key has ended
            if self._holder is None:  # once per session: who it is never changes
                try:
                    with deadlines.bounded(self._connection, bound):
                        self._holder = fencing_tokens.session_holder(self._cursor)
                except BaseException as exc:
                    if self._connection.closed or driver_errors.is_disconnect(exc):
                        self._fail(f"naming the session failed: {exc!r}", exc)
                        return None
                    base.reraise(
                        exc, f"issue a fencing token for lock {key.name!r}", self.engine
                    )
            return self._holder

    def holder_of(self, key: LockKey, *, bound: float) -> str | None:
        # On this session when it is open: a skip then needs no second connection.
        with self._mutex:
            if self._cursor is not None:
                row = self._one_row(
                    f"looking up the holder of {key.name!r}",
                    sql_text.HOLDER,
                    key.pg_locks_ids,
                    bound,
                )
                return None if row is None else row[0]
        return self.waits.holder_of(key, bound=bound)

    def run_alive(self, run: LockKey, *, bound: float) -> bool | None:
        with self._mutex:
            if run.ids in self._runs:
                return True  # a run of this process (on this session it would re-enter)
            if self._cursor is not None:
                row = self._one_row(
                    f"checking run lock {run}",
                    sql_text.RUN_ALIVE,
                    (*run.ids, *run.ids),
                    bound,
                )
                return None if row is None else bool(row[0])
        return self.waits.run_alive(run, bound=bound)

    def _one_row(
        self, what: str, statement: str, params: tuple[Any, ...], bound: float
    ) -> tuple[Any, ...] | None:
        """Under the mutex, on the open session: one statement's row, or None if it
        failed (logged at DEBUG; a session found dead is ended)."""
        try:
            with deadlines.bounded(self._connection, bound):
                self._cursor.execute(statement, params)
                row: tuple[Any, ...] | None = self._cursor.fetchone()
        except Exception as exc:
            logger.debug("%s failed", what, exc_info=True)
            if self._connection.closed or driver_errors.is_disconnect(exc):
                self._fail(f"{what} failed: {exc!r}", exc)  # the session died
            return None
        return row

    # -- for lock-loss detection and shutdown ---------------------------------------------

    def run_check(
        self,
        statement: str,
        params: tuple[Any, ...],
        deadline: float,
        least: float,
    ) -> list[tuple[Any, ...]] | None:
        """For the lock watcher: one read-only statement on this session, by ``deadline``
        (``time.monotonic()``): its rows, or None if the session is not open.

        The session is idle while bodies run, so checking its locks here costs the
        process no second connection (issue 16). Raises :class:`SessionBusyError` if other
        statements keep it until less than ``least`` seconds remain: busy is no news
        about its locks. A statement that gets no answer in time, or finds the session
        gone, ends the session (its holds are lost) as a lock statement's would; any
        other error (a cancel) leaves it open. Either way the error is raised.
        """
        if not self._mutex.acquire(
            timeout=max(0.0, deadline - least - time.monotonic())
        ):
            raise SessionBusyError
        try:
            if self._cursor is None or self.pid != os.getpid():
                return None
            remaining = deadline - time.monotonic()
            if remaining < least:
                raise SessionBusyError
            try:
                with deadlines.bounded(self._connection, remaining):
                    self._cursor.execute(statement, params)
                    rows: list[tuple[Any, ...]] = self._cursor.fetchall()
            except BaseException as exc:
                if self._connection.closed or driver_errors.is_disconnect(exc):
                    self._fail(f"checking its locks failed: {exc!r}", exc)
                raise
            return rows
        finally:
            self._mutex.release()

    def holds(self) -> list[base.Hold]:
        """The locks held on this session right now."""
        with self._mutex:
            return list(self._owners.values())

    def lose(self, cause: str) -> list[base.Hold]:
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
            with driver_errors.wrap_db_errors(
                f"acquire lock {key.name!r}", self.engine, connecting=True
            ):
                raise
        self._pooled, self._connection, self._cursor = pooled, dbapi, cursor
        self._shown = None
        return cursor

    def _fail(self, cause: str, exc: BaseException) -> None:
        """Under the mutex: a statement failed; end the session.

        If it died (a server restart ends every session), the pool's connections
        (bounded waits, transaction scope) are likely dead too: they are replaced at their
        next checkout, the next of which may be this session's replacement.
        """
        self._close(cause)
        if driver_errors.is_disconnect(exc):
            # Detached from the pool, this connection cannot say when it was opened:
            # every pooled connection opened until now is retired (once per death).
            engines.mark_pool_stale(self.engine, None, exc)

    def _close(self, cause: str) -> list[base.Hold]:
        """Under the mutex: end the session; every hold on it is lost.

        Their keys stay claimed (``claims``) until their release: PostgreSQL has freed
        them, but their bodies may still run in this process.
        """
        connection, self._connection = self._connection, None
        self._pooled = self._cursor = self._holder = None
        lost = list(self._owners.values())
        self._owners.clear()
        self._runs.clear()
        for hold in lost:
            hold.lost = cause
        if connection is not None and self.pid == os.getpid():
            try:
                connection.close()  # ends the session: the release PostgreSQL always honours
            except Exception:  # a dead socket may complain; it is gone either way
                logger.debug("Closing the lock session failed", exc_info=True)
        return lost
