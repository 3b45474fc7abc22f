"""Fencing tokens: the table, its SQL, and issuing a token only to the key's holder.
Why: docs/guide/fencing.md ("Why a stale run never gets a token")."""

from __future__ import annotations

import contextlib
import dataclasses
import weakref
from typing import TYPE_CHECKING, Any

from celery_pglock import exceptions
from celery_pglock.db import deadlines, driver_errors, engines, sql_text

if TYPE_CHECKING:
    import datetime

    import sqlalchemy as sa

    from celery_pglock.keys import LockKey

UNDEFINED_TABLE, INSUFFICIENT_PRIVILEGE = "42P01", "42501"  # SQLSTATEs

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

# Asked on the session itself: the pid libpq knows may be a pooler's.
_SESSION_IDENTITY = """SELECT pg_backend_pid(),
  (SELECT backend_start FROM pg_stat_activity WHERE pid = pg_backend_pid()),
  pg_postmaster_start_time()"""

_KEY = "classid = %(classid)s::oid AND objid = %(objid)s::oid AND objsubid = %(objsubid)s::smallint"
LAST = f"SELECT token FROM celery_pglock_fencing WHERE {_KEY}"  #: params: key_params()
_GRANTED = f"""l.locktype = 'advisory' AND l.granted AND {_KEY}
  AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())"""

_TRANSACTION_IDENTITY = f"""
SELECT l.pid, a.backend_start, pg_postmaster_start_time(), l.virtualtransaction
FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
WHERE {_GRANTED} AND l.pid = pg_backend_pid() LIMIT 1"""

_HELD_BY = f"""SELECT 1 FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
  WHERE {_GRANTED} AND l.pid = %(pid)s AND a.backend_start = %(started)s
  AND pg_postmaster_start_time() = %(postmaster)s
  AND (%(vxid)s::text IS NULL OR l.virtualtransaction = %(vxid)s::text)"""

# (held, token); NULL token: not held, or the sequence fell behind (docs/guide/fencing.md).
_ISSUE = f"""
SELECT set_config('synchronous_commit', 'on', true);
INSERT INTO celery_pglock_fencing (classid, objid, objsubid, token)
  SELECT %(classid)s::oid, %(objid)s::oid, %(objsubid)s::smallint, 0
  WHERE EXISTS ({_HELD_BY})
  ON CONFLICT (classid, objid, objsubid) DO NOTHING;
SELECT 1 FROM celery_pglock_fencing WHERE {_KEY} FOR UPDATE;
WITH held AS (SELECT EXISTS ({_HELD_BY}) AS held),
  next AS (SELECT nextval('celery_pglock_fencing_token_seq') AS token
           FROM held WHERE held.held),
  issued AS (UPDATE celery_pglock_fencing AS f SET token = next.token, issued_at = now()
             FROM next WHERE {_KEY} AND f.token < next.token RETURNING f.token)
SELECT held.held, (SELECT token FROM issued) FROM held"""

FIX = (
    "create it once as its owner with `celery -A proj pglock sql --fencing --apply` "
    "(or the SQL of `pglock sql --fencing`), and grant the lock role "
    "SELECT, INSERT, UPDATE on celery_pglock_fencing and USAGE on "
    "celery_pglock_fencing_token_seq (docs/operations/security.md)"
)


@dataclasses.dataclass(frozen=True, slots=True)
class Holder:
    """Who holds a lock, as PostgreSQL names it."""

    pid: int
    started: datetime.datetime
    postmaster: datetime.datetime
    vxid: str | None = None  #: Transaction scope: the virtual transaction id.


def session_holder(cursor: Any) -> Holder:
    """Ask the lock's own session who it is (once per session: it never changes)."""
    cursor.execute(_SESSION_IDENTITY)
    return Holder(*cursor.fetchone())


def transaction_holder(cursor: Any, key: LockKey) -> Holder | None:
    """Ask the lock's connection, in its transaction, which one holds ``key`` (or None)."""
    cursor.execute(_TRANSACTION_IDENTITY, key_params(key))
    row = cursor.fetchone()
    return None if row is None else Holder(*row)


class OwnTable:
    """A table the library creates on first use, once per engine (fencing, lock_period,
    lock_enqueue); ``CREATE`` serialises itself (IF NOT EXISTS races itself)."""

    def __init__(self, what: str, exists: str, create: str, fix: str) -> None:
        self.what, self.exists, self.create, self.fix = what, exists, create, fix
        self._ready: weakref.WeakSet[sa.Engine] = weakref.WeakSet()
        self._guard = engines.fork_safe_lock()

    def ensure(self, engine: sa.Engine, bound: float | None = None) -> None:
        if engine in self._ready:
            return
        with self._guard:
            if engine in self._ready:
                return
            with (
                driver_errors.wrap_db_errors(f"set up the {self.what}", engine),
                engines.autocommit(engine) as dbapi,
                contextlib.nullcontext()
                if bound is None
                else deadlines.bounded(dbapi, bound),
                dbapi.cursor() as cursor,
            ):
                if not self.present(cursor):
                    try:
                        cursor.execute(self.create.format(schema=""))
                    except Exception as exc:
                        if driver_errors.sqlstate(exc) != INSUFFICIENT_PRIVILEGE:
                            raise
                        cursor.execute("ROLLBACK")  # autocommit: end the aborted BEGIN
                        raise exceptions.DatabaseError(
                            f"The {self.what} does not exist on "
                            f"{engines.engine_info(engine)['masked_url']} and this role "
                            f"may not create it; {self.fix}."
                        ) from exc
            self._ready.add(engine)

    def present(self, cursor: Any) -> bool:
        """Whether the table (and what it needs) exists, seen from ``cursor``."""
        cursor.execute(self.exists)
        return all(cursor.fetchone())

    def forget(self, engine: sa.Engine) -> None:
        """Check the table again at its next use (it was dropped, or its grant revoked)."""
        with self._guard:
            self._ready.discard(engine)


TABLE = OwnTable("fencing table celery_pglock_fencing", _EXISTS, CREATE, FIX)


def issue(engine: sa.Engine, key: LockKey, holder: Holder, bound: float) -> int | None:
    """``key``'s next token if ``holder`` holds it now, else None."""
    action = f"issue a fencing token for lock {key.name!r}"
    with (
        driver_errors.wrap_db_errors(action, engine),
        engines.autocommit(engine) as dbapi,
        deadlines.bounded(dbapi, bound),
        dbapi.cursor() as cursor,
    ):
        try:
            cursor.execute(_ISSUE, {**key_params(key), **dataclasses.asdict(holder)})
            sql_text.to_last_result(cursor)
            held, token = cursor.fetchone() or (False, None)
        except Exception as exc:
            code = driver_errors.sqlstate(exc)
            if code not in (UNDEFINED_TABLE, INSUFFICIENT_PRIVILEGE):
                raise
            TABLE.forget(engine)
            problem = (
                "does not exist (dropped since this process checked?)"
                if code == UNDEFINED_TABLE
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


def key_params(key: LockKey) -> dict[str, Any]:
    return dict(zip(("classid", "objid", "objsubid"), key.pg_locks_ids, strict=True))
