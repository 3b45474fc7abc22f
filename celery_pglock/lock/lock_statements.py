"""One lock statement on a pinned connection: try, or wait (bounded), and the run lock.

Used by :class:`~celery_pglock.lock.per_lock.PerLockSessions` for both scopes; every round
trip is bounded client-side (:mod:`celery_pglock.db.deadlines`), and a wait server-side too
(``lock_timeout``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from celery_pglock.db import deadlines, driver_errors, sql_text

if TYPE_CHECKING:
    from celery_pglock.keys import LockKey


def lock(
    cursor: Any,
    key: LockKey,
    holding_name: str,
    *,
    transaction: bool,
    timeout_ms: int | None,
    bound: float,
    run_ids: tuple[int, ...] | None,
) -> tuple[bool, bool, bool]:
    """Try (``timeout_ms`` None) or wait for ``key``, and take the run lock with it.

    Returns:
        (granted, run lock granted, the session must be discarded).
    """
    arity = len(key.ids)
    if timeout_ms is None:
        if transaction:
            tries = (
                sql_text.TRY_LOCK_TRANSACTION_RUN
                if run_ids
                else sql_text.TRY_LOCK_TRANSACTION
            )
        else:
            tries = (
                sql_text.TRY_LOCK_SESSION_RUN if run_ids else sql_text.TRY_LOCK_SESSION
            )
        granted, run_granted = try_lock(
            cursor, tries[arity], key, holding_name, bound, run_ids
        )
        return granted, run_granted, False
    waits = (
        sql_text.WAIT_LOCK_TRANSACTION if transaction else sql_text.WAIT_LOCK_SESSION
    )
    granted, discard = wait_lock(
        cursor, waits[arity], key, holding_name, timeout_ms, bound
    )
    run_statement = (
        sql_text.RUN_LOCK_TRANSACTION if transaction else sql_text.RUN_LOCK_SESSION
    )
    run_granted = granted and run_lock(cursor, run_statement, run_ids, bound)
    return granted, run_granted, discard


def try_lock(
    cursor: Any,
    statement: str,
    key: LockKey,
    holding_name: str,
    bound: float,
    run_ids: tuple[int, ...] | None = None,
) -> tuple[bool, bool]:
    """Try once (one round trip, at most ``bound`` seconds): (granted, run lock granted).

    With ``run_ids`` the statement is a ``*_RUN`` one, answering ARRAY[name, run granted].
    """
    with deadlines.bounded(cursor.connection, bound):
        cursor.execute(statement, (*key.ids, holding_name, *(run_ids or ())))
        row = cursor.fetchone()
    value = None if row is None else row[0]
    if value is None:
        return False, False
    return True, run_ids is not None and value[1] == "true"


def run_lock(
    cursor: Any, statement: str, run_ids: tuple[int, ...] | None, bound: float
) -> bool:
    """After a granted bounded wait: take the run lock too (True if taken)."""
    if run_ids is None:
        return False
    with deadlines.bounded(cursor.connection, bound):
        cursor.execute(statement, run_ids)
        row = cursor.fetchone()
    return bool(row and row[0])


def wait_lock(
    cursor: Any,
    statement: str,
    key: LockKey,
    holding_name: str,
    timeout_ms: int,
    bound: float,
) -> tuple[bool, bool]:
    """Run a bounded blocking lock statement: (granted, the session must be discarded)."""
    try:
        # lock_timeout bounds the wait server-side; bound, a server that never answers.
        with deadlines.bounded(cursor.connection, timeout_ms / 1000 + bound):
            cursor.execute(statement, (str(timeout_ms), holding_name, *key.ids))
    except Exception as exc:
        code = driver_errors.sqlstate(exc)
        if code not in (sql_text.LOCK_NOT_AVAILABLE, sql_text.QUERY_CANCELED):
            raise
        if not cursor.connection.autocommit:
            # Transaction scope: the rollback ends the transaction and the wait.
            cursor.connection.rollback()
            return False, False
        if code == sql_text.QUERY_CANCELED:
            # A cancel (statement_timeout, pg_cancel_backend) may land after the session
            # lock was granted, and a session lock outlives the aborted transaction: this
            # session cannot be trusted. The caller closes it.
            return False, True
        # lock_timeout fired inside pg_advisory_lock: nothing was granted. psycopg2's
        # rollback() is a no-op in autocommit mode, so end the aborted BEGIN by hand.
        with deadlines.bounded(cursor.connection, bound):
            cursor.execute(sql_text.ROLLBACK)
        return False, False
    return True, False


def to_last_result(cursor: Any) -> None:
    """After a string of several statements, make ``fetch*`` read the last one's result,
    as psycopg2 does; psycopg 3 starts at the first (``nextset()`` moves on)."""
    if type(cursor).__module__.partition(".")[0] == "psycopg":
        while cursor.nextset():
            pass
