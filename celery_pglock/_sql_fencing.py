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

# pg_locks rows of the key granted in this database (whose: each statement adds it).
_GRANTED = (
    "locktype = 'advisory' AND granted "
    "AND database = (SELECT oid FROM pg_database WHERE datname = current_database()) "
    "AND classid = %(classid)s::oid AND objid = %(objid)s::oid "
    "AND objsubid = %(objsubid)s::smallint"
)

#: Session scope, on the lock's own session (autocommit), right after the grant: issue
#: the next token for the key if, and only if, this very session holds it. Params (dict):
#: classid, objid, objsubid (LockKey.pg_locks_ids). One row: (held, token); token is NULL
#: when not held, or when the sequence is behind the row (someone reset it: refuse, never
#: go back). synchronous_commit is forced on for this one statement's transaction, so the
#: token is on disk before the client can read it. docs/guide/fencing.md has the argument.
ISSUE_ON_HOLDER = (
    "SELECT set_config('synchronous_commit', 'on', true); "
    "WITH held AS (SELECT EXISTS (SELECT 1 FROM pg_locks "
    f"WHERE {_GRANTED} AND pid = pg_backend_pid()) AS held), "
    "issued AS ("
    "INSERT INTO celery_pglock_fencing AS f (classid, objid, objsubid, token) "
    "SELECT %(classid)s::oid, %(objid)s::oid, %(objsubid)s::smallint, "
    "nextval('celery_pglock_fencing_token_seq') FROM held WHERE held.held "
    "ON CONFLICT (classid, objid, objsubid) "
    "DO UPDATE SET token = excluded.token, issued_at = now() "
    "WHERE f.token < excluded.token "
    "RETURNING f.token) "
    "SELECT held.held, (SELECT token FROM issued) FROM held"
)

#: Transaction scope, step 1, on the lock's connection inside the lock's transaction:
#: the virtual transaction id holding the key (NULL row: not held). A vxid is never
#: reused while its transaction lives, and a transaction never regains a lost lock.
HOLDING_TRANSACTION = (
    f"SELECT virtualtransaction FROM pg_locks WHERE {_GRANTED} "
    "AND pid = pg_backend_pid() LIMIT 1"
)

#: Transaction scope, step 2, on a second session in autocommit (one implicit
#: transaction): create the key's row if missing, lock it, then issue the next token if,
#: and only if, the transaction ``vxid`` still holds the key. The row lock is taken before
#: the check, so two issues for one key are serialised: whichever checks second sees the
#: holder of that moment. Params (dict): classid, objid, objsubid, vxid. One row: (held,
#: token) as for ISSUE_ON_HOLDER.
ISSUE_FOR_TRANSACTION = (
    "SELECT set_config('synchronous_commit', 'on', true); "
    "INSERT INTO celery_pglock_fencing (classid, objid, objsubid, token) "
    "SELECT %(classid)s::oid, %(objid)s::oid, %(objsubid)s::smallint, 0 "
    f"WHERE EXISTS (SELECT 1 FROM pg_locks WHERE {_GRANTED} "
    "AND virtualtransaction = %(vxid)s) "
    "ON CONFLICT (classid, objid, objsubid) DO NOTHING; "
    "SELECT 1 FROM celery_pglock_fencing WHERE classid = %(classid)s::oid "
    "AND objid = %(objid)s::oid AND objsubid = %(objsubid)s::smallint FOR UPDATE; "
    "WITH held AS (SELECT EXISTS (SELECT 1 FROM pg_locks "
    f"WHERE {_GRANTED} AND virtualtransaction = %(vxid)s) AS held), "
    "next AS (SELECT nextval('celery_pglock_fencing_token_seq') AS token "
    "FROM held WHERE held.held), "
    "issued AS (UPDATE celery_pglock_fencing AS f "
    "SET token = next.token, issued_at = now() FROM next "
    "WHERE f.classid = %(classid)s::oid AND f.objid = %(objid)s::oid "
    "AND f.objsubid = %(objsubid)s::smallint AND f.token < next.token "
    "RETURNING f.token) "
    "SELECT held.held, (SELECT token FROM issued) FROM held"
)

#: The last token issued for a key (None if none). Params: classid, objid, objsubid.
LAST = (
    "SELECT token FROM celery_pglock_fencing "
    "WHERE classid = %s::oid AND objid = %s::oid AND objsubid = %s::smallint"
)


#: SQLSTATEs that mean "the fencing table is not set up for this role".
UNDEFINED_TABLE = "42P01"
INSUFFICIENT_PRIVILEGE = "42501"
