"""Every SQL statement celery-pglock sends, as named constants.

Parameters are DBAPI ``%s`` placeholders filled by the driver (never string formatting of
user data), on the client with either driver (psycopg 3: ``db._bind_on_client``), so that
one execute may hold several statements. Statements that take a lock key exist in two forms, indexed by the key's arity:
``{1: <bigint form>, 2: <(int, int) form>}``; the key ids always come first.

Each lock function is called exactly once per statement, as a scalar in a single-row
SELECT: inside a multi-row query the planner may evaluate it more than once and leave a
phantom re-entrant hold that one unlock does not free (GoodJob PR #1735).
"""

from __future__ import annotations

_KEY = {1: "%s::bigint", 2: "%s::integer, %s::integer"}

#: Try to take a session lock; on success also label the session. Params: key ids, the
#: application_name to show while holding. Returns the new name, or NULL when busy.
TRY_LOCK_SESSION = {
    arity: f"SELECT CASE WHEN pg_try_advisory_lock({key}) "
    "THEN set_config('application_name', %s, false) END"
    for arity, key in _KEY.items()
}

#: Try to take a session lock without relabelling the session (the process's session
#: already shows the task's name). Params: key ids. Returns true when granted.
TRY_LOCK_SESSION_BARE = {
    arity: f"SELECT pg_try_advisory_lock({key})" for arity, key in _KEY.items()
}

#: The holder of a key as ``"<backend pid> <application_name>"`` (NULL: nobody holds it
#: now). pg_stat_get_activity(pid) reads one backend; joining the pg_stat_activity view
#: costs the server about three times as much. Params: classid, objid, objsubid as
#: unsigned OIDs (see LockKey.pg_locks_ids).
_HOLDER_TEXT = (
    "SELECT l.pid::text || ' ' || coalesce("
    "(SELECT a.application_name FROM pg_stat_get_activity(l.pid) a), '') "
    "FROM pg_locks l WHERE l.locktype = 'advisory' "
    "AND l.database = (SELECT d.oid FROM pg_database d WHERE d.datname = current_database()) "
    "AND l.classid = %s::oid AND l.objid = %s::oid AND l.objsubid = %s::smallint "
    "AND l.granted LIMIT 1"
)

#: Wait for a session lock for at most lock_timeout. The explicit transaction makes the
#: SET LOCALs end at COMMIT, so neither leaks onto the pooled connection; the session lock
#: itself outlives the transaction. statement_timeout is 0 for the wait (a role's or
#: database's statement_timeout would otherwise end it early, and lock_timeout is the
#: wait's bound; PostgreSQL 13+ times each statement of a query string separately, so
#: the setting applies to the statements after it). Params: timeout in ms,
#: application_name, key ids. Raises SQLSTATE 55P03 (lock_not_available) on timeout.
WAIT_LOCK_SESSION = {
    arity: "BEGIN; SELECT set_config('lock_timeout', %s, true), "
    "set_config('statement_timeout', '0', true); "
    f"SELECT set_config('application_name', %s, false), pg_advisory_lock({key}); COMMIT"
    for arity, key in _KEY.items()
}

#: Release a session lock and relabel the idle session in one round trip. Params: key ids,
#: the idle application_name. Returns (unlocked, name); unlocked is false if not held.
UNLOCK_SESSION = {
    arity: f"SELECT pg_advisory_unlock({key}), set_config('application_name', %s, false)"
    for arity, key in _KEY.items()
}

#: Release a session lock on the process's shared session, which keeps its label (the
#: holder is found through pg_locks; relabelling per task doubled the server's CPU per
#: task). Params: key ids. Returns unlocked.
UNLOCK_SESSION_KEEP_NAME = {
    arity: f"SELECT pg_advisory_unlock({key})" for arity, key in _KEY.items()
}

# The lock's transaction lasts as long as its body, idle between the body's statements:
# neither a role's idle_in_transaction_session_timeout nor its transaction_timeout
# (PostgreSQL 17+: set only where the server knows it) may end it. Transaction-local, and
# a string of length 0 (appended to the label the lock statement returns).
_KEEP_TRANSACTION = (
    "left(set_config('idle_in_transaction_session_timeout', '0', true), 0) "
    "|| COALESCE(left(CASE WHEN current_setting('transaction_timeout', true) IS NOT NULL "
    "THEN set_config('transaction_timeout', '0', true) END, 0), '')"
)

#: Try to take a transaction lock inside the caller's open transaction; the label is
#: transaction-local too, so COMMIT/ROLLBACK undo both, and so is _KEEP_TRANSACTION (the
#: body may still set its own bounds). Params: key ids, application_name.
TRY_LOCK_TRANSACTION = {
    arity: f"SELECT CASE WHEN pg_try_advisory_xact_lock({key}) "
    "THEN set_config('application_name', %s, true) "
    f"|| {_KEEP_TRANSACTION} END"
    for arity, key in _KEY.items()
}

#: Wait for a transaction lock for at most lock_timeout (statement_timeout 0 meanwhile,
#: as in WAIT_LOCK_SESSION), then put both back to what they were, so the task body's own
#: statements keep their bounds. idle_in_transaction_session_timeout = 0 for the rest of
#: the transaction (and transaction_timeout), as in TRY_LOCK_TRANSACTION. Params: timeout in ms, application_name,
#: key ids.
WAIT_LOCK_TRANSACTION = {
    arity: "SELECT set_config('celery_pglock.saved_lock_timeout', current_setting('lock_timeout'), true), "
    "set_config('celery_pglock.saved_statement_timeout', current_setting('statement_timeout'), true), "
    f"{_KEEP_TRANSACTION}; "
    "SELECT set_config('lock_timeout', %s, true), set_config('statement_timeout', '0', true); "
    f"SELECT set_config('application_name', %s, true), pg_advisory_xact_lock({key}); "
    "SELECT set_config('lock_timeout', current_setting('celery_pglock.saved_lock_timeout'), true), "
    "set_config('statement_timeout', current_setting('celery_pglock.saved_statement_timeout'), true)"
    for arity, key in _KEY.items()
}

#: Ends the server-side transaction a timed-out WAIT_LOCK_SESSION left aborted.
ROLLBACK = "ROLLBACK"

#: Pool check-in safety net: drop every session advisory lock of this session and stop
#: claiming to hold them. Params: the idle application_name.
UNLOCK_ALL = (
    "SELECT pg_advisory_unlock_all(), set_config('application_name', %s, false)"
)

#: After a transaction-scope run: the task body had the connection, so reset everything
#: it may have left on the session (settings, its own session advisory locks, temp
#: tables, prepared statements, LISTENs). application_name returns to its startup value.
DISCARD_ALL = "DISCARD ALL"

#: Is the key granted to any session in this database? Params: classid, objid, objsubid
#: as unsigned OIDs (see LockKey.pg_locks_ids).
IS_LOCKED = (
    "SELECT EXISTS (SELECT 1 FROM pg_locks WHERE locktype = 'advisory' "
    "AND database = (SELECT oid FROM pg_database WHERE datname = current_database()) "
    "AND classid = %s::oid AND objid = %s::oid AND objsubid = %s::smallint AND granted)"
)

#: Who holds a key, for a skip whose refusing statement did not say (per-lock sessions,
#: bounded waits): ``_HOLDER_TEXT`` as a one-row statement (celery-pglock sessions show
#: ``<prefix> <host>:<pid> [<key>] <task name>`` as their application_name).
HOLDER = f"SELECT ({_HOLDER_TEXT})"

#: SQLSTATEs that mean "the lock was not granted in time", not "the database failed".
LOCK_NOT_AVAILABLE = "55P03"
QUERY_CANCELED = "57014"

#: The lock watcher's one statement per check (see watch/loss_watcher.py), on its own session: one row
#: per held lock, in order, with the session the key is granted to now (NULL: nobody) and
#: its application_name, whether the holder's own backend still exists, and the server's
#: identity (postmaster start time; is it a standby?). Params: classid, objid (oid[]),
#: objsubid (int2[]) of each lock, as LockKey.pg_locks_ids gives them, and each holder's
#: backend pid (int[]). An exclusive advisory lock is granted to one session at most.
CHECK_HELD = (
    "SELECT w.i, l.pid, a.application_name, "
    "EXISTS (SELECT 1 FROM pg_stat_activity s WHERE s.pid = w.pid), "
    "pg_postmaster_start_time()::text, pg_is_in_recovery() "
    "FROM unnest(%s::oid[], %s::oid[], %s::int2[], %s::int[]) "
    "WITH ORDINALITY AS w(classid, objid, objsubid, pid, i) "
    "LEFT JOIN pg_locks l ON l.locktype = 'advisory' AND l.granted "
    "AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database()) "
    "AND l.classid = w.classid AND l.objid = w.objid AND l.objsubid = w.objsubid "
    "LEFT JOIN pg_stat_activity a ON a.pid = l.pid "
    "ORDER BY w.i"
)

# -- run locks ---------------------------------------------------------------------------
# An acks_late run also holds a lock keyed by its task id (keys.run_key), taken in the same
# statement as its key and released with it, so that a redelivery of that task which finds
# the key busy can tell its own first delivery (still running: the run lock is held) from
# another run (see task/busy_policy.py, _first_delivery_runs). Run keys are always in the two-int form.

_RUN = "%s::integer, %s::integer"

#: TRY_LOCK_SESSION_BARE that also takes the run lock when the key is granted. Params: key
#: ids, run ids. Returns NULL when busy, else whether the run lock was granted too.
TRY_LOCK_SESSION_BARE_RUN = {
    arity: f"SELECT CASE WHEN pg_try_advisory_lock({key}) "
    f"THEN pg_try_advisory_lock({_RUN}) END"
    for arity, key in _KEY.items()
}

#: TRY_LOCK_SESSION that also takes the run lock. Params: key ids, application_name, run
#: ids. Returns NULL when busy, else ARRAY[the new name, run lock granted].
TRY_LOCK_SESSION_RUN = {
    arity: f"SELECT CASE WHEN pg_try_advisory_lock({key}) "
    "THEN ARRAY[set_config('application_name', %s, false), "
    f"pg_try_advisory_lock({_RUN})::text] END"
    for arity, key in _KEY.items()
}

#: TRY_LOCK_TRANSACTION that also takes the run lock (transaction-level: it ends with the
#: transaction). Params: key ids, application_name, run ids. Returns NULL or an ARRAY.
TRY_LOCK_TRANSACTION_RUN = {
    arity: f"SELECT CASE WHEN pg_try_advisory_xact_lock({key}) "
    "THEN ARRAY[set_config('application_name', %s, true) "
    f"|| {_KEEP_TRANSACTION}, "
    f"pg_try_advisory_xact_lock({_RUN})::text] END"
    for arity, key in _KEY.items()
}

#: After a bounded wait was granted: the run lock alone. Params: run ids.
RUN_LOCK_SESSION = f"SELECT pg_try_advisory_lock({_RUN})"
RUN_LOCK_TRANSACTION = f"SELECT pg_try_advisory_xact_lock({_RUN})"

#: UNLOCK_SESSION_KEEP_NAME and UNLOCK_SESSION with the run lock. Params: key ids,
#: [the idle application_name,] run ids. Returns (unlocked, ...).
UNLOCK_SESSION_KEEP_NAME_RUN = {
    arity: f"SELECT pg_advisory_unlock({key}), pg_advisory_unlock({_RUN})"
    for arity, key in _KEY.items()
}
UNLOCK_SESSION_RUN = {
    arity: f"SELECT pg_advisory_unlock({key}), set_config('application_name', %s, false), "
    f"pg_advisory_unlock({_RUN})"
    for arity, key in _KEY.items()
}

#: Is a run lock held by any session? Tries it and, if granted, gives it back at once.
#: Params: run ids twice. Returns true when it is held (that run is alive).
RUN_ALIVE = (
    f"SELECT CASE WHEN pg_try_advisory_lock({_RUN}) "
    f"THEN NOT pg_advisory_unlock({_RUN}) ELSE true END"
)
