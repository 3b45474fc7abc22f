"""Every SQL statement the lock sessions send, as named constants (and one cursor helper).

``%s`` parameters are bound on the client by either driver, so one execute may hold
several statements. Keyed statements are ``{1: <bigint form>, 2: <(int, int) form>}``,
key ids first. Each lock function is a scalar of a one-row SELECT: in a multi-row query
the planner may call it twice and leave a phantom re-entrant hold (GoodJob PR #1735).
"""

from __future__ import annotations

from typing import Any

_KEY = {1: "%s::bigint", 2: "%s::integer, %s::integer"}


def _keyed(statement: str) -> dict[int, str]:
    return {arity: statement.replace("KEY", key) for arity, key in _KEY.items()}


#: Take a session lock and label the session. Params: key ids, application_name. Returns
#: the new name, or NULL when busy.
TRY_LOCK_SESSION = _keyed(
    "SELECT CASE WHEN pg_try_advisory_lock(KEY) "
    "THEN set_config('application_name', %s, false) END"
)

#: Take a session lock, no relabel (the session shows the task already). Params: key ids.
TRY_LOCK_SESSION_BARE = _keyed("SELECT pg_try_advisory_lock(KEY)")

#: ``"<backend pid> <application_name>"`` of a key's holder, or NULL (pg_stat_get_activity
#: reads one backend: a third of the view's cost). Params: LockKey.pg_locks_ids.
_HOLDER_TEXT = (
    "SELECT l.pid::text || ' ' || coalesce("
    "(SELECT a.application_name FROM pg_stat_get_activity(l.pid) a), '') "
    "FROM pg_locks l WHERE l.locktype = 'advisory' "
    "AND l.database = (SELECT d.oid FROM pg_database d WHERE d.datname = current_database()) "
    "AND l.classid = %s::oid AND l.objid = %s::oid AND l.objsubid = %s::smallint "
    "AND l.granted LIMIT 1"
)

#: Wait for a session lock for at most lock_timeout; the transaction scopes the SET LOCALs
#: (the lock outlives it). statement_timeout is 0 meanwhile: lock_timeout is the wait's
#: bound (PostgreSQL 13+ times each statement of a string separately). Params: timeout in
#: ms, application_name, key ids. Raises 55P03 (lock_not_available) on timeout.
WAIT_LOCK_SESSION = _keyed(
    "BEGIN; SELECT set_config('lock_timeout', %s, true), "
    "set_config('statement_timeout', '0', true); "
    "SELECT set_config('application_name', %s, false), pg_advisory_lock(KEY); COMMIT"
)

#: Release a session lock and relabel the idle session. Params: key ids, the idle
#: application_name. Returns (unlocked, name).
UNLOCK_SESSION = _keyed(
    "SELECT pg_advisory_unlock(KEY), set_config('application_name', %s, false)"
)

#: Release a session lock on the process's session, which keeps its label (relabelling
#: per task doubled the server's CPU). Params: key ids. Returns unlocked.
UNLOCK_SESSION_KEEP_NAME = _keyed("SELECT pg_advisory_unlock(KEY)")

# The lock's transaction lasts as long as its body: neither a role's
# idle_in_transaction_session_timeout nor transaction_timeout (PostgreSQL 17+) may end it.
# Transaction-local, and an empty string (appended to the returned label).
_KEEP_TRANSACTION = (
    "left(set_config('idle_in_transaction_session_timeout', '0', true), 0) "
    "|| COALESCE(left(CASE WHEN current_setting('transaction_timeout', true) IS NOT NULL "
    "THEN set_config('transaction_timeout', '0', true) END, 0), '')"
)

#: Take a transaction lock in the open transaction, with a transaction-local label and
#: _KEEP_TRANSACTION. Params: key ids, application_name.
TRY_LOCK_TRANSACTION = _keyed(
    f"SELECT CASE WHEN pg_try_advisory_xact_lock(KEY) "
    "THEN set_config('application_name', %s, true) "
    f"|| {_KEEP_TRANSACTION} END"
)

#: Wait for a transaction lock as WAIT_LOCK_SESSION does, then restore both timeouts for
#: the body's statements; _KEEP_TRANSACTION as TRY_LOCK_TRANSACTION. Params: timeout in
#: ms, application_name, key ids.
WAIT_LOCK_TRANSACTION = _keyed(
    "SELECT set_config('celery_pglock.saved_lock_timeout', current_setting('lock_timeout'), true), "
    "set_config('celery_pglock.saved_statement_timeout', current_setting('statement_timeout'), true), "
    f"{_KEEP_TRANSACTION}; "
    "SELECT set_config('lock_timeout', %s, true), set_config('statement_timeout', '0', true); "
    f"SELECT set_config('application_name', %s, true), pg_advisory_xact_lock(KEY); "
    "SELECT set_config('lock_timeout', current_setting('celery_pglock.saved_lock_timeout'), true), "
    "set_config('statement_timeout', current_setting('celery_pglock.saved_statement_timeout'), true)"
)

ROLLBACK = (
    "ROLLBACK"  #: Ends the transaction a timed-out WAIT_LOCK_SESSION left aborted.
)

#: Pool check-in safety net: drop every session advisory lock. Params: the idle name.
UNLOCK_ALL = (
    "SELECT pg_advisory_unlock_all(), set_config('application_name', %s, false)"
)
DISCARD_ALL = "DISCARD ALL"  #: After a transaction-scope body: reset all it left.

#: Is the key granted to any session in this database? Params: LockKey.pg_locks_ids.
IS_LOCKED = (
    "SELECT EXISTS (SELECT 1 FROM pg_locks WHERE locktype = 'advisory' "
    "AND database = (SELECT oid FROM pg_database WHERE datname = current_database()) "
    "AND classid = %s::oid AND objid = %s::oid AND objsubid = %s::smallint AND granted)"
)

#: Who holds a key, for a skip: ``_HOLDER_TEXT`` as a one-row statement.
HOLDER = f"SELECT ({_HOLDER_TEXT})"

#: SQLSTATEs that mean "the lock was not granted in time", not "the database failed".
LOCK_NOT_AVAILABLE = "55P03"
QUERY_CANCELED = "57014"

#: The lock watcher's check: per held lock, in order, the session granted the key now
#: (NULL: nobody) and its application_name, whether the holder's backend exists, and the
#: server's identity (postmaster start, standby?). Params: classid, objid (oid[]),
#: objsubid (int2[]) per lock (LockKey.pg_locks_ids) and each holder's backend pid (int[]).
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
# An acks_late run also holds its task id's lock (keys.run_key, two ints), taken and
# released in the statements of its key: a redelivery finding the key busy tells its own
# first delivery (run lock held) from another run (task/busy_policy.py).

_RUN = "%s::integer, %s::integer"

#: TRY_LOCK_SESSION_BARE and the run lock. Params: key ids, run ids. Returns NULL when
#: busy, else whether the run lock was granted.
TRY_LOCK_SESSION_BARE_RUN = _keyed(
    f"SELECT CASE WHEN pg_try_advisory_lock(KEY) THEN pg_try_advisory_lock({_RUN}) END"
)

#: TRY_LOCK_SESSION and the run lock. Params: key ids, application_name, run ids. Returns
#: NULL when busy, else ARRAY[the new name, run lock granted].
TRY_LOCK_SESSION_RUN = _keyed(
    f"SELECT CASE WHEN pg_try_advisory_lock(KEY) "
    "THEN ARRAY[set_config('application_name', %s, false), "
    f"pg_try_advisory_lock({_RUN})::text] END"
)

#: TRY_LOCK_TRANSACTION and a transaction-level run lock. Same params and answer.
TRY_LOCK_TRANSACTION_RUN = _keyed(
    f"SELECT CASE WHEN pg_try_advisory_xact_lock(KEY) "
    "THEN ARRAY[set_config('application_name', %s, true) "
    f"|| {_KEEP_TRANSACTION}, "
    f"pg_try_advisory_xact_lock({_RUN})::text] END"
)

#: After a granted bounded wait: the run lock alone. Params: run ids.

RUN_LOCK_SESSION = f"SELECT pg_try_advisory_lock({_RUN})"
RUN_LOCK_TRANSACTION = f"SELECT pg_try_advisory_xact_lock({_RUN})"

#: UNLOCK_SESSION_KEEP_NAME and UNLOCK_SESSION with the run lock (its ids last).
UNLOCK_SESSION_KEEP_NAME_RUN = _keyed(
    f"SELECT pg_advisory_unlock(KEY), pg_advisory_unlock({_RUN})"
)
UNLOCK_SESSION_RUN = _keyed(
    f"SELECT pg_advisory_unlock(KEY), set_config('application_name', %s, false), "
    f"pg_advisory_unlock({_RUN})"
)

#: Is a run lock held by any session (try it; give it back)? Params: run ids twice.
RUN_ALIVE = (
    f"SELECT CASE WHEN pg_try_advisory_lock({_RUN}) "
    f"THEN NOT pg_advisory_unlock({_RUN}) ELSE true END"
)


def to_last_result(cursor: Any) -> None:
    """After a string of statements, make ``fetch*`` read the last one's result, as
    psycopg2 does; psycopg 3 starts at the first."""
    if type(cursor).__module__.partition(".")[0] == "psycopg":
        while cursor.nextset():
            pass
