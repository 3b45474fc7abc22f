"""Fencing tokens: the table, its SQL, issuing a token only to the key's holder (public:
``fencing/__init__``). Why: docs/guide/fencing.md ("Why a stale run never gets a token")."""

from __future__ import annotations

import contextvars
import dataclasses
import logging
from typing import TYPE_CHECKING

from celery_pglock import exceptions
from celery_pglock.db import driver_errors, engines, own_tables, sql_text
from celery_pglock.lock import identity

if TYPE_CHECKING:
    import sqlalchemy as sa

    from celery_pglock.keys import LockKey
    from celery_pglock.lock import AdvisoryLock

logger = logging.getLogger(__name__)

#: True while a shadowed run's body (lock_shadow, run without its lock) runs here: its
#: writes go unfenced (token=None). The task layer sets it for every run.
unfenced: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "celery_pglock_unfenced", default=False
)

#: ``{schema}``: a quoted name and a dot, or "". Locked: IF NOT EXISTS races itself.
CREATE = """
BEGIN;
SELECT pg_advisory_xact_lock(hashtext('celery_pglock.fencing'));
CREATE SEQUENCE IF NOT EXISTS {schema}celery_pglock_fencing_token_seq
  AS bigint MINVALUE 1 CACHE 1 NO CYCLE;
CREATE TABLE IF NOT EXISTS {schema}celery_pglock_fencing (
  classid oid NOT NULL, objid oid NOT NULL, objsubid smallint NOT NULL,
  token bigint NOT NULL, issued_at timestamptz NOT NULL DEFAULT now(),
  PRIMARY KEY (classid, objid, objsubid)
);
COMMENT ON TABLE {schema}celery_pglock_fencing IS
  'celery-pglock: the last fencing token issued per advisory key (pg_locks ids)';
COMMIT;
"""

DROP = """
DROP TABLE IF EXISTS {schema}celery_pglock_fencing;
DROP SEQUENCE IF EXISTS {schema}celery_pglock_fencing_token_seq;
"""

#: What a least-privilege lock role needs; ``{role}`` is a quoted role name.
GRANT = """
GRANT SELECT, INSERT, UPDATE ON {schema}celery_pglock_fencing TO {role};
GRANT USAGE ON SEQUENCE {schema}celery_pglock_fencing_token_seq TO {role};
"""

_EXISTS = """SELECT to_regclass('celery_pglock_fencing') IS NOT NULL,
  to_regclass('celery_pglock_fencing_token_seq') IS NOT NULL"""

LAST = f"SELECT token FROM celery_pglock_fencing WHERE {sql_text.KEY_IS}"  #: key_params

_HELD_BY = f"""SELECT 1 FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
  WHERE {sql_text.GRANTED_KEY} AND l.pid = %(pid)s AND a.backend_start = %(started)s
  AND pg_postmaster_start_time() = %(postmaster)s
  AND (%(vxid)s::text IS NULL OR l.virtualtransaction = %(vxid)s::text)"""

# (held, token); NULL token: not held, or the sequence fell behind (docs/guide/fencing.md).
_ISSUE = f"""
SELECT set_config('synchronous_commit', 'on', true);
INSERT INTO celery_pglock_fencing (classid, objid, objsubid, token)
  SELECT %(classid)s::oid, %(objid)s::oid, %(objsubid)s::smallint, 0
  WHERE EXISTS ({_HELD_BY})
  ON CONFLICT (classid, objid, objsubid) DO NOTHING;
SELECT 1 FROM celery_pglock_fencing WHERE {sql_text.KEY_IS} FOR UPDATE;
WITH held AS (SELECT EXISTS ({_HELD_BY}) AS held),
  next AS (SELECT nextval('celery_pglock_fencing_token_seq') AS token
           FROM held WHERE held.held),
  issued AS (UPDATE celery_pglock_fencing AS f SET token = next.token, issued_at = now()
             FROM next WHERE {sql_text.KEY_IS} AND f.token < next.token RETURNING f.token)
SELECT held.held, (SELECT token FROM issued) FROM held"""

FIX = (
    "create it once as its owner with `celery -A proj pglock sql --fencing --apply` "
    "(or the SQL of `pglock sql --fencing`), and grant the lock role "
    "SELECT, INSERT, UPDATE on celery_pglock_fencing and USAGE on "
    "celery_pglock_fencing_token_seq (docs/operations/security.md)"
)

TABLE = own_tables.OwnTable("fencing table celery_pglock_fencing", _EXISTS, CREATE, FIX)


def _issue(
    engine: sa.Engine, key: LockKey, holder: identity.Identity, bound: float
) -> int | None:
    """``key``'s next token if ``holder`` holds it now, else None."""
    action = f"issue a fencing token for lock {key.name!r}"
    with (
        driver_errors.wrap_db_errors(action, engine),
        engines.autocommit_cursor(engine, bound) as cursor,
    ):
        try:
            cursor.execute(
                _ISSUE, {**identity.key_params(key), **dataclasses.asdict(holder)}
            )
            sql_text.to_last_result(cursor)
            held, token = cursor.fetchone() or (False, None)
        except Exception as exc:
            code = driver_errors.sqlstate(exc)
            if code not in (sql_text.UNDEFINED_TABLE, sql_text.INSUFFICIENT_PRIVILEGE):
                raise
            TABLE.forget(engine)
            problem = (
                "does not exist (dropped since this process checked?)"
                if code == sql_text.UNDEFINED_TABLE
                else "is not writable by this role"
            )
            raise exceptions.DatabaseError(
                f"Could not {action}: celery_pglock_fencing {problem}; {FIX}."
            ) from exc
        if not held:
            return None
        if token is None:
            raise exceptions.DatabaseError(
                f"Could not {action} (key {key}): "
                "celery_pglock_fencing_token_seq gave a token below the last one "
                "issued for this key (was it reset with setval, or given a CACHE "
                "above 1?). Tokens never go back: set CACHE 1 and the sequence past "
                "max(token) of celery_pglock_fencing."
            )
        return int(token)


def issue_token(lock: AdvisoryLock) -> int:
    """As ``celery_pglock.fencing.issue_token``, which documents it."""
    if not lock.owned():
        raise exceptions.PgLockError(
            f"Lock {lock.key.name!r} (key {lock.key}) is not held: a fencing token is "
            "only issued to the holder."
        )
    try:
        TABLE.ensure(lock.engine)
        holder = lock.holder_identity()
        token = None
        if holder is not None:
            token = _issue(lock.engine, lock.key, holder, lock.round_trip_timeout)
        if token is None:
            lock.mark_lost(
                "its session no longer held it when its fencing token was issued, "
                "before the body started"
            )
            raise exceptions.LockLostError(
                f"Lock {lock.key.name!r} (key {lock.key}) was lost between its grant "
                "and its fencing token (its session ended); no token was issued, and "
                "the body did not run.",
                key=str(lock.key),
                name=lock.key.name,
            )
    except BaseException:
        # A fenced run never runs without its token; a lost session freed it anyway.
        if lock.owned():
            try:
                lock.release(commit=False)
            except exceptions.PgLockError:
                logger.debug("Release after a failed fencing token", exc_info=True)
        raise
    lock.fencing_token = token
    return token
