"""What one ``delay()`` costs the producer: plain Celery, lock_enqueue and the Redis peers.

    .venv/bin/python benchmarks/publish_path.py [--calls N] [--reps R] [--json out.json]

Issue 18 adds one round trip to PostgreSQL per send of a ``lock_enqueue`` task (the
statement that takes or names the key's queued row); celery-once adds a Redis ``SET NX``
(and a ``PTTL`` on a duplicate), celery-singleton a ``SET NX`` (and a ``GET``). This
script times ``apply_async`` of bench_app's tasks in this process, to a queue nobody
consumes: per call, wall and CPU microseconds of the producer, CPU of its PostgreSQL
backends and of redis-server (psutil, when they run on this host; 10 ms clock ticks), and
the statements sent to PostgreSQL. A "new" case sends a new key every call; a "duplicate"
case (and latest wins' "replacing") sends one key whose message is already queued. Cases are interleaved over R
repetitions; the table shows medians (and the minimum of the producer's CPU).

Services as in compare.py (:func:`celery_pglock.testing.start_services`). The queue, the
queued-keys rows and the peers' Redis keys it made are deleted at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import psycopg2.extensions
import redis
import sqlalchemy as sa

from celery_pglock.db import row_writer
from celery_pglock.testing import start_services

HERE = Path(__file__).resolve().parent
os.environ.setdefault("BENCH_CONTENDER", "all")
sys.path.insert(0, str(HERE))
import bench_app  # noqa: E402 - configured by the environment set above
import compare_report  # noqa: E402
import measuring  # noqa: E402

STATEMENTS = [0]  #: statements sent on the lock engine's connections


class CountingCursor(psycopg2.extensions.cursor):
    """Counts statements: each ``execute`` of psycopg2 is one round trip."""

    def execute(self, query: Any, params: Any = None) -> Any:
        STATEMENTS[0] += 1
        return super().execute(query, params)


class Case:
    """One way of publishing: a callable sending one message."""

    def __init__(self, label: str, task: Any, queue: str, key: str | None) -> None:
        self.label, self.task, self.queue, self.key = label, task, queue, key
        self.ids: list[str] = []  #: task ids sent (their queued rows are deleted)
        self.count = 0
        self.producer: Any = None  #: the kombu producer every case shares

    def __call__(self) -> object:
        self.count += 1
        task_id = str(uuid.uuid4())
        self.ids.append(task_id)
        key = self.key or f"{self.queue}-{self.count}"
        return self.task.apply_async(
            (key, 0.0), queue=self.queue, task_id=task_id, producer=self.producer
        )


def measure(
    cases: list[Case], calls: int, reps: int, probe: measuring.Probe
) -> dict[str, list[dict[str, float | None]]]:
    results: dict[str, list[dict[str, float | None]]] = {c.label: [] for c in cases}
    for case in cases:  # warm up: connections, the table, each duplicate's first send
        for _ in range(20):
            case()
    for _ in range(reps):
        for case in cases:
            redis0, pg0 = probe.redis_seconds(), probe.producer_backends()
            statements0 = STATEMENTS[0]
            wall0, cpu0 = time.perf_counter(), time.process_time()
            for _ in range(calls):
                case()
            wall = time.perf_counter() - wall0
            # The case's batched confirmations land here, not in the next case's figures.
            row_writer.drain_all()
            cpu = time.process_time() - cpu0
            statements = STATEMENTS[0] - statements0
            redis1, pg1 = probe.redis_seconds(), probe.producer_backends()
            pg = None
            if pg0 is not None and pg1 is not None:
                pg = sum(s - pg0.get(pid, 0.0) for pid, s in pg1.items()) * 1e6 / calls
            results[case.label].append(
                {
                    "wall": wall * 1e6 / calls,
                    "cpu": cpu * 1e6 / calls,
                    "pg": pg,
                    "redis": None
                    if redis0 is None or redis1 is None
                    else (redis1 - redis0) * 1e6 / calls,
                    "statements": statements / calls,
                }
            )
    return results


def render(results: dict[str, list[dict[str, float | None]]]) -> str:
    def med(samples: list[dict[str, float | None]], name: str) -> float | None:
        values = [s[name] for s in samples if s[name] is not None]
        return statistics.median(v for v in values if v is not None) if values else None

    def fmt(value: float | None, pattern: str = ",.0f") -> str:
        return "n/a" if value is None else format(value, pattern)

    plain = med(results["plain Celery"], "cpu")
    lines = [
        "| delay() of | wall µs | producer CPU µs (min) | over plain | PostgreSQL CPU µs | Redis CPU µs | PostgreSQL statements |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for label, samples in results.items():
        cpu = med(samples, "cpu")
        least = min(s["cpu"] or 0.0 for s in samples)
        over = None if cpu is None or plain is None else cpu - plain
        lines.append(
            f"| {label} | {fmt(med(samples, 'wall'))} | {fmt(cpu)} ({least:,.0f}) "
            f"| {fmt(over, '+,.0f')} | {fmt(med(samples, 'pg'))} "
            f"| {fmt(med(samples, 'redis'))} | {fmt(med(samples, 'statements'), '.2f')} |"
        )
    return "\n".join(lines)


def cleanup(
    app: Any, client: Any, run: str, queue: str, cases: list[Case], engine: Any
) -> None:
    with contextlib.suppress(redis.RedisError):
        client.delete(queue)
        for pattern in (f"qo_{bench_app.ONCE}_*{run}*", f"bench-singleton-{run}-*"):
            for key in client.scan_iter(pattern, count=1000):
                client.delete(key)
        for prefix in ("_kombu.binding", "_kombu.binding_permanent"):
            for binding in client.scan_iter(f"{prefix}.*", count=1000):
                for member in client.smembers(binding):
                    if queue.encode() in member:
                        client.srem(binding, member)
    row_writer.drain_all()  # the last confirmations, before the server may stop
    ids = [task_id for case in cases for task_id in case.ids]
    with engine.begin() as connection:
        # A fresh database where only plain tasks were sent has no such table.
        if connection.scalar(sa.text("SELECT to_regclass('celery_pglock_queued')")):
            connection.execute(
                sa.text("DELETE FROM celery_pglock_queued WHERE task_id = ANY(:ids)"),
                {"ids": ids},
            )


def configure(services: Any, run: str) -> Any:
    """bench_app's app pointed at ``services``, its keys and the peers' of run ``run``."""
    app = bench_app.app
    app.conf.update(
        broker_url=services.broker_url,
        pglock_database_url=services.database_url,
        pglock_namespace=f"publish-path-{run}",
        ONCE={
            "backend": "celery_once.backends.Redis",
            "settings": {"url": services.broker_url, "default_timeout": 600},
        },
        singleton_backend_url=services.broker_url,
        singleton_key_prefix=f"bench-singleton-{run}-",
    )
    app.finalize()
    return app


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--calls", type=int, default=500, help="calls per repetition")
    parser.add_argument("--reps", type=int, default=7, help="interleaved repetitions")
    parser.add_argument("--json", type=Path)
    parser.add_argument(
        "--docs",
        type=Path,
        default=HERE.parent / "docs" / "benchmarks.md",
        help="the page whose publish-path section is rewritten",
    )
    parser.add_argument("--no-docs", action="store_true")
    args = parser.parse_args(argv)
    run = uuid.uuid4().hex[:8]
    queue = f"publish-path-{run}"
    with start_services() as services:
        app = configure(services, run)
        finished: Any = app.tasks[bench_app.UNTIL_FINISHED]
        engine = finished._binding().engine()
        sa.event.listen(
            engine,
            "connect",
            lambda dbapi, _record: setattr(dbapi, "cursor_factory", CountingCursor),
        )
        tasks = app.tasks
        cases = [
            Case("plain Celery", tasks[bench_app.PLAIN], queue, None),
            Case("SingletonTask, run lock only", tasks[bench_app.SESSION], queue, None),
            Case("until_finished, new key", finished, queue, None),
            Case("until_finished, duplicate", finished, queue, f"{run}-dup"),
            Case("until_started, new key", tasks[bench_app.UNTIL_STARTED], queue, None),
            Case(
                "until_started, duplicate",
                tasks[bench_app.UNTIL_STARTED],
                queue,
                f"{run}-dup",
            ),
            Case("replace, new key", tasks[bench_app.LATEST], queue, None),
            Case("replace, replacing", tasks[bench_app.LATEST], queue, f"{run}-dup"),
            Case("celery-once, new key", tasks[bench_app.ONCE], queue, None),
            Case("celery-once, duplicate", tasks[bench_app.ONCE], queue, f"{run}-dup"),
            Case("celery-singleton, new key", tasks[bench_app.SINGLETON], queue, None),
            Case(
                "celery-singleton, duplicate",
                tasks[bench_app.SINGLETON],
                queue,
                f"{run}-dup",
            ),
        ]
        client: Any = redis.Redis.from_url(services.broker_url, socket_timeout=10)
        probe = measuring.Probe(services, client)
        started = time.monotonic()
        try:
            with app.producer_or_acquire() as producer:
                for case in cases:
                    case.producer = producer
                results = measure(cases, args.calls, args.reps, probe)
        finally:
            probe.close()
            cleanup(app, client, run, queue, cases, engine)
            client.close()
    summary = (
        f"publish path: {args.calls} calls x {args.reps} interleaved repetitions in "
        f"{time.monotonic() - started:.0f} s, load "
        f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}; medians per call"
    )
    table = render(results)
    print(summary)
    print(table)
    if not args.no_docs:
        command = f"benchmarks/publish_path.py --calls {args.calls} --reps {args.reps}"
        compare_report.write_docs(
            args.docs,
            f"{table}\n\n`{command}` — {summary[len('publish path: ') :]}.",
            begin="<!-- publish-path:begin -->",
            end="<!-- publish-path:end -->",
        )
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
