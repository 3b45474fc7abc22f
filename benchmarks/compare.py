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
64 bodies run) and a memory-flat run (a worker skips N messages, then runs N). It
prints the table and PASS/FAIL for each target of issue 7, and writes the table into
the generated section of ``docs/benchmarks.md``.

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
import statistics
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import psutil
import redis

from celery_pglock.testing import Services, WorkerProcess, _support, start_services

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
os.environ.setdefault("BENCH_CONTENDER", "all")
sys.path.insert(0, str(HERE))
import bench_app  # noqa: E402 - configured by the environment set above

MiB = 1024 * 1024
TENANTS = 50
SLOW_BODY = 0.002
TIMES = "\N{MULTIPLICATION SIGN}"  # the table is Markdown for people
BEGIN, END = "<!-- benchmark:begin -->", "<!-- benchmark:end -->"


@dataclasses.dataclass(frozen=True)
class Contender:
    worker: str  #: BENCH_CONTENDER of its worker
    task: str  #: task name
    locks_at_publish: bool = False  #: the peers lock when a message is published


#: A skip that ends SUCCESS (lock_skip_result="success") instead of FAILURE: what Celery's
#: failure path costs a skip. Drained with the hot key only.
SKIP_SUCCESS_ROW = "SingletonTask session, skips end SUCCESS"
#: Not a library mode: the release's reply read later (unsafe; see bench_app).
UNAWAITED_ROW = "SingletonTask session (release not awaited; measured only)"
CONTENDERS = {
    "plain": Contender("plain", bench_app.PLAIN),
    "plain + 2 round trips": Contender("plain", bench_app.PLAIN_ROUND_TRIPS),
    "SingletonTask session": Contender("pglock", bench_app.SESSION),
    "SingletonTask transaction": Contender("pglock", bench_app.TRANSACTION),
    SKIP_SUCCESS_ROW: Contender("pglock", bench_app.SKIP_SUCCESS),
    UNAWAITED_ROW: Contender(bench_app.UNAWAITED, bench_app.SESSION),
    "celery-once 3.0.1": Contender("once", bench_app.ONCE, True),
    "celery-singleton 0.3.1": Contender("singleton", bench_app.SINGLETON, True),
}


@dataclasses.dataclass(frozen=True)
class Workload:
    keys: str  #: "distinct", "hot" (held by another session throughout) or "tenants"
    body: float = 0.0  #: seconds each body sleeps


WORKLOADS = {
    "distinct keys": Workload("distinct"),
    "one hot key": Workload("hot"),
    "per-tenant mix": Workload("tenants"),
    "slow body 2 ms": Workload("distinct", SLOW_BODY),
}
#: The threads-64 run: bodies long enough for 64 locks to be held at once.
THREADS = Workload("distinct", 0.1)
SESSION, PLAIN, ROUND_TRIPS = "SingletonTask session", "plain", "plain + 2 round trips"


@dataclasses.dataclass
class Sample:
    queued: int
    dropped: int  #: refused at publish (peers)
    peak: int = 0  #: most bodies running at the same instant
    ran: int = 0
    skipped: int = 0
    rate: float | None = None  #: messages handled per second
    worker_us: float | None = None  #: worker CPU per handled message
    worker_sys_us: float | None = None  #: the kernel's share of it
    pg_us: float | None = None  #: lock-session backends' CPU per handled message
    connections: int = 0
    rss: float | None = None  #: MiB, largest task process, after the worker's drains


class BenchError(Exception):
    pass


# -- measuring ----------------------------------------------------------------------------


class Probe:
    """Reads CPU of a worker's processes and of its lock sessions' backends."""

    def __init__(self, services: Services) -> None:
        self.connection = _support.connect(
            services.database_url, application_name="pglock-bench probe"
        )
        self.connection.autocommit = True

    def lock_backends(self, worker: WorkerProcess) -> list[int]:
        pids = {worker.pid, *worker.child_pids()}
        with self.connection.cursor() as cursor:
            cursor.execute(
                "SELECT pid, application_name FROM pg_stat_activity WHERE application_name LIKE %s",
                (bench_app.APPLICATION_NAME + " %",),
            )
            rows = cursor.fetchall()
        found = []
        for backend, name in rows:
            tag = name.split(" ")[1] if " " in name else ""
            if tag.rpartition(":")[2].isdigit() and int(tag.rpartition(":")[2]) in pids:
                found.append(backend)
        return found

    def cpu(self, worker: WorkerProcess) -> tuple[float, float, float | None]:
        """(worker CPU s, of which system s, lock backends' CPU s or None if unreadable)."""
        total = system = 0.0
        for pid in (worker.pid, *worker.child_pids()):
            with contextlib.suppress(psutil.Error):
                times = psutil.Process(pid).cpu_times()
                total += times.user + times.system
                system += times.system
        server: float | None = 0.0
        for backend in self.lock_backends(worker):
            try:
                times = psutil.Process(backend).cpu_times()
            except psutil.Error:  # PostgreSQL on another host
                server = None
                break
            server = (server or 0.0) + times.user + times.system
        return total, system, server

    def close(self) -> None:
        self.connection.close()


def rss(worker: WorkerProcess) -> float:
    """RSS in MiB of the largest task process (threads/solo: the main process)."""
    sizes = []
    for pid in worker.child_pids() or [worker.pid]:
        with contextlib.suppress(psutil.Error):
            sizes.append(psutil.Process(pid).memory_info().rss / MiB)
    return max(sizes, default=0.0)


def records(directory: Path) -> list[tuple[int, int, int]]:
    found = []
    for path in directory.glob("*.rec"):
        data = path.read_bytes()
        size = bench_app.RECORD.size
        found.extend(
            bench_app.RECORD.unpack_from(data, offset)
            for offset in range(0, len(data) - len(data) % size, size)
        )
    return found


# -- one worker ---------------------------------------------------------------------------


class Bench:
    def __init__(self, services: Services, args: argparse.Namespace) -> None:
        self.services = services
        self.args = args
        self.run_id = uuid.uuid4().hex[:8]
        self.namespace = f"bench-{self.run_id}"
        self.probe = Probe(services)
        self.redis: Any = redis.Redis.from_url(services.broker_url, socket_timeout=10)
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
                "PYTHONPATH": os.pathsep.join([str(HERE), str(REPO)]),
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
            raise BenchError(f"{kind} worker never warmed up; log: {worker.log_path}")
        return worker, record_dir

    def publish(
        self, contender: Contender, workload: Workload, count: int, queue: str
    ) -> tuple[int, int]:
        """Publish ``count`` messages; (queued, dropped at publish)."""
        task = self.app.tasks[contender.task]
        rng = random.Random(self.run_id)  # noqa: S311 - test data
        queued = dropped = 0
        with self.app.producer_or_acquire() as producer:
            for i in range(count):
                key = {
                    "hot": "hot",
                    "tenants": f"t{rng.randrange(TENANTS)}",
                }.get(workload.keys, f"{self.run_id}-{uuid.uuid4().hex[:8]}-{i}")
                task_id = str(uuid.uuid4())
                result = task.apply_async(
                    (key, workload.body),
                    queue=queue,
                    task_id=task_id,
                    producer=producer,
                )
                if result is None or result.id != task_id:
                    dropped += 1  # the peers' publish-time lock refused it
                else:
                    queued += 1
        return queued, dropped

    @contextlib.contextmanager
    def hot_key_held(self, contender: Contender, workload: Workload) -> Any:
        """One hot key: another session holds it, so every message is a skip."""
        if workload.keys != "hot" or contender.worker not in (
            "pglock",
            bench_app.UNAWAITED,
        ):
            yield
            return
        from celery_pglock import AdvisoryLock, db

        engine = db.create_engine(self.services.database_url)
        key = self.app.tasks[contender.task].lock_key_for("hot", 0.0)
        lock = AdvisoryLock(engine=engine, key=key)
        if not lock.acquire():
            raise BenchError("the hot key is held by someone else")
        try:
            yield
        finally:
            lock.release()
            from celery_pglock import _session

            _session.close_for(engine)
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
        before = len(records(record_dir))
        try:
            with self.hot_key_held(contender, workload):
                queued, dropped = self.publish(contender, workload, count, queue)
                cpu0, sys0, pg0 = self.probe.cpu(worker)
                self.app.control.add_consumer(
                    queue, destination=[worker.hostname], reply=True, timeout=10
                )
                deadline = time.monotonic() + max(60.0, queued / 100)
                while len(records(record_dir)) - before < queued:
                    if time.monotonic() > deadline or not worker.running:
                        raise BenchError(
                            f"{contender.task} {workload}: drain incomplete; log {worker.log_path}"
                        )
                    time.sleep(0.05)
                cpu1, sys1, pg1 = self.probe.cpu(worker)
                connections = len(self.probe.lock_backends(worker))
        finally:
            self.app.control.cancel_consumer(
                queue, destination=[worker.hostname], reply=True, timeout=10
            )
            self.forget(queue)
        mine = records(record_dir)
        mine.sort(key=lambda record: record[1])
        mine = mine[len(mine) - queued :] if queued else []
        sample = Sample(queued=queued, dropped=dropped, connections=connections)
        sample.ran = sum(1 for record in mine if record[2] == bench_app.RAN)
        sample.skipped = queued - sample.ran
        running = 0
        for _, step in sorted([(r[0], 1) for r in mine] + [(r[1], -1) for r in mine]):
            running += step
            sample.peak = max(sample.peak, running)
        if queued >= 100:
            span = (max(r[1] for r in mine) - min(r[0] for r in mine)) / 1e9
            sample.rate = queued / span if span > 0 else None
            sample.worker_us = (cpu1 - cpu0) * 1e6 / queued
            sample.worker_sys_us = (sys1 - sys0) * 1e6 / queued
            if pg0 is not None and pg1 is not None:
                sample.pg_us = (pg1 - pg0) * 1e6 / queued
        return sample

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
                            f"  rep {repetition + 1} {name:<26} {workload:<16} {describe(sample)}",
                            flush=True,
                        )
                for kind, (worker, _) in workers.items():
                    rss_now = rss(worker)
                    for (name, _), runs in samples.items():
                        if CONTENDERS[name].worker == kind:
                            runs[-1].rss = rss_now
            finally:
                for worker, _ in workers.values():
                    worker.stop(timeout=30)
        return samples

    def threads64(self) -> tuple[int, Sample]:
        """Lock connections of a threads worker at concurrency 64, sampled during a drain."""
        worker, record_dir = self.worker("pglock", pool="threads", concurrency=64)
        probe = Probe(self.services)  # its own connection: used from the sampler thread
        peak = 0
        stop = threading.Event()

        def sample() -> None:
            nonlocal peak
            deadline = time.monotonic() + 300
            while not stop.is_set() and time.monotonic() < deadline:
                with contextlib.suppress(Exception):
                    peak = max(peak, len(probe.lock_backends(worker)))
                time.sleep(0.02)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        try:
            count = max(640, self.args.messages // 2)
            result = self.drain(worker, record_dir, CONTENDERS[SESSION], THREADS, count)
        finally:
            stop.set()
            sampler.join(timeout=10)
            probe.close()
            worker.stop(timeout=30)
        return peak, result

    def flat(self) -> dict[str, float]:
        """Skip N messages, then run N; RSS of the task processes along the way."""
        count = self.args.flat
        worker, record_dir = self.worker("pglock")
        contender = CONTENDERS[SESSION]
        task = self.app.tasks[contender.task]
        queue = f"bench-{self.run_id}-flat"
        marks: dict[str, float] = {}
        chunk = 5000
        try:
            self.app.control.add_consumer(
                queue, destination=[worker.hostname], reply=True, timeout=10
            )
            for phase in ("skip", "run"):
                held = self.hot_key_held(
                    contender,
                    WORKLOADS["one hot key" if phase == "skip" else "distinct keys"],
                )
                with held, self.app.producer_or_acquire() as producer:
                    done_before = len(records(record_dir))
                    deadline = time.monotonic() + max(120.0, count / 50)
                    for start in range(0, count, chunk):
                        for i in range(start, min(start + chunk, count)):
                            key = "hot" if phase == "skip" else f"{self.run_id}-f{i}"
                            task.apply_async((key, 0.0), queue=queue, producer=producer)
                        # Keep the queue short: wait until all but a chunk is consumed.
                        while (
                            len(records(record_dir)) - done_before
                            < min(start + chunk, count) - chunk
                        ):
                            if time.monotonic() > deadline:
                                raise BenchError(
                                    f"flat run too slow; log {worker.log_path}"
                                )
                            time.sleep(0.1)
                        if (
                            phase == "skip"
                            and "warm" not in marks
                            and start + chunk >= count // 10
                        ):
                            marks["warm"] = rss(worker)
                    while len(records(record_dir)) - done_before < count:
                        if time.monotonic() > deadline:
                            raise BenchError(
                                f"flat run too slow; log {worker.log_path}"
                            )
                        time.sleep(0.1)
                    marks[f"after {phase}"] = rss(worker)
            outcomes = [record[2] for record in records(record_dir)]
            marks["skipped"] = float(outcomes.count(bench_app.SKIPPED))
            marks["ran"] = float(outcomes.count(bench_app.RAN))
        finally:
            self.app.control.cancel_consumer(
                queue, destination=[worker.hostname], reply=True, timeout=10
            )
            self.forget(queue)
            worker.stop(timeout=30)
        return marks

    def profile(self) -> str:
        """One untimed drain per contender, pool children under cProfile."""
        import pstats

        out = []
        for name in ("plain", SESSION):
            contender = CONTENDERS[name]
            directory = Path(tempfile.mkdtemp(dir=self.tmp, prefix="profile-"))
            worker, record_dir = self.worker(contender.worker, profile_dir=directory)
            try:
                self.drain(
                    worker,
                    record_dir,
                    contender,
                    WORKLOADS[self.args.profile],
                    self.args.messages,
                )
            finally:
                worker.stop(timeout=30)
            stats: Any = pstats.Stats(*map(str, directory.glob("*.prof")))
            rows = sorted(
                (
                    (
                        own,
                        cum,
                        f"{where[0].split('site-packages/')[-1]}:{where[1]}({where[2]})",
                    )
                    for where, (_, _, own, cum, _) in stats.stats.items()
                ),
                reverse=True,
            )[:20]
            per = self.args.messages
            out.append(
                f"{name}: own / cumulative CPU µs per message (cProfile inflates small calls)"
            )
            out.extend(
                f"  {own * 1e6 / per:7.1f} {cum * 1e6 / per:8.1f}  {where}"
                for own, cum, where in rows
            )
        return "\n".join(out)

    def close(self) -> None:
        self.probe.close()
        self.redis.close()


# -- reporting ----------------------------------------------------------------------------


def describe(sample: Sample) -> str:
    rate = f"{sample.rate:7.0f}/s" if sample.rate else "     n/a"
    cpu = (
        f"{sample.worker_us:6.0f} us (sys {sample.worker_sys_us or 0:4.0f})"
        if sample.worker_us
        else "     n/a"
    )
    return f"{rate} wk {cpu} ran {sample.ran} skip {sample.skipped} dropped {sample.dropped}"


def median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def summarise(
    samples: dict[tuple[str, str], list[Sample]],
) -> dict[tuple[str, str], dict[str, Any]]:
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    for (name, workload), runs in samples.items():
        rows[name, workload] = {
            "rate": median([s.rate for s in runs]),
            "worker_us": median([s.worker_us for s in runs]),
            "pg_us": median([s.pg_us for s in runs]),
            "rss": median([s.rss for s in runs]),
            "connections": max(s.connections for s in runs),
            "ran": sum(s.ran for s in runs),
            "skipped": sum(s.skipped for s in runs),
            "dropped": sum(s.dropped for s in runs),
            "repetitions": len(runs),
        }
    for (name, workload), row in rows.items():
        base_key = (
            PLAIN,
            "slow body 2 ms" if workload.startswith("slow") else "distinct keys",
        )
        # Paired per repetition: each ratio and CPU difference compares two drains that
        # ran seconds apart, and the median is taken over those pairs.
        base_runs = samples.get(base_key)  # None when plain was not measured
        pairs = (
            list(zip(samples[name, workload], base_runs, strict=True))
            if base_runs
            else []
        )
        row["ratio"] = median(
            [s.rate / b.rate if s.rate and b.rate else None for s, b in pairs]
        )
        row["cpu_over_plain"] = median(
            [
                s.worker_us - b.worker_us
                if s.worker_us is not None and b.worker_us is not None
                else None
                for s, b in pairs
            ]
        )
    return rows


def fmt(value: float | None, pattern: str) -> str:
    return "n/a" if value is None else format(value, pattern)


def table(rows: dict[tuple[str, str], dict[str, Any]]) -> str:
    lines = [
        f"| workload | contender | msgs/s | {TIMES} plain | worker CPU µs/msg | PostgreSQL CPU µs/msg | RSS MiB | lock conns | ran / skipped / dropped at publish |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for workload in WORKLOADS:
        for name in CONTENDERS:
            row = rows.get((name, workload))
            if row is None:
                continue
            lines.append(
                f"| {workload} | {name} | {fmt(row['rate'], ',.0f')} | {fmt(row['ratio'], '.3f')} "
                f"| {fmt(row['worker_us'], ',.0f')} | {fmt(row['pg_us'], ',.0f')} | {fmt(row['rss'], '.0f')} "
                f"| {row['connections']} | {row['ran']} / {row['skipped']} / {row['dropped']} |"
            )
    return "\n".join(lines)


def verdicts(
    rows: dict[tuple[str, str], dict[str, Any]],
    connections: int,
    flat: dict[str, float],
    args: argparse.Namespace,
) -> list[tuple[str, str, bool]]:
    distinct = rows.get((SESSION, "distinct keys"), {})
    hot = rows.get((SESSION, "one hot key"), {})
    peers = [
        rows.get((name, "distinct keys"), {}).get("ratio")
        for name in CONTENDERS
        if CONTENDERS[name].locks_at_publish
    ]
    ratio = distinct.get("ratio")
    growth = flat.get("after run", 0.0) - flat.get("warm", 0.0)
    return [
        (
            f"distinct keys ≥ 0.95{TIMES} plain",
            f"{fmt(ratio, '.3f')}{TIMES}",
            ratio is not None and ratio >= 0.95,
        ),
        (
            "distinct keys above both peers",
            f"{fmt(ratio, '.3f')}{TIMES} vs "
            + " / ".join(f"{fmt(p, '.3f')}{TIMES}" for p in peers),
            ratio is not None and all(p is not None and ratio > p for p in peers),
        ),
        (
            "full contention ≥ distinct keys",
            f"{fmt(hot.get('ratio'), '.3f')}{TIMES} vs {fmt(ratio, '.3f')}{TIMES} plain "
            f"({fmt(hot.get('rate'), ',.0f')} vs {fmt(distinct.get('rate'), ',.0f')} msgs/s)",
            bool(hot.get("ratio") and ratio and hot["ratio"] >= ratio),
        ),
        (
            "worker CPU overhead ≤ 80 µs per locked task",
            f"{fmt(distinct.get('cpu_over_plain'), '+.0f')} µs",
            distinct.get("cpu_over_plain") is not None
            and distinct["cpu_over_plain"] <= 80,
        ),
        (
            "PostgreSQL CPU ≤ 60 µs per task",
            f"{fmt(distinct.get('pg_us'), '.0f')} µs",
            distinct.get("pg_us") is not None and distinct["pg_us"] <= 60,
        ),
        (
            "lock connections ≤ 2, threads worker at concurrency 64",
            str(connections),
            connections <= 2,
        ),
        (
            f"memory flat: {int(flat.get('skipped', 0)):,} skipped + {int(flat.get('ran', 0)):,} run, growth ≤ 10 MiB",
            f"{fmt(flat.get('warm'), '.1f')} → {fmt(flat.get('after skip'), '.1f')} → {fmt(flat.get('after run'), '.1f')} MiB ({growth:+.1f})",
            bool(flat) and growth <= 10.0,
        ),
    ]


def round_trip_note(rows: dict[tuple[str, str], dict[str, Any]]) -> str:
    """SingletonTask against the floor of two awaited round trips, in the same run."""
    floor = rows.get((ROUND_TRIPS, "distinct keys"), {})
    locked = rows.get((SESSION, "distinct keys"), {})
    needed = ("ratio", "cpu_over_plain")
    if not all(floor.get(k) is not None and locked.get(k) is not None for k in needed):
        return "(the two-round-trip floor: not measured in this run)"
    return (
        "The floor of a lock taken before the body and released, awaited, after it: a "
        f"plain task with a blocking `SELECT 1` before and after its body ran at "
        f"{floor['ratio']:.3f}{TIMES} plain, {floor['cpu_over_plain']:+,.0f} µs of worker "
        f"CPU and {fmt(floor.get('pg_us'), '.0f')} µs of PostgreSQL CPU per message in "
        f"this run; SingletonTask (session, distinct keys): {locked['ratio']:.3f}{TIMES}, "
        f"{locked['cpu_over_plain']:+,.0f} µs, {fmt(locked.get('pg_us'), '.0f')} µs."
    )


def write_docs(path: Path, text: str) -> None:
    """Replace only the generated section of the docs page (create the page if missing)."""
    block = f"{BEGIN}\n{text}\n{END}"
    if path.exists():
        current = path.read_text(encoding="utf-8")
        if BEGIN in current and END in current:
            head, _, rest = current.partition(BEGIN)
            _, _, tail = rest.partition(END)
            path.write_text(head + block + tail, encoding="utf-8")
            return
        path.write_text(current.rstrip("\n") + "\n\n" + block + "\n", encoding="utf-8")
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("# Benchmarks\n\n" + block + "\n", encoding="utf-8")


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
        "--contenders",
        type=lambda text: text.split(","),
        default=list(CONTENDERS),
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
    started = time.monotonic()
    command = "benchmarks/compare.py " + " ".join(
        argv if argv is not None else sys.argv[1:]
    )
    with start_services() as services:
        bench = Bench(services, args)
        try:
            if args.profile:
                print(bench.profile(), flush=True)
            print(
                f"comparison: {args.messages} messages {TIMES} {args.repetitions} repetitions, prefork concurrency {args.concurrency}",
                flush=True,
            )
            rows = summarise(bench.comparison())
            connections, threads = 999, Sample(queued=0, dropped=0)
            if not args.no_threads:
                print("threads worker, concurrency 64", flush=True)
                connections, threads = bench.threads64()
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
                flat = bench.flat()
        finally:
            bench.close()
    checks = verdicts(rows, connections, flat, args)
    elapsed = time.monotonic() - started
    markdown = "\n".join(
        [
            table(rows),
            "",
            round_trip_note(rows),
            "",
            "| target (issue 7) | measured | verdict |",
            "|---|---|---|",
            *(
                f"| {name} | {value} | {'PASS' if ok else 'FAIL'} |"
                for name, value, ok in checks
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
        write_docs(args.docs, markdown)
        print(f"\nwritten to {args.docs}")
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "rows": {f"{k[0]} | {k[1]}": v for k, v in rows.items()},
                    "flat": flat,
                    "connections": connections,
                    "checks": checks,
                },
                indent=2,
            )
        )
    return 0 if all(ok for _, _, ok in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
