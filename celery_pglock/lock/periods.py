"""lock_period: one durable row per key, the last start; a start within the period is refused.
Sent only by the key's holder, so starts of a key are serialised. Why: docs/guide/period.md."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from celery_pglock import exceptions
from celery_pglock.db import deadlines, driver_errors, engines, sql_text
from celery_pglock.lock import fencing_tokens

if TYPE_CHECKING:
    import sqlalchemy as sa

    from celery_pglock.lock import AdvisoryLock

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

# (started, seconds left, last start's task id). A retry or redelivery (``again``) of the
# message that opened the period starts again and keeps its start while the period runs;
# the same task id sent anew is a new start. A start later than clock_timestamp()
# (not now(): a racing start may commit after this transaction began) means the server's
# clock went back: taken over rather than blocking the key for that long. The read sees
# the statement's snapshot, which may predate the start that refused this one. The INSERT
# reads ``bounded`` first, so its settings apply before the row lock is waited for: the
# server ends a wait on a locked row (a racing start, an operator's transaction) before
# the client cuts the socket, which on the process session would end every lock on it.
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
SELECT EXISTS (SELECT 1 FROM started),
  extract(epoch FROM p.started_at - clock_timestamp())::float8 + %(period)s, p.task_id
FROM bounded
LEFT JOIN celery_pglock_periods p ON p.classid = %(classid)s::oid
  AND p.objid = %(objid)s::oid AND p.objsubid = %(objsubid)s::smallint"""

FIX = (
    "create it once as its owner with `celery -A proj pglock sql --periods --apply` "
    "(or the SQL of `pglock sql --periods`), and grant the lock role "
    "SELECT, INSERT, UPDATE on celery_pglock_periods (docs/operations/security.md)"
)

START_NAME = sql_text.versioned("celery_pglock_period", _START)

TABLE = fencing_tokens.OwnTable(
    "lock_period table celery_pglock_periods",
    "SELECT to_regclass('celery_pglock_periods') IS NOT NULL",
    CREATE,
    FIX,
)


# A row whose period has passed decides nothing: the next start replaces it. Deleted in
# batches that skip rows a start has locked, so no start waits on the prune for long.
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
    with engines.autocommit(engine) as dbapi, dbapi.cursor() as cursor:
        if not TABLE.present(cursor):
            return None
        cursor.execute(_SUMMARY, (older_than,))
        rows, older, oldest, newest = cursor.fetchone()
    return Summary(int(rows), int(older), oldest, newest)


def prune(engine: sa.Engine, older_than: float, batch: int = PRUNE_BATCH) -> int | None:
    """Delete the rows started more than ``older_than`` seconds ago (at least the longest
    lock_period that uses the table, or periods reopen early): how many; None when the
    table does not exist."""
    with engines.autocommit(engine) as dbapi, dbapi.cursor() as cursor:
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
    recorded, else the Throttle. ``again``: a retry or redelivery of ``task_id``'s message
    (never the id alone: a reused id is a new message). One committed statement, on the lock's own session in
    session scope, else on a pooled connection. Slots of a key (lock_limit) share its row."""
    engine = lock.engine
    TABLE.ensure(engine)
    key = lock.slots[0]
    bound = lock.round_trip_timeout
    params = {
        **fencing_tokens.key_params(key),
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
                fencing_tokens.UNDEFINED_TABLE,
                fencing_tokens.INSUFFICIENT_PRIVILEGE,
            ):
                raise
            TABLE.forget(engine)
            raise exceptions.DatabaseError(
                f"Could not {action}: celery_pglock_periods is missing or not "
                f"writable by this role; {FIX}."
            ) from exc
        row: tuple[Any, ...] = cursor.fetchone()
        return row

    with driver_errors.wrap_db_errors(action, engine):
        row = lock.on_holding_session(action, record)
        if row is None:
            with (
                engines.autocommit(engine) as dbapi,
                deadlines.bounded(dbapi, bound),
                dbapi.cursor() as cursor,
            ):
                row = record(dbapi, cursor)
    started, left, last = row
    if started:
        return None
    if left is None or left <= 0:  # the refusing start is not in the snapshot
        return Throttle(period, None)  # the whole period: the safe bound
    return Throttle(left, last)
