"""The chaos run's fourth phase: lock_group and lock_rate under pool-child kills
(docs/operations/chaos.md).

A stream of ``chaos.grouped`` (a group of 2, one run per key, 4 keys) and ``chaos.rated``
(2 starts per 2 s per key, 2 keys) messages, re-queued while busy, ``acks_late`` with
``reject_on_worker_lost``; pool children running their bodies are SIGKILLed. Passed: every
message ran (a killed one's redelivery included), no two bodies of a key overlapped, the
group never had more than 2 bodies, no key of the rate started more than 2 times in any
2 s, and no advisory lock is left once the workers are idle (the run's final check).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from tests.chaos import enqueue_phase

if TYPE_CHECKING:
    from tests.chaos.run import Chaos

SECONDS = 8.0
GROUP_SENDS, GROUP_KEYS, GROUP_BODY = 24, 4, 0.3
RATE_SENDS, RATE_KEYS = 10, 2
#: Between a start's row (PostgreSQL's now()) and its body's record: a window of body
#: starts may look this much shorter than the rate's.
SLACK = 0.25


def run(chaos: Chaos) -> dict[str, Any]:
    from tests.chaos import app as chaos_app

    run_id = f"{chaos.run_id}-flow"
    sent = []
    start = time.monotonic()
    total = GROUP_SENDS + RATE_SENDS
    killed = 0
    for n in range(total):
        delay = start + SECONDS * n / total - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        if n % 3 == 2:
            key = f"r{n % RATE_KEYS}"
            task, seconds = chaos_app.rated, 0.05
        else:
            key = f"g{n % GROUP_KEYS}"
            task, seconds = chaos_app.grouped, GROUP_BODY
        sent.append(task.apply_async((run_id, key, seconds), queue=chaos.queue))
        if n in (total // 3, 2 * total // 3):
            killed += enqueue_phase.kill_a_running_child(chaos, run_id)
    deadline = time.monotonic() + 120
    for result in sent:
        result.get(timeout=max(1.0, deadline - time.monotonic()), propagate=False)
    intervals = chaos_app.recorder.intervals(run_id)
    ran = {i.task_id for i in intervals if i.task_id}
    spans = []  # seconds from each rate start to the start RATE[0] later
    limit, window = chaos_app.RATE
    for key in {i.key for i in intervals if i.key.startswith("r")}:
        # A killed run's redelivery is the same start, by design (docs/guide/period.md):
        # each message's first body start counts.
        first: dict[Any, Any] = {}
        for i in intervals:
            if i.key == key:
                first[i.task_id] = min(first.get(i.task_id, i.started_at), i.started_at)
        starts = sorted(first.values())
        spans += [
            (later - earlier).total_seconds()
            for earlier, later in zip(starts, starts[limit:], strict=False)
        ]
    return {
        "sent": len(sent),
        "bodies": len(intervals),
        "children_killed": killed,
        "not_run": len({r.id for r in sent} - ran),
        "not_run_ids": sorted({r.id for r in sent} - ran)[:20],
        "overlaps": len(chaos_app.recorder.overlaps(run_id)),
        "group_peak": chaos_app.recorder.peak(f"{run_id}-group", "group"),
        "group_limit": chaos_app.GROUP_LIMIT,
        "rate_exceeded": sum(span < window - SLACK for span in spans),
        "rate_windows_checked": len(spans),
    }
