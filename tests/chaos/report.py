"""The chaos run's figures (gathered here, judged in analysis.py), its acceptance checks
and its Markdown report."""

from __future__ import annotations

import json
import re
import time
from typing import TYPE_CHECKING, Any

from celery_pglock.task import busy_policy
from tests.chaos import analysis, faults
from tests.chaos.plan import INTERVAL, PARTITION_CHECK_TIMEOUT

if TYPE_CHECKING:
    from tests.chaos.plan import Plan
    from tests.chaos.run import Chaos

#: Seconds from a fault to its loss signal, at most: the interval, the watcher's tick
#: (interval / 4) and one query (1 s, on a busy machine); a restart adds its downtime
#: (under 1 s here); a frozen link is only known once a check times out.
DETECTION_BOUND = {
    "terminate": INTERVAL * 1.25 + 1.0,
    "restart": INTERVAL * 1.25 + 2.0,
    "link frozen, then cut": INTERVAL * 1.25 + PARTITION_CHECK_TIMEOUT + 0.5,
}
#: What celery-pglock logs when it skips a redelivered message without storing a result.
REDELIVERY_SKIP = busy_policy.REDELIVERY_IGNORED.strip()


def _outcomes(chaos: Chaos, deadline: float) -> dict[str, tuple[str, str]]:
    """task id -> (state, reason) once every task is terminal or the deadline passed."""
    from celery_pglock import LockSkipped

    outcomes: dict[str, tuple[str, str]] = {}
    while True:
        for task_id in chaos.sent:
            if task_id in outcomes:
                continue
            result = chaos.app.app.AsyncResult(task_id)
            state = result.state
            if state == "SUCCESS":
                outcomes[task_id] = ("ran", "")
            elif state == "FAILURE":
                error = result.result
                if isinstance(error, LockSkipped):
                    outcomes[task_id] = ("skipped", "")
                else:
                    outcomes[task_id] = ("failed", type(error).__name__)
        if len(outcomes) == len(chaos.sent) or time.monotonic() > deadline:
            return outcomes
        time.sleep(1.0)


def collect(chaos: Chaos, started: float) -> dict[str, Any]:
    """Every figure of a finished run: outcomes, intervals, overlaps, losses, faults."""
    recorder = chaos.app.recorder
    outcomes = _outcomes(chaos, time.monotonic() + 90)
    missing = [
        _trace(chaos, task_id) for task_id in sorted(set(chaos.sent) - set(outcomes))
    ]
    # A message taken off Redis by a consumer killed before it recorded the message:
    # decided from what Redis still holds, never from when the kills happened.
    consumers_killed = sum(f.kind.startswith("SIGKILL whole") for f in chaos.faults)
    broker_lost, unaccounted = analysis.broker_losses(
        missing, _in_broker(chaos, {t["id"] for t in missing}), consumers_killed
    )
    intervals = [
        i
        for part in ("main", "part")
        for i in recorder.intervals(f"{chaos.run_id}-{part}")
    ]
    events = _events(chaos)
    overlaps = [
        o
        for part in ("main", "part")
        for o in recorder.overlaps(f"{chaos.run_id}-{part}")
    ]
    left = _locks_left(chaos)
    figures = analysis.analyse(chaos, outcomes, intervals, events, overlaps)
    figures.update(
        unaccounted=len(unaccounted),
        unaccounted_ids=unaccounted[:20],
        lost_by_broker=len(broker_lost),
        lost_by_broker_ids=broker_lost[:20],
        advisory_locks_left=left,
        wall_seconds=round(time.time() - started, 1),
        enqueue=chaos.enqueue_figures,
        flow=chaos.flow_figures,
        latest=chaos.latest_figures,
        **_from_logs(chaos),
    )
    return figures


def _in_broker(chaos: Chaos, task_ids: set[str]) -> dict[str, str]:
    """task id -> where the broker's Redis still holds its message: a queue's list, or
    kombu's ``unacked`` hash (fetched by a worker, not acknowledged)."""
    if not task_ids:
        return {}
    import redis
    from kombu.transport.redis import Channel

    app = chaos.app.app
    unacked_key = app.conf.broker_transport_options.get(
        "unacked_key", Channel.unacked_key
    )
    client: Any = redis.Redis.from_url(app.conf.broker_url)
    found: dict[str, str] = {}
    try:
        for queue in (chaos.queue, chaos.part_queue):
            # The queue's list and its priority lists (kombu: queue + separator + step).
            for name in client.scan_iter(match=f"{queue}*", count=1000):
                for raw in client.lrange(name, 0, -1):
                    task_id = _message_id(raw)
                    if task_id in task_ids:
                        found[task_id] = f"queue {name.decode(errors='replace')}"
        for raw in client.hvals(unacked_key):
            task_id = _message_id(raw, unacked=True)
            if task_id in task_ids:
                found[task_id] = f"kombu {unacked_key!r} hash"
    finally:
        client.close()
    return found


def _message_id(raw: bytes, *, unacked: bool = False) -> str | None:
    """The task id of a kombu message as Redis stores it (unacked: [message, ex, rk])."""
    try:
        message = json.loads(raw)
        if unacked:
            message = message[0]
        return str(message["headers"]["id"])
    except (ValueError, KeyError, IndexError, TypeError):
        return None


def _trace(chaos: Chaos, task_id: str) -> dict[str, Any]:
    """What the logs say of a task that never reached a terminal state."""
    lines = [
        f"{worker.hostname.split('@')[0]}: {line.strip()}"
        for worker in chaos.workers
        for line in worker.log_text().splitlines()
        if task_id in line
    ]
    return {
        "id": task_id,
        # celery-pglock's documented gap (docs/guide/skipped-results.md): a
        # redelivery that finds the key held, and its first delivery's run lock held
        # or unknown after looking again, stores nothing; if that delivery was in fact
        # killed, the caller never hears.
        "ignored_redelivery": any(REDELIVERY_SKIP in line for line in lines),
        "received": any("] received" in line for line in lines),
        "kind": chaos.sent[task_id],
        "sent_at": chaos.sent_at[task_id],
        "sent_at_s": round(chaos.sent_at[task_id] - chaos.t0, 2),
        "log": lines[:10],
    }


def _events(chaos: Chaos) -> dict[str, list[tuple[str, float]]]:
    from tests.acceptance.loss_app import LOST_TABLE

    with chaos.app.loss_app._events_cursor() as cursor:
        cursor.execute(
            f"SELECT task_id, cause, extract(epoch from at) FROM {LOST_TABLE} "
            "WHERE task_id = ANY(%s)",
            (list(chaos.sent),),
        )
        rows = cursor.fetchall()
    events: dict[str, list[tuple[str, float]]] = {}
    for task_id, cause, at in rows:
        events.setdefault(task_id, []).append((cause, float(at)))
    return events


def _locks_left(chaos: Chaos) -> int:
    sql = "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory'"
    count = -1
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        count = int(faults.lock_query(chaos, sql)[0][0])
        if count == 0:
            break
        time.sleep(0.5)
    return count


def _from_logs(chaos: Chaos) -> dict[str, int]:
    """autoretry_for re-runs of a DatabaseError at acquire, and redeliveries (a message received again,
    not as a retry), counted from the worker logs."""
    pattern = re.compile(r"chaos\.work\[([0-9a-f-]+)\] (received|retry)")
    counts = {task_id: {"received": 0, "retry": 0} for task_id in chaos.sent}
    for worker in chaos.workers:
        for match in pattern.finditer(worker.log_text()):
            if match.group(1) in counts:
                counts[match.group(1)][match.group(2)] += 1
    return {
        "retried": sum(c["retry"] for c in counts.values()),
        "redelivered": sum(
            max(0, c["received"] - 1 - c["retry"]) for c in counts.values()
        ),
    }


def checks(figures: dict[str, Any], plan: Plan) -> list[tuple[str, bool]]:
    """(what, passed) for each acceptance check of the run."""
    losses = figures["losses"]
    undetected = [
        loss
        for loss in losses
        if loss["signal"] is None and not loss["killed_before_detection"]
    ]
    late = [
        loss
        for loss in losses
        if loss["detected_after_s"] is not None
        and loss["detected_after_s"] > DETECTION_BOUND[loss["fault"].split(" (")[0]]
    ]
    kinds = [f["fault"] for f in figures["faults"]]
    enqueue, flow, latest = figures["enqueue"], figures["flow"], figures["latest"]
    return [
        ("0 unaccounted", figures["unaccounted"] == 0),
        ("0 unexplained overlaps", not figures["overlaps_unexplained"]),
        (
            "0 overlaps under partitions (lock_on_lost=terminate)",
            figures["partition_overlaps"] == 0,
        ),
        ("every injected loss detected and signalled", bool(losses) and not undetected),
        ("every loss signalled within its bound (DETECTION_BOUND)", not late),
        ("0 advisory locks left", figures["advisory_locks_left"] == 0),
        (
            f">= {plan.restarts} lock server restarts",
            sum(k.startswith("restart") for k in kinds) >= plan.restarts,
        ),
        ("backend terminations injected", "terminate" in kinds),
        (
            "pool children and whole workers SIGKILLed",
            "SIGKILL pool child" in kinds
            and any(k.startswith("SIGKILL whole") for k in kinds),
        ),
        ("hard time-limit kills", figures["time_limit_kills"] > 0),
        ("broker redeliveries", figures["redelivered"] > 0),
        ("link frozen and cut", "link frozen, then cut" in kinds),
        ("enqueue: 0 keys blocked at the end", enqueue["blocked_keys"] == 0),
        (
            "enqueue: a fresh send of every key published",
            enqueue["fresh_send_failures"] == 0,
        ),
        ("enqueue: 0 unaccounted", enqueue["unaccounted"] == 0),
        ("enqueue: 0 revoked messages ran", enqueue["revoked_that_ran"] == 0),
        ("enqueue: 0 overlaps", enqueue["overlaps"] == 0),
        ("enqueue: producers and children killed", enqueue["children_killed"] > 0),
        ("flow: every message ran", flow["not_run"] == 0),
        ("flow: 0 overlaps of a key", flow["overlaps"] == 0),
        (
            "flow: the group never above its limit",
            flow["group_peak"] <= flow["group_limit"],
        ),
        ("flow: no rate exceeded", flow["rate_exceeded"] == 0),
        ("flow: children killed", flow["children_killed"] > 0),
        ("latest: 0 overlaps of a key", latest["overlaps"] == 0),
        ("latest: 0 doubled (replaced, yet ran)", latest["doubled"] == 0),
        ("latest: 0 lost (a chain of replacements ends at a run)", latest["lost"] == 0),
        (
            "latest: untold sends at most one per killed producer",
            latest["untold"] <= latest["producers_killed"],
        ),
        ("latest: a fresh send of every key ran", latest["fresh_not_run"] == 0),
        ("latest: 0 keys left queued", latest["blocked_keys"] == 0),
        ("latest: children killed", latest["children_killed"] > 0),
    ]


def render(figures: dict[str, Any], results: list[tuple[str, bool]]) -> str:
    losses = figures["losses"]
    by_fault: dict[str, list[dict[str, Any]]] = {}
    for loss in losses:
        by_fault.setdefault(loss["fault"], []).append(loss)
    ignored = sum(t["ignored_redelivery"] for t in figures["unaccounted_ids"])
    ignored = (
        f" (a skipped redelivery stored nothing; its first delivery was killed: {ignored})"
        if ignored
        else ""
    )
    lines = [
        "| tasks | count |",
        "|---|---|",
        f"| sent | {figures['sent']} |",
        f"| ran (SUCCESS) | {figures['ran']} |",
        f"| skipped (lock busy) | {figures['skipped']} |",
        f"| failed, with reason | {figures['failed']} "
        f"({', '.join(f'{k} {v}' for k, v in sorted(figures['failed_reasons'].items())) or '-'}) |",
        f"| lost by the broker: taken off Redis by a worker SIGKILLed before it "
        f"recorded it (in no queue, not unacked, received by no worker) | "
        f"{figures['lost_by_broker']} |",
        f"| unaccounted | {figures['unaccounted']}{ignored} |",
        f"| task ids whose body ran more than once (redelivered after a kill) | {figures['task_ids_run_more_than_once']} |",
        f"| messages redelivered (acks_late, after a kill) | {figures['redelivered']} |",
        f"| database-error retries | {figures['retried']} |",
        f"| hard time-limit kills | {figures['time_limit_kills']} |",
        "",
        "| overlaps | count |",
        "|---|---|",
        f"| after a detected, signalled loss | {len(figures['overlaps_explained'])} "
        f"(window max {figures['overlap_window_max_s']:.3f}s) |",
        f"| after a loss, its holder killed before the loss was detected | {len(figures['overlaps_killed_first'])} |",
        f"| unexplained | {len(figures['overlaps_unexplained'])} |",
        f"| in the partition phase (lock_on_lost=terminate) | {figures['partition_overlaps']} |",
        f"| advisory locks left at the end | {figures['advisory_locks_left']} |",
        "",
        "| losses by fault | injected | detected (lock_lost / at release) | killed first | detection delay max |",
        "|---|---|---|---|---|",
    ]
    for fault, rows in by_fault.items():
        lost = sum(
            1 for r in rows if r["signal"] and not r["signal"].startswith("release")
        )
        released = sum(
            1 for r in rows if r["signal"] and r["signal"].startswith("release")
        )
        killed = sum(1 for r in rows if r["killed_before_detection"])
        delays = [
            r["detected_after_s"] for r in rows if r["detected_after_s"] is not None
        ]
        worst = f"{max(delays):.2f}s" if delays else "-"
        lines.append(
            f"| {fault} | {len(rows)} | {lost} / {released} | {killed} | {worst} |"
        )
    lines += ["", "| fault | at | first lock after | detail |", "|---|---|---|---|"]
    for fault in figures["faults"]:
        recovered = fault["recovered_after_s"]
        lines.append(
            f"| {fault['fault']} | {fault['at_s']}s | "
            f"{'-' if recovered is None else f'{recovered:.2f}s'} | {fault['detail']} |"
        )
    enqueue = figures["enqueue"]
    lines += [
        "",
        *_phase_table("enqueue", enqueue),
    ]
    if enqueue["unaccounted_ids"] or enqueue["blocked_rows"]:
        lines += [
            "",
            f"enqueue: unaccounted {enqueue['unaccounted_ids']}, blocked {enqueue['blocked_rows']}",
            *(f"- {fate}" for fate in enqueue.get("unaccounted_fates", [])),
        ]
    lines += ["", *_phase_table("flow", figures["flow"])]
    lines += ["", *_phase_table("latest-wins", figures["latest"])]
    latest = figures["latest"]
    if latest["doubled_ids"] or latest["lost_ids"] or latest["untold_ids"]:
        lines += [
            "",
            f"latest: doubled {latest['doubled_ids']}, lost {latest['lost_ids']}, "
            f"untold {latest['untold_ids']}",
        ]
    lines += ["", "| check | result |", "|---|---|"]
    lines += [f"| {what} | {'ok' if ok else 'FAILED'} |" for what, ok in results]
    if figures["overlaps_unexplained"]:
        lines += ["", f"unexplained overlaps: {figures['overlaps_unexplained'][:10]}"]
    if figures["unaccounted"]:
        lines += ["", f"unaccounted task ids: {figures['unaccounted_ids']}"]
    if figures["lost_by_broker"]:
        lines += ["", f"lost by the broker: {figures['lost_by_broker_ids']}"]
    return "\n".join(lines)


def _phase_table(phase: str, figures: dict[str, Any]) -> list[str]:
    """A phase's counts as a table (its id and row samples are printed apart)."""
    return [
        f"| {phase} phase | count |",
        "|---|---|",
        *(
            f"| {name} | {value} |"
            for name, value in figures.items()
            if not name.endswith(("_ids", "_rows", "_fates"))
        ),
    ]
