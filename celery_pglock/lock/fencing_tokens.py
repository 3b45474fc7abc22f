"""Issuing fencing tokens: only to a session that holds the key at that very moment.

The invariant, and why this design guarantees it, is in docs/guide/fencing.md ("Why a
stale run never gets a token"). The lock's session names itself (:class:`Holder`: who
it is, and in transaction scope which transaction), and :func:`issue` takes the token
on a pooled connection, in one committed statement that first locks the key's row and
then checks ``pg_locks`` for that holder. Never on the lock's own session: a transaction
scope lock's transaction commits only at the end (a token inside it would not be
durable), and the process's shared session must not wait for a synchronous commit with
every other task of the process queued behind it. The table is created on first use in a
process (once per engine) unless it exists; a role that cannot create it gets an error
naming the fix.
"""

from __future__ import annotations

import dataclasses
import threading
import weakref
from typing import TYPE_CHECKING, Any

from celery_pglock import exceptions
from celery_pglock.db import deadlines, driver_errors, engines, sql_text
from celery_pglock.lock import fencing_sql

if TYPE_CHECKING:
    import datetime

    import sqlalchemy as sa

    from celery_pglock.keys import LockKey

#: Engines whose fencing table this process has seen (weak: engines come and go in tests).
_ready: weakref.WeakSet[sa.Engine] = weakref.WeakSet()
_ready_guard = threading.Lock()

FIX = (
    "create it once as its owner with `celery -A proj pglock sql --fencing --apply` "
    "(or the SQL of `pglock sql --fencing`), and grant the lock role "
    "SELECT, INSERT, UPDATE on celery_pglock_fencing and USAGE on "
    "celery_pglock_fencing_token_seq (docs/operations/security.md)"
)


def ensure_table(engine: sa.Engine) -> None:
    """Create the fencing table if this process has not seen it yet (once per engine)."""
    if engine in _ready:
        return
    with _ready_guard:
        if engine in _ready:
            return
        action = "set up the fencing table"
        with driver_errors.wrap_db_errors(action, engine):
            pooled: Any = engine.raw_connection()
            try:
                pooled.dbapi_connection.autocommit = True
                with pooled.dbapi_connection.cursor() as cursor:
                    cursor.execute(fencing_sql.EXISTS)
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
        cursor.execute(fencing_sql.CREATE.format(schema=""))
    except Exception as exc:
        if driver_errors.sqlstate(exc) != fencing_sql.INSUFFICIENT_PRIVILEGE:
            raise
        cursor.execute("ROLLBACK")  # autocommit: end the aborted BEGIN by hand
        raise exceptions.DatabaseError(
            f"The fencing table {fencing_sql.TABLE} does not exist on "
            f"{engines.engine_info(engine)['masked_url']} and this role may not create it; "
            f"{FIX}."
        ) from exc


@dataclasses.dataclass(frozen=True, slots=True)
class Holder:
    """Who holds a lock, as PostgreSQL names it (fencing_sql.SESSION_IDENTITY)."""

    pid: int
    started: datetime.datetime
    postmaster: datetime.datetime
    #: Transaction scope: the virtual transaction id holding the key; else None.
    vxid: str | None = None


def session_holder(cursor: Any) -> Holder:
    """Ask the lock's own session who it is (once per session: it never changes)."""
    cursor.execute(fencing_sql.SESSION_IDENTITY)
    pid, started, postmaster = cursor.fetchone()
    return Holder(pid, started, postmaster)


def transaction_holder(cursor: Any, key: LockKey) -> Holder | None:
    """Ask the lock's connection, inside its transaction, which transaction holds
    ``key``: None if it does not."""
    cursor.execute(fencing_sql.TRANSACTION_IDENTITY, _ids(key))
    row = cursor.fetchone()
    if row is None:
        return None
    vxid, pid, started, postmaster = row
    return Holder(pid, started, postmaster, vxid)


def issue(engine: sa.Engine, key: LockKey, holder: Holder, bound: float) -> int | None:
    """Issue ``key``'s next token if ``holder`` holds ``key`` now; None if it does not.

    On a pooled connection of ``engine``, bounded by ``bound`` seconds.
    """
    action = f"issue a fencing token for lock {key.name!r}"
    params = {
        **_ids(key),
        "pid": holder.pid,
        "started": holder.started,
        "postmaster": holder.postmaster,
        "vxid": holder.vxid,
    }
    with driver_errors.wrap_db_errors(action, engine):
        pooled: Any = engine.raw_connection()
    try:
        dbapi = pooled.dbapi_connection
        dbapi.autocommit = True
        with (
            driver_errors.wrap_db_errors(action, engine),
            deadlines.bounded(dbapi, bound),
            dbapi.cursor() as cursor,
        ):
            return _issue(cursor, params, key, engine)
    except BaseException:
        pooled.invalidate()  # unknown state: never pool it
        raise
    finally:
        pooled.close()


def _ids(key: LockKey) -> dict[str, Any]:
    classid, objid, objsubid = key.pg_locks_ids
    return {"classid": classid, "objid": objid, "objsubid": objsubid}


def _issue(
    cursor: Any, params: dict[str, Any], key: LockKey, engine: sa.Engine
) -> int | None:
    try:
        cursor.execute(fencing_sql.ISSUE, params)
        sql_text.to_last_result(cursor)
        row = cursor.fetchone()
    except Exception as exc:
        code = driver_errors.sqlstate(exc)
        if code in (fencing_sql.UNDEFINED_TABLE, fencing_sql.INSUFFICIENT_PRIVILEGE):
            forget(engine)
            problem = (
                "does not exist (dropped since this process checked?)"
                if code == fencing_sql.UNDEFINED_TABLE
                else "is not writable by this role"
            )
            raise exceptions.DatabaseError(
                f"Could not issue a fencing token for lock {key.name!r}: "
                f"{fencing_sql.TABLE} {problem}; {FIX}."
            ) from exc
        raise
    held, token = row if row is not None else (False, None)
    if not held:
        return None
    if token is None:
        raise exceptions.DatabaseError(
            f"Could not issue a fencing token for lock {key.name!r} (key "
            f"{key}): {fencing_sql.SEQUENCE} gave a token below the last one "
            "issued for this key (was it reset with setval, or given a CACHE above 1?). "
            "Tokens never go back: set CACHE 1 and the sequence past max(token) of "
            f"{fencing_sql.TABLE}."
        )
    return int(token)
