"""The queued rows' changes written later, batched off the caller's thread (db.row_writer):
publish confirmations, and the deletes of messages that never run. Why: docs/guide/enqueue.md
("How it works")."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from celery_pglock.db import row_writer, sql_text
from celery_pglock.task import queued

if TYPE_CHECKING:
    import sqlalchemy as sa

    from celery_pglock.task.surface import LockedTask

#: queued.DELETE_ONE for many (revoked, expired or rejected messages). Params: oid[], oid[], int2[], text[].
DELETE_MANY = """
WITH d AS MATERIALIZED (
  SELECT * FROM unnest(%s::oid[], %s::oid[], %s::int2[], %s::text[]) AS d(c, o, s, id)),
gone AS (
  DELETE FROM celery_pglock_queued q USING d
  WHERE (q.classid, q.objid, q.objsubid, q.task_id) = (d.c, d.o, d.s, d.id)
    AND q.carrier IS NULL RETURNING 1)
UPDATE celery_pglock_queued q SET stale_at = least(q.stale_at, now()) FROM d
WHERE (q.classid, q.objid, q.objsubid, q.carrier) = (d.c, d.o, d.s, d.id)"""

_MESSAGE = "coalesce(q.carrier, q.task_id)"  #: The key's message in the broker.
#: A confirmed publish: its unstarted row's real bound (``stale``: seconds past
#: published_at) replaces queued.PUBLISH_GRACE; a handed-over send's row drops the payload kept
#: for a publish again (task.replacing.HANDED). Only a row claimed at least ``age``
#: seconds ago: the publish's own, never a later claim of its id (a retry's, which has
#: its own bound). Params: oid[], oid[], int2[], text[], float8[], float8[].
CONFIRM_MANY = (
    "WITH s AS MATERIALIZED (SELECT set_config('synchronous_commit', 'off', true)) "
    "UPDATE celery_pglock_queued q "
    "SET stale_at = q.published_at + make_interval(secs => d.stale), "
    "payload = CASE WHEN q.carrier IS NULL THEN NULL ELSE q.payload END, "
    "payload_type = CASE WHEN q.carrier IS NULL THEN NULL ELSE q.payload_type END "
    "FROM s, unnest(%s::oid[], %s::oid[], %s::int2[], %s::text[], %s::float8[], "
    "%s::float8[]) AS d(c, o, s, id, stale, age) "
    f"WHERE (q.classid, q.objid, q.objsubid, {_MESSAGE}) = (d.c, d.o, d.s, d.id) "
    "AND q.started_at IS NULL "
    "AND q.published_at <= now() - make_interval(secs => d.age)"
)


#: (statement, the key's pg_locks ids, task id, seconds, time.monotonic() of the publish a
#: confirmation confirms, or 0.0): a row change to send later.
_Change = tuple[str, tuple[int, int, int], str, float, float]


def _write_rows(engine: sa.Engine, cursor: Any, batch: list[_Change]) -> None:
    # Array params per column: DELETE_MANY takes 4, CONFIRM_MANY all 6. Confirmations
    # first: a carrier freed in the same batch stays stale for the sweep.
    now = time.monotonic()
    for statement, width in ((CONFIRM_MANY, 6), (DELETE_MANY, 4)):
        rows = [
            (*row, i, n, now - at if at else 0.0)
            for sql, row, i, n, at in batch
            if sql == statement
        ]
        if rows:
            c, o, s, ids, stale, age = zip(*rows, strict=True)
            array = sql_text.array_literal
            params = [array(c), array(o), array(s), list(ids), array(stale), array(age)]
            cursor.execute(statement, params[:width])


#: Publish confirmations and deletes of unrun messages' rows, retried until the rows are
#: stale; unsent at exit, a confirmation frees its key for a second send after the grace.
QUEUED_ROWS = row_writer.Purpose(
    "queued",
    _write_rows,
    lambda batch: ", ".join(task_id for _, _, task_id, _, _ in batch),
    "each key frees itself once stale, or clear it with `celery pglock queued clear "
    f"<task id>` (an unconfirmed one after {queued.PUBLISH_GRACE:g}s)",
)


def free_later(task: LockedTask, row: tuple[int, int, int], task_id: str) -> None:
    """Queue the delete of ``task_id``'s row (a no-op if a newer message has the key)."""
    write_later(task, (DELETE_MANY, row, task_id, 0.0, 0.0))


def write_later(task: LockedTask, change: _Change) -> None:
    settings = task.lock_config
    writer_for(
        task.locks_engine(), settings.db_timeout, settings.enqueue_lost_after
    ).put(change)


def writer_for(
    engine: sa.Engine, bound: float, give_up_after: float
) -> row_writer.RowWriter[_Change]:
    return row_writer.writer_for(engine, QUEUED_ROWS, bound, give_up_after)


drain_writers = row_writer.drain_all  #: At exit, and where a test needs rows written.
