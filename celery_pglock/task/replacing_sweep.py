"""Latest wins' safety net: a key whose carrier will never be taken (its producer died
between its statement and its publish, or its publish failed) still runs its latest send,
and so does a send handed over whose own publish never came (its publisher was killed or
failed after the hand-over). Each worker's main process sweeps such rows every
SWEEP_EVERY seconds (docs/guide/latest-wins.md, "How it works")."""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Any

from celery.utils import uuid

from celery_pglock import keys
from celery_pglock.config import OnDuplicate
from celery_pglock.db import engines
from celery_pglock.task import queued, replacing

if TYPE_CHECKING:
    import sqlalchemy as sa

logger = logging.getLogger(__name__)

SWEEP_EVERY = queued.PUBLISH_GRACE / 2  #: A stuck key waits at most grace + this.
_BATCH = 20
_FREE_ROW = (
    "(q.classid, q.objid, q.objsubid) = (free.classid, free.objid, free.objsubid)"
)

#: Rows whose latest send waits behind a carrier that is past its bound and not running
#: (its run lock is free): hand each over, as its carrier would, and tombstone the carrier
#: (taken late, it runs nothing). Rows handed over whose publish was never confirmed (no
#: carrier, the payload still there) are returned too, for REISSUE. SKIP LOCKED: several
#: workers sweep apart.
SWEEP = f"""
WITH stuck AS MATERIALIZED (
  SELECT q.classid, q.objid, q.objsubid, q.task_id, q.task_name, q.carrier, q.run_objid,
    q.latest_run, q.payload, q.payload_type, {replacing.WAIT} AS wait
  FROM celery_pglock_queued q
  WHERE (q.carrier IS NOT NULL OR q.payload IS NOT NULL) AND q.started_at IS NULL
    AND q.stale_at < now() AND q.task_name = ANY(%(names)s)
  LIMIT {_BATCH} FOR UPDATE SKIP LOCKED),
free AS MATERIALIZED (
  SELECT * FROM stuck
  WHERE pg_try_advisory_xact_lock({keys.RUN_NAMESPACE}, stuck.run_objid)),
handed AS ({
    replacing.HANDED.format(
        source="free", where=f"free.carrier IS NOT NULL AND {_FREE_ROW}"
    )
}),
tomb AS ({
    replacing.TOMBSTONE.format(
        carrier="carrier",
        by="task_id",
        name="task_name",
        source="free WHERE free.carrier IS NOT NULL",
    )
})
SELECT classid, objid, objsubid, task_id, task_name, carrier, payload, payload_type, wait
FROM free
"""

#: A handed-over send whose publish never came, again under a new id: its first message
#: may be in the broker after all (published, then its publisher died before confirming
#: it), so that one gets a tombstone naming the new id, and one of them runs.
REISSUE = f"""
WITH old AS MATERIALIZED (
  SELECT q.task_id FROM celery_pglock_queued q
  WHERE {queued.ROW} AND q.task_id = %(old)s AND q.carrier IS NULL
    AND q.payload IS NOT NULL AND q.started_at IS NULL AND q.stale_at < now()
    AND pg_try_advisory_xact_lock({keys.RUN_NAMESPACE}, q.run_objid)
  FOR UPDATE),
renamed AS (
  UPDATE celery_pglock_queued q SET task_id = %(id)s, run_objid = %(run)s,
    published_at = now(), stale_at = {replacing.PROVISIONAL}
  FROM old WHERE {queued.ROW} RETURNING 1),
tomb AS ({
    replacing.TOMBSTONE.format(
        carrier="old.task_id", by="%(id)s", name="%(name)s", source="old"
    )
})
SELECT count(*) FROM old
"""


def sweep(app: Any) -> int:
    """One sweep of ``app``'s replacing tasks' rows: how many latest sends it published."""
    tasks = _replacing(app)
    if not tasks:
        return 0
    by_engine: dict[sa.Engine, list[Any]] = {}
    for task in tasks.values():
        by_engine.setdefault(task.locks_engine(), []).append(task)
    published = 0
    for engine, mine in by_engine.items():
        replacing.TABLE.ensure(engine)
        with engines.autocommit_cursor(engine) as cursor:
            cursor.execute(SWEEP, {"names": [task.name for task in mine]})
            rows = cursor.fetchall()
        for c, o, s, latest, name, carrier, payload, payload_type, wait in rows:
            task = tasks[name]
            key = keys.LockKey.from_pg_locks(task.lock_config.name, c, o, s)
            if carrier is None:
                reissued = _reissue(engine, key, latest, name)
                if reissued is None:
                    continue  # confirmed or started meanwhile
                logger.warning(
                    "%s: key %s's latest send %s was handed over but never published; "
                    "publishing it as %s",
                    name,
                    key,
                    latest,
                    reissued,
                )
                carrier, latest = latest, reissued
            else:
                logger.warning(
                    "%s: key %s's carrier %s never came; publishing its latest send %s",
                    name,
                    key,
                    carrier,
                    latest,
                )
            replacing.tell_replaced(task, carrier, latest)
            replacing.publish_latest(task, key, latest, payload, payload_type, wait)
            published += 1
    return published


def _reissue(engine: sa.Engine, key: keys.LockKey, old: str, name: str) -> str | None:
    """Give ``old``'s unconfirmed row a new id (REISSUE): that id, or None if the row
    was confirmed, started or taken meanwhile."""
    task_id = uuid()
    classid, objid, objsubid = key.pg_locks_ids
    params = {
        "c": classid,
        "o": objid,
        "s": objsubid,
        "old": old,
        "id": task_id,
        "run": keys.run_key(task_id).ids[-1],
        "name": name,
    }
    with engines.autocommit_cursor(engine) as cursor:
        cursor.execute(REISSUE, params)
        (renamed,) = cursor.fetchone()
    return task_id if renamed else None


def _replacing(app: Any) -> dict[str, Any]:
    """``app``'s tasks with lock_enqueue_on_duplicate='replace' (lock_debounce's too)."""
    return {
        task.name: task
        for task in app.tasks.values()
        if getattr(getattr(task, "lock_config", None), "enqueue_on_duplicate", None)
        is OnDuplicate.REPLACE
    }


def start(app: Any) -> threading.Event | None:
    """At worker_ready: sweep every SWEEP_EVERY seconds until the returned event is set;
    None when the app has no replacing task."""
    if not _replacing(app):
        return None
    stop = threading.Event()

    def loop() -> None:
        while not stop.wait(SWEEP_EVERY):
            try:
                sweep(app)
            except Exception:  # the next sweep tries again; a run is never failed
                logger.warning(
                    "celery-pglock: the latest-wins sweep failed", exc_info=True
                )

    threading.Thread(target=loop, name="celery-pglock-sweep", daemon=True).start()
    return stop
