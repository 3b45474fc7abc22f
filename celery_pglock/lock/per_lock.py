"""PerLockSessions: a pooled connection pinned per held lock.

Transaction scope always works this way (the body borrows the connection), so do bounded
waits (a blocking ``pg_advisory_lock`` on the process's shared session would stall every
task of the process), and so does every lock in ``pglock_session_mode='per_lock'``.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import time
from typing import TYPE_CHECKING, Any

from celery_pglock import exceptions
from celery_pglock.db import (
    deadlines,
    driver_errors,
    engines,
    sql_text,
    startup_options,
)
from celery_pglock.lock import base, fencing_tokens, lock_statements

if TYPE_CHECKING:
    from collections.abc import Callable

    import sqlalchemy as sa

    from celery_pglock.keys import LockKey

logger = logging.getLogger(__name__)

#: Key of a pooled connection's ``info``: the fencing Holder its session is.
_HOLDER = "celery_pglock_fencing_holder"


class PerLockSessions(base.LockSession):
    """A pooled connection per held lock, pinned from acquire to release."""

    def __init__(self, engine: sa.Engine, claims: base.Claims) -> None:
        self.engine = engine
        self.claims = claims

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
        prefix = engines.engine_info(self.engine)["application_name_prefix"]
        tag = engines.process_tag()
        # str(key): the ids only. The LockKey itself would pin its key text (the
        # argument values, possibly megabytes) in the cache below.
        holding_name = _application_name(prefix, tag, str(key), label)
        idle_name = _application_name(prefix, tag, "idle")
        hold = base.Hold(self, key.ids, idle_name)
        hold.holding_name = holding_name
        # Another run of this process holding the key (on a connection of its own, or
        # one whose session is gone) is refused, or waited for, here: PostgreSQL would
        # grant a key whose holder's session has ended, beside that holder's body.
        deadline = None if timeout_ms is None else time.monotonic() + timeout_ms / 1000
        handed = False
        try:
            # Inside the try: an exception landing just after the claim (a soft time
            # limit) must not leave the key claimed by nobody.
            if not self.claims.claim(hold, deadline):
                return None
            if deadline is not None:
                # What the wait in the process left of the bound, never 0 (which would
                # make lock_timeout unbounded).
                timeout_ms = max(1, math.ceil((deadline - time.monotonic()) * 1000))
            run_ids = None if run is None else run.ids
            if transaction:
                granted = self._acquire_transaction(
                    hold, key, holding_name, timeout_ms, bound, run_ids
                )
            else:
                granted = self._acquire_session(
                    hold, key, holding_name, timeout_ms, bound, run_ids
                )
            if granted:
                # Here a pinned connection that nobody knows is unlocked at its pool
                # check-in (and its claim given back below).
                if on_granted is not None:
                    on_granted(hold)
                handed = True
        finally:
            if not handed:
                self.claims.release(hold)  # a no-op if the claim was refused
        return hold if handed else None

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
        try:
            if hold.sa_connection is not None:
                self._release_transaction(hold, key, commit, timeout)
            else:
                self._release_session(hold, key, timeout)
        finally:
            # The run has ended, whatever became of its lock (released, or lost with
            # its connection): its key is free in the process again.
            self.claims.release(hold)

    def fencing_holder(
        self, hold: base.Hold, key: LockKey, *, bound: float
    ) -> fencing_tokens.Holder | None:
        connection = hold.connection
        if hold.lost is not None or connection is None or connection.closed:
            return None
        try:
            with deadlines.bounded(connection, bound), connection.cursor() as cursor:
                if hold.sa_connection is not None:  # which transaction: each time
                    return fencing_tokens.transaction_holder(cursor, key)
                # Who the session is never changes: asked once per pooled connection.
                info = hold.pooled.info
                if _HOLDER not in info:
                    info[_HOLDER] = fencing_tokens.session_holder(cursor)
                holder: fencing_tokens.Holder = info[_HOLDER]
                return holder
        except BaseException as exc:
            if connection.closed or driver_errors.is_disconnect(exc):
                # The lock's session ended: it holds nothing. Its release will say so
                # and discard the connection.
                return None
            base.reraise(
                exc, f"issue a fencing token for lock {key.name!r}", self.engine
            )

    def holder_of(self, key: LockKey, *, bound: float) -> str | None:
        row = self._one_row(sql_text.HOLDER, key.pg_locks_ids, bound)
        return None if row is None else row[0]

    def run_alive(self, run: LockKey, *, bound: float) -> bool | None:
        row = self._one_row(sql_text.RUN_ALIVE, (*run.ids, *run.ids), bound)
        return None if row is None else bool(row[0])

    def _one_row(
        self, statement: str, params: tuple[Any, ...], bound: float
    ) -> tuple[Any, ...] | None:
        """One statement on a pooled connection: its row, or None if it failed (logged
        at DEBUG: these questions only add detail to an outcome, never decide one)."""
        try:
            pooled = self.engine.raw_connection()
        except Exception:
            logger.debug("Could not run %s", statement, exc_info=True)
            return None
        try:
            dbapi: Any = pooled.dbapi_connection
            dbapi.autocommit = True
            with deadlines.bounded(dbapi, bound), dbapi.cursor() as cursor:
                cursor.execute(statement, params)
                row: tuple[Any, ...] | None = cursor.fetchone()
        except Exception as exc:
            logger.debug("Could not run %s", statement, exc_info=True)
            self._discard(pooled, exc)
            return None
        finally:
            pooled.close()
        return row

    def _discard(self, pooled: Any, exc: BaseException) -> None:
        """Close ``pooled`` (whose session is in an unknown state) instead of pooling it."""
        self._retire_if_dead(pooled, exc)
        pooled.invalidate()

    def _retire_if_dead(self, pooled: Any, exc: BaseException) -> None:
        """If ``exc`` says ``pooled``'s session died, retire the pool's older connections.

        Only a dead established session does: a failed connect never reaches here.
        """
        if driver_errors.is_disconnect(exc):
            engines.mark_pool_stale(self.engine, pooled, exc)

    def _acquire_session(
        self,
        hold: base.Hold,
        key: LockKey,
        holding_name: str,
        timeout_ms: int | None,
        bound: float,
        run_ids: tuple[int, ...] | None,
    ) -> bool:
        try:
            pooled = self.engine.raw_connection()
        except Exception:
            with driver_errors.wrap_db_errors(
                f"acquire lock {key.name!r}", self.engine, connecting=True
            ):
                raise
        try:
            # The driver's connection, which SQLAlchemy types loosely.
            dbapi: Any = pooled.dbapi_connection
            dbapi.autocommit = True
            with dbapi.cursor() as cursor:
                granted, run_granted, discard = lock_statements.lock(
                    cursor,
                    key,
                    holding_name,
                    transaction=False,
                    timeout_ms=timeout_ms,
                    bound=bound,
                    run_ids=run_ids,
                )
        except BaseException as exc:
            # Unknown state (e.g. interrupted mid-statement): closing is the only safe release.
            self._discard(pooled, exc)
            pooled.close()
            base.reraise(exc, f"acquire lock {key.name!r}", self.engine)
        if not granted:
            if discard:
                pooled.invalidate()
            pooled.close()
            return False
        engines.held_keys(pooled.info)[key.ids] += 1
        pooled.info[engines.IDLE_NAME] = hold.idle_name
        hold.pooled, hold.connection = pooled, dbapi
        hold.run_ids = run_ids if run_granted else None
        return True

    def _release_session(self, hold: base.Hold, key: LockKey, timeout: float) -> None:
        pooled = hold.pooled
        arity = len(key.ids)
        held = engines.held_keys(pooled.info)
        bound: deadlines.Bound | None = None
        try:
            # Bounded: on a cut or frozen link the socket is shut down (deadlines.py).
            with (
                deadlines.bounded(hold.connection, timeout) as bound,
                hold.connection.cursor() as cursor,
            ):
                if hold.run_ids is None:
                    cursor.execute(
                        sql_text.UNLOCK_SESSION[arity], (*key.ids, hold.idle_name)
                    )
                else:
                    cursor.execute(
                        sql_text.UNLOCK_SESSION_RUN[arity],
                        (*key.ids, hold.idle_name, *hold.run_ids),
                    )
                row = cursor.fetchone()
            unlocked = bool(row and row[0])
        except BaseException as exc:
            held.clear()
            self._discard(pooled, exc)  # the session's end frees whatever it held
            pooled.close()
            base.reraise(
                exc, f"release lock {key.name!r}{deadlines.explain(bound)}", self.engine
            )
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
        self,
        hold: base.Hold,
        key: LockKey,
        holding_name: str,
        timeout_ms: int | None,
        bound: float,
        run_ids: tuple[int, ...] | None,
    ) -> bool:
        with driver_errors.wrap_db_errors(
            f"acquire lock {key.name!r}", self.engine, connecting=True
        ):
            connection = self.engine.connect()
        pooled: Any = None
        try:
            pooled = connection.connection
            # The driver's connection, which SQLAlchemy types loosely.
            dbapi: Any = pooled.dbapi_connection
            dbapi.autocommit = False
            transaction = connection.begin()
            with dbapi.cursor() as cursor:
                # A failed wait in a transaction is rolled back: nothing to discard.
                granted, run_granted, _ = lock_statements.lock(
                    cursor,
                    key,
                    holding_name,
                    transaction=True,
                    timeout_ms=timeout_ms,
                    bound=bound,
                    run_ids=run_ids,
                )
            if not granted:
                transaction.rollback()
                connection.close()
                return False
        except BaseException as exc:
            self._retire_if_dead(pooled, exc)
            connection.invalidate()
            connection.close()
            base.reraise(exc, f"acquire lock {key.name!r}", self.engine)
        hold.pooled, hold.connection = pooled, dbapi
        hold.sa_connection, hold.transaction = connection, transaction
        # A transaction-level run lock ends with the transaction: nothing to release.
        hold.run_ids = run_ids if run_granted else None
        return True

    def _release_transaction(
        self, hold: base.Hold, key: LockKey, commit: bool, timeout: float
    ) -> None:
        connection, transaction = hold.sa_connection, hold.transaction
        if connection is None or transaction is None:  # a session-scope hold
            raise exceptions.LockNotOwnedError(
                f"Lock {key.name!r} has no open transaction.",
                key=str(key),
                name=key.name,
            )
        bound: deadlines.Bound | None = None
        try:
            if not transaction.is_active:
                raise exceptions.LockLostError(
                    f"The transaction of lock {key.name!r} (key {key}) was ended before "
                    "release (committed or rolled back by the task?), so the lock ended early.",
                    key=str(key),
                    name=key.name,
                )
            with (
                driver_errors.wrap_db_errors(
                    f"{'commit' if commit else 'roll back'} lock {key.name!r}",
                    self.engine,
                ),
                # Bounded: on a cut or frozen link the socket is shut down. An answer
                # that came late still counts: the transaction did commit (or roll back),
                # which is what released the lock.
                deadlines.bounded(
                    hold.connection, timeout, late_answer_fails=False
                ) as bound,
            ):
                if commit:
                    transaction.commit()
                else:
                    transaction.rollback()
            if bound.fired:
                connection.invalidate()  # the socket was shut down: the session ends
            elif hold.lent:
                self._discard_all(hold, timeout)
        except BaseException as exc:
            self._retire_if_dead(hold.pooled, exc.__cause__ or exc)
            connection.invalidate()
            if isinstance(exc, exceptions.DatabaseError) and deadlines.explain(bound):
                raise exceptions.DatabaseError(
                    f"{exc}{deadlines.explain(bound)}"
                ) from exc.__cause__
            raise
        finally:
            connection.close()

    def _discard_all(self, hold: base.Hold, timeout: float) -> None:
        """After a transaction-scope run whose body had the connection: wipe what it may
        have left on the session (SET search_path, its own advisory locks, temp tables)
        before pooling it. Not needed (one round trip saved) otherwise. A failure only
        costs the connection: the transaction, and with it the lock, already ended."""
        connection = hold.sa_connection
        try:
            with deadlines.bounded(hold.connection, timeout):
                hold.connection.autocommit = True
                with hold.connection.cursor() as cursor:
                    cursor.execute(sql_text.DISCARD_ALL)
                fallback = startup_options.fallback_of(self.engine)
                if fallback is None or not fallback.carries_settings():
                    # DISCARD ALL returns every setting to its startup value: ours
                    # were set by a statement, not at startup (see startup_options.py).
                    startup_options.apply_session_settings(hold.connection)
        except Exception as exc:
            logger.debug("DISCARD ALL after lock %s failed", hold.ids, exc_info=True)
            self._retire_if_dead(hold.pooled, exc)
            if connection is not None:
                connection.invalidate()


@functools.lru_cache(maxsize=4096)
def _application_name(prefix: str, *parts: object) -> str:
    # Per-lock hot path (per_lock mode, transaction scope): the same names recur.
    return engines.application_name(prefix, *parts)
