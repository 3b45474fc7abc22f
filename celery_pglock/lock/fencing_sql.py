"""Every SQL statement of fencing tokens, as named constants (see celery_pglock.fencing).

Kept apart from ``db/sql_text.py`` so that fencing stays opt-in and self-contained. Parameters
are DBAPI ``%s`` placeholders filled by the driver; ``{schema}`` (operator SQL only) is a
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

#: Who a lock's session is, for the life of the session: (backend pid, backend_start,
#: pg_postmaster_start_time()). Together unique: a pid is reused only after its backend
#: ended, with a later backend_start; a restart or a failover changes the postmaster
#: start time. Asked once per session, on it (the pid libpq knows is a pooler's).
SESSION_IDENTITY = (
    "SELECT pg_backend_pid(), "
    "(SELECT backend_start FROM pg_stat_activity WHERE pid = pg_backend_pid()), "
    "pg_postmaster_start_time()"
)

# The holder pg_locks must show for the key: this database, granted, the session named
# by (pid, started, postmaster), and in transaction scope its transaction (vxid; NULL in
# session scope).
_HELD_BY = (
    "SELECT 1 FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid "
    "WHERE l.locktype = 'advisory' AND l.granted "
    "AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database()) "
    "AND l.classid = %(classid)s::oid AND l.objid = %(objid)s::oid "
    "AND l.objsubid = %(objsubid)s::smallint "
    "AND l.pid = %(pid)s AND a.backend_start = %(started)s "
    "AND pg_postmaster_start_time() = %(postmaster)s "
    "AND (%(vxid)s::text IS NULL OR l.virtualtransaction = %(vxid)s::text)"
)

#: Transaction scope, on the lock's connection inside the lock's transaction, before the
#: issue: the transaction holding the key (virtual transaction id) and its session's
#: identity (as SESSION_IDENTITY); no row if it does not hold the key. Params: classid,
#: objid, objsubid.
TRANSACTION_IDENTITY = (
    "SELECT l.virtualtransaction, l.pid, a.backend_start, pg_postmaster_start_time() "
    "FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid "
    "WHERE l.locktype = 'advisory' AND l.granted AND l.pid = pg_backend_pid() "
    "AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database()) "
    "AND l.classid = %(classid)s::oid AND l.objid = %(objid)s::oid "
    "AND l.objsubid = %(objsubid)s::smallint LIMIT 1"
)

#: Issue the next token for a key, on a pooled session in autocommit (one implicit
#: transaction), if and only if the holder named by (pid, started, postmaster[, vxid])
#: holds the key: create the key's row if missing, lock it, then check and take nextval.
#: The row lock comes before the check, so two issues for one key are serialised and
#: whichever checks second sees the holder of that moment (docs/guide/fencing.md has the
#: argument). synchronous_commit is on for this transaction: the token is on disk before
#: the client can read it. Params (dict): classid, objid, objsubid, pid, started,
#: postmaster, vxid. One row: (held, token); token NULL when not held, or when the
#: sequence is behind the row (someone reset it: refuse, never go back).
ISSUE = (
    "SELECT set_config('synchronous_commit', 'on', true); "
    "INSERT INTO celery_pglock_fencing (classid, objid, objsubid, token) "
    "SELECT %(classid)s::oid, %(objid)s::oid, %(objsubid)s::smallint, 0 "
    f"WHERE EXISTS ({_HELD_BY}) "
    "ON CONFLICT (classid, objid, objsubid) DO NOTHING; "
    "SELECT 1 FROM celery_pglock_fencing WHERE classid = %(classid)s::oid "
    "AND objid = %(objid)s::oid AND objsubid = %(objsubid)s::smallint FOR UPDATE; "
    f"WITH held AS (SELECT EXISTS ({_HELD_BY}) AS held), "
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
