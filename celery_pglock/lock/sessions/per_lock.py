"""Per-lock sessions: a pooled connection pinned to each hold from acquire to release,
for waits and transaction scope. Why: docs/design.md ("One lock session per process")."""

from __future__ import annotations

import logging
import math
import time
from typing import TYPE_CHECKING, Any

from celery_pglock import exceptions
from celery_pglock.config import LockScope
from celery_pglock.db import (
    deadlines,
    driver_errors,
    engines,
    server_probe,
    sql_text,
    startup_options,
)
from celery_pglock.lock import identity
from celery_pglock.lock.sessions import base

if TYPE_CHECKING:
    import sqlalchemy as sa

    from celery_pglock.keys import LockKey

logger = logging.getLogger(__name__)

_IDENTITY = "celery_pglock_identity"  #: pooled.info key: who its session is.


class PerLockSessions(base.LockSessions):
    """A pooled connection per held lock, pinned from acquire to release."""

    _claims_wait = True

    def acquire(self, request: base.AcquireRequest) -> base.Hold | None:
        scope = LockScope.TRANSACTION if request.transaction else LockScope.SESSION
        # Probed once per engine, before a wait's deadline starts counting.
        server_probe.check(self.engine, scope, request.slots[0].name)
        return super().acquire(request)

    def _take(
        self,
        request: base.AcquireRequest,
        free: list[base.Hold],
        deadline: float | None,
    ) -> base.Hold | None:
        for hold in free:
            hold.idle_name = self._name("idle")
            # str(key): the ids only (the key text may be megabytes, kept by the cache).
            hold.holding_name = self._name(str(request.slots[hold.slot]), request.label)
        timeout_ms = request.timeout_ms
        if deadline is not None:
            # What the wait in the process left, never 0 (lock_timeout 0: unbounded).
            timeout_ms = max(1, math.ceil((deadline - time.monotonic()) * 1000))
        # The key (or the first free slot) on a pooled connection pinned to its hold.
        transaction, bound, key = request.transaction, request.bound, request.slots[0]
        run_ids = None if request.run is None else request.run.ids
        action = f"acquire lock {key.name!r}"
        with driver_errors.wrap_db_errors(action, self.engine, connecting=True):
            owner: Any = (
                self.engine.connect() if transaction else self.engine.raw_connection()
            )
        pooled: Any = None
        lock_transaction: Any = None
        hold = free[0]
        try:
            pooled = owner.connection if transaction else owner
            dbapi: Any = pooled.dbapi_connection
            dbapi.autocommit = not transaction
            if transaction:
                lock_transaction = owner.begin()
            with dbapi.cursor() as cursor:
                if len(request.slots) == 1:
                    granted, run_granted, discard = lock_or_wait(
                        cursor, key, hold, transaction, timeout_ms, bound, run_ids
                    )
                else:
                    with deadlines.bounded(dbapi, bound):
                        chosen, run_granted = base.try_slots(
                            cursor, free, True, run_ids, transaction
                        )
                    granted, discard, hold = chosen is not None, False, chosen or hold
            if not granted:
                if transaction:
                    lock_transaction.rollback()
                elif discard:
                    owner.invalidate()
                owner.close()
                return None
            # In the try: an interrupt before the hold is handed over closes its session.
            if transaction:
                hold.sa_connection, hold.transaction = owner, lock_transaction
            else:
                engines.held_keys(pooled.info)[hold.ids] += 1
                pooled.info[engines.IDLE_NAME] = hold.idle_name
            hold.pooled, hold.connection = pooled, dbapi
            # A transaction-level run lock ends with the transaction: nothing to release.
            hold.run_ids = run_ids if run_granted else None
            if request.on_granted is not None:
                request.on_granted(hold)
        except BaseException as exc:
            # Unknown state (interrupted mid-statement): closing is the only safe release.
            self._retire_if_dead(pooled, exc)
            owner.invalidate()
            owner.close()
            self._raise(exc, action)
        return hold

    def identity(
        self, hold: base.Hold, key: LockKey, *, bound: float
    ) -> identity.Identity | None:
        connection = hold.connection
        if not _pinned_alive(hold):
            return None
        try:
            with deadlines.bounded(connection, bound), connection.cursor() as cursor:
                if hold.sa_connection is not None:  # which transaction: each time
                    return identity.of_transaction(cursor, key)
                info = hold.pooled.info  # who the session is: once per connection
                if _IDENTITY not in info:
                    info[_IDENTITY] = identity.of_session(cursor)
                found: identity.Identity = info[_IDENTITY]
                return found
        except BaseException as exc:
            if connection.closed or driver_errors.is_disconnect(exc):
                return None  # its session ended; the release says so
            self._raise(exc, f"issue a fencing token for lock {key.name!r}")

    def on_holder(
        self, hold: base.Hold, action: str, bound: float, work: base.Work
    ) -> tuple[Any, ...] | None:
        """As ProcessSession.on_holder, on the pinned connection; session scope only."""
        connection = hold.connection
        if hold.transaction is not None or not _pinned_alive(hold):
            return None
        with deadlines.bounded(connection, bound), connection.cursor() as cursor:
            return work(connection, cursor)

    def release(
        self, hold: base.Hold, key: LockKey, commit: bool, timeout: float
    ) -> None:
        """Unlock or end the transaction; the connection is closed after any failure."""
        transaction = hold.transaction
        owner: Any = hold.pooled if transaction is None else transaction.connection
        bound: deadlines.Bound | None = None
        try:
            if transaction is None:
                statement, params = sql_text.UNLOCK_SESSION, (*key.ids, hold.idle_name)
                if hold.run_ids is not None:
                    statement = sql_text.UNLOCK_SESSION_RUN
                    params = (*params, *hold.run_ids)
                with (
                    deadlines.bounded(hold.connection, timeout) as bound,
                    hold.connection.cursor() as cursor,
                ):
                    row = base.execute(
                        cursor, statement[len(key.ids)], params, hold.rider, end=True
                    )
                held = engines.held_keys(hold.pooled.info)
                held[key.ids] -= 1
                if held[key.ids] <= 0:
                    del held[key.ids]
                if not (row and row[0]):
                    raise exceptions.LockNotOwnedError(
                        f"PostgreSQL says the session no longer held lock {key.name!r} (key {key}) "
                        "at release; the connection was closed instead of being pooled.",
                        key=str(key),
                        name=key.name,
                    )
            else:
                if not transaction.is_active:
                    raise exceptions.LockLostError(
                        f"The transaction of lock {key.name!r} (key {key}) was ended before "
                        "release (committed or rolled back by the task?), so the lock ended early.",
                        key=str(key),
                        name=key.name,
                    )
                # A late answer still counts: the transaction ended, releasing the lock.
                with deadlines.bounded(
                    hold.connection, timeout, late_answer_fails=False
                ) as bound:
                    if commit:
                        transaction.commit()
                    else:
                        transaction.rollback()
                if bound.fired:
                    owner.invalidate()  # the socket was shut down: the session ends
                elif hold.lent:
                    self._discard_all(hold, owner, timeout)
        except BaseException as exc:
            if transaction is None:
                engines.held_keys(hold.pooled.info).clear()
                verb = "release"
            else:
                verb = "commit" if commit else "roll back"
            self._retire_if_dead(hold.pooled, exc)
            owner.invalidate()  # the session's end frees whatever it held
            self._raise(exc, f"{verb} lock {key.name!r}{deadlines.explain(bound)}")
        finally:
            try:
                owner.close()
            finally:  # the run has ended, whatever became of its lock
                hold.connection = None  # not still_holds() now
                self.claims.release(hold)

    def still_holds(self, hold: base.Hold) -> bool:
        # Interrupted before its release began: still pinned (until then).
        return _pinned_alive(hold)

    def _discard_all(
        self, hold: base.Hold, connection: sa.Connection, timeout: float
    ) -> None:
        """DISCARD ALL (docs/guide/scopes.md); a failure only costs the connection."""
        try:
            with deadlines.bounded(hold.connection, timeout):
                hold.connection.autocommit = True
                with hold.connection.cursor() as cursor:
                    sql_text.forget_prepared(hold.connection)
                    cursor.execute(sql_text.DISCARD_ALL)
                fallback = startup_options.fallback_of(self.engine)
                if fallback is None or not fallback.carries_settings():
                    # DISCARD ALL restores startup values; ours were SET (startup_options).
                    startup_options.apply_session_settings(hold.connection)
        except Exception as exc:
            logger.debug("DISCARD ALL after lock %s failed", hold.ids, exc_info=True)
            self._retire_if_dead(hold.pooled, exc)
            connection.invalidate()


def _pinned_alive(hold: base.Hold) -> bool:
    """A per-lock hold whose pinned connection has not ended (as far as we know)."""
    connection = hold.connection
    return hold.lost is None and connection is not None and not connection.closed


def lock_or_wait(
    cursor: Any,
    key: LockKey,
    hold: base.Hold,
    transaction: bool,
    timeout_ms: int | None,
    bound: float,
    run_ids: tuple[int, ...] | None,
) -> tuple[bool, bool, bool]:
    """Try (``timeout_ms`` None) or wait: (granted, run lock granted, discard session)."""
    connection, arity, name = cursor.connection, len(key.ids), hold.holding_name
    if timeout_ms is None:
        with deadlines.bounded(connection, bound):
            granted = base.try_named(
                cursor, key.ids, name, run_ids, transaction, hold.rider
            )
            return (*granted, False)
    waits = (
        sql_text.WAIT_LOCK_TRANSACTION if transaction else sql_text.WAIT_LOCK_SESSION
    )
    try:
        # lock_timeout bounds the wait server-side; bound, a server that never answers.
        with deadlines.bounded(connection, timeout_ms / 1000 + bound):
            cursor.execute(waits[arity], (str(timeout_ms), name, *key.ids))
    except Exception as exc:
        code = driver_errors.sqlstate(exc)
        if code not in (sql_text.LOCK_NOT_AVAILABLE, sql_text.QUERY_CANCELED):
            raise
        if transaction:
            connection.rollback()  # ends the transaction and the wait
            return False, False, False
        if code == sql_text.QUERY_CANCELED:
            # A cancel may land after the grant, and a session lock outlives the BEGIN.
            return False, False, True
        # lock_timeout: nothing granted; psycopg2's rollback() is a no-op in autocommit.
        with deadlines.bounded(connection, bound):
            cursor.execute(sql_text.ROLLBACK)
        return False, False, False
    if run_ids is None and hold.rider is None:
        return True, False, False
    # Granted: the rider runs with the run lock (or alone, if there is none).
    statement = (
        sql_text.RUN_LOCK_TRANSACTION if transaction else sql_text.RUN_LOCK_SESSION
    )
    with deadlines.bounded(connection, bound):
        if run_ids is None:
            statement, run_ids = sql_text.NOTHING, ()
        row = base.execute(cursor, statement, run_ids, hold.rider, "true")
    return True, bool(row and row[0]), False
