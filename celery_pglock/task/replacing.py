"""Latest wins (``lock_enqueue_on_duplicate='replace'``): a send takes its key's row from the
unstarted message queued there, and that message is told, durably, never to run its body.
Why each statement is shaped as it is: docs/guide/latest-wins.md ("How it works")."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from celery import states

from celery_pglock import exceptions, keys
from celery_pglock.config import OnDuplicate
from celery_pglock.db import driver_errors, engines, own_tables, sql_text
from celery_pglock.task import outcomes, queued, retries, runs

if TYPE_CHECKING:
    import sqlalchemy as sa

    from celery_pglock.lock import AdvisoryLock
    from celery_pglock.task.singleton_task import SingletonTask
    from celery_pglock.task.surface import LockedTask

logger = logging.getLogger(__name__)

#: A tombstone per replaced message. WAL-logged, unlike the queued rows: a crash must not
#: let replaced messages run (only replaces in the last moments before it are lost).
#: ``keep_until``: past the message's own stale_at by KEEP; once seen, SEEN_KEEP.
CREATE = """
BEGIN;
SELECT pg_advisory_xact_lock(hashtext('celery_pglock.replaced'));
CREATE TABLE IF NOT EXISTS {schema}celery_pglock_replaced (
  task_id text PRIMARY KEY, replaced_by text NOT NULL, task_name text NOT NULL,
  replaced_at timestamptz NOT NULL DEFAULT now(), seen_at timestamptz,
  keep_until timestamptz NOT NULL
);
CREATE INDEX IF NOT EXISTS celery_pglock_replaced_keep_until
  ON {schema}celery_pglock_replaced (keep_until);
COMMENT ON TABLE {schema}celery_pglock_replaced IS
  'celery-pglock lock_enqueue_on_duplicate=replace: messages replaced before they started';
COMMIT;
"""
DROP = "DROP TABLE IF EXISTS {schema}celery_pglock_replaced;\n"
GRANT = "GRANT SELECT, INSERT, UPDATE, DELETE ON {schema}celery_pglock_replaced TO {role};\n"
TABLE = own_tables.OwnTable(
    "lock_enqueue_on_duplicate table celery_pglock_replaced",
    "SELECT to_regclass('celery_pglock_replaced') IS NOT NULL",
    CREATE,
    queued.FIX,
)
KEEP = "1 day"  #: A tombstone outlives its message's stale_at by this much.
SEEN_KEEP = "2 hours"  #: Once its message was delivered: for a redelivery of it.

_ROW = "(q.classid, q.objid, q.objsubid) = (%(c)s::oid, %(o)s::oid, %(s)s::smallint)"
_STALE_AT = "now() + make_interval(secs => %(stale)s)"

#: queued.CLAIM's replacing form. The row is locked first (FOR UPDATE reads its latest
#: version), so racing senders replace one another in the database's order and each
#: replaced id names the send that came right after it. A retry (``force``) takes its own
#: row back, but yields to a newer unstarted message ('superseded').
CLAIM = f"""
WITH prev AS MATERIALIZED (
  SELECT q.task_id, q.started_at IS NULL AS unstarted, q.stale_at, q.run_objid
  FROM celery_pglock_queued q WHERE {_ROW} FOR UPDATE),
ins AS (
  INSERT INTO celery_pglock_queued AS q
    (classid, objid, objsubid, task_id, task_name, run_objid, mode, stale_at)
  SELECT %(c)s::oid, %(o)s::oid, %(s)s::smallint, %(id)s, %(name)s, %(run)s, %(mode)s,
         {_STALE_AT}
  WHERE NOT EXISTS (SELECT 1 FROM prev)
  ON CONFLICT (classid, objid, objsubid) DO NOTHING RETURNING q.task_id),
act AS MATERIALIZED (
  SELECT prev.task_id, prev.stale_at, CASE
    WHEN prev.task_id = %(id)s THEN 'own'
    WHEN prev.unstarted THEN CASE WHEN %(force)s THEN 'superseded' ELSE 'replaced' END
    WHEN %(force)s OR (prev.stale_at < now()
      AND pg_try_advisory_xact_lock({keys.RUN_NAMESPACE}, prev.run_objid)) THEN 'took_over'
    ELSE 'queued' END AS action
  FROM prev),
upd AS (
  UPDATE celery_pglock_queued q SET task_id = %(id)s, task_name = %(name)s,
    run_objid = %(run)s, mode = %(mode)s, published_at = now(), started_at = NULL,
    stale_at = {_STALE_AT}
  FROM act WHERE act.action IN ('own', 'replaced', 'took_over') AND {_ROW}
  RETURNING act.action, act.task_id, act.stale_at),
tomb AS (
  INSERT INTO celery_pglock_replaced AS t (task_id, replaced_by, task_name, keep_until)
  SELECT upd.task_id, %(id)s, %(name)s,
         greatest(upd.stale_at, now()) + interval '{KEEP}'
  FROM upd WHERE upd.action = 'replaced'
  ON CONFLICT (task_id) DO UPDATE SET replaced_by = excluded.replaced_by,
    replaced_at = now(), seen_at = NULL, keep_until = excluded.keep_until),
sync AS MATERIALIZED (SELECT set_config('synchronous_commit', 'off', true))
SELECT r.* FROM (
  SELECT 'new' AS outcome, task_id FROM ins
  UNION ALL SELECT action, task_id FROM upd
  UNION ALL SELECT action, task_id FROM act WHERE action IN ('superseded', 'queued')) r,
  sync
"""
CLAIM_NAME = sql_text.versioned("celery_pglock_replace", CLAIM)

#: At a run's start, after its grant (and its row's change) committed: was its message
#: replaced first? A new statement, so it sees a replace that won the row. It also drops
#: a few tombstones past keep_until, so the table keeps itself bounded.
CHECK = f"""
WITH seen AS (
  UPDATE celery_pglock_replaced SET seen_at = coalesce(seen_at, now()),
    keep_until = least(keep_until, now() + interval '{SEEN_KEEP}')
  WHERE task_id = %(id)s RETURNING replaced_by),
gone AS (
  DELETE FROM celery_pglock_replaced WHERE ctid = ANY(ARRAY(
    SELECT ctid FROM celery_pglock_replaced WHERE keep_until < now() AND task_id <> %(id)s
    LIMIT 8 FOR UPDATE SKIP LOCKED))),
sync AS MATERIALIZED (SELECT set_config('synchronous_commit', 'off', true))
SELECT (SELECT replaced_by FROM seen) FROM sync
"""
CHECK_NAME = sql_text.versioned("celery_pglock_replaced", CHECK)

#: A publish that failed after its claim replaced ``old``: ``old`` may run again.
_UNDO = (
    "DELETE FROM celery_pglock_replaced WHERE task_id = %(old)s "
    "AND replaced_by = %(id)s RETURNING seen_at IS NULL"
)
#: ``pglock why`` without pglock_history: the tombstone, while it is kept.
LOOKUP = (
    "SELECT replaced_by, extract(epoch FROM replaced_at)::float8, "
    "extract(epoch FROM seen_at)::float8 FROM celery_pglock_replaced WHERE task_id = %s"
)


def replaced_error(task_name: str, task_id: str, by: str) -> exceptions.TaskReplaced:
    return exceptions.TaskReplaced(
        f"{task_name}[{task_id}] was replaced by {by}, a later send of its key, before it "
        "started (lock_enqueue_on_duplicate='replace'); its body did not run.",
        replaced_by=by,
    )


def tell_replaced(task: LockedTask, task_id: str, by: str) -> None:
    """End ``task_id``'s result now: FAILURE with TaskReplaced, naming ``by``. Best effort:
    its message still ends so when it is delivered."""
    if task.ignore_result:
        return
    try:
        task.backend.store_result(
            task_id, replaced_error(task.name, task_id, by), states.FAILURE
        )
    except Exception:
        logger.warning(
            "%s: could not store that %s was replaced by %s; its message stores it "
            "when delivered",
            task.name,
            task_id,
            by,
            exc_info=True,
        )


def undo(
    engine: sa.Engine, key: keys.LockKey, task_id: str, old: str, bound: float
) -> None:
    """``task_id`` replaced ``old`` and was then not published: ``old`` runs after all
    (its key is freed, so a later send may queue one more message)."""
    try:
        with engines.autocommit_cursor(engine, bound) as cursor:
            cursor.execute(_UNDO, {"old": old, "id": task_id})
            row = cursor.fetchone()
    except Exception:
        row = (False,)
    if not (row and row[0]):
        logger.warning(
            "%s was replaced by %s, whose publish failed; %s may not run: send the key "
            "again",
            old,
            task_id,
            old,
        )
    queued.give_back(engine, key, task_id, bound)


def end_if_replaced(
    task: SingletonTask, lock: AdvisoryLock, task_id: str | None, direct: bool
) -> None:
    """At a granted run of a replacing task: raise TaskReplaced (the lock released, the
    skip reported) if a later send replaced its message before it started."""
    options = task.lock_config
    if task_id is None or options.enqueue_on_duplicate is not OnDuplicate.REPLACE:
        return
    if queued.row_of(lock) is None:  # not a worker's run of a checked message
        return
    try:
        by = _replaced_by(lock, task_id)
    except exceptions.DatabaseError as failed:
        runs.release_unrun(task, lock, task_id)  # nothing runs without the check
        retries.on_database_error(task, failed, direct=direct)
    if by is None:
        return
    runs.release_unrun(task, lock, task_id)
    error = replaced_error(task.name, task_id, by)
    details = {
        "reason": "replaced",
        "task": task.name,
        "lock": lock.key.name,
        "key": str(lock.key),
        "policy": "replaced",
        "replaced_by": by,
    }
    outcomes.skipped(
        task,
        task_id,
        lock,
        action="replaced",
        message=error.message,
        details=details,
        celery_logs=True,
    )
    raise error


def _replaced_by(lock: AdvisoryLock, task_id: str) -> str | None:
    engine = lock.engine
    TABLE.ensure(engine, lock.round_trip_timeout)
    action = f"check whether {task_id} was replaced (lock {lock.key.name!r})"

    def check(dbapi: Any, cursor: Any) -> tuple[Any, ...]:
        try:
            statement = sql_text.prepared(dbapi, cursor, CHECK_NAME, CHECK)
            cursor.execute(statement, {"id": task_id})
        except Exception as exc:
            if driver_errors.sqlstate(exc) == sql_text.UNDEFINED_TABLE:
                TABLE.forget(engine)
            raise
        return tuple(cursor.fetchone())

    with driver_errors.wrap_db_errors(action, engine):
        row = lock.on_holding_session(action, check)
        if row is None:
            with engines.autocommit_cursor(engine, lock.round_trip_timeout) as cursor:
                row = check(cursor.connection, cursor)
    return None if row[0] is None else str(row[0])


def lookup(engine: sa.Engine, task_id: str) -> tuple[str, float, float | None] | None:
    """``task_id``'s tombstone: (replaced by, when, when its message was seen), or None."""
    with engines.autocommit_cursor(engine) as cursor:
        if not TABLE.present(cursor):
            return None
        cursor.execute(LOOKUP, (task_id,))
        row = cursor.fetchone()
    return None if row is None else (str(row[0]), float(row[1]), row[2])
