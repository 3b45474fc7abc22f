"""pglock_history: what became of each message of a SingletonTask (``pglock why``), kept for
a bounded time. Fed by the outcome signals, written off the run's thread (db.row_writer):
with the setting unset no receiver is connected and nothing is sent. docs/guide/why.md."""

from __future__ import annotations

import json
import logging
import time
from typing import TYPE_CHECKING, Any

from celery_pglock import config, exceptions, signals
from celery_pglock.config.options import seconds
from celery_pglock.db import engines, own_tables, row_writer

if TYPE_CHECKING:
    from collections.abc import Mapping

    import sqlalchemy as sa

logger = logging.getLogger(__name__)

SETTING = "pglock_history"  #: Seconds to keep a message's history; unset: none kept.

CREATE = """
BEGIN;
SELECT pg_advisory_xact_lock(hashtext('celery_pglock.history'));
CREATE TABLE IF NOT EXISTS {schema}celery_pglock_history (
  task_id text NOT NULL, at timestamptz NOT NULL, event text NOT NULL,
  detail jsonb NOT NULL
);
CREATE INDEX IF NOT EXISTS celery_pglock_history_task_id
  ON {schema}celery_pglock_history (task_id, at);
CREATE INDEX IF NOT EXISTS celery_pglock_history_at ON {schema}celery_pglock_history (at);
COMMENT ON TABLE {schema}celery_pglock_history IS
  'celery-pglock pglock_history: what became of each message, for pglock why';
COMMIT;
"""
DROP = "DROP TABLE IF EXISTS {schema}celery_pglock_history;\n"
GRANT = "GRANT SELECT, INSERT, DELETE ON {schema}celery_pglock_history TO {role};\n"
FIX = (
    "create it with `celery -A <app> pglock sql --history --apply` as a role that may, "
    "or GRANT this role what `pglock sql --history` prints"
)
TABLE = own_tables.OwnTable(
    "pglock_history table celery_pglock_history",
    "SELECT to_regclass('celery_pglock_history') IS NOT NULL",
    CREATE,
    FIX,
)
# Params: task ids, epoch seconds, events, JSON details (arrays, one row each).
_INSERT = (
    "WITH s AS MATERIALIZED (SELECT set_config('synchronous_commit', 'off', true)) "
    "INSERT INTO celery_pglock_history (task_id, at, event, detail) "
    "SELECT i, to_timestamp(a), e, d::jsonb FROM s, "
    "unnest(%s::text[], %s::float8[], %s::text[], %s::text[]) AS r(i, a, e, d)"
)
# In batches that skip rows another process's prune has locked.
_PRUNE = """
DELETE FROM celery_pglock_history WHERE ctid = ANY(ARRAY(
  SELECT ctid FROM celery_pglock_history WHERE at < now() - make_interval(secs => %s)
  LIMIT 1000 FOR UPDATE SKIP LOCKED))"""  # PRUNE_BATCH
#: ``pglock why``: one message's events, oldest first.
EVENTS = (
    "SELECT extract(epoch FROM at)::float8, event, detail FROM celery_pglock_history "
    "WHERE task_id = %s ORDER BY at, event"
)
PRUNE_EVERY = 60.0  #: Seconds between a process's prunes of the rows past retention.
PRUNE_FOR = 2.0  #: Longest a prune goes on, in batches of PRUNE_BATCH rows.
PRUNE_BATCH = 1000
#: Seconds a batch's round trip may take, and how long a failing batch is tried again.
WRITE_BOUND = 10.0

_Event = tuple[str, float, str, str]  # task id, epoch seconds, event, JSON detail


def retention(conf: Mapping[str, Any]) -> float | None:
    """``pglock_history`` in seconds, None when unset; ConfigurationError when invalid."""
    value = conf.get(SETTING)
    if value is None:
        return None
    try:
        return seconds(value)
    except ValueError as exc:
        raise exceptions.ConfigurationError(
            f"{SETTING}={value!r} is invalid; expected {exc}: how long to keep what "
            "became of each message (`pglock why`), such as 86400, or None to keep none."
        ) from None


def configure(conf: Mapping[str, Any]) -> None:
    """At task bind: with pglock_history set, connect the receivers (once)."""
    global _connected
    if retention(conf) is None or _connected:
        return
    for signal, receiver in _RECEIVERS.items():
        signal.connect(receiver, weak=False)
    _connected = True


_connected = False


def _record(sender: Any, task_id: str | None, event: str, **detail: Any) -> None:
    if task_id is None:  # a direct call: no message to tell of
        return
    try:
        keep = retention(sender.app.conf)
        if keep is None:  # another app of this process keeps history, not this one
            return
        engine = sender.locks_engine()
        _retention_of[engine] = keep
        detail = {k: v for k, v in detail.items() if v is not None}
        # jsonb refuses a NUL character (one in an error's text would lose the batch).
        text = json.dumps(detail, default=str).replace("\\u0000", "")
        writer = row_writer.writer_for(engine, EVENTS_ROWS, WRITE_BOUND, WRITE_BOUND)
        writer.put((task_id, time.time(), event, text))
    except Exception:  # history never fails a run
        logger.debug("pglock_history: could not record %s", event, exc_info=True)


def _enqueued(sender: Any = None, task_id: str | None = None, **kw: Any) -> None:
    by = engines.process_tag()
    outcome, owner, key = kw.get("outcome"), kw.get("queued_task_id"), kw.get("key")
    _record(sender, task_id, "sent", outcome=outcome, queued=owner, key=key, by=by)
    # The replaced message's own record says by whom; a latest-wins send taking a stale
    # row over drops the send waiting in it, as enqueue's tell_replaced says.
    options = getattr(sender, "lock_config", None)
    replacing = getattr(options, "enqueue_on_duplicate", None)
    took_over = outcome == "took_over" and replacing is config.OnDuplicate.REPLACE
    if (outcome == "replaced" or took_over) and owner not in (None, task_id):
        _record(sender, owner, "replaced", by_task=task_id, key=key, by=by)


def _started(sender: Any = None, task_id: str | None = None, **kw: Any) -> None:
    key, waited = kw.get("key"), kw.get("wait_seconds")
    _record(
        sender, task_id, "started", key=key, on=engines.process_tag(), waited=waited
    )


def _skipped(sender: Any = None, task_id: str | None = None, **kw: Any) -> None:
    details = dict(kw.get("details") or {})
    for name in ("task", "lock", "reason", "policy"):
        details.pop(name, None)
    _record(
        sender,
        task_id,
        "skipped",
        reason=kw.get("reason"),
        policy=kw.get("action"),
        shadow=kw.get("shadow") or None,
        waited=kw.get("wait_seconds"),
        **details,
    )


def _ended(sender: Any = None, task_id: str | None = None, **kw: Any) -> None:
    error = kw.get("exception")
    state, held = kw.get("state"), kw.get("held_seconds")
    error_text = None if error is None else f"{type(error).__name__}: {error}"[:500]
    _record(sender, task_id, "ended", state=state, held=held, error=error_text)


def _lost(sender: Any = None, task_id: str | None = None, **kw: Any) -> None:
    _record(sender, task_id, "lost", cause=kw.get("cause"))


_RECEIVERS = {
    signals.lock_enqueued: _enqueued,
    signals.lock_acquired: _started,
    signals.lock_skipped: _skipped,
    signals.lock_completed: _ended,
    signals.lock_failed: _ended,
    signals.lock_lost: _lost,
}


def _write_events(engine: sa.Engine, cursor: Any, batch: list[_Event]) -> None:
    TABLE.ensure(engine)
    cursor.execute(_INSERT, [list(column) for column in zip(*batch, strict=True)])
    if time.monotonic() - _pruned_at.get(engine, -PRUNE_EVERY) >= PRUNE_EVERY:
        _pruned_at[engine] = time.monotonic()
        stop = time.monotonic() + PRUNE_FOR  # several processes share the backlog
        while time.monotonic() < stop:
            cursor.execute(_PRUNE, (_retention_of.get(engine, 0.0),))
            if cursor.rowcount < PRUNE_BATCH:
                break


_pruned_at: dict[Any, float] = {}  #: engine -> when this process last pruned
_retention_of: dict[Any, float] = {}  #: engine -> its app's pglock_history
#: Best effort: a batch the database refuses for 10 s is dropped, never a run failed.
EVENTS_ROWS = row_writer.Purpose(
    "history",
    _write_events,
    lambda batch: f"{len({task_id for task_id, *_ in batch})} message(s)",
    "those events are lost (pglock why tells less of those messages)",
    kept=False,  # a failing history never closes the producer's claim connection
)


def events(
    engine: sa.Engine, task_id: str
) -> list[tuple[float, str, dict[str, Any]]] | None:
    """``task_id``'s events, oldest first; None when the table does not exist."""
    with engines.autocommit_cursor(engine) as cursor:
        if not TABLE.present(cursor):
            return None
        cursor.execute(EVENTS, (task_id,))
        return [(float(at), str(event), dict(detail)) for at, event, detail in cursor]
