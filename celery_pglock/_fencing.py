"""Issuing fencing tokens: only to a session that holds the key at that very moment.

The invariant, and why this design guarantees it, is in docs/guide/fencing.md ("Why a
stale run never gets a token"). In short:

- session scope: the token is issued on the lock's own session, in one autocommit
  statement that also checks (``pg_locks``, ``pid = pg_backend_pid()``) that this session
  holds the key. A session can only lose its lock by ending, which aborts the statement,
  so every committed token was issued while its session held the key, and tokens of one
  key are issued in the order of its grants.
- transaction scope: the lock's transaction cannot commit early (the token would not be
  durable before the body uses it), so the token is issued on a second, autocommit
  session, which first locks the key's row of the table and then checks that the lock's
  transaction (its virtual transaction id) still holds the key.

Either way the token is committed with ``synchronous_commit`` on before the client can
read it: a crash cannot make PostgreSQL issue it again. The table is created on first
use in a process (once per engine) unless it exists; a role that cannot create it gets
an error naming the fix.
"""

from __future__ import annotations

import threading
import weakref
from typing import TYPE_CHECKING, Any

from celery_pglock import _deadline, _driver_errors, _sql_fencing, db, exceptions

if TYPE_CHECKING:
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


def issue_on_holder(cursor: Any, key: LockKey, engine: sa.Engine) -> int | None:
    """Session scope: issue on the lock's own ``cursor`` (autocommit), under its session's
    serialisation. The token, or None if this session does not hold ``key``."""
    return _issue(cursor, _sql_fencing.ISSUE_ON_HOLDER, _ids(key), key, engine)


def issue_for_transaction(
    cursor: Any, key: LockKey, engine: sa.Engine, bound: float
) -> int | None:
    """Transaction scope: learn on the lock's ``cursor`` which transaction holds ``key``,
    then issue on a pooled connection of ``engine`` if that transaction still holds it.
    The token, or None if the lock's transaction does not hold ``key``."""
    params = _ids(key)
    cursor.execute(_sql_fencing.HOLDING_TRANSACTION, params)
    row = cursor.fetchone()
    if row is None:
        return None
    params["vxid"] = row[0]
    action = f"issue a fencing token for lock {key.name!r}"
    with _driver_errors.wrap_db_errors(action, engine):
        pooled: Any = engine.raw_connection()
    try:
        dbapi = pooled.dbapi_connection
        dbapi.autocommit = True
        # Wrapped here: this session's failure is no news about the lock's session.
        with (
            _driver_errors.wrap_db_errors(action, engine),
            _deadline.bounded(dbapi, bound),
            dbapi.cursor() as issuing,
        ):
            return _issue(
                issuing, _sql_fencing.ISSUE_FOR_TRANSACTION, params, key, engine
            )
    except BaseException:
        pooled.invalidate()  # unknown state: never pool it
        raise
    finally:
        pooled.close()


def _ids(key: LockKey) -> dict[str, Any]:
    classid, objid, objsubid = key.pg_locks_ids
    return {"classid": classid, "objid": objid, "objsubid": objsubid}


def _issue(
    cursor: Any,
    statement: str,
    params: dict[str, Any],
    key: LockKey,
    engine: sa.Engine,
) -> int | None:
    try:
        cursor.execute(statement, params)
        row = cursor.fetchone()
    except Exception as exc:
        code = _driver_errors.sqlstate(exc)
        if code in (_sql_fencing.UNDEFINED_TABLE, _sql_fencing.INSUFFICIENT_PRIVILEGE):
            forget(engine)
            problem = (
                "does not exist (dropped since this process checked?)"
                if code == _sql_fencing.UNDEFINED_TABLE
                else "is not writable by this role"
            )
            raise exceptions.DatabaseError(
                f"Could not issue a fencing token for lock {key.name!r}: "
                f"{_sql_fencing.TABLE} {problem}; {FIX}."
            ) from exc
        raise
    held, token = row if row is not None else (False, None)
    if not held:
        return None
    if token is None:
        raise exceptions.DatabaseError(
            f"Could not issue a fencing token for lock {key.name!r} (key "
            f"{key}): {_sql_fencing.SEQUENCE} gave a token below the last one "
            "issued for this key (was it reset with setval, or given a CACHE above 1?). "
            "Tokens never go back: set CACHE 1 and the sequence past max(token) of "
            f"{_sql_fencing.TABLE}."
        )
    return int(token)
