"""Every SQL statement the lock sessions send; keyed ones are ``{1: bigint, 2: (int, int)}``
forms, key ids first. Why: docs/design.md ("Each lock function is a scalar ...")."""

from __future__ import annotations

import functools
import hashlib
import math
import re
import weakref
from typing import TYPE_CHECKING, Any

from celery_pglock.db import driver_errors

if TYPE_CHECKING:
    from collections.abc import Iterable

_KEY = {1: "%s::bigint", 2: "%s::integer, %s::integer"}


def _keyed(statement: str) -> dict[int, str]:
    return {arity: statement.replace("KEY", key) for arity, key in _KEY.items()}


#: Params: key ids, application_name. Returns the new name, or NULL when busy.
TRY_LOCK_SESSION = _keyed(
    "SELECT CASE WHEN pg_try_advisory_lock(KEY) "
    "THEN set_config('application_name', %s, false) END"
)

#: No relabel: the session shows the task already.
TRY_LOCK_SESSION_BARE = _keyed("SELECT pg_try_advisory_lock(KEY)")

#: ``"<pid> <application_name>"`` or NULL; pg_stat_get_activity(pid) costs a third of the view.
HOLDER = (
    "SELECT (SELECT l.pid::text || ' ' || coalesce("
    "(SELECT a.application_name FROM pg_stat_get_activity(l.pid) a), '') "
    "FROM pg_locks l WHERE l.locktype = 'advisory' "
    "AND l.database = (SELECT d.oid FROM pg_database d WHERE d.datname = current_database()) "
    "AND l.classid = %s::oid AND l.objid = %s::oid AND l.objsubid = %s::smallint "
    "AND l.granted LIMIT 1)"
)

#: The transaction scopes only the SET LOCALs; statement_timeout 0 leaves lock_timeout the
#: bound. Params: timeout in ms, application_name, key ids. 55P03 on timeout.
WAIT_LOCK_SESSION = _keyed(
    "BEGIN; SELECT set_config('lock_timeout', %s, true), "
    "set_config('statement_timeout', '0', true); "
    "SELECT set_config('application_name', %s, false), pg_advisory_lock(KEY); COMMIT"
)

#: Params: key ids, the idle application_name. Returns (unlocked, name).
UNLOCK_SESSION = _keyed(
    "SELECT pg_advisory_unlock(KEY), set_config('application_name', %s, false)"
)

#: The process session keeps its label (docs/design.md: labelled per task name).
UNLOCK_SESSION_KEEP_NAME = _keyed("SELECT pg_advisory_unlock(KEY)")

# No role timeout may end the body's transaction (transaction_timeout: 17+); yields "".
_KEEP_TRANSACTION = (
    "left(set_config('idle_in_transaction_session_timeout', '0', true), 0) "
    "|| COALESCE(left(CASE WHEN current_setting('transaction_timeout', true) IS NOT NULL "
    "THEN set_config('transaction_timeout', '0', true) END, 0), '')"
)

#: In the open transaction, label transaction-local. Params: key ids, application_name.
TRY_LOCK_TRANSACTION = _keyed(
    f"SELECT CASE WHEN pg_try_advisory_xact_lock(KEY) "
    "THEN set_config('application_name', %s, true) "
    f"|| {_KEEP_TRANSACTION} END"
)

#: As WAIT_LOCK_SESSION, then both timeouts restored for the body. Same params.
WAIT_LOCK_TRANSACTION = _keyed(
    "SELECT set_config('celery_pglock.saved_lock_timeout', current_setting('lock_timeout'), true), "
    "set_config('celery_pglock.saved_statement_timeout', current_setting('statement_timeout'), true), "
    f"{_KEEP_TRANSACTION}; "
    "SELECT set_config('lock_timeout', %s, true), set_config('statement_timeout', '0', true); "
    f"SELECT set_config('application_name', %s, true), pg_advisory_xact_lock(KEY); "
    "SELECT set_config('lock_timeout', current_setting('celery_pglock.saved_lock_timeout'), true), "
    "set_config('statement_timeout', current_setting('celery_pglock.saved_statement_timeout'), true)"
)

#: Ends the transaction a timed-out WAIT_LOCK_SESSION, or a refused CREATE, left aborted.
ROLLBACK = "ROLLBACK"

#: Pool check-in net. Params: the idle name.
UNLOCK_ALL = (
    "SELECT pg_advisory_unlock_all(), set_config('application_name', %s, false)"
)
DISCARD_ALL = "DISCARD ALL"  #: After a transaction-scope body: reset all it left.

#: Params: LockKey.pg_locks_ids.
IS_LOCKED = (
    "SELECT EXISTS (SELECT 1 FROM pg_locks WHERE locktype = 'advisory' "
    "AND database = (SELECT oid FROM pg_database WHERE datname = current_database()) "
    "AND classid = %s::oid AND objid = %s::oid AND objsubid = %s::smallint AND granted)"
)


@functools.cache  # one text per scope and form: at most 8, whatever the limit
def try_slots(*, transaction: bool, named: bool, run: bool) -> str:
    """A try-lock of the first free slot (slot_params), at most one: docs/guide/limits.md
    ("Slots"). No row when all are busy, else ARRAY[the slot's 1-based position in the
    arrays, application_name?, run lock granted?]."""
    lock = "pg_try_advisory_xact_lock" if transaction else "pg_try_advisory_lock"
    at = "[t.i + 1]"
    label = ""
    if named:
        local = str(transaction).lower()
        label = f", set_config('application_name', (%(names)s::text[])[t.i], {local})"
        label += f" || {_KEEP_TRANSACTION}" if transaction else ""
    run_lock = f", {lock}(%(r1)s::integer, %(r2)s::integer)::text" if run else ""
    return (
        "WITH RECURSIVE t(i, got) AS (SELECT 0, false UNION ALL "
        f"SELECT t.i + 1, CASE WHEN (%(pair)s::boolean[]){at} "
        f"THEN {lock}(((%(k1)s::bigint[]){at})::integer, (%(k2)s::integer[]){at}) "
        f"ELSE {lock}((%(k1)s::bigint[]){at}) END "
        "FROM t WHERE NOT t.got AND t.i < cardinality(%(k1)s::bigint[])) "
        f"SELECT ARRAY[t.i::text{label}{run_lock}] FROM t WHERE t.got"
    )


def slot_params(
    ids: list[tuple[int, ...]],
    names: list[str | None] | None,
    run_ids: tuple[int, ...] | None,
) -> dict[str, Any]:
    """try_slots' params: the slots' key ids in the order to try them (``k1``: a bigint key
    or an (int, int) key's first id, ``k2`` its second, ``pair`` which form), ``names``
    (application_name per slot, if named) and the run lock's ids (``r1``, ``r2``, if run).
    Each array is one literal (array_literal)."""
    params: dict[str, Any] = {
        "k1": array_literal(key[0] for key in ids),
        "k2": array_literal(key[1] if len(key) == 2 else 0 for key in ids),
        "pair": array_literal("t" if len(key) == 2 else "f" for key in ids),
    }
    if names is not None:
        params["names"] = names
    if run_ids is not None:
        params["r1"], params["r2"] = run_ids
    return params


DUPLICATE_PREPARED_STATEMENT = "42P05"  #: A PREPARE of a name the session has.
LOCK_NOT_AVAILABLE = "55P03"  #: "Not granted in time", not "the database failed".
QUERY_CANCELED = "57014"
#: A feature's table is missing, or the lock role may not use (or create) it.
UNDEFINED_TABLE, INSUFFICIENT_PRIVILEGE = "42P01", "42501"
UNDEFINED_COLUMN = "42703"  #: A feature's table made by an older version.

#: A key's pg_locks ids as named params (keys.LockKey.pg_locks_ids, lock.identity).
KEY_IS = (
    "classid = %(classid)s::oid AND objid = %(objid)s::oid "
    "AND objsubid = %(objsubid)s::smallint"
)
#: ``pg_locks l`` has the key granted, in this database.
GRANTED_KEY = f"""l.locktype = 'advisory' AND l.granted AND {KEY_IS}
  AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())"""
#: Who this session is, asked on the session itself: the pid libpq knows may be a pooler's.
SESSION_IDENTITY = """SELECT pg_backend_pid(),
  (SELECT backend_start FROM pg_stat_activity WHERE pid = pg_backend_pid()),
  pg_postmaster_start_time()"""
#: Who holds the key in this transaction: the session's identity and its virtual xid.
TRANSACTION_IDENTITY = f"""
SELECT l.pid, a.backend_start, pg_postmaster_start_time(), l.virtualtransaction
FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
WHERE {GRANTED_KEY} AND l.pid = pg_backend_pid() LIMIT 1"""

#: The watcher's check, per held lock: granted pid (or NULL), its name, holder alive, server
#: identity. Params: pg_locks_ids as oid[], oid[], int2[], and holder pids (int[]).
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

# Run locks (keys.run_key), in the key's statements: docs/design.md ("The acks_late run lock").
_RUN = "%s::integer, %s::integer"

#: Params: key ids, run ids. Returns NULL when busy, else the run lock granted.
TRY_LOCK_SESSION_BARE_RUN = _keyed(
    f"SELECT CASE WHEN pg_try_advisory_lock(KEY) THEN pg_try_advisory_lock({_RUN}) END"
)

#: Params: key ids, name, run ids. Returns NULL when busy, else ARRAY[name, run granted].
TRY_LOCK_SESSION_RUN = _keyed(
    f"SELECT CASE WHEN pg_try_advisory_lock(KEY) "
    "THEN ARRAY[set_config('application_name', %s, false), "
    f"pg_try_advisory_lock({_RUN})::text] END"
)

TRY_LOCK_TRANSACTION_RUN = _keyed(
    f"SELECT CASE WHEN pg_try_advisory_xact_lock(KEY) "
    "THEN ARRAY[set_config('application_name', %s, true) "
    f"|| {_KEEP_TRANSACTION}, "
    f"pg_try_advisory_xact_lock({_RUN})::text] END"
)

#: After a granted bounded wait. Params: run ids.
RUN_LOCK_SESSION = f"SELECT pg_try_advisory_lock({_RUN})"
RUN_LOCK_TRANSACTION = f"SELECT pg_try_advisory_xact_lock({_RUN})"
#: What a rider rides on after a wait granted the key with no run lock to take.
NOTHING = "SELECT false"


@functools.cache  # one text per form: at most 8, whatever the number of companions
def try_with_companion(*, arity: int, named: bool, run: bool) -> str:
    """A session try-lock of a key and, where granted, of the first free of its
    companions (bigint keys: lock_group's slots), in one statement. Params: key ids, the
    companions' ids (companion_array), application_name if ``named``, run ids if ``run``.
    NULL when the key is busy, else ARRAY[the companion's 1-based position, or 0 when
    none was free (the key is held all the same), name?, run lock granted?]."""
    label = ", set_config('application_name', %s, false)" if named else ""
    run_lock = f", pg_try_advisory_lock({_RUN})::text" if run else ""
    return (
        f"WITH RECURSIVE k(got) AS MATERIALIZED (SELECT pg_try_advisory_lock({_KEY[arity]})), "
        "c(k) AS MATERIALIZED (SELECT %s::bigint[]), "
        "t(i, got) AS (SELECT 0, false FROM k WHERE k.got UNION ALL "
        "SELECT t.i + 1, pg_try_advisory_lock(c.k[t.i + 1]) "
        "FROM t, c WHERE NOT t.got AND t.i < cardinality(c.k)) "
        "SELECT CASE WHEN k.got THEN ARRAY[coalesce((SELECT t.i FROM t WHERE t.got), 0)"
        f"::text{label}{run_lock}] END FROM k"
    )


def array_literal(items: Iterable[object]) -> str:
    """An array parameter as one literal of numbers or booleans ("t", "f"): psycopg2
    adapts a list item by item (benchmarks/README.md, lock_limit's slots)."""
    return "{" + ",".join(map(str, items)) + "}"


@functools.lru_cache(maxsize=64)  # a group's slots: the same tuple run after run
def companion_array(ids: tuple[tuple[int, ...], ...]) -> str:
    """try_with_companion's companions (bigint keys) as one array literal."""
    return array_literal(key[0] for key in ids)


@functools.cache
def unlock_with_companion(*, arity: int, run: bool) -> str:
    """The process session's unlock (its label kept) of a key, its run lock if ``run``
    and its (bigint) companion. Params: key ids, run ids?, the companion's id. Returns
    (unlocked, …)."""
    run_unlock = f", pg_advisory_unlock({_RUN})" if run else ""
    return (
        f"SELECT pg_advisory_unlock({_KEY[arity]}){run_unlock}, "
        f"pg_advisory_unlock({_KEY[1]})"
    )


#: The run lock's ids last.
UNLOCK_SESSION_KEEP_NAME_RUN = _keyed(
    f"SELECT pg_advisory_unlock(KEY), pg_advisory_unlock({_RUN})"
)
UNLOCK_SESSION_RUN = _keyed(
    f"SELECT pg_advisory_unlock(KEY), set_config('application_name', %s, false), "
    f"pg_advisory_unlock({_RUN})"
)

#: Held by any session? (Try it, give it back.) Params: run ids twice.
RUN_ALIVE = (
    f"SELECT CASE WHEN pg_try_advisory_lock({_RUN}) "
    f"THEN NOT pg_advisory_unlock({_RUN}) ELSE true END"
)


def run(cursor: Any, execute: str, params: Any) -> None:
    """Send an EXECUTE of :func:`prepared` (or :func:`inline`'s form of it); ``fetch*``
    then read the statement's result, not PLAN_GUARD's. Inside a transaction block
    (lock_scope='transaction') it goes without the guard: SET LOCAL would last through
    the task's own work in that transaction."""
    if execute.startswith(PLAN_GUARD):
        dbapi = cursor.connection
        if dbapi.autocommit and dbapi.info.transaction_status == _IDLE:
            cursor.execute(execute, params)
            to_last_result(cursor)
            return
        execute = execute[len(PLAN_GUARD) :]
    cursor.execute(execute, params)


def to_last_result(cursor: Any) -> None:
    """Make ``fetch*`` read the last statement's result, as psycopg2 does (psycopg 3: first)."""
    if type(cursor).__module__.partition(".")[0] == "psycopg":
        while cursor.nextset():
            pass


#: Sent before an EXECUTE of a statement on the library's tables, in its round trip and
#: transaction. A session keeps a statement's generic plan: made while the table was
#: nearly empty it scans the whole table, on every send, for as long as the session lives
#: (benchmarks/README.md, "A plan made while the table was empty").
PLAN_GUARD = "SET LOCAL enable_seqscan = off; "
_TABLE = re.compile(r"\bcelery_pglock_[a-z_]+")
_IDLE = 0  #: libpq's PQTRANS_IDLE, as both drivers' ``info.transaction_status`` say it
_PARAM = re.compile(r"%\((\w+)\)s|%s")
#: The statements prepared on each DBAPI connection's session, by name.
_prepared: weakref.WeakKeyDictionary[Any, set[str]] = weakref.WeakKeyDictionary()


@functools.lru_cache(maxsize=64)
def _prepare_and_execute(name: str, statement: str) -> tuple[str, str]:
    # $n per distinct param in order: a named one wherever it recurs, each %s once.
    params: dict[str | int, int] = {}
    body = _PARAM.sub(
        lambda m: f"${params.setdefault(m[1] or m.start(), len(params) + 1)}", statement
    )
    arguments = ", ".join("%s" if isinstance(p, int) else f"%({p})s" for p in params)
    guard = PLAN_GUARD if _TABLE.search(body) else ""
    return f"PREPARE {name} AS {body}", f"{guard}EXECUTE {name}({arguments})"


@functools.lru_cache(maxsize=64)
def name_for(statement: str) -> str:
    """A prepared statement's name derived from its text (``celery_pglock_s`` + a hash)."""
    digest = hashlib.sha1(statement.encode(), usedforsecurity=False).hexdigest()
    return "celery_pglock_s" + digest[:12]


@functools.lru_cache(maxsize=64)
def versioned(name: str, statement: str) -> str:
    """``name`` and a hash of ``statement``: a pooled server session that kept another
    version's statement of that name (no DISCARD ALL) never runs it with these params."""
    return f"{name}_{name_for(statement)[-8:]}"


@functools.lru_cache(maxsize=128)
def _arguments(execute: str) -> tuple[str, tuple[str | int, ...]] | None:
    """An EXECUTE of _prepare_and_execute as its head and its params' names (or
    positions), in order; None for any other text."""
    guard = PLAN_GUARD if execute.startswith(PLAN_GUARD) else ""
    head, _, arguments = execute[len(guard) :].partition("(")
    if not head.startswith("EXECUTE ") or not arguments.endswith(")"):
        return None
    found = _PARAM.findall(arguments[:-1])
    if ", ".join("%s" if not m else f"%({m})s" for m in found) != arguments[:-1]:
        return None
    return guard + head + "(", tuple(m or i for i, m in enumerate(found))


def _plain(text: str) -> bool:
    # No quote or backslash to escape; no % for the driver to read as a placeholder.
    return "'" not in text and "\\" not in text and "%" not in text


def inline(execute: str, params: Any) -> tuple[str, Any]:
    """``execute`` and ``params`` with the ints, finite floats, booleans, NULLs, bytea and
    plain text written into the text, the rest left as ``%s``: the driver adapts a param
    in about a microsecond, more than the statement's other client work
    (benchmarks/README.md, "Params written as literals")."""
    template = _arguments(execute) if params else None
    if template is None:
        return execute, params
    head, names = template
    written: list[str] = []
    rest: list[Any] = []
    for name in names:
        value = params[name]
        kind = type(value)
        if kind is int:
            written.append(str(value))
        elif value is None:
            written.append("NULL")
        elif kind is bool:
            written.append("true" if value else "false")
        elif kind is float and math.isfinite(value):
            written.append(repr(value))
        elif kind is str and value.isascii() and value.isprintable() and _plain(value):
            written.append(f"'{value}'")  # the driver's quoting of it, byte for byte
        elif kind is bytes:
            # Not '\x..'::bytea: standard_conforming_strings off reads its backslash.
            written.append(f"decode('{value.hex()}', 'hex')")
        else:
            written.append("%s")
            rest.append(value)
    return head + ", ".join(written) + ")", tuple(rest) if rest else None


def prepared(dbapi: Any, cursor: Any, name: str, statement: str) -> str:
    """``statement`` as an EXECUTE, prepared once per connection, to run with the same
    params on ``cursor``: both drivers bind on the client here (engines.py), so a
    statement sent as text would be planned again on every call."""
    prepare, execute = _prepare_and_execute(name, statement)
    done = _prepared.setdefault(dbapi, set())
    if name not in done:
        try:
            cursor.execute(prepare)
        except Exception as exc:
            # A pooler that hands over server sessions without DISCARD ALL: an earlier
            # client prepared it. The name is the text's hash, so it is this statement.
            # (Outside autocommit the error has aborted the transaction: raised.)
            duplicate = driver_errors.sqlstate(exc) == DUPLICATE_PREPARED_STATEMENT
            if not (duplicate and dbapi.autocommit):
                raise
        done.add(name)
    return execute


def forget_prepared(dbapi: Any) -> None:
    """The session was reset (DISCARD ALL): its prepared statements are gone."""
    _prepared.pop(dbapi, None)


# -- db/'s and watch/'s own statements: the server probe, session settings, the watcher.

#: The server probe's first look: who serves this connection, and what server it is.
PROBE_SERVER = (
    "SELECT pg_backend_pid(), current_setting('server_version'), "
    "current_setting('server_version_num')::int, pg_is_in_recovery(), "
    "inet_client_port()"
)
BACKEND_PID = "SELECT pg_backend_pid()"  #: Which backend serves this connection now.
#: A transaction's statements, one by one: a statement pooler drops the client at BEGIN.
BEGIN, SELECT_ONE, COMMIT = "BEGIN", "SELECT 1", "COMMIT"
SERVER_VERSION = "SHOW server_version"
#: Session settings by name and value; the join on pg_settings drops what the server
#: does not know. Params: text[], text[].
APPLY_SESSION_SETTINGS = (
    "SELECT count(set_config(s.name, w.value, false)) "
    "FROM unnest(%s::text[], %s::text[]) AS w(name, value) "
    "JOIN pg_settings s ON s.name = w.name"
)
#: The watcher's session: the server gives up too, so a slow check never lingers there.
SET_STATEMENT_TIMEOUT = "SELECT set_config('statement_timeout', %s, false)"
