"""Issuing fencing tokens: one committed statement, right after the grant.

Hazard: a token must be issued while the lock is held and be durable before the body
can use it. Issued before the grant, a waiter's older token would reach the resource
after a newer holder's and be refused although it then holds the lock. Issued inside an
uncommitted transaction, the sequence step reaches the WAL only at commit: a server crash
before that (the very fault fencing exists for) makes PostgreSQL issue the same token
again after recovery, to the next holder, while the cut-off body may still write with
it. So:

- session scope: on the lock's own session (autocommit): the statement commits at once,
  with ``synchronous_commit`` on, before the body starts;
- transaction scope: on a second pooled session, in autocommit, while the lock's
  transaction holds the lock; the token is durable before the body starts, and neither
  it nor the row is undone when the run rolls back (``nextval`` never is).

The table is created on first use in a process (a separate short connection, once per
engine), unless it exists already; a role that cannot create it gets an error naming
the fix.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from typing import TYPE_CHECKING, Any

from celery_pglock import _driver_errors, _sql_fencing, db, exceptions

if TYPE_CHECKING:
    import sqlalchemy as sa

    from celery_pglock.lock import AdvisoryLock

#: Engines whose fencing table this process has seen (weak: engines come and go in tests).
_ready: weakref.WeakSet[sa.Engine] = weakref.WeakSet()
_ready_guard = threading.Lock()

FIX = (
    "create it once as its owner with `celery -A proj pglock sql --fencing --apply` "
    "(or the SQL of `pglock sql --fencing`), and grant the lock role "
    "SELECT, INSERT, UPDATE on celery_pglock_fencing and USAGE on "
    "celery_pglock_fencing_token_seq (docs/operations/security.md)"
)


def issue(lock: AdvisoryLock) -> int:
    """Give ``lock`` (held) its next fencing token and return it.

    On failure the lock is released (a fenced run never runs without its token) and
    DatabaseError says why and, for a missing table or privilege, how to fix it.
    """
    if not lock.owned():
        raise exceptions.PgLockError(
            f"Lock {lock.key.name!r} (key {lock.key}) is not held: a fencing token is "
            "only issued to the holder."
        )
    try:
        ensure_table(lock.engine)
        token = _next_token(lock)
    except BaseException:
        _release_quietly(lock)
        raise
    lock.fencing_token = token
    return token


def ensure_table(engine: sa.Engine) -> None:
    """Create the fencing table if this process has not seen it yet (once per engine)."""
    if engine in _ready:
        return
    with _ready_guard:
        if engine in _ready:
            return
        action = "set up the fencing table"
        with _driver_errors.wrap_db_errors(action, engine):
            pooled: Any = engine.raw_connection()
            try:
                pooled.dbapi_connection.autocommit = True
                with pooled.dbapi_connection.cursor() as cursor:
                    cursor.execute(_sql_fencing.EXISTS)
                    row = cursor.fetchone()
                    if not (row and all(row)):
                        _create(cursor, engine)
            finally:
                pooled.close()
        _ready.add(engine)


def forget(engine: sa.Engine) -> None:
    """Check the table again at the next issue (after it failed, or was dropped)."""
    with _ready_guard:
        _ready.discard(engine)


def _create(cursor: Any, engine: sa.Engine) -> None:
    try:
        cursor.execute(_sql_fencing.CREATE.format(schema=""))
    except Exception as exc:
        if _driver_errors.sqlstate(exc) != _sql_fencing.INSUFFICIENT_PRIVILEGE:
            raise
        cursor.execute("ROLLBACK")  # autocommit: end the aborted BEGIN by hand
        raise exceptions.DatabaseError(
            f"The fencing table {_sql_fencing.TABLE} does not exist on "
            f"{db.engine_info(engine)['masked_url']} and this role may not create it; "
            f"{FIX}."
        ) from exc


def _next_token(lock: AdvisoryLock) -> int:
    # Always on a pooled connection of its own, in its own committed statement: never
    # inside a transaction-scope lock's transaction (a crash before its commit would give
    # the same token again), and never on a process's shared lock session (that belongs
    # to every task of the process, behind its mutex). The sequence, not the session,
    # makes tokens increase; the lock is held throughout.
    with _driver_errors.wrap_db_errors(
        f"issue a fencing token for lock {lock.key.name!r}", lock.engine
    ):
        pooled: Any = lock.engine.raw_connection()
    try:
        pooled.dbapi_connection.autocommit = True
        return _issue_on(lock, pooled.dbapi_connection)
    except BaseException:
        pooled.invalidate()  # unknown state: never pool it
        raise
    finally:
        pooled.close()


def _issue_on(lock: AdvisoryLock, dbapi: Any) -> int:
    try:
        with dbapi.cursor() as cursor:
            cursor.execute(_sql_fencing.ISSUE, lock.key.pg_locks_ids)
            row = cursor.fetchone()
    except Exception as exc:
        code = _driver_errors.sqlstate(exc)
        if code in (_sql_fencing.UNDEFINED_TABLE, _sql_fencing.INSUFFICIENT_PRIVILEGE):
            forget(lock.engine)
            problem = (
                "does not exist (dropped since this process checked?)"
                if code == _sql_fencing.UNDEFINED_TABLE
                else "is not writable by this role"
            )
            raise exceptions.DatabaseError(
                f"Could not issue a fencing token for lock {lock.key.name!r}: "
                f"{_sql_fencing.TABLE} {problem}; {FIX}."
            ) from exc
        with _driver_errors.wrap_db_errors(
            f"issue a fencing token for lock {lock.key.name!r}", lock.engine
        ):
            raise
    if row is None:
        raise exceptions.DatabaseError(
            f"Could not issue a fencing token for lock {lock.key.name!r} (key "
            f"{lock.key}): {_sql_fencing.SEQUENCE} gave a token below the last one "
            "issued for this key (was it reset with setval, or given a CACHE above 1?). "
            "Tokens never go back: set CACHE 1 and the sequence past max(token) of "
            f"{_sql_fencing.TABLE}."
        )
    return int(row[0])


def _release_quietly(lock: AdvisoryLock) -> None:
    """Give the lock back after a failed issue; a failing release closes the session."""
    if lock.owned():
        # A failing release has closed the connection, which ends the lock too.
        with contextlib.suppress(exceptions.PgLockError):
            lock.release(commit=False)
