"""Latest wins' safety net: a key whose carrier will never be taken (its producer died
between its statement and its publish, or its publish failed) still runs its latest send.
Each worker's main process sweeps such rows every SWEEP_EVERY seconds and does what the
carrier would have done (docs/guide/latest-wins.md, "How it works")."""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Any

from celery_pglock import keys
from celery_pglock.config import OnDuplicate
from celery_pglock.db import engines
from celery_pglock.task import queued, replacing

if TYPE_CHECKING:
    import sqlalchemy as sa

logger = logging.getLogger(__name__)

SWEEP_EVERY = queued.PUBLISH_GRACE / 2  #: A stuck key waits at most grace + this.
_BATCH = 20

#: Rows whose latest send waits behind a carrier that is past its bound and not running
#: (its run lock is free): hand each over, as its carrier would, and tombstone the carrier
#: (taken late, it runs nothing). SKIP LOCKED: several workers sweep apart.
SWEEP = f"""
WITH stuck AS MATERIALIZED (
  SELECT q.classid, q.objid, q.objsubid, q.task_id, q.task_name, q.carrier, q.run_objid,
    q.latest_run, q.payload, q.payload_type, {replacing.WAIT} AS wait
  FROM celery_pglock_queued q
  WHERE q.carrier IS NOT NULL AND q.started_at IS NULL AND q.stale_at < now()
    AND q.task_name = ANY(%(names)s)
  LIMIT {_BATCH} FOR UPDATE SKIP LOCKED),
free AS MATERIALIZED (
  SELECT * FROM stuck
  WHERE pg_try_advisory_xact_lock({keys.RUN_NAMESPACE}, stuck.run_objid)),
handed AS (
  UPDATE celery_pglock_queued q SET carrier = NULL, run_objid = free.latest_run,
    latest_run = NULL, payload = NULL, payload_type = NULL, published_at = now(),
    stale_at = now() + make_interval(secs => {queued.PUBLISH_GRACE})
  FROM free WHERE (q.classid, q.objid, q.objsubid) = (free.classid, free.objid,
    free.objsubid) RETURNING 1),
tomb AS (
  INSERT INTO celery_pglock_replaced AS t (task_id, replaced_by, task_name, keep_until)
  SELECT carrier, task_id, task_name, now() + interval '{replacing.KEEP}' FROM free
  ON CONFLICT (task_id) DO UPDATE SET replaced_by = excluded.replaced_by,
    replaced_at = now(), seen_at = NULL, keep_until = excluded.keep_until)
SELECT classid, objid, objsubid, task_id, task_name, carrier, payload, payload_type, wait
FROM free
"""


def sweep(app: Any) -> int:
    """One sweep of ``app``'s replacing tasks' rows: how many latest sends it published."""
    tasks = {
        task.name: task
        for task in app.tasks.values()
        if getattr(getattr(task, "lock_config", None), "enqueue_on_duplicate", None)
        is OnDuplicate.REPLACE
    }
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
            key = _key_of(task.lock_config.name, int(c), int(o), int(s))
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


def _key_of(name: str, classid: int, objid: int, objsubid: int) -> keys.LockKey:
    """The LockKey of a row's ``pg_locks`` ids (the inverse of ``pg_locks_ids``)."""
    if objsubid == 1:
        unsigned = (classid << 32) | objid
        return keys.LockKey(
            name, (unsigned - (1 << 64) if unsigned >> 63 else unsigned,)
        )
    signed = [i - (1 << 32) if i >> 31 else i for i in (classid, objid)]
    return keys.LockKey(name, (signed[0], signed[1]))


def start(app: Any) -> threading.Event | None:
    """At worker_ready: sweep every SWEEP_EVERY seconds until the returned event is set;
    None when the app has no replacing task."""
    if not any(
        getattr(getattr(t, "lock_config", None), "enqueue_on_duplicate", None)
        is OnDuplicate.REPLACE
        for t in app.tasks.values()
    ):
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
