"""The queued-keys table of ``lock_enqueue``: one row per key from publish to start or end.
Why each statement is shaped as it is: docs/guide/enqueue.md ("How it works")."""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import TYPE_CHECKING, Any

from celery_pglock import config, exceptions, keys
from celery_pglock.db import driver_errors, engines, own_tables, sql_text

if TYPE_CHECKING:
    import sqlalchemy as sa

    from celery_pglock.lock import AdvisoryLock
    from celery_pglock.task.surface import LockedTask

logger = logging.getLogger(__name__)

UNTIL_FINISHED, UNTIL_STARTED = "f", "s"  #: The ``mode`` column.
HEADER = "pglock_q"  #: Message header: ``"<classid>:<objid>:<objsubid>"`` of the row.

#: ``{schema}``: a quoted name and a dot, or "". Locked: IF NOT EXISTS races itself.
#: UNLOGGED: no WAL for its rows; a crash or a failover empties it (docs/guide/enqueue.md,
#: How it works). SET UNLOGGED converts a table an earlier version created. Committed
#: durably, whatever the server's synchronous_commit: a crash loses the rows, not the table.
CREATE = """
BEGIN;
SET LOCAL synchronous_commit = on;
SELECT pg_advisory_xact_lock(hashtext('celery_pglock.queued'));
CREATE UNLOGGED TABLE IF NOT EXISTS {schema}celery_pglock_queued (
  classid oid NOT NULL, objid oid NOT NULL, objsubid smallint NOT NULL,
  task_id text NOT NULL, task_name text NOT NULL,
  run_objid integer NOT NULL, mode "char" NOT NULL,
  published_at timestamptz NOT NULL DEFAULT now(), started_at timestamptz,
  stale_at timestamptz NOT NULL,
  PRIMARY KEY (classid, objid, objsubid)
) WITH (fillfactor = 80);
ALTER TABLE {schema}celery_pglock_queued SET UNLOGGED;
ALTER TABLE {schema}celery_pglock_queued
  ADD COLUMN IF NOT EXISTS carrier text, ADD COLUMN IF NOT EXISTS latest_run integer,
  ADD COLUMN IF NOT EXISTS payload bytea, ADD COLUMN IF NOT EXISTS payload_type text,
  ADD COLUMN IF NOT EXISTS due_at timestamptz, ADD COLUMN IF NOT EXISTS first_at timestamptz,
  ADD COLUMN IF NOT EXISTS previous text;
COMMENT ON TABLE {schema}celery_pglock_queued IS
  'celery-pglock lock_enqueue: the one message queued or running per advisory key';
COMMIT;
"""
DROP = "DROP TABLE IF EXISTS {schema}celery_pglock_queued;\n"
GRANT = (
    "GRANT SELECT, INSERT, UPDATE, DELETE ON {schema}celery_pglock_queued TO {role};\n"
)

ROW = "(q.classid, q.objid, q.objsubid) = (%(c)s::oid, %(o)s::oid, %(s)s::smallint)"
STALE_AT = "now() + make_interval(secs => %(stale)s)"  #: ``stale`` seconds from now

#: A new key's row (CLAIM's and FIRST's first CTE): nothing if the key has one.
_NEW_ROW = f"""ins AS (
  INSERT INTO celery_pglock_queued AS q
    (classid, objid, objsubid, task_id, task_name, run_objid, mode, stale_at)
  VALUES (%(c)s::oid, %(o)s::oid, %(s)s::smallint, %(id)s, %(name)s, %(run)s, %(mode)s,
          {STALE_AT})
  ON CONFLICT (classid, objid, objsubid) DO NOTHING RETURNING q.task_id)"""

#: Take the key's row or name its owner, in one statement (docs/guide/enqueue.md, How it
#: works; the run lock's probe is an xact lock). No row (or 'retry'): sent again.
CLAIM = f"""
WITH {_NEW_ROW},
old AS MATERIALIZED (
  SELECT q.task_id, %(force)s OR CASE WHEN q.stale_at < now()
    THEN pg_try_advisory_xact_lock_shared({keys.RUN_NAMESPACE}, q.run_objid) END AS free
  FROM celery_pglock_queued q WHERE {ROW} AND NOT EXISTS (SELECT 1 FROM ins)),
upd AS (
  UPDATE celery_pglock_queued q SET task_id = %(id)s, task_name = %(name)s,
    run_objid = %(run)s, mode = %(mode)s, published_at = now(), started_at = NULL,
    stale_at = {STALE_AT}
  FROM old WHERE old.free AND {ROW} AND q.task_id = old.task_id RETURNING old.task_id),
sync AS MATERIALIZED (SELECT set_config('synchronous_commit', 'off', true))
SELECT r.* FROM (
  SELECT 'new' AS outcome, task_id FROM ins
  UNION ALL SELECT 'took_over', task_id FROM upd
  UNION ALL SELECT CASE WHEN old.free THEN 'retry' ELSE 'queued' END, old.task_id FROM old
  WHERE NOT EXISTS (SELECT 1 FROM upd)) r, sync
"""

#: A send's hot path, tried before CLAIM: a new key's row, or the message of a row that
#: is fresh or whose run lock is held (CLAIM's probe). No row back (a stale row whose run
#: is gone, or one committed after this statement's snapshot): CLAIM decides. Fewer plan
#: nodes than CLAIM's: less server CPU per send (benchmarks/README.md, "A lean claim").
FIRST = f"""
WITH {_NEW_ROW},
sync AS MATERIALIZED (SELECT set_config('synchronous_commit', 'off', true))
SELECT r.* FROM (
  SELECT 'new' AS outcome, task_id FROM ins
  UNION ALL SELECT 'queued', q.task_id FROM celery_pglock_queued q
  WHERE {ROW} AND NOT EXISTS (SELECT 1 FROM ins) AND CASE WHEN q.stale_at >= now()
    THEN true ELSE NOT pg_try_advisory_xact_lock_shared({keys.RUN_NAMESPACE}, q.run_objid)
    END) r, sync
"""

#: Give back a key this message took, if it still has it (a failed publish, a skip). A
#: row it only carries a later send in (latest wins) is made stale instead, for the sweep.
DELETE_ONE = f"""
WITH gone AS (
  DELETE FROM celery_pglock_queued q
  WHERE {ROW} AND q.task_id = %(id)s AND q.carrier IS NULL RETURNING 1)
UPDATE celery_pglock_queued q SET stale_at = least(q.stale_at, now())
WHERE {ROW} AND q.carrier = %(id)s"""
#: Seconds a row stays provisional (docs/guide/enqueue.md, How it works).
PUBLISH_GRACE = 10.0


# Sent in the lock's own statements (a lock.rider.Rider); ``{granted}`` reads the lock's
# ``l.g``. Params after the lock's: [redeliver,] classid, objid, objsubid, id.
_MINE = (
    "(q.classid, q.objid, q.objsubid) = (%s::oid, %s::oid, %s::smallint) "
    "AND q.task_id = %s"
)
#: until_started: the run starts, so the next message of the key may be queued.
ON_START_STARTED = (
    f"DELETE FROM celery_pglock_queued q USING l WHERE {{granted}} AND {_MINE} "
    "RETURNING 1"
)
#: until_finished: stale once ``redeliver`` seconds pass with its run lock free.
ON_START_FINISHED = (
    "UPDATE celery_pglock_queued q SET started_at = now(), "
    "stale_at = now() + make_interval(secs => %s) "
    f"FROM l WHERE {{granted}} AND {_MINE} RETURNING 1"
)
#: until_finished: the run ended (sent with the unlock).
ON_END = f"DELETE FROM celery_pglock_queued q WHERE {_MINE} RETURNING 1"


@dataclasses.dataclass(slots=True)
class Queued:
    """What a run of a ``lock_enqueue`` message changes in its key's row: a
    ``lock.rider.Rider``, sent with the grant and the release."""

    mode: str  #: UNTIL_FINISHED or UNTIL_STARTED
    row: tuple[int, int, int]  #: The key's pg_locks ids.
    task_id: str
    #: until_finished: seconds a dead run's message may come back.
    redeliver: float = 0.0
    #: Whether the grant's statement changed the row of this message (None: not sent).
    #: until_started: it deleted the row it owned, so it carries no later send.
    took_row: bool | None = None
    #: until_started with lock_rate or lock_group: the grant leaves the row, deleted
    #: once those let the run start (start_deferred): a refused start keeps its key.
    deferred: bool = False

    def on_grant(self) -> tuple[str, tuple[Any, ...]] | None:
        if self.mode == UNTIL_STARTED:
            if self.deferred:
                return None
            return ON_START_STARTED, (*self.row, self.task_id)
        return ON_START_FINISHED, (self.redeliver, *self.row, self.task_id)

    def on_reply(self, changed: int) -> None:
        self.took_row = changed > 0

    def on_release(self) -> tuple[str, tuple[Any, ...]] | None:
        if self.mode == UNTIL_STARTED:
            return None
        return ON_END, (*self.row, self.task_id)


def rider_for(
    options: config.LockConfig, key: keys.LockKey, task_id: str, *, requeued: bool
) -> Queued:
    """The row changes of a run of ``task_id`` (``requeued``: a killed run's message
    comes back, and its key waits for it, lock_enqueue_lost_after)."""
    until_started = options.enqueue is config.Enqueue.UNTIL_STARTED
    return Queued(
        UNTIL_STARTED if until_started else UNTIL_FINISHED,
        key.pg_locks_ids,
        task_id,
        options.enqueue_lost_after if requeued else 0.0,
        deferred=until_started
        and options.enqueue_on_duplicate is not config.OnDuplicate.REPLACE
        and (options.rate is not None or options.group is not None),
    )


def start_deferred(task: LockedTask, lock: AdvisoryLock) -> None:
    """The run of a deferred until_started row (Queued.deferred) starts: free its key."""
    row = row_of(lock)
    if row is not None and row.deferred:
        give_back(
            task.locks_engine(), lock.key, row.task_id, task.lock_config.db_timeout
        )


def row_of(lock: AdvisoryLock | None) -> Queued | None:
    """``lock``'s queued row, if its rider is one (a lock_enqueue run)."""
    rider = None if lock is None else lock.rider
    return rider if isinstance(rider, Queued) else None


FIX = (
    "create it with `celery -A <app> pglock sql --enqueue --apply` as a role that may, "
    "or GRANT this role what `pglock sql --enqueue` prints"
)
TABLE = own_tables.OwnTable(
    "lock_enqueue table celery_pglock_queued",
    # Made, and with the columns latest wins added (CREATE adds them to an older one).
    "SELECT to_regclass('celery_pglock_queued') IS NOT NULL, EXISTS (SELECT 1 FROM "
    "pg_attribute WHERE attrelid = to_regclass('celery_pglock_queued') "
    "AND attname = 'previous' AND NOT attisdropped)",
    CREATE,
    FIX,
)


#: Sends of CLAIM before giving up on READ COMMITTED's snapshot race (measured: 2 at most).
CLAIM_TRIES = 5
CLAIM_NAME = sql_text.versioned("celery_pglock_claim", CLAIM)
FIRST_NAME = sql_text.versioned("celery_pglock_claim_first", FIRST)


def claim(
    engine: sa.Engine,
    *,
    key: keys.LockKey,
    task_id: str,
    task_name: str,
    mode: str,
    stale: float,
    bound: float,
    retry: bool = False,
    statement: tuple[str, str] = (CLAIM_NAME, CLAIM),
    more: dict[str, Any] | None = None,
    first: tuple[str, str] | None = None,
) -> tuple[Any, ...]:
    """Take ``key``'s row for ``task_id`` (always, for a ``retry``): ("new", id),
    ("took_over", the old owner's id) or ("queued", the owner's id). ``statement``: its
    name and text, CLAIM or a form of it taking these params and ``more``
    (task.replacing), whose row may have more columns; ``first``: a cheaper statement
    tried before it, whose row (if any) is the answer."""
    TABLE.ensure(engine, bound)
    params = {
        **_row_params(key, task_id),
        "name": task_name,
        "run": keys.run_key(task_id).ids[-1],
        "mode": mode,
        "stale": max(0.0, stale),
        "force": retry,
        **(more or {}),
    }
    began = time.monotonic()
    deadline = began + bound
    try:
        return engines.on_kept(
            engine, bound, lambda c: _claim(first, statement, params, key, c)
        )
    except Exception as exc:  # wrapped here only: a send that succeeds pays no wrapper
        what = f"check the queue of lock {key.name!r}"
        with driver_errors.wrap_db_errors(what, engine):
            # A connection the server closed meanwhile (a restart, an idle cut) fails
            # at once: one more try, on a fresh one. A frozen server used the bound.
            # A table dropped since this process checked it is created again first.
            dropped = driver_errors.sqlstate(exc) == sql_text.UNDEFINED_TABLE
            if not (dropped or driver_errors.is_disconnect(exc)) or (
                time.monotonic() >= deadline
            ):
                raise
            if dropped:
                logger.info("%s was dropped; creating it again for %s", TABLE.what, key)
                TABLE.forget(engine)
                TABLE.ensure(engine, bound)
            else:
                logger.info(
                    "Lock database connection was closed; checking %s again", key
                )
            row = engines.on_kept(
                engine, bound, lambda c: _claim(first, statement, params, key, c)
            )
            # The first try's, committed before its reply was lost: still to publish.
            # Not a queued message that has this (reused) id: claimed before this send.
            if (
                row[0] == "queued"
                and row[1] == task_id
                and _claimed_since(engine, bound, key, task_id, began)
            ):
                return ("own", *row[1:])
            return row


#: How long ago ``task_id``'s unstarted row of the key was claimed (seconds).
_CLAIM_AGE = (
    "SELECT extract(epoch FROM now() - q.published_at)::float8 "
    f"FROM celery_pglock_queued q WHERE {ROW} AND q.task_id = %(id)s "
    "AND q.started_at IS NULL"
)


def _claimed_since(
    engine: sa.Engine, bound: float, key: keys.LockKey, task_id: str, began: float
) -> bool:
    """Whether ``task_id``'s row of ``key`` was claimed after ``began`` (monotonic)."""

    def age(cursor: Any) -> float | None:
        cursor.execute(_CLAIM_AGE, _row_params(key, task_id))
        found = cursor.fetchone()
        return None if found is None else float(found[0])

    seconds = engines.on_kept(engine, bound, age)
    return seconds is not None and seconds <= time.monotonic() - began


def _claim(
    first: tuple[str, str] | None,
    statement: tuple[str, str],
    params: dict[str, Any],
    key: keys.LockKey,
    cursor: Any,
) -> tuple[Any, ...]:
    if first is not None:
        first_execute = sql_text.prepared(cursor.connection, cursor, *first)
        sql_text.run(cursor, *sql_text.inline(first_execute, params))
        row = cursor.fetchone()
        if row is not None:
            return tuple(row)
    execute = sql_text.inline(
        sql_text.prepared(cursor.connection, cursor, *statement), params
    )
    for _ in range(CLAIM_TRIES):
        sql_text.run(cursor, *execute)
        row = cursor.fetchone()
        if row is not None and row[0] != "retry":
            return tuple(row)
    raise exceptions.DatabaseError(
        f"Could not check the queue of lock {key.name!r} (key {key}): its row kept "
        f"changing under {CLAIM_TRIES} tries."
    )


def give_back(engine: sa.Engine, key: keys.LockKey, task_id: str, bound: float) -> None:
    """Delete ``task_id``'s row of ``key``, if it still has it; logs, never raises."""
    try:
        with engines.autocommit_cursor(engine, bound) as cursor:
            cursor.execute(DELETE_ONE, _row_params(key, task_id))
    except Exception:
        logger.warning(
            "Could not free the queued key %s of %s; `celery pglock queued clear %s` "
            "frees it, or it frees itself once stale",
            key,
            task_id,
            task_id,
            exc_info=True,
        )


def _row_params(key: keys.LockKey, task_id: str) -> dict[str, Any]:
    """``task_id``'s row of ``key`` as the params of ROW and ``%(id)s``."""
    classid, objid, objsubid = key.pg_locks_ids
    return {"c": classid, "o": objid, "s": objsubid, "id": task_id}


def parse_header(value: object) -> tuple[int, int, int] | None:
    if not isinstance(value, str):
        return None
    try:
        classid, objid, objsubid = (int(part) for part in value.split(":"))
    except ValueError:
        return None
    return classid, objid, objsubid


def header_of(key: keys.LockKey) -> str:
    return ":".join(str(part) for part in key.pg_locks_ids)


#: `pglock locks`, `pglock queued` and `pglock why`: the key as LockKey.__str__ writes
#: it; "running": its run lock is held by a session.
_ROWS = f"""
SELECT CASE WHEN q.objsubid = 1 THEN ((q.classid::bigint << 32) | q.objid::bigint)::text
       ELSE q.classid::bigint::bit(32)::int || ',' || q.objid::bigint::bit(32)::int
       END AS key,
  q.task_name, q.task_id, q.carrier,
  CASE q.mode WHEN 'f' THEN 'until_finished' ELSE 'until_started' END AS mode,
  r.pid AS run_pid, a.application_name,
  CASE WHEN r.pid IS NOT NULL THEN 'running' WHEN q.stale_at < now() THEN 'stale'
    WHEN q.started_at IS NOT NULL THEN 'started' ELSE 'queued' END AS state,
  q.started_at IS NOT NULL AS started,
  extract(epoch FROM now() - q.published_at)::float8 AS age_seconds,
  extract(epoch FROM q.stale_at - now())::float8 AS stale_in_seconds,
  extract(epoch FROM q.due_at - now())::float8 AS due_in_seconds
FROM celery_pglock_queued q
LEFT JOIN pg_locks r ON r.locktype = 'advisory' AND r.granted
  AND r.database = (SELECT oid FROM pg_database WHERE datname = current_database())
  AND r.classid = {keys.RUN_NAMESPACE} AND r.objid = q.run_objid::bit(32)::bigint::oid
  AND r.objsubid = 2
LEFT JOIN pg_stat_activity a ON a.pid = r.pid
"""
SUMMARY = f"{_ROWS}ORDER BY q.published_at"
#: The row naming a task id: as the key's message, or as the send its carrier carries.
ROW_NAMING = f"{_ROWS}WHERE q.task_id = %(id)s OR q.carrier = %(id)s"


def summary(
    engine: sa.Engine, task_id: str | None = None
) -> list[dict[str, Any]] | None:
    """The queued keys, oldest first (or the one naming ``task_id``); None when
    lock_enqueue never ran here (no table)."""
    with engines.autocommit_cursor(engine) as cursor:
        if not TABLE.present(cursor):
            return None
        if task_id is None:
            cursor.execute(SUMMARY)
        else:
            cursor.execute(ROW_NAMING, {"id": task_id})
        names = [column[0] for column in cursor.description]
        return [dict(zip(names, row, strict=True)) for row in cursor.fetchall()]


#: `pglock queued clear`: free the keys of these task ids. Params: text[].
CLEAR_BY_TASK_ID = (
    "DELETE FROM celery_pglock_queued WHERE task_id = ANY(%s) OR carrier = ANY(%s)"
)
