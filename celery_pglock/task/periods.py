"""lock_rate (lock_period is its one-start case): one durable row per key, its last N
starts; a start while N are within the window is refused. Sent by a holder of the key (its
row lock serialises the slots of lock_limit). Why: docs/guide/period.md."""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING, Any

from celery_pglock import celery_compat, config, exceptions
from celery_pglock.db import driver_errors, engines, own_tables, sql_text
from celery_pglock.lock import identity
from celery_pglock.task import outcomes, retries, runs

if TYPE_CHECKING:
    import sqlalchemy as sa

    from celery_pglock.lock import AdvisoryLock
    from celery_pglock.task.singleton_task import SingletonTask

#: ``{schema}``: a quoted name and a dot, or "". Locked: IF NOT EXISTS races itself. The
#: ALTER brings a table made before lock_rate up to date (a constant default: no rewrite).
CREATE = """
BEGIN;
SELECT pg_advisory_xact_lock(hashtext('celery_pglock.periods'));
CREATE TABLE IF NOT EXISTS {schema}celery_pglock_periods (
  classid oid NOT NULL, objid oid NOT NULL, objsubid smallint NOT NULL,
  started_at timestamptz NOT NULL, task_id text,
  PRIMARY KEY (classid, objid, objsubid)
);
ALTER TABLE {schema}celery_pglock_periods
  ADD COLUMN IF NOT EXISTS earlier timestamptz[] NOT NULL DEFAULT '{{}}',
  ADD COLUMN IF NOT EXISTS earlier_ids text[] NOT NULL DEFAULT '{{}}';
COMMENT ON TABLE {schema}celery_pglock_periods IS
  'celery-pglock: the last starts per advisory key (pg_locks ids) of lock_rate and lock_period tasks';
COMMIT;
"""

DROP = "DROP TABLE IF EXISTS {schema}celery_pglock_periods;\n"

#: What a least-privilege lock role needs; ``{role}`` is a quoted role name.
GRANT = "GRANT SELECT, INSERT, UPDATE ON {schema}celery_pglock_periods TO {role};\n"

# (started, seconds left, task id of the start whose slot opens next); the rules:
# docs/guide/period.md. A row keeps its key's last ``starts`` starts: the latest in
# started_at/task_id, the ones before, oldest first, in earlier/earlier_ids. A start is
# refused while the starts-th latest is within the window; a retry or redelivery of a
# start still within it (``again``) runs without a new one. Not now(): a racing start
# may commit after this transaction began. The row is read only for a refusal (a one-time
# filter: a recorded start skips the scan), in the statement's snapshot, which may
# predate the refusing start (no row then). ``bounded`` first: the server's
# lock_timeout, not the client, ends a wait on a locked row.
_START = """
WITH bounded AS MATERIALIZED (
  SELECT set_config('synchronous_commit', 'on', true) AS durable,
         set_config('lock_timeout', %(lock_timeout)s, true) AS waits),
started AS (
  INSERT INTO celery_pglock_periods AS t (classid, objid, objsubid, started_at, task_id)
  SELECT %(classid)s::oid, %(objid)s::oid, %(objsubid)s::smallint, now(), %(task_id)s
  FROM bounded
  ON CONFLICT (classid, objid, objsubid) DO UPDATE
  SET (started_at, task_id, earlier, earlier_ids) = (
    SELECT CASE WHEN c.keep THEN t.started_at ELSE EXCLUDED.started_at END,
      CASE WHEN c.keep THEN t.task_id ELSE EXCLUDED.task_id END,
      CASE WHEN c.keep THEN t.earlier WHEN c.future THEN '{}'
        ELSE (t.earlier || t.started_at)[cardinality(t.earlier) + 3 - %(starts)s:] END,
      CASE WHEN c.keep THEN t.earlier_ids WHEN c.future THEN '{}'
        ELSE (t.earlier_ids || t.task_id)[cardinality(t.earlier) + 3 - %(starts)s:] END
    FROM (SELECT t.started_at > clock_timestamp() AS future,
      %(again)s AND t.started_at <= clock_timestamp() AND EXISTS (
        SELECT 1 FROM unnest(t.earlier || t.started_at, t.earlier_ids || t.task_id) u(at, id)
        WHERE u.id = EXCLUDED.task_id
          AND u.at > EXCLUDED.started_at - make_interval(secs => %(window)s)) AS keep) c)
  WHERE t.started_at > clock_timestamp()
     OR coalesce((t.earlier || t.started_at)[cardinality(t.earlier) + 2 - %(starts)s]
        <= EXCLUDED.started_at - make_interval(secs => %(window)s), true)
     OR (%(again)s AND EXISTS (
        SELECT 1 FROM unnest(t.earlier || t.started_at, t.earlier_ids || t.task_id) u(at, id)
        WHERE u.id = EXCLUDED.task_id
          AND u.at > EXCLUDED.started_at - make_interval(secs => %(window)s)))
  RETURNING 1)
SELECT true, NULL::float8, NULL::text FROM started
UNION ALL
SELECT false, extract(epoch FROM (p.earlier || p.started_at)[
    cardinality(p.earlier) + 2 - %(starts)s] - clock_timestamp())::float8 + %(window)s,
  (p.earlier_ids || p.task_id)[cardinality(p.earlier) + 2 - %(starts)s]
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
    # Made before lock_rate (no earlier_ids): CREATE's ALTER brings it up to date.
    """SELECT to_regclass('celery_pglock_periods') IS NOT NULL, EXISTS (
      SELECT 1 FROM pg_attribute WHERE attname = 'earlier_ids' AND NOT attisdropped
      AND attrelid = to_regclass('celery_pglock_periods'))""",
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
    """The table's rows and ages; None when it does not exist (no lock_rate start)."""
    with engines.autocommit_cursor(engine) as cursor:
        if not _table_exists(cursor):
            return None
        cursor.execute(_SUMMARY, (older_than,))
        rows, older, oldest, newest = cursor.fetchone()
    return Summary(int(rows), int(older), oldest, newest)


def prune(engine: sa.Engine, older_than: float, batch: int = PRUNE_BATCH) -> int | None:
    """Delete the rows started more than ``older_than`` seconds ago (at least the longest
    lock_period that uses the table, or periods reopen early): how many; None when the
    table does not exist."""
    with engines.autocommit_cursor(engine) as cursor:
        if not _table_exists(cursor):
            return None
        deleted = 0
        while True:  # ends: a row started now is never older_than > 0 old
            cursor.execute(_PRUNE, (older_than, batch))
            deleted += int(cursor.rowcount)
            if cursor.rowcount < batch:
                return deleted


def _table_exists(cursor: Any) -> bool:
    """Made, if perhaps before lock_rate: its started_at is all a summary or prune reads."""
    cursor.execute(TABLE.exists)
    return bool(cursor.fetchone()[0])


@dataclasses.dataclass(frozen=True, slots=True)
class Throttle:
    """A start refused: ``seconds_left`` until the key's window has a start free."""

    seconds_left: float
    #: The task id of the start whose slot opens next (lock_period: the last start).
    last_task_id: str | None


def start(
    lock: AdvisoryLock, task_id: str | None, rate: config.Rate, *, again: bool = False
) -> Throttle | None:
    """Record a start of ``lock``'s key (held) unless ``rate`` has none free: None if
    recorded, else the Throttle. ``again``: a retry or redelivery of ``task_id``'s message.
    Sent on the lock's own session in session scope, else on a pooled connection."""
    engine = lock.engine
    TABLE.ensure(engine)
    key = lock.slots[0]  # the slots of a key (lock_limit) share its row
    bound = lock.round_trip_timeout
    params = {
        **identity.key_params(key),
        "task_id": task_id,
        "window": rate.window,
        "starts": rate.starts,
        "again": again,
        "lock_timeout": f"{max(1, int(bound * 500))}ms",  # half the round trip's bound
    }
    action = f"record the start of lock {key.name!r} (lock_rate {rate})"

    def record(dbapi: Any, cursor: Any) -> tuple[Any, ...]:
        try:
            statement = sql_text.prepared(dbapi, cursor, START_NAME, _START)
            sql_text.run(cursor, *sql_text.inline(statement, params))
        except Exception as exc:
            if driver_errors.sqlstate(exc) not in (
                sql_text.UNDEFINED_TABLE,
                sql_text.UNDEFINED_COLUMN,
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

    def send() -> tuple[Any, ...]:
        row = lock.on_holding_session(action, record)
        if row is None:
            with engines.autocommit_cursor(engine, bound) as cursor:
                row = record(cursor.connection, cursor)
        return row

    with driver_errors.wrap_db_errors(action, engine):
        row = send()
        if not row[0] and (row[1] is None or row[1] <= 0):
            # Refused on now(), from before a wait on the row: the refusing start was
            # not in the snapshot, or the window has opened since. Once more decides.
            row = send()
    started, left, last = row
    if started:
        return None
    if left is None or left <= 0:  # the refusing start is not in the snapshot
        return Throttle(rate.window, None)  # the whole window: the safe bound
    return Throttle(left, last)


def start_run(
    task: SingletonTask,
    options: config.LockConfig,
    lock: AdvisoryLock,
    task_id: str | None,
    direct: bool,
) -> Throttle | None:
    """Record a run's start (its lock held); a refused one releases the lock, unless
    shadowed. Under 'wait', a start opening within lock_wait_timeout is waited for."""
    rate = options.rate or config.Rate(1, 0.0)  # set: only a lock_rate run comes here
    request = task.request
    # The same message going on (a retry, a redelivery), never a reused id sent anew.
    again = not direct and bool(request.retries or celery_compat.redelivered(request))
    try:
        throttle = start(lock, task_id, rate, again=again)
        if throttle and options.on_busy is config.OnBusy.WAIT and not options.shadow:
            began = time.monotonic()
            # One budget for both waits: the lock's, then the window's.
            deadline = began + options.wait_timeout - (lock.wait_seconds or 0.0)
            while throttle and throttle.seconds_left <= deadline - time.monotonic():
                time.sleep(throttle.seconds_left)
                throttle = start(lock, task_id, rate, again=again)
            lock.wait_seconds = (lock.wait_seconds or 0.0) + time.monotonic() - began
    except BaseException as error:
        runs.release_unrun(task, lock, task_id)  # nothing runs without the check
        if isinstance(error, exceptions.LockLostError):  # its session ended meanwhile
            outcomes.lost(task, task_id, lock, lock.lost_cause or "unknown")
        if isinstance(error, exceptions.DatabaseError):
            retries.on_database_error(task, error, direct=direct)
        raise
    if throttle is not None and not options.shadow:
        runs.release_unrun(task, lock, task_id)
    return throttle
