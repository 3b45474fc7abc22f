"""The chaos run's third phase: lock_enqueue under kills (docs/operations/chaos.md).

Producer processes send four hot keys of both lock_enqueue tasks for ``SECONDS``; one is
SIGKILLed midway (perhaps between its row's commit and its publish), pool children running
enqueued bodies are SIGKILLed, queued messages are revoked, a queue is purged, and two rows
are committed whose messages are never published. Then the bound is waited out. Passed:
no key is left blocked, a fresh send of every key publishes and runs, every id a caller
got ran or is accounted for by a fault (a killed producer, a revoke, a purge, a SIGKILLed
child without acks_late: WorkerLostError), and no two bodies of a key overlapped.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tests.chaos.run import Chaos

SECONDS = 12.0
PRODUCERS = 3


def run(chaos: Chaos) -> dict[str, Any]:
    from celery_pglock.db import engines
    from celery_pglock.task import queued
    from tests.chaos import app as chaos_app
    from tests.chaos.producer import KEYS

    run_id = f"{chaos.run_id}-enq"
    tasks = (chaos_app.until_finished, chaos_app.until_started)
    engine = engines.engine_for(chaos_app.app.conf)
    logs = [chaos.log_dir / f"producer-{n}.log" for n in range(PRODUCERS)]
    producers = start_producers(chaos, run_id, SECONDS, logs)
    revoked: set[str] = set()
    purged: set[str] = set()
    never_published: set[str] = set()
    killed_children = 0
    try:
        time.sleep(SECONDS / 3)
        producers[0].send_signal(signal.SIGKILL)
        for n, task in enumerate(tasks):
            # Held by the worker until due (countdown), then dropped: task_revoked.
            message = task.apply_async(
                (run_id, f"r{n}", 0.1), countdown=2, queue=chaos.queue
            )
            chaos_app.app.control.revoke(message.id)
            revoked.add(message.id)
            # Published to a queue nobody reads, then purged: no signal, the bound frees it.
            nobody = f"{chaos.queue}-nobody"
            purged.add(task.apply_async((run_id, f"p{n}", 0.1), queue=nobody).id)
            with chaos_app.app.connection_for_write() as connection:
                connection.default_channel.queue_purge(nobody)  # type: ignore[attr-defined]
            # A producer that died between the row's commit and its publish.
            lost_id = str(uuid.uuid4())
            queued.claim(
                engine,
                key=task.lock_key_for(run_id, f"l{n}", 0.1),
                task_id=lost_id,
                task_name=task.name,
                mode=queued.UNTIL_FINISHED,
                stale=chaos_app.ENQUEUE_LOST_AFTER,
                bound=5.0,
            )
            never_published.add(lost_id)
        for _ in range(2):
            killed_children += kill_a_running_child(chaos, run_id)
            time.sleep(SECONDS / 6)
        for producer in producers:
            producer.wait(timeout=SECONDS + 60)
    finally:
        for producer in producers:
            with contextlib.suppress(ProcessLookupError):
                producer.kill()
            producer.wait(timeout=10)
    faults_done = time.time()
    # Every message drained, and every bound passed: nothing may hold its key any more.
    deadline = time.monotonic() + 90
    blocked: list[dict[str, Any]] = []
    while time.monotonic() < deadline:
        rows = queued.summary(engine) or []
        blocked = [r for r in rows if r["state"] != "stale"]
        if not blocked and time.time() > faults_done + chaos_app.ENQUEUE_LOST_AFTER + 1:
            break
        time.sleep(0.5)
    # Each key once more: a fresh send publishes (its own id) and runs.
    fresh_failed = 0
    for task in tasks:
        for key in (*KEYS, "r0", "r1", "p0", "p1", "l0", "l1"):
            task_id = str(uuid.uuid4())
            result = task.apply_async(
                (run_id, key, 0.05), task_id=task_id, queue=chaos.queue
            )
            if result.id != task_id:
                fresh_failed += 1
            else:
                result.get(timeout=60, propagate=False)
    returned, killed_tries = _read_logs(logs, killed=logs[:1])
    ran = {i.task_id for i in chaos_app.recorder.intervals(run_id) if i.task_id}
    accounted = ran | revoked | purged | never_published | killed_tries
    # A message running (or waiting for its lock) in a SIGKILLed child without acks_late
    # ends FAILURE (WorkerLostError), as with plain Celery; the result backend says so.
    lost_with_child = {
        task_id
        for task_id in set(returned.values()) - accounted
        if _lost_with_its_child(chaos_app.app.AsyncResult(task_id))
    }
    unaccounted = sorted(set(returned.values()) - accounted - lost_with_child)
    # What the result backend says of each: a failure names its cause (CI keeps no logs).
    fates = {
        task_id: _fate(chaos_app.app.AsyncResult(task_id)) for task_id in unaccounted
    }
    ran_revoked = sorted(ran & revoked)
    return {
        "sends": len(returned),
        "published_ids": len(set(returned.values())),
        "bodies": len(chaos_app.recorder.intervals(run_id)),
        "children_killed": killed_children,
        "lost_with_a_killed_child": len(lost_with_child),
        "blocked_keys": len(blocked),
        "blocked_rows": blocked[:10],
        "fresh_send_failures": fresh_failed,
        "unaccounted": len(unaccounted),
        "unaccounted_ids": unaccounted[:20],
        "unaccounted_fates": [fates[i] for i in unaccounted[:20]],
        "revoked_that_ran": len(ran_revoked),
        "overlaps": len(chaos_app.recorder.overlaps(run_id)),
    }


def start_producers(
    chaos: Chaos, run_id: str, seconds: float, logs: list[Any], *mode: str
) -> list[subprocess.Popen[bytes]]:
    """A tests.chaos.producer process per log, sending for ``seconds``."""
    return [
        subprocess.Popen(
            [
                *(sys.executable, "-m", "tests.chaos.producer", run_id, str(seconds)),
                *(str(chaos.rng.randrange(10**6)), str(log), chaos.queue, *mode),
            ],
            env=os.environ.copy(),
        )
        for log in logs
    ]


def _lost_with_its_child(result: Any) -> bool:
    with contextlib.suppress(Exception):  # an unreadable result is not an excuse
        return result.state == "FAILURE" and type(result.result).__name__ == (
            "WorkerLostError"
        )
    return False


def _fate(result: Any) -> str:
    """``STATE: ResultType: text`` of an unaccounted message, for the report."""
    try:
        return f"{result.state}: {type(result.result).__name__}: {result.result!s:.160}"
    except Exception as exc:  # a report line, not a check
        return f"unreadable: {exc!r:.160}"


def kill_a_running_child(chaos: Chaos, run_id: str) -> int:
    """SIGKILL a prefork child running an enqueued body (0 if none was found in 3 s)."""
    children = {
        pid
        for worker in chaos.main_workers
        if worker.pool == "prefork" and worker.running
        for pid in worker.child_pids()
    }
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline:
        with chaos.app.loss_app._events_cursor() as cursor:
            cursor.execute(
                f"SELECT DISTINCT pid FROM {chaos.app.recorder.table} WHERE run = %s "
                "AND ended_at > clock_timestamp() - interval '0.3 seconds'",
                (run_id,),
            )
            busy = [row[0] for row in cursor.fetchall() if row[0] in children]
        if busy:
            with contextlib.suppress(ProcessLookupError):
                os.kill(chaos.rng.choice(busy), signal.SIGKILL)
            return 1
        time.sleep(0.1)
    return 0


def _read_logs(logs: list[Any], killed: list[Any]) -> tuple[dict[str, str], set[str]]:
    """{sent id: id returned}, and the ids a killed producer tried without an answer."""
    returned: dict[str, str] = {}
    unanswered: set[str] = set()
    for log in logs:
        tried: set[str] = set()
        with contextlib.suppress(FileNotFoundError):
            for line in log.read_text().splitlines():
                parts = line.split()
                if parts[:1] == ["T"] and len(parts) == 2:
                    tried.add(parts[1])
                elif parts[:1] == ["R"] and len(parts) == 3:
                    returned[parts[1]] = parts[2]
                    tried.discard(parts[1])
        if log in killed:
            unanswered |= tried
    return returned, unanswered
