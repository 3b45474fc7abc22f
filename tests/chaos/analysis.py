"""The chaos run's verdict on its figures: outcomes, overlaps, losses and recoveries.

Pure: it reads what :func:`tests.chaos.report.collect` gathered (outcomes, intervals,
loss events, overlaps) and the faults the run injected, and does no I/O, so that its
classification of each overlap, which decides whether CI passes, is unit-tested
(tests/unit/test_chaos_analysis.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tests.chaos.plan import CUT_AFTER

if TYPE_CHECKING:
    from celery_pglock.testing.overlap import Interval, Overlap
    from tests.chaos import faults
    from tests.chaos.run import Chaos


def analyse(
    chaos: Chaos,
    outcomes: dict[str, tuple[str, str]],
    intervals: list[Interval],
    events: dict[str, list[tuple[str, float]]],
    overlaps: list[Overlap],
) -> dict[str, Any]:
    by_task: dict[str | None, list[Any]] = {}
    for interval in intervals:
        by_task.setdefault(interval.task_id, []).append(interval)
    counts = {"ran": 0, "skipped": 0, "failed": 0}
    reasons: dict[str, int] = {}
    for state, reason in outcomes.values():
        counts[state] += 1
        if reason:
            reasons[reason] = reasons.get(reason, 0) + 1

    def lost_at(task_id: str | None, after: float) -> tuple[str, float] | None:
        if task_id is None:
            return None
        found = [e for e in events.get(task_id, []) if e[1] >= after - 0.05]
        return min(found, key=lambda e: e[1]) if found else None

    # Processes SIGKILLed (pid -> when), and runs a hard time limit killed.
    killed = {
        pid: f.began for f in chaos.faults if "SIGKILL" in f.kind for pid in f.pids
    }
    limit_killed = {
        task_id
        for task_id, (_, reason) in outcomes.items()
        if reason == "TimeLimitExceeded"
    }

    def killed_after(interval: Interval, instant: float) -> bool:
        return interval.task_id in limit_killed or killed.get(interval.pid, 0) > instant

    # Overlaps: explained when the earlier run's loss was signalled, or when a fault took
    # its lock and its process was then killed before the loss could be detected (a dead
    # process signals nothing; its body still ran until its last heartbeat).
    explained: list[dict[str, Any]] = []
    killed_first: list[dict[str, Any]] = []
    unexplained: list[dict[str, Any]] = []
    windows: list[float] = []
    for overlap in overlaps:
        first, second = overlap.first, overlap.second
        # overlaps() pairs finished intervals only: both have an end.
        assert first.ended_at is not None
        assert second.ended_at is not None
        window = (
            min(first.ended_at, second.ended_at) - second.started_at
        ).total_seconds()
        event = lost_at(first.task_id, first.started_at.timestamp())
        row: dict[str, Any] = {
            "key": first.key,
            "window_s": round(window, 3),
            "signal": event[0] if event else None,
            "run": "part" if first.run.endswith("part") else "main",
        }
        windows.append(window)
        if event:
            explained.append(row)
            continue
        # Enough to find both runs in the kept worker logs.
        row["runs"] = [
            {
                "task": i.task_id,
                "pid": i.pid,
                "kind": chaos.sent.get(i.task_id or ""),
                "outcome": outcome(outcomes, i.task_id or ""),
                "at_s": round(i.started_at.timestamp() - chaos.t0, 3),
                "to_s": round(i.ended_at.timestamp() - chaos.t0, 3),
            }
            for i in (first, second)
            if i.ended_at is not None
        ]
        taken_by = [
            fault
            for fault in chaos.faults
            if fault.kind.startswith(("restart", "terminate"))
            and second.started_at.timestamp() > fault.began
            and took_lock(chaos, fault, first, alive_after=fault.began)
            and killed_after(first, fault.began)
        ]
        if taken_by:
            row["fault"] = taken_by[-1].kind
            killed_first.append(row)
        else:
            unexplained.append(row)

    # Losses injected (runs whose lock the fault surely took away) vs detected.
    losses = []
    for fault in chaos.faults:
        if not (fault.kind.startswith(("restart", "terminate", "link"))):
            continue
        link = fault.kind.startswith("link")
        hit = [
            i
            for i in intervals
            # A frozen link makes the lock unverifiable at once; a restart or a
            # termination surely took it once the fault was done.
            if took_lock(
                chaos, fault, i, alive_after=fault.began if link else fault.done + 0.1
            )
        ]
        if link:
            hit = [i for i in hit if i.task_id in chaos.partition_holders]
        for interval in hit:
            event = lost_at(interval.task_id, interval.started_at.timestamp())
            losses.append(
                {
                    "fault": fault.kind,
                    "task": interval.task_id,
                    "detected_after_s": None
                    if event is None
                    else round(event[1] - fault.began, 3),
                    "signal": None if event is None else event[0],
                    "killed_before_detection": event is None
                    and killed_after(interval, fault.began),
                }
            )

    recoveries = []
    starts = sorted(i.started_at.timestamp() for i in intervals)
    for fault in chaos.faults:
        after = [s for s in starts if s > fault.done]
        if fault.holders:
            ends = [
                i.ended_at.timestamp() - fault.began
                for task_id in fault.holders
                for i in by_task.get(task_id, [])
                if i.ended_at is not None
            ]
            again = [
                i.started_at.timestamp() - fault.began
                for i in by_task.get(fault.after, [])
            ]
            ended = sorted({outcome(outcomes, task_id) for task_id in fault.holders})
            fault.detail = (
                f"holders' bodies ended {max(ends, default=float('nan')):.2f}s after "
                f"the freeze ({', '.join(ended)}); "
                f"cut at {CUT_AFTER:.1f}s; the proxied worker locked again at "
                f"{min(again, default=float('nan')):.2f}s"
            )
        recoveries.append(
            {
                "fault": fault.kind,
                "at_s": round(fault.began - chaos.t0, 1),
                "recovered_after_s": round(after[0] - fault.began, 2)
                if after
                else None,
                "detail": fault.detail,
                "pids": sorted(fault.pids),
            }
        )
    time_limited = reasons.get("TimeLimitExceeded", 0)
    reruns = sum(1 for runs in by_task.values() if len(runs) > 1)
    return {
        "sent": len(chaos.sent),
        **counts,
        "failed_reasons": reasons,
        "overlaps_explained": explained,
        "overlaps_killed_first": killed_first,
        "overlaps_unexplained": unexplained,
        "overlap_window_max_s": round(max(windows), 3) if windows else 0.0,
        "partition_overlaps": sum(
            1 for o in explained + killed_first + unexplained if o["run"] == "part"
        ),
        "losses": losses,
        "faults": recoveries,
        "time_limit_kills": time_limited,
        "task_ids_run_more_than_once": reruns,
        "keys": chaos.plan.keys,
    }


def took_lock(
    chaos: Chaos, fault: faults.Fault, interval: Interval, *, alive_after: float
) -> bool:
    """``fault`` (a restart, termination or frozen link) took the lock of ``interval``'s
    run: its body started before the fault and was still alive at ``alive_after``."""
    link = fault.kind.startswith("link")
    return (
        interval.started_at.timestamp() < fault.began
        and interval.ended_at is not None
        and interval.ended_at.timestamp() > alive_after
        and interval.run.endswith("part") == link
        and (not fault.pids or interval.pid in fault.pids or link)
        and (
            fault.locks is None
            or chaos.app.work.lock_key_for(interval.run, interval.key, 0).pg_locks_ids
            in fault.locks
        )
    )


def outcome(outcomes: dict[str, tuple[str, str]], task_id: str) -> str:
    state, reason = outcomes.get(task_id, ("unaccounted", ""))
    return reason or state


def broker_losses(
    missing: list[dict[str, Any]],
    in_broker: dict[str, str],
    consumers_killed: int,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Split the tasks that never got an outcome into (lost by the broker, unaccounted).

    ``missing``: what the logs say of each (report._trace: ``id``, ``received``);
    ``in_broker``: task id -> where Redis still holds its message at the end (a queue, or
    kombu's ``unacked`` hash); ``consumers_killed``: broker consumers SIGKILLed during the
    run (one per whole worker: its main process does the BRPOP).

    Kombu's Redis transport takes a message off its list (BRPOP) and only then records it
    in ``unacked`` (``QoS.append``). Redis hands a message to a *blocked* BRPOP at once,
    so a consumer that dies before reading the reply, or between reading it and the
    record, takes the message with it: in no list, in no unacked record, received by no
    worker. That is the evidence, read from Redis, not a timing window: a live consumer
    records every message it pops before Celery even logs it, and each dead consumer took
    at most one (a BRPOP returns one message). A message with a record (still queued, or
    unacked: a worker fetched it and never acked, so kombu's visibility timeout would
    bring it back), one a worker received, or more such messages than killed consumers,
    is unaccounted: the run fails.
    """
    vanished = [
        task for task in missing if not task["received"] and task["id"] not in in_broker
    ]
    lost = vanished if len(vanished) <= consumers_killed else []
    unaccounted = [
        {**task, "in_broker": in_broker.get(task["id"])}
        for task in missing
        if task not in lost
    ]
    return lost, unaccounted
