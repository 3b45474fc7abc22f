"""lock_period: one durable row per key, the last start; a start within the period is refused.
Sent only by the key's holder, so starts of a key are serialised. Why: docs/guide/period.md."""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING, Any

from celery_pglock import celery_compat, config, exceptions
from celery_pglock.db import driver_errors, engines, own_tables, sql_text
from celery_pglock.lock import identity
from celery_pglock.task import retries, runs

if TYPE_CHECKING:
    import sqlalchemy as sa

    from celery_pglock.lock import AdvisoryLock
    from celery_pglock.task.singleton_task import SingletonTask

#: ``{schema}``: a quoted name and a dot, or "". Locked: IF NOT EXISTS races itself.
CREATE = """
BEGIN;
SELECT pg_advisory_xact_lock(hashtext('celery_pglock.periods'));
CREATE TABLE IF NOT EXISTS {schema}celery_pglock_periods (
  classid oid NOT NULL, objid oid NOT NULL, objsubid smallint NOT NULL,
  started_at timestamptz NOT NULL, task_id text,
  PRIMARY KEY (classid, objid, objsubid)
);
COMMENT ON TABLE {schema}celery_pglock_periods IS
  'celery-pglock: the last start per advisory key (pg_locks ids) of lock_period tasks';
COMMIT;
"""

DROP = "DROP TABLE IF EXISTS {schema}celery_pglock_periods;\n"

#: What a least-privilege lock role needs; ``{role}`` is a quoted role name.
GRANT = "GRANT SELECT, INSERT, UPDATE ON {schema}celery_pglock_periods TO {role};\n"

# (started, seconds left, last start's task id); the rules: docs/guide/period.md. Not
# now(): a racing start may commit after this transaction began. The row is read only for
# a refusal (a one-time filter: a recorded start skips the scan), in the statement's
# snapshot, which may predate the refusing start (no row then). ``bounded`` first: the
# server's lock_timeout, not the client, ends a wait on a locked row.
_START = """
WITH bounded AS MATERIALIZED (
  SELECT set_config('synchronous_commit', 'on', true) AS durable,
         set_config('lock_timeout', %(lock_timeout)s, true) AS waits),
started AS (
  INSERT INTO celery_pglock_periods AS t (classid, objid, objsubid, started_at, task_id)
  SELECT %(classid)s::oid, %(objid)s::oid, %(objsubid)s::smallint, now(), %(task_id)s
  FROM bounded
  ON CONFLICT (classid, objid, objsubid) DO UPDATE
  SET started_at = CASE WHEN %(again)s AND t.task_id = EXCLUDED.task_id
      AND t.started_at > EXCLUDED.started_at - make_interval(secs => %(period)s)
      AND t.started_at <= clock_timestamp() THEN t.started_at
      ELSE EXCLUDED.started_at END,
      task_id = EXCLUDED.task_id
  WHERE (%(again)s AND t.task_id = EXCLUDED.task_id)
     OR t.started_at <= EXCLUDED.started_at - make_interval(secs => %(period)s)
     OR t.started_at > clock_timestamp()
  RETURNING 1)
SELECT true, NULL::float8, NULL::text FROM started
UNION ALL
SELECT false,
  extract(epoch FROM p.started_at - clock_timestamp())::float8 + %(period)s, p.task_id
FROM celery_pglock_periods p WHERE NOT EXISTS (SELECT 1 FROM started)
  AND p.classid = %(classid)s::oid AND p.objid = %(objid)s::oid
  AND p.objsubid = %(objsubid)s::smallint"""

FIX = (
    "create it once as its owner with `celery -A proj pglock sql --periods --apply` "
    "(or the SQL of `pglock sql --periods`), and grant the lock role "
    "SELECT, INSERT, UPDATE on celery_pglock_periods (docs/operations/security.md)"
)

START_NAME = sql_text.versioned("celery_pglock_period", _START)

TABLE = own_tables.OwnTable(
    "lock_period table celery_pglock_periods",
    "SELECT to_regclass('celery_pglock_periods') IS NOT NULL",
    CREATE,
    FIX,
)


# In batches that skip rows a start has locked: no start waits on the prune for long.
_PRUNE = """
DELETE FROM celery_pglock_periods WHERE ctid = ANY(ARRAY(
  SELECT ctid FROM celery_pglock_periods
  WHERE started_at < now() - make_interval(secs => %s)
  LIMIT %s FOR UPDATE SKIP LOCKED))"""
_SUMMARY = """
SELECT count(*),
  count(*) FILTER (WHERE started_at < now() - make_interval(secs => %s)),
  extract(epoch FROM now() - min(started_at))::float8,
  extract(epoch FROM now() - max(started_at))::float8
FROM celery_pglock_periods"""
#: Rows per DELETE of :func:`prune`.
PRUNE_BATCH = 1000


@dataclasses.dataclass(frozen=True, slots=True)
class Summary:
    rows: int
    older: int  #: rows started more than the ``older_than`` asked about ago
    oldest_seconds: float | None
    newest_seconds: float | None


def summary(engine: sa.Engine, older_than: float | None) -> Summary | None:
    """The table's rows and ages; None when it does not exist (no lock_period start)."""
    with engines.autocommit_cursor(engine) as cursor:
        if not TABLE.present(cursor):
            return None
        cursor.execute(_SUMMARY, (older_than,))
        rows, older, oldest, newest = cursor.fetchone()
    return Summary(int(rows), int(older), oldest, newest)


def prune(engine: sa.Engine, older_than: float, batch: int = PRUNE_BATCH) -> int | None:
    """Delete the rows started more than ``older_than`` seconds ago (at least the longest
    lock_period that uses the table, or periods reopen early): how many; None when the
    table does not exist."""
    with engines.autocommit_cursor(engine) as cursor:
        if not TABLE.present(cursor):
            return None
        deleted = 0
        while True:  # ends: a row started now is never older_than > 0 old
            cursor.execute(_PRUNE, (older_than, batch))
            deleted += int(cursor.rowcount)
            if cursor.rowcount < batch:
                return deleted


@dataclasses.dataclass(frozen=True, slots=True)
class Throttle:
    """A start refused: the key's period has ``seconds_left`` to run."""

    seconds_left: float
    last_task_id: str | None  #: The task id of the start that opened the period.


def start(
    lock: AdvisoryLock, task_id: str | None, period: float, *, again: bool = False
) -> Throttle | None:
    """Record a start of ``lock``'s key (held) unless one is within ``period``: None if
    recorded, else the Throttle. ``again``: a retry or redelivery of ``task_id``'s message.
    Sent on the lock's own session in session scope, else on a pooled connection."""
    engine = lock.engine
    TABLE.ensure(engine)
    key = lock.slots[0]  # the slots of a key (lock_limit) share its row
    bound = lock.round_trip_timeout
    params = {
        **identity.key_params(key),
        "task_id": task_id,
        "period": period,
        "again": again,
        "lock_timeout": f"{max(1, int(bound * 500))}ms",  # half the round trip's bound
    }
    action = f"record the start of lock {key.name!r} (lock_period)"

    def record(dbapi: Any, cursor: Any) -> tuple[Any, ...]:
        try:
            statement = sql_text.prepared(dbapi, cursor, START_NAME, _START)
            cursor.execute(statement, params)
        except Exception as exc:
            if driver_errors.sqlstate(exc) not in (
                sql_text.UNDEFINED_TABLE,
                sql_text.INSUFFICIENT_PRIVILEGE,
            ):
                raise
            TABLE.forget(engine)
            raise exceptions.DatabaseError(
                f"Could not {action}: celery_pglock_periods is missing or not "
                f"writable by this role; {FIX}."
            ) from exc
        # No row at all: the refusing start is not in the statement's snapshot.
        return tuple(cursor.fetchone() or (False, None, None))

    with driver_errors.wrap_db_errors(action, engine):
        row = lock.on_holding_session(action, record)
        if row is None:
            with engines.autocommit_cursor(engine, bound) as cursor:
                row = record(cursor.connection, cursor)
    started, left, last = row
    if started:
        return None
    if left is None or left <= 0:  # the refusing start is not in the snapshot
        return Throttle(period, None)  # the whole period: the safe bound
    return Throttle(left, last)


def start_run(
    task: SingletonTask,
    options: config.LockConfig,
    lock: AdvisoryLock,
    task_id: str | None,
    direct: bool,
) -> Throttle | None:
    """Record a run's start (its lock held); a refused one releases the lock, unless
    shadowed. Under 'wait', a period ending within lock_wait_timeout is waited out."""
    period = options.period or 0.0  # set: only a lock_period task's run comes here
    request = task.request
    # The same message going on (a retry, a redelivery), never a reused id sent anew.
    again = not direct and bool(request.retries or celery_compat.redelivered(request))
    try:
        throttle = start(lock, task_id, period, again=again)
        if throttle and options.on_busy is config.OnBusy.WAIT and not options.shadow:
            began = time.monotonic()
            # One budget for both waits: the lock's, then the period's.
            deadline = began + options.wait_timeout - (lock.wait_seconds or 0.0)
            while throttle and throttle.seconds_left <= deadline - time.monotonic():
                time.sleep(throttle.seconds_left)
                throttle = start(lock, task_id, period, again=again)
            lock.wait_seconds = (lock.wait_seconds or 0.0) + time.monotonic() - began
    except BaseException as error:
        runs.release_unrun(task, lock, task_id)  # nothing runs without the check
        if isinstance(error, exceptions.DatabaseError):
            retries.on_database_error(task, error, direct=direct)
        raise
    if throttle is not None and not options.shadow:
        runs.release_unrun(task, lock, task_id)
    return throttle
