"""What a run's lock statements cost PostgreSQL, sent back to back from one process.

    .venv/bin/python benchmarks/lock_statements.py [--keys N] [--reps R]

An ``AdvisoryLock`` is taken and released on the process session, key after key: the
plain run lock, and the lock of a ``lock_enqueue="until_finished"`` run (its run lock and
its queued row's rider; the rows are claimed first, as a producer would). Per key: the CPU
of the lock session's backend (psutil, 10 ms ticks) and of this process. Back to back the
server's caches stay warm; in compare.py's workers each backend sleeps between messages,
so the same statements cost it more there. The two are interleaved over R repetitions;
medians.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import uuid
from typing import Any

import psutil

from celery_pglock import AdvisoryLock, keys
from celery_pglock.db import engines
from celery_pglock.lock import sessions
from celery_pglock.task import queued, queued_writes
from celery_pglock.testing import _support, start_services


def backend_seconds(url: str) -> float:
    """CPU seconds of this process's lock-engine backends."""
    probe = _support.connect(url, application_name="bench probe")
    try:
        with probe.cursor() as cursor:
            cursor.execute(
                "SELECT pid FROM pg_stat_activity WHERE application_name ~ %s",
                (rf":{os.getpid()}( |$)",),  # the host:pid tag of engines.process_tag
            )
            pids = [row[0] for row in cursor.fetchall()]
    finally:
        probe.close()
    return sum(sum(psutil.Process(pid).cpu_times()[:2]) for pid in pids)


def run(engine: Any, url: str, rider: bool, count: int) -> tuple[float, float]:
    """``count`` new keys locked and released: (backend, client) CPU µs per key."""
    task_ids = [str(uuid.uuid4()) for _ in range(count)]
    locks = []
    for task_id in task_ids:
        key = keys.make_key("lock-statements", task_id)
        lock = AdvisoryLock(engine=engine, key=key)
        if rider:
            queued.claim(
                engine,
                key=key,
                task_id=task_id,
                task_name="bench",
                mode=queued.UNTIL_FINISHED,
                stale=60.0,
                bound=5.0,
            )
            lock.run_key = keys.run_key(task_id)
            lock.rider = queued.Queued(queued.UNTIL_FINISHED, key.pg_locks_ids, task_id)
        locks.append(lock)
    queued_writes.drain_writers()  # the claims' confirmations: not the lock's work
    server, client = backend_seconds(url), time.process_time()
    for lock in locks:
        if not lock.acquire():
            raise RuntimeError("a new key was busy")
        lock.release()
    server, client = backend_seconds(url) - server, time.process_time() - client
    return server * 1e6 / count, client * 1e6 / count


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keys", type=int, default=2000, help="keys per figure")
    parser.add_argument("--reps", type=int, default=5, help="interleaved repetitions")
    args = parser.parse_args()
    cases = {"run lock only": False, "until_finished: run lock and rider": True}
    figures: dict[str, list[tuple[float, float]]] = {label: [] for label in cases}
    with start_services() as services:
        url = services.database_url
        engine = engines.create_engine(url)
        try:
            for rider in cases.values():  # warm: the session, its prepared statements
                run(engine, url, rider, 50)
            for _ in range(args.reps):
                for label, rider in cases.items():
                    figures[label].append(run(engine, url, rider, args.keys))
        finally:
            sessions.close_for(engine)
            engine.dispose()
    print("| lock | backend CPU µs/key | client CPU µs/key |")
    print("|---|---:|---:|")
    for label, rows in figures.items():
        server = statistics.median(r[0] for r in rows)
        client = statistics.median(r[1] for r in rows)
        print(f"| {label} | {server:.0f} | {client:.0f} |")
    print(
        f"\n`benchmarks/lock_statements.py --keys {args.keys} --reps {args.reps}`; medians."
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
