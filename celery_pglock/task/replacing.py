"""Latest wins (``lock_enqueue_on_duplicate='replace'``). A send to a key whose message is
queued writes its arguments into the key's row instead of publishing; the message in the
broker (the *carrier*) publishes the latest send when a worker takes it, and never runs a
body of its own. Why each statement is shaped as it is: docs/guide/latest-wins.md."""

from __future__ import annotations

import datetime
import logging
from typing import TYPE_CHECKING, Any

import celery
from celery import states
from celery.utils.time import maybe_iso8601
from kombu import serialization

from celery_pglock import exceptions, keys
from celery_pglock.db import driver_errors, engines, own_tables, sql_text
from celery_pglock.task import outcomes, queued, queued_writes, runs

if TYPE_CHECKING:
    import sqlalchemy as sa

    from celery_pglock.lock import AdvisoryLock
    from celery_pglock.task.surface import LockedTask

logger = logging.getLogger(__name__)

#: A tombstone per carrier that must never run: it handed over, or a send took its stale
#: row. WAL-logged, unlike the queued rows: a crash must not let such a message run.
#: ``keep_until``: KEEP past its writing; once its message was seen, SEEN_KEEP.
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
  'celery-pglock lock_enqueue_on_duplicate=replace: messages that must not run';
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
KEEP = "1 day"  #: How long a tombstone waits for its message.
SEEN_KEEP = "2 hours"  #: Once its message was delivered: for a redelivery of it.

_ROW, _STALE_AT = queued.ROW, queued.STALE_AT
#: A row's stale_at while its message's publish is unconfirmed.
PROVISIONAL = f"now() + make_interval(secs => {queued.PUBLISH_GRACE})"
#: Seconds until the row's latest send is due (lock_debounce), or NULL.
WAIT = "greatest(0, extract(epoch FROM q.due_at - now()))::float8"
#: lock_debounce: a batch's first send is due ``window`` after it; each later send pushes
#: that to ``window`` after itself, never past ``longest`` after the first (NULL: none).
_FIRST_DUE = "now() + make_interval(secs => %(window)s)"
_PUSHED_DUE = f"least({_FIRST_DUE}, q.first_at + make_interval(secs => %(longest)s))"
#: A carrier that must never run, told by whom (CLAIM, HAND_OVER, the sweep's).
TOMBSTONE = f"""
  INSERT INTO celery_pglock_replaced AS t (task_id, replaced_by, task_name, keep_until)
  SELECT {{carrier}}, {{by}}, {{name}}, now() + interval '{KEEP}' FROM {{source}}
  ON CONFLICT (task_id) DO UPDATE SET replaced_by = excluded.replaced_by,
    replaced_at = now(), seen_at = NULL, keep_until = excluded.keep_until"""
#: A row handed to its latest send ({source}.latest_run: its run key), whose message is
#: published next: provisional until that publish is confirmed (CLAIM, HAND_OVER, sweep).
#: It keeps the payload until then (queued_writes.CONFIRM_MANY clears it): a publisher killed or
#: failing meanwhile loses no send, the sweep publishes it again (replacing_sweep.py).
HANDED = f"""
  UPDATE celery_pglock_queued q SET carrier = NULL, run_objid = {{source}}.latest_run,
    latest_run = NULL, published_at = now(),
    stale_at = {PROVISIONAL}
  FROM {{source}} WHERE {{where}} RETURNING 1"""

#: A send's hot path, tried before CLAIM: a new key's row, or this send's arguments into
#: a fresh unstarted row it does not carry. ``previous``: the send it replaced (to tell).
#: No row back (a stale row, a retry, its own row, a row it is already in): CLAIM decides.
#: Half CLAIM's cost.
UPSERT = f"""
INSERT INTO celery_pglock_queued AS q
  (classid, objid, objsubid, task_id, task_name, run_objid, mode, stale_at, due_at,
   first_at)
VALUES (%(c)s::oid, %(o)s::oid, %(s)s::smallint, %(id)s, %(name)s, %(run)s, %(mode)s,
  {_STALE_AT}, {_FIRST_DUE}, now())
ON CONFLICT (classid, objid, objsubid) DO UPDATE SET task_id = %(id)s,
  task_name = %(name)s, latest_run = %(run)s, carrier = coalesce(q.carrier, q.task_id),
  previous = q.task_id, payload = %(payload)s, payload_type = %(payload_type)s,
  due_at = {_PUSHED_DUE}
WHERE q.started_at IS NULL AND q.stale_at >= now()
  AND coalesce(q.carrier, q.task_id) <> %(id)s AND q.task_id <> %(id)s
RETURNING CASE WHEN q.previous IS NULL THEN 'new' ELSE 'replaced' END,
  coalesce(q.previous, q.task_id)
"""
UPSERT_NAME = sql_text.versioned("celery_pglock_replace_first", UPSERT)

#: queued.CLAIM's replacing form. The row is locked first (FOR UPDATE reads its latest
#: version), so racing senders replace one another in the database's order. Actions:
#: 'replaced' (the hot path: this send's payload into the row, nothing published),
#: 'own' (its own row, reset and published: a retry's, or a stale one's; a fresh one
#: is 'queued', a duplicate of itself),
#: 'took_over' (publish this send; a stale carrier is tombstoned: its run lock
#: is free, so it has not started), 'hand_over' (a retry of the carrier: publish the
#: latest instead), 'superseded' (a retry yields to a newer send), 'queued' (running),
#: 'again' (this send is in the row already: its reply was lost, or its id sent again;
#: answered as 'replaced', naming the send it replaced).
CLAIM = f"""
WITH prev AS MATERIALIZED (
  SELECT q.task_id, coalesce(q.carrier, q.task_id) AS carrier,
    q.started_at IS NULL AS unstarted, q.stale_at, q.run_objid, q.latest_run,
    q.payload, q.payload_type, {WAIT} AS wait, q.previous
  FROM celery_pglock_queued q WHERE {_ROW} FOR UPDATE),
ins AS (
  INSERT INTO celery_pglock_queued AS q
    (classid, objid, objsubid, task_id, task_name, run_objid, mode, stale_at,
     due_at, first_at)
  SELECT %(c)s::oid, %(o)s::oid, %(s)s::smallint, %(id)s, %(name)s, %(run)s, %(mode)s,
         {_STALE_AT}, {_FIRST_DUE}, now()
  WHERE NOT EXISTS (SELECT 1 FROM prev)
  ON CONFLICT (classid, objid, objsubid) DO NOTHING RETURNING q.task_id),
act AS MATERIALIZED (
  SELECT prev.*, CASE
    WHEN prev.carrier = %(id)s THEN
      CASE WHEN prev.task_id <> %(id)s THEN 'hand_over'
        WHEN %(force)s OR prev.stale_at < now() THEN 'own' ELSE 'queued' END
    WHEN prev.task_id = %(id)s AND NOT %(force)s THEN 'again'
    WHEN %(force)s AND prev.unstarted AND (prev.stale_at >= now()
      OR prev.payload IS NOT NULL OR NOT pg_try_advisory_xact_lock({
    keys.RUN_NAMESPACE
}, prev.run_objid)) THEN 'superseded'
    WHEN %(force)s OR (prev.stale_at < now()
      AND pg_try_advisory_xact_lock({
    keys.RUN_NAMESPACE
}, prev.run_objid)) THEN 'took_over'
    WHEN prev.unstarted THEN 'replaced'
    ELSE 'queued' END AS action
  FROM prev),
put AS (
  UPDATE celery_pglock_queued q SET task_id = %(id)s, task_name = %(name)s,
    latest_run = %(run)s, carrier = act.carrier, previous = act.task_id,
    payload = %(payload)s,
    payload_type = %(payload_type)s, due_at = {_PUSHED_DUE}
  FROM act WHERE act.action = 'replaced' AND {_ROW} RETURNING 1),
took AS (
  UPDATE celery_pglock_queued q SET task_id = %(id)s, task_name = %(name)s,
    run_objid = %(run)s, mode = %(mode)s, carrier = NULL, latest_run = NULL,
    payload = NULL, payload_type = NULL, published_at = now(), started_at = NULL,
    stale_at = {_STALE_AT}, due_at = {_FIRST_DUE},
    first_at = CASE WHEN act.action = 'own' THEN q.first_at ELSE now() END
  FROM act WHERE act.action IN ('own', 'took_over') AND {_ROW} RETURNING 1),
handed AS ({HANDED.format(source="act", where=f"act.action = 'hand_over' AND {_ROW}")}),
tomb AS ({
    TOMBSTONE.format(
        carrier="act.carrier",
        by="CASE WHEN act.action = 'hand_over' THEN act.task_id ELSE %(id)s END",
        name="%(name)s",
        source="act WHERE act.action = 'hand_over' "
        "OR (act.action = 'took_over' AND act.unstarted AND act.carrier <> %(id)s)",
    )
}),
sync AS MATERIALIZED (SELECT set_config('synchronous_commit', 'off', true))
SELECT r.* FROM (
  SELECT 'new' AS outcome, task_id, NULL::bytea AS payload, NULL AS payload_type,
    NULL::float8 AS wait
  FROM ins
  UNION ALL SELECT CASE WHEN action = 'again' THEN 'replaced' ELSE action END,
    CASE WHEN action = 'again' THEN coalesce(previous, task_id) ELSE task_id END,
    CASE WHEN action = 'hand_over' THEN payload END,
    CASE WHEN action = 'hand_over' THEN payload_type END, wait FROM act
  WHERE action <> 'replaced' OR EXISTS (SELECT 1 FROM put)) r, sync
"""
CLAIM_NAME = sql_text.versioned("celery_pglock_replace", CLAIM)

#: After a run's grant (its row deleted if it was the latest send): if it carries a
#: later send, hand the row over to that send (its message, published next); else, was
#: it told never to run? Its run lock is held, so no send can take its row meanwhile. A
#: hand-over also drops a few tombstones past keep_until (each writes one): the table
#: keeps itself bounded, and a run that carries nothing pays nothing for it.
HAND_OVER = f"""
WITH prev AS MATERIALIZED (
  SELECT q.task_id, q.latest_run, q.payload, q.payload_type, {WAIT} AS wait
  FROM celery_pglock_queued q
  WHERE {_ROW} AND q.carrier = %(id)s AND q.started_at IS NULL FOR UPDATE),
handed AS ({HANDED.format(source="prev", where=_ROW)}),
tomb AS ({TOMBSTONE.format(carrier="%(id)s", by="prev.task_id", name="%(name)s", source="prev")}),
seen AS (
  UPDATE celery_pglock_replaced SET seen_at = coalesce(seen_at, now()),
    keep_until = least(keep_until, now() + interval '{SEEN_KEEP}')
  WHERE task_id = %(id)s AND NOT EXISTS (SELECT 1 FROM prev) RETURNING replaced_by),
gone AS (
  DELETE FROM celery_pglock_replaced WHERE ctid = ANY(ARRAY(
    SELECT ctid FROM celery_pglock_replaced WHERE keep_until < now() AND task_id <> %(id)s
    AND EXISTS (SELECT 1 FROM prev) ORDER BY keep_until LIMIT 8 FOR UPDATE SKIP LOCKED))),
sync AS MATERIALIZED (SELECT set_config('synchronous_commit', 'off', true))
SELECT r.* FROM (
  SELECT task_id, payload, payload_type, wait, NULL AS told FROM prev
  UNION ALL SELECT NULL, NULL, NULL, NULL, replaced_by FROM seen) r, sync
"""
HAND_OVER_NAME = sql_text.versioned("celery_pglock_hand_over", HAND_OVER)

#: ``pglock why`` without pglock_history: a carrier's tombstone, while it is kept.
LOOKUP = (
    "SELECT replaced_by, extract(epoch FROM replaced_at)::float8, "
    "extract(epoch FROM seen_at)::float8 FROM celery_pglock_replaced WHERE task_id = %s"
)
#: The publish options a replacing send keeps for its message (countdown: as an eta).
_KEPT = frozenset(
    (
        "exchange",
        "routing_key",
        "priority",
        "headers",
        "expires",
        "eta",
        "time_limit",
        "soft_time_limit",
        "ignore_result",
        "shadow",
    )
)


def pack(
    task: LockedTask, args: Any, kwargs: Any, options: dict[str, Any]
) -> dict[str, Any]:
    """A send's arguments and publish options, serialized by the task's serializer, as
    CLAIM's ``payload`` params (the row keeps them until its message is published), and
    its debounce params."""
    kept = {
        name: value
        for name, value in options.items()
        if name in _KEPT and value is not None
    }
    if options.get("countdown") is not None:
        kept["eta"] = float(options["countdown"])
    for name in ("eta", "expires"):
        when = kept.get(name)
        if isinstance(when, (int, float)):  # a countdown, or expires in seconds
            now = datetime.datetime.now(datetime.timezone.utc)
            when = now + datetime.timedelta(seconds=float(when))
        if isinstance(when, datetime.datetime):
            kept[name] = when.isoformat()
    queue = options.get("queue")
    if queue is not None:
        kept["queue"] = queue if isinstance(queue, str) else queue.name
    body = (list(args or ()), dict(kwargs or {}), kept)
    content_type, encoding, data = serialization.dumps(body, serializer=task.serializer)
    raw = data.encode(encoding) if isinstance(data, str) else data
    settings = task.lock_config
    return {
        "payload": raw,
        "payload_type": f"{content_type};{encoding}",
        "window": settings.debounce,
        "longest": settings.debounce_max,
    }


def publish_latest(
    task: LockedTask,
    key: keys.LockKey,
    task_id: str,
    payload: Any,
    payload_type: str,
    wait: float | None = None,
) -> None:
    """Publish the key's latest send ``task_id`` from its row's payload, as its own
    message (its row now names it: no check again), then confirm its row, batched, as a
    producer does."""
    content_type, encoding = payload_type.split(";", 1)
    args, kwargs, options = serialization.loads(bytes(payload), content_type, encoding)
    for name in ("eta", "expires"):
        if isinstance(options.get(name), str):
            options[name] = maybe_iso8601(options[name])
    if wait is not None:  # lock_debounce: when the row says it is due, not at its send
        options.pop("eta", None)
        options["countdown"] = wait
    headers = dict(options.pop("headers", None) or {})
    headers[queued.HEADER] = queued.header_of(key)
    celery.Task.apply_async(
        task,  # type: ignore[arg-type]
        args,
        kwargs,
        task_id,
        headers=headers,
        **options,
    )
    outcomes.enqueued(task, "handed_over", task_id, key)
    settings = task.lock_config
    stale = settings.enqueue_lost_after + (wait or 0.0)  # past its due time
    if isinstance(options.get("eta"), datetime.datetime):
        now = datetime.datetime.now(datetime.timezone.utc)
        stale += max(0.0, (options["eta"] - now).total_seconds())
    # Unconfirmed, its row frees itself in 10 s: a later send (or the sweep) takes it.
    change = (queued_writes.CONFIRM_MANY, key.pg_locks_ids, task_id, stale, 0.0)
    queued_writes.write_later(task, change)


def replaced_error(task_name: str, task_id: str, by: str) -> exceptions.TaskReplaced:
    return exceptions.TaskReplaced(
        f"{task_name}[{task_id}] was replaced by {by}, a later send of its key, before it "
        "started (lock_enqueue_on_duplicate='replace'); its body did not run.",
        replaced_by=by,
    )


def tell_replaced(task: LockedTask, task_id: str, by: str) -> None:
    """End ``task_id``'s result now: FAILURE with TaskReplaced, naming ``by``. Best effort:
    a carrier's message stores it again when delivered."""
    if task.ignore_result:
        return
    try:
        task.backend.store_result(
            task_id, replaced_error(task.name, task_id, by), states.FAILURE
        )
    except Exception:
        logger.warning(
            "%s: could not store that %s was replaced by %s",
            task.name,
            task_id,
            by,
            exc_info=True,
        )


def end_if_replaced(task: LockedTask, lock: AdvisoryLock, task_id: str | None) -> None:
    """At a granted run of a replacing task: if its message carries a later send, publish
    that send and raise TaskReplaced; the same if it was told never to run. The lock is
    released and the skip reported first; released too if the check fails (raised)."""
    row = queued.row_of(lock)
    if task_id is None or row is None or row.took_row:
        return  # not a checked message's run, or its grant took the key's row: its own
    try:
        latest, payload, payload_type, wait, told = _hand_over(lock, task_id, task.name)
    except (exceptions.DatabaseError, exceptions.LockLostError):
        runs.release_unrun(task, lock, task_id)  # nothing runs without the check
        raise
    by = latest or told
    if by is None:
        return
    runs.release_unrun(task, lock, task_id)
    if latest is not None:
        # Its row names it, provisionally: unpublished, a later send takes it in 10 s.
        publish_latest(task, lock.key, latest, payload, payload_type, wait)
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


def _hand_over(lock: AdvisoryLock, task_id: str, task_name: str) -> tuple[Any, ...]:
    engine = lock.engine
    TABLE.ensure(engine, lock.round_trip_timeout)
    action = f"check whether {task_id} carries a later send (lock {lock.key.name!r})"
    classid, objid, objsubid = lock.key.pg_locks_ids
    params = {"c": classid, "o": objid, "s": objsubid, "id": task_id, "name": task_name}

    def hand_over(dbapi: Any, cursor: Any) -> tuple[Any, ...]:
        # Nothing back may mean a sweep or a send handed this carrier's row over (or took
        # it) while the statement waited for the row: FOR UPDATE re-reads the row, but
        # the tombstone that transaction wrote is not in the statement's snapshot. So
        # once more, on a fresh snapshot (only a run that carries nothing pays it).
        for _ in range(2):
            try:
                statement = sql_text.prepared(dbapi, cursor, HAND_OVER_NAME, HAND_OVER)
                sql_text.run(cursor, *sql_text.inline(statement, params))
            except Exception as exc:
                if driver_errors.sqlstate(exc) == sql_text.UNDEFINED_TABLE:
                    TABLE.forget(engine)
                raise
            row = cursor.fetchone()
            if row is not None:
                return tuple(row)
        return (None, None, None, None, None)

    with driver_errors.wrap_db_errors(action, engine):
        row = lock.on_holding_session(action, hand_over)
        if row is None:
            with engines.autocommit_cursor(engine, lock.round_trip_timeout) as cursor:
                row = hand_over(cursor.connection, cursor)
    return row


def lookup(engine: sa.Engine, task_id: str) -> tuple[str, float, float | None] | None:
    """``task_id``'s tombstone: (replaced by, when, when its message was seen), or None."""
    with engines.autocommit_cursor(engine) as cursor:
        if not TABLE.present(cursor):
            return None
        cursor.execute(LOOKUP, (task_id,))
        row = cursor.fetchone()
    return None if row is None else (str(row[0]), float(row[1]), row[2])
