"""The chaos run's fifth phase: latest wins under kills (docs/operations/chaos.md).

Two producer processes send ``chaos.latest`` (until_started, replace, acks_late) and
``chaos.debounced`` (the same with a 0.3 s quiet time, 1 s longest) to four hot keys each
for ``SECONDS``; one is SIGKILLed midway (perhaps between its statement and its
publish); pool children running its bodies are SIGKILLed. Then the workers drain, and a
fresh send of every key runs. Passed: no two bodies of a key overlapped; nothing ran that
was told it was replaced (*doubled*: a carrier or a send held in a row that also ran its
body); every send either ran or was replaced by a chain of sends that ends at one that ran
(*lost*: a chain ending elsewhere), apart from the one send a killed producer may have left
untold; and no key is left queued but not stale.
"""

from __future__ import annotations

import contextlib
import signal
import time
import uuid
from typing import TYPE_CHECKING, Any

from tests.chaos import enqueue_phase

if TYPE_CHECKING:
    from tests.chaos.run import Chaos

SECONDS = 8.0
PRODUCERS = 2


def run(chaos: Chaos) -> dict[str, Any]:
    from celery_pglock import TaskReplaced
    from celery_pglock.db import engines
    from celery_pglock.task import queued
    from tests.chaos import app as chaos_app
    from tests.chaos.producer import KEYS

    run_id = f"{chaos.run_id}-latest"
    tasks = (chaos_app.latest, chaos_app.debounced)
    logs = [chaos.log_dir / f"latest-producer-{n}.log" for n in range(PRODUCERS)]
    producers = enqueue_phase.start_producers(chaos, run_id, SECONDS, logs, "latest")
    killed_children = 0
    try:
        time.sleep(SECONDS / 3)
        producers[0].send_signal(signal.SIGKILL)
        for _ in range(2):
            killed_children += enqueue_phase.kill_a_running_child(chaos, run_id)
            time.sleep(SECONDS / 6)
        for producer in producers:
            producer.wait(timeout=SECONDS + 60)
    finally:
        for producer in producers:
            with contextlib.suppress(ProcessLookupError):
                producer.kill()
            producer.wait(timeout=10)
    engine = engines.engine_for(chaos_app.app.conf)
    _drained(chaos_app, queued, engine, run_id, 90)
    fresh = {}  # a fresh send of every key is the latest: it runs
    for task in tasks:
        for key in KEYS:
            fresh[task.name, key] = task.apply_async(
                (run_id, key, 0.05), task_id=str(uuid.uuid4()), queue=chaos.queue
            ).id
    blocked = _drained(chaos_app, queued, engine, run_id, 60)
    returned, unanswered = enqueue_phase._read_logs(logs, killed=logs[:1])
    sent = set(returned.values()) | set(fresh.values())
    intervals = chaos_app.recorder.intervals(run_id)
    ran = {i.task_id for i in intervals if i.task_id}
    by: dict[str, str] = {}
    for task_id in sent | unanswered:
        meta = chaos_app.app.backend.get_task_meta(task_id, cache=False)
        if isinstance(meta.get("result"), TaskReplaced):
            by[task_id] = str(meta["result"].replaced_by)
    untold = sorted(sent - ran - set(by))
    # A send the killed producer replaced before it could tell it is untold: its chain
    # goes on through that producer's unanswered send (which ran or was replaced).
    goes_on = [x for x in unanswered if _end(by, x) in ran]
    lost = [
        start
        for start in set(by) & sent
        if not (
            _end(by, start) in ran
            or (_end(by, start) in untold and len(untold) <= len(goes_on))
        )
    ]
    return {
        "sends": len(sent),
        "bodies": len(intervals),
        "ran": len(ran),
        "replaced": len(by),
        "children_killed": killed_children,
        "doubled": len(ran & set(by)),
        "doubled_ids": sorted(ran & set(by))[:10],
        "lost": len(lost),
        "lost_ids": sorted(lost)[:10],
        "untold": len(untold),
        "untold_ids": untold[:10],
        "producers_killed": 1,
        "fresh_not_run": len(set(fresh.values()) - ran),
        "blocked_keys": len(blocked),
        "overlaps": len(chaos_app.recorder.overlaps(run_id)),
    }


def _end(by: dict[str, str], start: str) -> str:
    """Where a chain of ``replaced_by`` from ``start`` ends."""
    end, seen = start, {start}
    while end in by and by[end] not in seen:
        end = by[end]
        seen.add(end)
    return end


def _drained(
    chaos_app: Any, queued: Any, engine: Any, run_id: str, seconds: float
) -> list[dict[str, Any]]:
    """Wait until no body of the phase runs and no key of it is queued (stale ones
    aside: a send takes them over); the rows still queued when time is up."""
    deadline = time.monotonic() + seconds
    while True:
        rows = [
            r
            for r in queued.summary(engine) or []
            if r["task_name"] in (chaos_app.latest.name, chaos_app.debounced.name)
            and r["state"] != "stale"
        ]
        idle = not chaos_app.recorder.unfinished(run_id)
        if (idle and not rows) or time.monotonic() > deadline:
            return rows
        time.sleep(0.5)
