"""Every SQL statement of fencing tokens, as named constants (see celery_pglock.fencing).

Kept apart from ``_sql.py`` so that fencing stays opt-in and self-contained. Parameters
are DBAPI ``%s`` placeholders filled by psycopg2; ``{schema}`` (operator SQL only) is a
quoted identifier.

The table is keyed exactly as ``pg_locks`` keys an advisory lock, by ``(classid, objid,
objsubid)`` (``LockKey.pg_locks_ids``): a bigint key and a two-int key with the same bits
are different locks in PostgreSQL (objsubid 1 and 2), so they get different rows here, and
an operator can join the table with ``pg_locks`` as it is.

Tokens come from one sequence, not from ``token + 1`` on the row: ``nextval`` is never
rolled back, so a transaction-scope run that rolls back cannot have its token issued
again, and a sequence survives restarts (it may skip values after a crash; it never goes
back). ``CACHE 1`` matters: with a per-session cache, two sessions would hand out tokens
out of acquisition order.
"""

from __future__ import annotations

TABLE = "celery_pglock_fencing"
SEQUENCE = "celery_pglock_fencing_token_seq"

#: Creates the sequence and the table; ``{schema}`` is a quoted schema name followed by a
#: dot, or empty (the first schema of the search_path). Creators are serialised by a
#: transaction advisory lock, because ``CREATE ... IF NOT EXISTS`` still races with
#: itself (a unique violation on pg_type).
CREATE = """
BEGIN;
SELECT pg_advisory_xact_lock(hashtext('celery_pglock.fencing'));
CREATE SEQUENCE IF NOT EXISTS {schema}celery_pglock_fencing_token_seq
  AS bigint MINVALUE 1 CACHE 1 NO CYCLE;
CREATE TABLE IF NOT EXISTS {schema}celery_pglock_fencing (
  classid oid NOT NULL,
  objid oid NOT NULL,
  objsubid smallint NOT NULL,
  token bigint NOT NULL,
  issued_at timestamptz NOT NULL DEFAULT now(),
  PRIMARY KEY (classid, objid, objsubid)
);
COMMENT ON TABLE {schema}celery_pglock_fencing IS
  'celery-pglock: the last fencing token issued per advisory key (pg_locks ids)';
COMMIT;
"""

#: Removes what CREATE makes (the issued tokens are lost: never while workers run).
DROP = """
DROP TABLE IF EXISTS {schema}celery_pglock_fencing;
DROP SEQUENCE IF EXISTS {schema}celery_pglock_fencing_token_seq;
"""

#: What a least-privilege lock role needs. ``{role}`` is a quoted role name.
GRANT = """
GRANT SELECT, INSERT, UPDATE ON {schema}celery_pglock_fencing TO {role};
GRANT USAGE ON SEQUENCE {schema}celery_pglock_fencing_token_seq TO {role};
"""

#: Do the table and the sequence exist (on the search_path)? One row, two booleans.
EXISTS = (
    "SELECT to_regclass('celery_pglock_fencing') IS NOT NULL, "
    "to_regclass('celery_pglock_fencing_token_seq') IS NOT NULL"
)

#: Issue the next token for a key, in autocommit, while the lock is held (see
#: _fencing.py for which session). Params: classid, objid, objsubid (LockKey.pg_locks_ids).
#: Returns one row (token), or no row if the sequence is behind the row (someone reset
#: it: refuse, never go back). synchronous_commit is forced on for this one statement's
#: transaction, so the token is on disk before anyone can use it.
ISSUE = (
    "SELECT set_config('synchronous_commit', 'on', true); "
    "INSERT INTO celery_pglock_fencing AS f (classid, objid, objsubid, token) "
    "VALUES (%s::oid, %s::oid, %s::smallint, nextval('celery_pglock_fencing_token_seq')) "
    "ON CONFLICT (classid, objid, objsubid) "
    "DO UPDATE SET token = excluded.token, issued_at = now() "
    "WHERE f.token < excluded.token "
    "RETURNING f.token"
)

#: The last token issued for a key (None if none). Params: classid, objid, objsubid.
LAST = (
    "SELECT token FROM celery_pglock_fencing "
    "WHERE classid = %s::oid AND objid = %s::oid AND objsubid = %s::smallint"
)


#: SQLSTATEs that mean "the fencing table is not set up for this role".
UNDEFINED_TABLE = "42P01"
INSUFFICIENT_PRIVILEGE = "42501"
