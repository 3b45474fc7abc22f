"""celery-pglock against plain Celery and its Redis peers, the way users compare them.

    .venv/bin/python benchmarks/compare.py [--messages N] [--repetitions R]
        [--flat N] [--concurrency C] [--docs docs/benchmarks.md] [--json out.json]

One run measures, in real ``celery worker`` subprocesses (prefork, concurrency C, Redis
broker), a plain task, SingletonTask in session and transaction scope, celery-once and
celery-singleton (``pip install -e '.[bench]'``) on four workloads: distinct keys, one
hot key (held by another session the whole time: every message is a skip), a
per-tenant mix (50 tenants) and a slower body (2 ms). Medians over R repetitions
(workers started afresh each repetition; each workload drained by every contender back to
back, in an order that rotates); ratios to plain with the same body and CPU over plain
paired per repetition; CPU per message of the worker's processes and of the
PostgreSQL backends of its lock sessions; RSS of the largest task process; lock
connections. Then a threads worker at concurrency 64 (lock connections sampled while
64 bodies run), a memory-flat run (a worker skips N messages, then runs N) and
``publish_path.py``. It prints the tables and PASS/FAIL for each target of issues 7, 18
and 35, and writes them into the generated sections of ``docs/benchmarks.md``.

Services come from :func:`celery_pglock.testing.start_services` (configured servers, or
embedded ones started and stopped here). Every wait is bounded; workers are always
stopped; queues are deleted.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import random
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import redis

from celery_pglock import signals
from celery_pglock.testing import Services, WorkerProcess, _support, start_services

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
os.environ.setdefault("BENCH_CONTENDER", "all")
sys.path.insert(0, str(HERE))
import bench_app  # noqa: E402 - configured by the environment set above
import compare_report  # noqa: E402
import compare_runs  # noqa: E402
import measuring  # noqa: E402
from contenders import (  # noqa: E402
    BASELINE_ROW,
    CONTENDERS,
    DISTINCT_ONLY,
    FLOORS,
    PLAIN,
    ROUND_TRIPS,
    SKIP_SUCCESS_ROW,
    TENANTS,
    WORKLOADS,
    Contender,
    Sample,
    Workload,
)

# -- one worker ---------------------------------------------------------------------------


class Bench:
    """One benchmark run: its services, its app, and the workers it starts and drains."""

    def __init__(self, services: Services, args: argparse.Namespace) -> None:
        self.services = services
        self.args = args
        self.run_id = uuid.uuid4().hex[:8]
        self.namespace = f"bench-{self.run_id}"
        self.redis: Any = redis.Redis.from_url(services.broker_url, socket_timeout=10)
        self.probe = measuring.Probe(services, self.redis)
        self.app = bench_app.app
        self.app.conf.update(
            broker_url=services.broker_url,
            pglock_database_url=services.database_url,
            pglock_namespace=self.namespace,
            ONCE={
                "backend": "celery_once.backends.Redis",
                "settings": {"url": services.broker_url, "default_timeout": 600},
            },
            singleton_backend_url=services.broker_url,
        )
        self.tmp = Path(tempfile.mkdtemp(prefix="pglock-bench-"))

    def worker(
        self,
        kind: str,
        *,
        pool: str = "prefork",
        concurrency: int | None = None,
        profile_dir: Path | None = None,
    ) -> tuple[WorkerProcess, Path]:
        concurrency = concurrency or self.args.concurrency
        record_dir = Path(tempfile.mkdtemp(dir=self.tmp, prefix=f"{kind}-"))
        worker = WorkerProcess(
            "bench_app",
            pool=pool,
            concurrency=concurrency,
            queues=[f"bench-idle-{self.run_id}"],
            loglevel="INFO",
            log_path=record_dir / "worker.log",
            env={
                # The baseline worker imports celery_pglock from the other checkout.
                "PYTHONPATH": os.pathsep.join(
                    [str(HERE), str(self.args.baseline or REPO)]
                    if kind == bench_app.BASELINE
                    else [str(HERE), str(REPO)]
                ),
                bench_app.CONTENDER_ENV: kind,
                bench_app.BROKER_URL_ENV: self.services.broker_url,
                bench_app.DATABASE_URL_ENV: self.services.database_url,
                bench_app.NAMESPACE_ENV: self.namespace,
                bench_app.RECORD_DIR_ENV: str(record_dir),
                bench_app.POOL_ENV: pool,
                bench_app.PROFILE_DIR_ENV: str(profile_dir or ""),
            },
        )
        worker.start(timeout=90)
        warm = 1 if pool != "prefork" else concurrency
        if not _support.wait_until(
            lambda: len(list(record_dir.glob("*.warm"))) >= warm, timeout=60
        ):
            worker.kill()
            raise measuring.BenchError(
                f"{kind} worker never warmed up; log: {worker.log_path}"
            )
        return worker, record_dir

    def publish(
        self, contender: Contender, workload: Workload, count: int, queue: str
    ) -> tuple[int, int]:
        """Publish ``count`` messages; (queued, dropped at publish)."""
        task = self.app.tasks[contender.task]
        rng = random.Random(self.run_id)  # noqa: S311 - test data
        if contender.task in (
            bench_app.PLAIN_LATEST_ROW,
            bench_app.PLAIN_DEBOUNCED_ROW,
        ):
            bench_app.FLOOR_REPLACED.clear()
            queued, dropped = self._publish(
                task, workload, count, queue, rng, bench_app.FLOOR_REPLACED
            )
            return queued + len(set(bench_app.FLOOR_REPLACED)), dropped
        if contender.task not in (bench_app.LATEST, bench_app.DEBOUNCED):
            return self._publish(task, workload, count, queue, rng, [])
        # Latest wins: a replacing send keeps its own id but publishes nothing; its key's
        # carrier publishes the latest send when taken (one more message to drain).
        replaces: list[str] = []

        def replaced(key: Any = None, outcome: str = "", **_: Any) -> None:
            if outcome == "replaced":
                replaces.append(str(key))

        signals.lock_enqueued.connect(replaced, weak=False)
        try:
            queued, dropped = self._publish(task, workload, count, queue, rng, replaces)
        finally:
            signals.lock_enqueued.disconnect(replaced)
        return queued + len(set(replaces)), dropped

    def _publish(
        self,
        task: Any,
        workload: Workload,
        count: int,
        queue: str,
        rng: random.Random,
        replaces: list[str],
    ) -> tuple[int, int]:
        queued = dropped = 0
        with self.app.producer_or_acquire() as producer:
            for i in range(count):
                key = {
                    "hot": "hot",
                    "tenants": f"t{rng.randrange(TENANTS)}",
                }.get(workload.keys, f"{self.run_id}-{uuid.uuid4().hex[:8]}-{i}")
                task_id = str(uuid.uuid4())
                replaced_before = len(replaces)
                result = task.apply_async(
                    (key, workload.body),
                    queue=queue,
                    task_id=task_id,
                    producer=producer,
                )
                if result is None or result.id != task_id:
                    dropped += 1  # the peers' publish-time lock refused it
                elif len(replaces) > replaced_before:
                    dropped += 1  # written into its key's row, not published
                else:
                    queued += 1
        return queued, dropped

    @contextlib.contextmanager
    def hot_key_held(self, contender: Contender, workload: Workload) -> Any:
        """One hot key: another session holds it, so every message is a skip."""
        if (
            workload.keys != "hot"
            or contender.enqueue
            or contender.worker
            not in (
                "pglock",
                bench_app.UNAWAITED,
                bench_app.BASELINE,
            )
        ):
            yield
            return
        from celery_pglock import AdvisoryLock
        from celery_pglock.db import engines

        engine = engines.create_engine(self.services.database_url)
        task: Any = self.app.tasks[contender.task]  # a SingletonTask
        key = task.lock_key_for("hot", 0.0)
        lock = AdvisoryLock(engine=engine, key=key)
        if not lock.acquire():
            raise measuring.BenchError("the hot key is held by someone else")
        try:
            yield
        finally:
            lock.release()
            from celery_pglock.lock import sessions

            sessions.close_for(engine)
            engine.dispose()

    def drain(
        self,
        worker: WorkerProcess,
        record_dir: Path,
        contender: Contender,
        workload: Workload,
        count: int,
    ) -> Sample:
        queue = f"bench-{self.run_id}-{uuid.uuid4().hex[:6]}"
        before = len(measuring.records(record_dir))
        self.vacuum()
        try:
            with self.hot_key_held(contender, workload):
                redis0 = self.probe.redis_seconds()
                producer_pg0 = self.probe.producer_backends()
                producer0 = measuring.own_cpu()
                started = time.perf_counter()
                queued, dropped = self.publish(contender, workload, count, queue)
                publish_s = time.perf_counter() - started
                producer1 = measuring.own_cpu()
                producer_pg1 = self.probe.producer_backends()
                cpu0, sys0, pg0 = self.probe.cpu(worker)
                self.app.control.add_consumer(
                    queue, destination=[worker.hostname], reply=True, timeout=10
                )
                deadline = time.monotonic() + max(60.0, queued / 100)
                while len(measuring.records(record_dir)) - before < queued:
                    if time.monotonic() > deadline or not worker.running:
                        raise measuring.BenchError(
                            f"{contender.task} {workload}: drain incomplete; log {worker.log_path}"
                        )
                    time.sleep(0.05)
                cpu1, sys1, pg1 = self.probe.cpu(worker)
                redis1 = self.probe.redis_seconds()
                connections = len(self.probe.lock_backends(worker))
        finally:
            self.app.control.cancel_consumer(
                queue, destination=[worker.hostname], reply=True, timeout=10
            )
            self.forget(queue)
        mine = measuring.records(record_dir)
        mine.sort(key=lambda record: record[1])
        mine = mine[len(mine) - queued :] if queued else []
        sample = Sample(queued=queued, dropped=dropped, connections=connections)
        sample.ran = sum(1 for record in mine if record[2] == bench_app.RAN)
        sample.skipped = queued - sample.ran
        running = 0
        for _, step in sorted([(r[0], 1) for r in mine] + [(r[1], -1) for r in mine]):
            running += step
            sample.peak = max(sample.peak, running)
        span = (
            (max(r[1] for r in mine) - min(r[0] for r in mine)) / 1e9 if mine else 0.0
        )
        if queued >= 100:
            sample.rate = queued / span if span > 0 else None
            sample.worker_us = (cpu1 - cpu0) * 1e6 / queued
            sample.worker_sys_us = (sys1 - sys0) * 1e6 / queued
            if pg0 is not None and pg1 is not None:
                sample.pg_us = (pg1 - pg0) * 1e6 / queued
        # End to end, per send: the harness's pause between publish and consume (reading
        # CPU, add_consumer) is left out; nothing of a real producer's work is.
        sample.e2e_rate = count / (publish_s + span)
        sample.producer_us = (producer1 - producer0) * 1e6 / count
        sample.worker_send_us = (cpu1 - cpu0) * 1e6 / count
        if redis0 is not None and redis1 is not None:
            sample.redis_us = (redis1 - redis0) * 1e6 / count
        if (
            pg0 is not None
            and pg1 is not None
            and producer_pg0 is not None
            and producer_pg1 is not None
        ):
            producer_pg = sum(
                seconds - producer_pg0.get(pid, 0.0)
                for pid, seconds in producer_pg1.items()
            )
            sample.pg_send_us = (pg1 - pg0 + producer_pg) * 1e6 / count
        return sample

    def vacuum(self) -> None:
        """VACUUM the feature and floor tables before a drain, outside its figures: each
        drain meets them as autovacuum keeps them, even on a server that runs without it
        (whose dead rows would make each drain dearer than the one before)."""
        connection = _support.connect(
            self.services.database_url, application_name="bench vacuum"
        )
        try:
            with connection.cursor() as cursor:
                cursor.execute(
                    "SELECT quote_ident(relname) FROM pg_class WHERE relkind = 'r' AND "
                    "relname IN ('celery_pglock_queued', 'celery_pglock_periods', "
                    "'celery_pglock_fencing', 'bench_floor_queued', "
                    "'bench_floor_queued_unlogged', 'bench_floor_periods', "
                    "'bench_floor_latest', "
                    "'celery_pglock_history') "
                    "AND pg_table_is_visible(oid)"
                )
                tables = [row[0] for row in cursor.fetchall()]
                if tables:
                    cursor.execute(f"VACUUM {', '.join(tables)}")
        finally:
            connection.close()

    def warm_producer(self, chosen: dict[str, Contender]) -> None:
        """Open what the first send of each contender would open (the broker connection,
        the peers' Redis clients, the lock engine's pooled connection and its check that
        the queued-keys table exists), so that no drain pays for it."""
        with self.app.producer_or_acquire() as producer:
            producer.connection.ensure_connection(max_retries=3)
        for contender in chosen.values():
            task: Any = self.app.tasks[contender.task]
            if contender.task == bench_app.ONCE:
                task.once_backend.redis.ping()
            elif contender.task == bench_app.SINGLETON:
                task.singleton_backend.redis.ping()
            elif contender.task in (
                *bench_app.QUEUED_FLOOR_TABLES,
                bench_app.PLAIN_LATEST_ROW,
                bench_app.PLAIN_DEBOUNCED_ROW,
            ):
                bench_app.raw_connection()
            elif contender.enqueue:
                from celery_pglock.task import queued

                queued.TABLE.ensure(task._binding().engine(), 10.0)

    def forget(self, queue: str) -> None:
        with contextlib.suppress(redis.RedisError):
            self.redis.delete(queue)
            for prefix in ("_kombu.binding", "_kombu.binding_permanent"):
                for binding in self.redis.scan_iter(f"{prefix}.*", count=1000):
                    for member in self.redis.smembers(binding):
                        if queue.encode() in member:
                            self.redis.srem(binding, member)

    # -- the scenarios --------------------------------------------------------------------

    def comparison(self) -> dict[tuple[str, str], list[Sample]]:
        """Each repetition starts one worker per kind, then drains every workload with
        every contender back to back, in an order that rotates per repetition: a drain and
        the plain drain it is compared with run seconds apart (within a minute for the
        keyed workloads, compared with plain's distinct keys), not minutes (on a shared
        machine the speed of everything drifts over minutes; see summarise())."""
        samples: dict[tuple[str, str], list[Sample]] = {}
        chosen = {n: c for n, c in CONTENDERS.items() if n in self.args.contenders}
        kinds = list(dict.fromkeys(c.worker for c in chosen.values()))
        self.warm_producer(chosen)
        for repetition in range(self.args.repetitions):
            turn = repetition % len(chosen)
            order = list(chosen.items())[turn:] + list(chosen.items())[:turn]
            workers: dict[str, tuple[WorkerProcess, Path]] = {}
            try:
                for kind in kinds:
                    workers[kind] = self.worker(kind)
                for workload in self.args.workloads:
                    for name, contender in order:
                        if name in (PLAIN, ROUND_TRIPS) and workload in (
                            "one hot key",
                            "per-tenant mix",
                        ):
                            continue  # no key: the same as distinct keys
                        if name == SKIP_SUCCESS_ROW and workload != "one hot key":
                            continue  # only skips differ from the session row
                        if name in DISTINCT_ONLY and workload != "distinct keys":
                            continue
                        worker, record_dir = workers[contender.worker]
                        sample = self.drain(
                            worker,
                            record_dir,
                            contender,
                            WORKLOADS[workload],
                            self.args.messages,
                        )
                        samples.setdefault((name, workload), []).append(sample)
                        print(
                            f"  rep {repetition + 1} {name:<38} {workload:<16} {compare_report.describe(sample)}",
                            flush=True,
                        )
                for kind, (worker, _) in workers.items():
                    rss_now = measuring.rss(worker)
                    for (name, _), runs in samples.items():
                        if CONTENDERS[name].worker == kind:
                            runs[-1].rss = rss_now
            finally:
                for worker, _ in workers.values():
                    worker.stop(timeout=30)
        return samples

    def close(self) -> None:
        if set(FLOORS) & set(self.args.contenders):
            # The floors' rows of this run (its keys start with the run id); the two
            # small tables stay, shared with other runs.
            bench_app.forget_floor_rows(f"{self.run_id}-%")
        self.probe.close()
        self.redis.close()


def publish_path(
    services: Any, args: argparse.Namespace
) -> dict[str, list[dict[str, float | None]]]:
    """publish_path.py's figures, measured now on the same services (a process of its
    own: its producer is alone in it); it rewrites its section of the docs page too."""
    print("publish path: benchmarks/publish_path.py --calls 500 --reps 7", flush=True)
    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch) / "publish.json"
        command = [sys.executable, str(HERE / "publish_path.py"), "--json", str(out)]
        command += ["--calls", "500", "--reps", "7"]
        command += ["--no-docs"] if args.no_docs else ["--docs", str(args.docs)]
        subprocess.run(
            command, env={**os.environ, **services.env()}, check=True, timeout=600
        )
        results: dict[str, list[dict[str, float | None]]] = json.loads(out.read_text())
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--messages", type=int, default=2000, help="messages per drain")
    parser.add_argument("--repetitions", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=2, help="prefork children")
    parser.add_argument(
        "--flat",
        type=int,
        default=100_000,
        help="memory-flat run: N skips, then N runs",
    )
    parser.add_argument("--docs", type=Path, default=REPO / "docs" / "benchmarks.md")
    parser.add_argument(
        "--no-docs", action="store_true", help="do not write the docs page"
    )
    parser.add_argument("--json", type=Path)
    parser.add_argument(
        "--baseline",
        type=Path,
        help="a checkout of an earlier celery-pglock (e.g. a git worktree): adds the row "
        f"{BASELINE_ROW!r}, the same harness on that code, and its ratio to ours",
    )
    parser.add_argument(
        "--contenders",
        type=lambda text: text.split(","),
        default=[name for name in CONTENDERS if name != BASELINE_ROW],
        help="comma-separated subset of: " + ", ".join(CONTENDERS),
    )
    parser.add_argument(
        "--workloads",
        type=lambda text: text.split(","),
        default=list(WORKLOADS),
        help="comma-separated subset of: " + ", ".join(WORKLOADS),
    )
    parser.add_argument(
        "--no-threads", action="store_true", help="skip the threads-64 run"
    )
    parser.add_argument(
        "--no-publish-path",
        action="store_true",
        help="skip publish_path.py (run after the drains, on the same services)",
    )
    parser.add_argument(
        "--profile",
        nargs="?",
        const="distinct keys",
        metavar="WORKLOAD",
        help="first profile one drain (default: distinct keys) of plain and of "
        "SingletonTask in the pool children",
    )
    args = parser.parse_args(argv)
    if args.repetitions < 1 or args.messages < 100 or not args.flat >= 0:
        parser.error("--repetitions ≥ 1, --messages ≥ 100, --flat ≥ 0 (0: skip)")
    unknown = set(args.contenders) - set(CONTENDERS) | set(args.workloads) - set(
        WORKLOADS
    )
    if unknown:
        parser.error(f"unknown contenders/workloads: {', '.join(sorted(unknown))}")
    if args.baseline is not None:
        if not (args.baseline / "celery_pglock" / "__init__.py").is_file():
            parser.error(f"--baseline {args.baseline}: no celery_pglock/ package there")
        args.baseline = args.baseline.resolve()
        if BASELINE_ROW not in args.contenders:
            args.contenders.append(BASELINE_ROW)
    elif BASELINE_ROW in args.contenders:
        parser.error(f"{BASELINE_ROW!r} needs --baseline PATH")
    started = time.monotonic()
    command = "benchmarks/compare.py " + " ".join(
        argv if argv is not None else sys.argv[1:]
    )
    with start_services() as services:
        bench = Bench(services, args)
        try:
            if args.profile:
                print(compare_runs.profile(bench), flush=True)
            print(
                f"comparison: {args.messages} messages {compare_report.TIMES} {args.repetitions} repetitions, prefork concurrency {args.concurrency}",
                flush=True,
            )
            samples = bench.comparison()
            rows = compare_report.summarise(samples)
            connections, threads = 999, Sample(queued=0, dropped=0)
            if not args.no_threads:
                print("threads worker, concurrency 64", flush=True)
                connections, threads = compare_runs.threads64(bench)
                print(
                    f"  lock connections at most {connections} with {threads.peak} bodies at once",
                    flush=True,
                )
            flat: dict[str, float] = {}
            if args.flat:
                print(
                    f"memory-flat run: {args.flat:,} skips then {args.flat:,} runs",
                    flush=True,
                )
                flat = compare_runs.flat(bench)
            publish = None if args.no_publish_path else publish_path(services, args)
        finally:
            bench.close()
    checks = compare_report.verdicts(rows, connections, flat, args)
    checks18 = compare_report.issue18_verdicts(samples)
    checks35 = compare_report.issue35_verdicts(samples, publish)
    checks34 = compare_report.issue34_verdicts(samples)
    elapsed = time.monotonic() - started
    markdown = "\n".join(
        [
            compare_report.table(rows),
            "",
            compare_report.round_trip_note(rows),
            "",
            "| target (issue 7) | measured | verdict |",
            "|---|---|---|",
            *(
                f"| {name} | {value} | {'PASS' if ok else 'FAIL'} |"
                for name, value, ok in checks
            ),
            "",
            "End to end, per send (issue 18): publish time plus the first run's start to "
            "the last run's end; CPU of the producer during publish, of the worker during "
            "the drain, of redis-server and of the producer's and the worker's PostgreSQL "
            "backends, divided by the messages sent (dropped ones included).",
            "",
            compare_report.e2e_table(rows),
            "",
            "| target (issue 18) | measured | verdict |",
            "|---|---|---|",
            *(
                f"| {name} | {value} | {'PASS' if ok else 'FAIL'} |"
                for name, value, ok in checks18
            ),
            "",
            "| target (issue 34) | measured | verdict |",
            "|---|---|---|",
            *(
                f"| {name} | {value} | {'PASS' if ok else 'FAIL'} |"
                for name, value, ok in checks34
            ),
            "",
            "| target (issue 35) | measured | verdict |",
            "|---|---|---|",
            *(
                f"| {name} | {value} | {'PASS' if ok else 'FAIL'} |"
                for name, value, ok in checks35
            ),
            "",
            f"`{command.strip()}` — {elapsed / 60:.0f} min on {os.cpu_count()} CPUs, "
            f"load {' '.join(f'{x:.1f}' for x in os.getloadavg())} at the end; "
            f"PostgreSQL {services.postgres_version}, Redis broker. Medians over "
            f"{args.repetitions} repetitions of {args.messages:,} messages; ratios to plain "
            "with the same body and CPU over plain paired per repetition"
            + (
                f"; threads worker: {threads.peak} bodies at once."
                if not args.no_threads
                else "."
            ),
        ]
    )
    print()
    print(markdown)
    if not args.no_docs:
        compare_report.write_docs(args.docs, markdown)
        print(f"\nwritten to {args.docs}")
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "rows": {f"{k[0]} | {k[1]}": v for k, v in rows.items()},
                    "flat": flat,
                    "connections": connections,
                    "checks": checks,
                    "checks_issue_18": checks18,
                    "checks_issue_35": checks35,
                    "publish_path": publish,
                    "samples": {
                        f"{k[0]} | {k[1]}": [dataclasses.asdict(s) for s in v]
                        for k, v in samples.items()
                    },
                },
                indent=2,
            )
        )
    return 0 if all(ok for _, _, ok in [*checks, *checks18, *checks35]) else 1


if __name__ == "__main__":
    sys.exit(main())
