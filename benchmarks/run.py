"""Throughput and memory of SingletonTask against a plain Celery task, in one run.

    .venv/bin/python benchmarks/run.py [--tasks N] [--rounds R]
        [--pool prefork|threads|solo] [--concurrency C] [--json out.json]

Method (benchmarks/README.md says how to read the output): for every variant and round
a fresh ``celery worker`` subprocess is started on an empty queue and waits until each of
its task processes has opened its lock connection; then N messages are published to the
benchmark queue and ``add_consumer`` switches the worker to it. The drain throughput is N
divided by the time from the first task start to the last task end, as the task
processes recorded them (bench_app's prerun/postrun records). CPU time of the worker's
processes and of its lock sessions' PostgreSQL backends is read before and after the
drain. Variants are interleaved (round r starts with the r-th variant), so a slow spell
of the shared machine hits all of them; medians are compared, and each round's ratio is
shown too, for the spread.

Hazard: this starts worker subprocesses and, without configured URLs, a private
PostgreSQL and Redis. Every phase has a deadline, and workers and embedded services are
stopped in ``finally`` blocks (plus testing.WorkerProcess's atexit net), also on Ctrl-C.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import importlib.metadata
import json
import os
import platform
import pstats
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

import bench_app
import celery
import kombu
import psutil  # type: ignore[import-untyped, unused-ignore]  # no stubs shipped
from kombu.utils.url import maybe_sanitize_url
from sqlalchemy.engine import make_url

from celery_pglock import config, db, testing
from celery_pglock.testing import _support
from celery_pglock.testing import services as testing_services

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator, Sequence

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
#: Read when set; otherwise the TEST_* variables of celery_pglock.testing, else embedded.
DATABASE_URL_ENV = config.DATABASE_URL_ENV  # CELERY_PGLOCK_DATABASE_URL
BROKER_URL_ENV = "CELERY_PGLOCK_BROKER_URL"
#: The speed target of the issue: a locked task keeps >= 0.95x plain Celery's throughput.
TARGET_RATIO = 0.95
#: The row the target is about: no contention, so pure lock overhead.
TARGET_VARIANT = "locked_per_arg"
MIB = 1024 * 1024


@dataclasses.dataclass(frozen=True, kw_only=True)
class Variant:
    """One row of the table: which task, called how, compared with which baseline."""

    name: str  #: Row label.
    task: str  #: Celery task name in bench_app.
    per_arg: bool  #: Called with a distinct ``i`` per message (else no arguments).
    plain_only: bool  #: Run on a worker that never imports celery_pglock.
    baseline: str | None  #: Variant whose median this one is divided by.
    locked: bool  #: Held to the throughput target.
    note: str  #: One line for the legend.


VARIANTS: tuple[Variant, ...] = (
    Variant(
        name="plain",
        task=bench_app.PLAIN,
        per_arg=True,
        plain_only=True,
        baseline=None,
        locked=False,
        note="plain Celery task, worker without celery_pglock (the baseline)",
    ),
    Variant(
        name="plain+pglock",
        task=bench_app.PLAIN,
        per_arg=True,
        plain_only=False,
        baseline="plain",
        locked=False,
        note="the same plain task in an app that also has SingletonTasks",
    ),
    Variant(
        name="locked_per_arg",
        task=bench_app.LOCKED_PER_ARG,
        per_arg=True,
        plain_only=False,
        baseline="plain",
        locked=True,
        note="SingletonTask lock_args=('i',), distinct i: pure lock overhead (TARGET)",
    ),
    Variant(
        name="locked_fixed",
        task=bench_app.LOCKED_FIXED,
        per_arg=False,
        plain_only=False,
        baseline="plain",
        locked=True,
        note="SingletonTask, one key: every run contends; losers are skipped",
    ),
    Variant(
        name="locked_xact",
        task=bench_app.LOCKED_XACT,
        per_arg=True,
        plain_only=False,
        baseline="plain",
        locked=True,
        note="as locked_per_arg, lock_scope='transaction'",
    ),
    Variant(
        name="plain_results",
        task=bench_app.PLAIN_RESULTS,
        per_arg=True,
        plain_only=True,
        baseline=None,
        locked=False,
        note="plain task, result stored (baseline of locked_results)",
    ),
    Variant(
        name="locked_results",
        task=bench_app.LOCKED_RESULTS,
        per_arg=True,
        plain_only=False,
        baseline="plain_results",
        locked=True,
        note="as locked_per_arg, result stored",
    ),
    Variant(
        name="plain_ignore",
        task=bench_app.PLAIN_IGNORE,
        per_arg=True,
        plain_only=True,
        baseline="plain",
        locked=False,
        note="plain task raising Ignore: Celery's own cost of a skip (not default)",
    ),
)
#: What runs without --variants (plain_ignore is a diagnostic for locked_fixed).
DEFAULT_VARIANTS = tuple(v.name for v in VARIANTS if v.name != "plain_ignore")
VARIANTS_BY_NAME = {variant.name: variant for variant in VARIANTS}


class BenchError(RuntimeError):
    """A measurement could not be completed (the message says which and why)."""


# -- services ------------------------------------------------------------------------------


@dataclasses.dataclass(kw_only=True)
class Endpoints:
    """Where the benchmark's services are."""

    database_url: str
    broker_url: str
    result_backend: str
    postgres_version: str
    started: list[str]  #: Embedded services this run started ("postgres", "redis").


@contextlib.contextmanager
def open_services(timeout: float = 30.0) -> Iterator[Endpoints]:
    """Configured services, else embedded ones (stopped on exit).

    CELERY_PGLOCK_DATABASE_URL / CELERY_PGLOCK_BROKER_URL win; then the test suite's
    CELERY_PGLOCK_TEST_* variables; whatever is still missing is started privately.
    """
    database_url = os.environ.get(DATABASE_URL_ENV, "")
    broker_url = os.environ.get(BROKER_URL_ENV, "")
    if database_url and broker_url:
        testing.wait_for_postgres(database_url, timeout)
        testing.wait_for_broker(broker_url, timeout)
        yield Endpoints(
            database_url=database_url,
            broker_url=broker_url,
            result_backend=testing_services.default_result_backend(
                broker_url, database_url
            ),
            postgres_version=testing_services.server_version(database_url),
            started=[],
        )
        return
    mapped = {
        testing.DATABASE_URL_ENV: database_url,
        testing.BROKER_URL_ENV: broker_url,
    }
    saved: dict[str, str | None] = {name: os.environ.get(name) for name in mapped}
    for name, value in mapped.items():
        if value:
            os.environ[name] = value
    try:
        services: testing.Services = testing.start_services(timeout=timeout)
    finally:
        for name, previous in saved.items():
            if previous is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = previous
    try:
        yield Endpoints(
            database_url=services.database_url,
            broker_url=services.broker_url,
            result_backend=services.result_backend_url,
            postgres_version=services.postgres_version,
            started=list(services.started),
        )
    finally:
        services.stop()


def mask(url: str) -> str:
    """A URL with its password hidden, for output."""
    if url.startswith(("postgres", "db+postgres")):
        return db.mask_url(url.removeprefix("db+"))
    return str(maybe_sanitize_url(url))


# -- one measurement -----------------------------------------------------------------------


@dataclasses.dataclass(kw_only=True)
class Sample:
    """One drain of N messages by one fresh worker."""

    variant: str
    round: int
    tasks: int  #: Tasks that recorded a run (== N unless something was lost).
    seconds: float  #: First task start to last task end.
    tasks_per_s: float
    steady_tasks_per_s: float  #: Between the 5th and 95th percentile of task ends.
    in_task_us_median: float  #: Median prerun -> postrun time of one task.
    in_task_us_p90: float
    #: CPU time (user + system) of the worker's processes during the drain, per task.
    worker_cpu_us: float
    #: The part of worker_cpu_us spent in the main process (prefork: not in pool children).
    main_cpu_us: float
    #: CPU time of the worker's lock-session backends during the drain, per task (None:
    #: PostgreSQL is not on this host, so its processes cannot be read).
    postgres_cpu_us: float | None
    ran: int  #: Runs whose state was SUCCESS.
    skipped: (
        int  #: Runs whose state was IGNORED (a SingletonTask that found its lock busy).
    )
    other: int  #: Anything else (failures): should be 0.
    task_rss_mib: float  #: Largest RSS of a process that ran tasks, after the drain.
    task_uss_mib: (
        float  #: Its unique set size (memory not shared with other processes).
    )
    main_rss_mib: float  #: RSS of the worker's main process.
    wall_seconds: float  #: Publish + start + drain + stop, for the record.


@dataclasses.dataclass(frozen=True, kw_only=True)
class Settings:
    """Command-line settings shared by every measurement."""

    tasks: int
    rounds: int
    pool: str
    concurrency: int
    start_timeout: float
    drain_timeout: float
    stop_timeout: float
    run_id: str
    queue: str  #: Loaded with N messages before each drain.
    idle_queue: str  #: What a worker consumes until it is switched to ``queue``.
    namespace: str
    work_dir: Path


def publisher(endpoints: Endpoints) -> celery.Celery:
    """A bare app that only sends by task name (no result backend: no subscriptions)."""
    app = celery.Celery("bench-publisher", broker=endpoints.broker_url)
    app.conf.broker_connection_retry_on_startup = True
    return app


def reset_queue(app: celery.Celery, queue: str, *, delete: bool = False) -> None:
    """Declare and empty (or delete) the benchmark queue."""
    with app.connection_for_write() as connection:
        channel = connection.default_channel
        bound = kombu.Queue(queue, kombu.Exchange(queue), routing_key=queue)(channel)
        if delete:
            bound.delete()
        else:
            bound.declare()
            bound.purge()


def forget_bindings(broker_url: str, settings: Settings) -> None:
    """Delete the routing keys kombu's Redis transport keeps after a queue is deleted."""
    if not broker_url.startswith(("redis://", "rediss://")):
        return
    import redis

    client: Any = redis.Redis.from_url(broker_url, socket_timeout=5)
    try:
        names = [
            f"{prefix}.{queue}"
            for queue in (settings.queue, settings.idle_queue)
            for prefix in ("_kombu.binding", "_kombu.binding_permanent")
        ]
        with contextlib.suppress(redis.RedisError):
            client.delete(*names)
    finally:
        client.close()


def publish(app: celery.Celery, variant: Variant, settings: Settings) -> None:
    """Publish N messages of ``variant`` to the benchmark queue (nobody consumes it yet)."""
    deadline = time.monotonic() + max(60.0, settings.tasks / 200)
    with app.producer_or_acquire() as producer:
        for i in range(settings.tasks):
            app.send_task(
                variant.task,
                args=(i,) if variant.per_arg else (),
                queue=settings.queue,
                producer=producer,
            )
            if i % 256 == 0 and time.monotonic() > deadline:
                raise BenchError(f"Publishing {settings.tasks} messages took too long.")


def record_count(directory: Path) -> int:
    """Tasks recorded so far by the worker's processes."""
    total = 0
    for path in directory.glob("*.rec"):
        with contextlib.suppress(OSError):
            total += path.stat().st_size // bench_app.RECORD.size
    return total


def read_records(directory: Path) -> list[tuple[int, int, int]]:
    """Every (start_ns, end_ns, outcome) record the worker's processes wrote."""
    records: list[tuple[int, int, int]] = []
    for path in sorted(directory.glob("*.rec")):
        data = path.read_bytes()
        usable = len(data) - len(data) % bench_app.RECORD.size
        records.extend(bench_app.RECORD.iter_unpack(data[:usable]))
    return records


def wait_for_drain(
    worker: testing.WorkerProcess, directory: Path, settings: Settings
) -> None:
    """Wait until N tasks have been recorded, the worker died, or the deadline passed."""
    deadline = time.monotonic() + settings.drain_timeout
    while True:
        if record_count(directory) >= settings.tasks:
            return
        if not worker.running:
            raise BenchError(
                f"Worker {worker.hostname} exited during the drain "
                f"(code {worker.returncode}); log: {worker.log_path}\n"
                + worker.log_text()[-3000:]
            )
        if time.monotonic() > deadline:
            raise BenchError(
                f"Only {record_count(directory)} of {settings.tasks} tasks ran within "
                f"{settings.drain_timeout:g} s (--drain-timeout); log: {worker.log_path}\n"
                + worker.log_text()[-3000:]
            )
        time.sleep(0.02)


def memory(worker: testing.WorkerProcess, pool: str) -> tuple[float, float, float]:
    """(largest task-process RSS, its USS, main RSS) in MiB."""
    main = psutil.Process(worker.pid)
    main_rss = main.memory_info().rss / MIB
    if pool != "prefork":
        return main_rss, main.memory_full_info().uss / MIB, main_rss
    best = (0.0, 0.0)
    for pid in worker.child_pids():
        with contextlib.suppress(psutil.Error):
            info = psutil.Process(pid).memory_full_info()
            best = max(best, (info.rss / MIB, info.uss / MIB))
    return best[0], best[1], main_rss


def worker_env(
    endpoints: Endpoints,
    variant: Variant,
    settings: Settings,
    record_dir: Path,
    profile_dir: Path | None,
) -> dict[str, str]:
    env = {
        bench_app.BROKER_URL_ENV: endpoints.broker_url,
        bench_app.RESULT_BACKEND_ENV: endpoints.result_backend,
        bench_app.DATABASE_URL_ENV: endpoints.database_url,
        bench_app.NAMESPACE_ENV: settings.namespace,
        bench_app.QUEUE_ENV: settings.queue,
        bench_app.RECORD_DIR_ENV: str(record_dir),
        bench_app.POOL_ENV: settings.pool,
        bench_app.WARM_CONNECTIONS_ENV: str(
            settings.concurrency if settings.pool == "threads" else 1
        ),
        bench_app.PLAIN_ONLY_ENV: "1" if variant.plain_only else "0",
        "PYTHONPATH": os.pathsep.join(
            filter(None, [str(BENCH_DIR), str(REPO_ROOT), os.environ.get("PYTHONPATH")])
        ),
    }
    if profile_dir is not None:
        env[bench_app.PROFILE_DIR_ENV] = str(profile_dir)
    return env


def wait_for_warm(
    worker: testing.WorkerProcess, directory: Path, expected: int, timeout: float
) -> None:
    """Wait until every task process has opened its lock connection(s)."""

    def warm() -> int:
        return len(list(directory.glob(f"*{bench_app.WARM_SUFFIX}")))

    deadline = time.monotonic() + timeout
    while warm() < expected:
        if not worker.running or time.monotonic() > deadline:
            raise BenchError(
                f"Worker {worker.hostname}: {warm()} of {expected} task processes warmed "
                f"up within {timeout:g} s; log: {worker.log_path}\n"
                + worker.log_text()[-3000:]
            )
        time.sleep(0.02)


def add_consumer(
    app: celery.Celery, worker: testing.WorkerProcess, queue: str, timeout: float
) -> None:
    """Make the (idle, warm) worker start consuming the loaded queue now."""
    deadline = time.monotonic() + timeout
    while True:
        replies = app.control.add_consumer(
            queue,
            exchange=queue,
            routing_key=queue,
            destination=[worker.hostname],
            reply=True,
            timeout=2.0,
        )
        if any(worker.hostname in reply for reply in replies or ()):
            return
        if not worker.running or time.monotonic() > deadline:
            raise BenchError(
                f"Worker {worker.hostname} did not confirm add_consumer({queue!r}) within "
                f"{timeout:g} s; log: {worker.log_path}"
            )


class CpuMeter:
    """CPU seconds of a worker's processes and of its lock sessions' backends.

    The backends are found in pg_stat_activity by the ``host:pid`` tag celery_pglock puts
    in application_name, and read with psutil, so only a PostgreSQL on this host counts
    (``postgres_visible`` says whether it could be read).
    """

    def __init__(self, worker: testing.WorkerProcess, database_url: str) -> None:
        self.worker = worker
        self.database_url = database_url
        host = make_url(database_url).host or "localhost"
        self.postgres_visible = host in (
            "127.0.0.1",
            "localhost",
            "::1",
        ) or host.startswith("/")
        self._connection: Any = None

    def close(self) -> None:
        if self._connection is not None:
            with contextlib.suppress(Exception):
                self._connection.close()
            self._connection = None

    def snapshot(self) -> tuple[dict[int, float], dict[int, float]]:
        """({worker pid: cpu s}, {backend pid: cpu s})."""
        pids = [self.worker.pid, *self.worker.child_pids()]
        return _cpu(pids), _cpu(self._backends(pids)) if self.postgres_visible else {}

    def _backends(self, worker_pids: Sequence[int]) -> list[int]:
        if self._connection is None:
            self._connection = _support.connect(
                self.database_url, application_name="celery_pglock bench probe"
            )
        with self._connection.cursor() as cursor:
            cursor.execute(
                "SELECT pid, application_name FROM pg_stat_activity "
                "WHERE application_name LIKE %s",
                (bench_app.APPLICATION_NAME + " %",),
            )
            rows = cursor.fetchall()
        wanted = {str(pid) for pid in worker_pids}
        found = []
        for backend, name in rows:
            tag = name.split(" ")[1] if " " in name else ""
            if tag.rpartition(":")[2] in wanted:
                found.append(int(backend))
        return found


def _cpu(pids: Sequence[int]) -> dict[int, float]:
    seconds = {}
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            times = psutil.Process(pid).cpu_times()
            seconds[pid] = times.user + times.system
    return seconds


def _spent(before: dict[int, float], after: dict[int, float]) -> float:
    # A process born during the drain (a new lock connection's backend) counts in full.
    return sum(value - before.get(pid, 0.0) for pid, value in after.items())


def measure(
    app: celery.Celery,
    endpoints: Endpoints,
    variant: Variant,
    round_no: int,
    settings: Settings,
    profile_dir: Path | None = None,
) -> Sample:
    """Start a worker on an idle queue, load the bench queue, then switch it over.

    The worker is started first and waits, warm, on a queue that stays empty; the N
    messages are published; then ``add_consumer`` points the worker at them. So the
    drain is not mixed up with worker start-up, and the CPU meters read before and after
    see the drain alone. The worker is always stopped.
    """
    began = time.monotonic()
    label = f"r{round_no}-{variant.name}" + ("-profile" if profile_dir else "")
    record_dir = settings.work_dir / label
    record_dir.mkdir()
    reset_queue(app, settings.queue)
    worker = testing.WorkerProcess(
        "bench_app",
        env=worker_env(endpoints, variant, settings, record_dir, profile_dir),
        pool=settings.pool,
        concurrency=settings.concurrency,
        hostname=f"pglock-bench-{settings.run_id}-{label}@%h",
        queues=[settings.idle_queue],
        log_path=settings.work_dir / f"{label}.log",
    )
    meter = CpuMeter(worker, endpoints.database_url)
    try:
        worker.start(timeout=settings.start_timeout)
        processes = settings.concurrency if settings.pool == "prefork" else 1
        wait_for_warm(worker, record_dir, processes, settings.start_timeout)
        publish(app, variant, settings)
        cpu_before = meter.snapshot()
        add_consumer(app, worker, settings.queue, settings.start_timeout)
        wait_for_drain(worker, record_dir, settings)
        cpu_after = meter.snapshot()
        rss, uss, main_rss = memory(worker, settings.pool)
    finally:
        meter.close()
        worker.stop(timeout=settings.stop_timeout)
    records = read_records(record_dir)
    if not records:
        raise BenchError(f"{label}: no task records in {record_dir}.")
    first = min(start for start, _end, _outcome in records)
    last = max(end for _start, end, _outcome in records)
    seconds = (last - first) / 1e9
    ends = sorted(end for _start, end, _outcome in records)
    low, high = int(len(ends) * 0.05), int(len(ends) * 0.95) - 1
    steady_span = (ends[high] - ends[low]) / 1e9
    durations = sorted((end - start) / 1e3 for start, end, _outcome in records)
    outcomes = [outcome for _start, _end, outcome in records]
    count = len(records)
    return Sample(
        variant=variant.name,
        round=round_no,
        tasks=count,
        seconds=seconds,
        tasks_per_s=count / seconds if seconds > 0 else float("nan"),
        steady_tasks_per_s=(high - low) / steady_span
        if steady_span > 0
        else float("nan"),
        in_task_us_median=statistics.median(durations),
        in_task_us_p90=durations[int(len(durations) * 0.9)],
        worker_cpu_us=_spent(cpu_before[0], cpu_after[0]) * 1e6 / count,
        main_cpu_us=(
            cpu_after[0].get(worker.pid, 0.0) - cpu_before[0].get(worker.pid, 0.0)
        )
        * 1e6
        / count,
        postgres_cpu_us=_spent(cpu_before[1], cpu_after[1]) * 1e6 / count
        if meter.postgres_visible
        else None,
        ran=outcomes.count(bench_app.OUTCOME_SUCCESS),
        skipped=outcomes.count(bench_app.OUTCOME_IGNORED),
        other=outcomes.count(bench_app.OUTCOME_OTHER),
        task_rss_mib=rss,
        task_uss_mib=uss,
        main_rss_mib=main_rss,
        wall_seconds=time.monotonic() - began,
    )


# -- summary -------------------------------------------------------------------------------


@dataclasses.dataclass(kw_only=True)
class Summary:
    """One variant over all rounds."""

    variant: str
    baseline: str | None
    locked: bool
    tasks_per_s_median: float
    tasks_per_s_min: float
    tasks_per_s_max: float
    ratio: float | None  #: median / baseline median.
    round_ratios: list[float]  #: Same-round ratios, for the spread.
    meets_target: bool | None  #: ratio >= TARGET_RATIO (locked variants only).
    in_task_us_median: float
    in_task_extra_us: float | None  #: Median in-task time minus the baseline's.
    worker_cpu_us: float  #: Median worker CPU per task.
    postgres_cpu_us: float | None  #: Median lock-backend CPU per task.
    #: (worker + backend CPU) minus the baseline's, per task.
    cpu_extra_us: float | None
    #: Baseline CPU per task / this variant's: the throughput ratio to expect when the
    #: host's CPUs, not latency, are the limit (Redis's own CPU is not counted).
    cpu_ratio: float | None
    task_rss_mib: float
    rss_ratio: float | None
    task_uss_mib: float
    ran: int
    skipped: int
    other: int


def _total_cpu(sample: Sample) -> float:
    return sample.worker_cpu_us + (sample.postgres_cpu_us or 0.0)


def summarize(variants: Sequence[Variant], samples: Sequence[Sample]) -> list[Summary]:
    by_variant: dict[str, list[Sample]] = {variant.name: [] for variant in variants}
    for sample in samples:
        by_variant[sample.variant].append(sample)

    def median(name: str, field: Callable[[Sample], float]) -> float:
        return statistics.median(field(sample) for sample in by_variant[name])

    summaries = []
    for variant in variants:
        mine = by_variant[variant.name]
        if not mine:
            continue
        rates = [sample.tasks_per_s for sample in mine]
        base = variant.baseline if by_variant.get(variant.baseline or "") else None
        ratio = extra = rss_ratio = cpu_extra = cpu_ratio = None
        round_ratios: list[float] = []
        if base is not None:
            ratio = statistics.median(rates) / median(base, lambda s: s.tasks_per_s)
            extra = median(variant.name, lambda s: s.in_task_us_median) - median(
                base, lambda s: s.in_task_us_median
            )
            rss_ratio = median(variant.name, lambda s: s.task_rss_mib) / median(
                base, lambda s: s.task_rss_mib
            )
            cpu_extra = median(variant.name, _total_cpu) - median(base, _total_cpu)
            cpu_ratio = median(base, _total_cpu) / median(variant.name, _total_cpu)
            base_by_round = {s.round: s for s in by_variant[base]}
            round_ratios = [
                s.tasks_per_s / base_by_round[s.round].tasks_per_s
                for s in mine
                if s.round in base_by_round
            ]
        summaries.append(
            Summary(
                variant=variant.name,
                baseline=base,
                locked=variant.locked,
                tasks_per_s_median=statistics.median(rates),
                tasks_per_s_min=min(rates),
                tasks_per_s_max=max(rates),
                ratio=ratio,
                round_ratios=round_ratios,
                meets_target=None
                if ratio is None or not variant.locked
                else ratio >= TARGET_RATIO,
                in_task_us_median=median(variant.name, lambda s: s.in_task_us_median),
                in_task_extra_us=extra,
                worker_cpu_us=median(variant.name, lambda s: s.worker_cpu_us),
                postgres_cpu_us=None
                if any(s.postgres_cpu_us is None for s in mine)
                else median(variant.name, lambda s: s.postgres_cpu_us or 0.0),
                cpu_extra_us=cpu_extra,
                cpu_ratio=cpu_ratio,
                task_rss_mib=median(variant.name, lambda s: s.task_rss_mib),
                rss_ratio=rss_ratio,
                task_uss_mib=median(variant.name, lambda s: s.task_uss_mib),
                ran=sum(s.ran for s in mine),
                skipped=sum(s.skipped for s in mine),
                other=sum(s.other for s in mine),
            )
        )
    return summaries


def render(summaries: Sequence[Summary], settings: Settings) -> str:
    header = (
        f"{'variant':<15} {'tasks/s median [min-max]':>24} {'ratio':>6} "
        f"{'per-round':>10} {'target':>10} {'in-task us (+)':>15} "
        f"{'CPU us/task wk+pg':>17} {'CPU r':>5} {'RSS MiB (x)':>12} {'ran/skip':>10}"
    )
    lines = [header, "-" * len(header)]
    for s in summaries:
        rate = f"{s.tasks_per_s_median:.0f} [{s.tasks_per_s_min:.0f}-{s.tasks_per_s_max:.0f}]"
        ratio = "-" if s.ratio is None else f"{s.ratio:.3f}"
        spread = (
            f"{min(s.round_ratios):.2f}-{max(s.round_ratios):.2f}"
            if s.round_ratios
            else "-"
        )
        target = _verdict(s)
        in_task = f"{s.in_task_us_median:.0f}"
        if s.in_task_extra_us is not None:
            in_task += f" ({s.in_task_extra_us:+.0f})"
        pg = "?" if s.postgres_cpu_us is None else f"{s.postgres_cpu_us:.0f}"
        cpu = f"{s.worker_cpu_us:.0f}+{pg}"
        cpu_ratio = "-" if s.cpu_ratio is None else f"{s.cpu_ratio:.2f}"
        rss = f"{s.task_rss_mib:.1f}"
        if s.rss_ratio is not None:
            rss += f" ({s.rss_ratio:.2f})"
        lines.append(
            f"{s.variant:<15} {rate:>24} {ratio:>6} {spread:>10} {target:>10} "
            f"{in_task:>15} {cpu:>17} {cpu_ratio:>5} {rss:>12} "
            f"{f'{s.ran}/{s.skipped}':>10}"
        )
    total = settings.tasks * settings.rounds
    failed = [s.variant for s in summaries if s.other]
    lines.append("")
    lines.append(
        "ratio: median tasks/s over the baseline's median; per-round: same-round "
        "ratios; (+n): minus\nthe baseline; CPU r: baseline CPU/task over this one's "
        "(the ratio when CPU-bound); ran/skip:\n"
        f"totals of {total} messages per variant."
        + (f" FAILED runs in {', '.join(failed)}." if failed else "")
    )
    if any(_straddles(s) for s in summaries):
        lines.append(
            "?: the per-round ratios straddle the target, so this run cannot tell; "
            "add --rounds."
        )
    headline = next((s for s in summaries if s.variant == TARGET_VARIANT), None)
    if headline is not None and headline.ratio is not None:
        cpu = (
            ""
            if headline.cpu_ratio is None
            else f", CPU-bound {headline.cpu_ratio:.2f}"
        )
        lines.append(
            f"TARGET {TARGET_VARIANT} >= {TARGET_RATIO}x plain: {_verdict(headline)} "
            f"(median {headline.ratio:.3f}, per-round "
            f"{min(headline.round_ratios):.2f}-{max(headline.round_ratios):.2f}{cpu})"
        )
    return "\n".join(lines)


def _straddles(summary: Summary) -> bool:
    rounds = summary.round_ratios
    return (
        summary.meets_target is not None
        and bool(rounds)
        and min(rounds) < TARGET_RATIO <= max(rounds)
    )


def _verdict(summary: Summary) -> str:
    if summary.meets_target is None:
        return "-"
    text = f"ok>={TARGET_RATIO}" if summary.meets_target else f"BELOW {TARGET_RATIO}"
    return text + ("?" if _straddles(summary) else "")


# -- profile -------------------------------------------------------------------------------


def render_profile(variant: str, directory: Path, tasks: int, *, top: int = 22) -> str:
    """Top functions by own time per task, over every pool child of a profiled drain."""
    files = sorted(str(path) for path in directory.glob("*.prof"))
    if not files:
        return f"{variant}: no profile written (prefork children only)"
    stats = pstats.Stats(*files)
    rows: list[tuple[float, float, int, str]] = []
    for func, (_cc, calls, tottime, cumtime, _callers) in stats.stats.items():  # type: ignore[attr-defined]
        filename, line, name = func
        where = _short_path(filename)
        rows.append((tottime, cumtime, calls, f"{where}:{line}({name})"))
    rows.sort(reverse=True)
    lines = [
        f"{variant}: top {top} by own time, microseconds per task under cProfile "
        f"({len(files)} child profiles, {tasks} tasks)",
        f"  {'own us':>7} {'cum us':>7} {'calls/task':>10}  function",
    ]
    for tottime, cumtime, calls, label in rows[:top]:
        lines.append(
            f"  {tottime * 1e6 / tasks:>7.1f} {cumtime * 1e6 / tasks:>7.1f} "
            f"{calls / tasks:>10.2f}  {label}"
        )
    return "\n".join(lines)


def _short_path(filename: str) -> str:
    for marker in ("site-packages/", "celery_pglock/", "benchmarks/"):
        if marker in filename:
            head = "" if marker == "site-packages/" else marker
            return head + filename.split(marker, 1)[1]
    return filename


# -- main ----------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="SingletonTask throughput and memory against a plain Celery task."
    )
    parser.add_argument("--tasks", type=int, default=2000, help="messages per drain")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds")
    parser.add_argument(
        "--pool", choices=("prefork", "threads", "solo"), default="prefork"
    )
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument(
        "--variants",
        default=",".join(DEFAULT_VARIANTS),
        help="comma-separated subset of: " + ", ".join(VARIANTS_BY_NAME),
    )
    parser.add_argument("--json", type=Path, help="also write every sample here")
    parser.add_argument(
        "--profile",
        action="store_true",
        help="after the timed rounds, drain once more per variant under cProfile "
        "(prefork children) and print where the time goes",
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help=f"exit 1 when {TARGET_VARIANT}'s median ratio is below {TARGET_RATIO}",
    )
    parser.add_argument("--start-timeout", type=float, default=60.0)
    parser.add_argument(
        "--drain-timeout",
        type=float,
        default=None,
        help="seconds per drain (default: 60 + tasks/20)",
    )
    parser.add_argument("--stop-timeout", type=float, default=30.0)
    args = parser.parse_args(argv)
    unknown = set(args.variants.split(",")) - set(VARIANTS_BY_NAME)
    if unknown:
        parser.error(
            f"unknown variants {sorted(unknown)}; known: {list(VARIANTS_BY_NAME)}"
        )
    if args.tasks < 20 or args.rounds < 1 or args.concurrency < 1:
        parser.error("need --tasks >= 20, --rounds >= 1 and --concurrency >= 1")
    if args.pool == "solo" and args.concurrency != 1:
        args.concurrency = 1
    return args


def environment(endpoints: Endpoints, settings: Settings) -> dict[str, Any]:
    load = os.getloadavg() if hasattr(os, "getloadavg") else (float("nan"),) * 3
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
            timespec="seconds"
        ),
        "host_cpus": os.cpu_count(),
        "load_average": [round(x, 2) for x in load],
        "python": platform.python_version(),
        "celery": importlib.metadata.version("celery"),
        "kombu": importlib.metadata.version("kombu"),
        "postgresql": endpoints.postgres_version,
        "database": mask(endpoints.database_url),
        "broker": mask(endpoints.broker_url),
        "result_backend": mask(endpoints.result_backend),
        "embedded": endpoints.started,
        "tasks": settings.tasks,
        "rounds": settings.rounds,
        "pool": settings.pool,
        "concurrency": settings.concurrency,
    }


def rotated(variants: Sequence[Variant], round_no: int) -> list[Variant]:
    shift = round_no % len(variants)
    return [*variants[shift:], *variants[:shift]]


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    variants = [VARIANTS_BY_NAME[name] for name in args.variants.split(",")]
    run_id = uuid.uuid4().hex[:8]
    work_dir = Path(tempfile.mkdtemp(prefix=f"pglock-bench-{run_id}-"))
    settings = Settings(
        tasks=args.tasks,
        rounds=args.rounds,
        pool=args.pool,
        concurrency=args.concurrency,
        start_timeout=args.start_timeout,
        drain_timeout=args.drain_timeout or 60.0 + args.tasks / 20,
        stop_timeout=args.stop_timeout,
        run_id=run_id,
        queue=f"pglock-bench-{run_id}",
        idle_queue=f"pglock-bench-{run_id}-idle",
        namespace=f"bench-{run_id}",
        work_dir=work_dir,
    )
    samples: list[Sample] = []
    profiles: dict[str, str] = {}
    status = 0
    try:
        with open_services() as endpoints:
            env = environment(endpoints, settings)
            print(
                f"celery-pglock benchmark {env['date']}: {settings.tasks} tasks x "
                f"{settings.rounds} rounds, --pool {settings.pool} --concurrency "
                f"{settings.concurrency}; {env['host_cpus']} CPUs, load "
                f"{' '.join(map(str, env['load_average']))}",
                flush=True,
            )
            print(
                f"database {env['database']} (PostgreSQL {env['postgresql']}), broker "
                f"{env['broker']}, results {env['result_backend']}"
                + (
                    f"; embedded: {', '.join(env['embedded'])}"
                    if env["embedded"]
                    else ""
                ),
                flush=True,
            )
            app = publisher(endpoints)
            try:
                for round_no in range(settings.rounds):
                    for variant in rotated(variants, round_no):
                        sample = measure(app, endpoints, variant, round_no, settings)
                        samples.append(sample)
                        print(
                            f"  round {round_no + 1}/{settings.rounds} "
                            f"{variant.name:<15} {sample.tasks_per_s:7.0f} tasks/s "
                            f"({sample.tasks} in {sample.seconds:.2f} s, in-task "
                            f"{sample.in_task_us_median:.0f} us, ran/skipped "
                            f"{sample.ran}/{sample.skipped}, RSS {sample.task_rss_mib:.1f} MiB)",
                            file=sys.stderr,
                            flush=True,
                        )
                if args.profile:
                    profiles = run_profiles(app, endpoints, variants, settings)
            finally:
                for queue in (settings.queue, settings.idle_queue):
                    with contextlib.suppress(Exception):
                        reset_queue(app, queue, delete=True)
                forget_bindings(endpoints.broker_url, settings)
            env["load_average_after"] = [
                round(x, 2)
                for x in (os.getloadavg() if hasattr(os, "getloadavg") else ())
            ]
    except (BenchError, testing.ServiceError) as error:
        print(f"benchmark failed: {error}", file=sys.stderr)
        status = 2
        env = {}
    except KeyboardInterrupt:
        print("interrupted; workers stopped", file=sys.stderr)
        status = 130
        env = {}
    finally:
        if status == 0:
            shutil.rmtree(work_dir, ignore_errors=True)
        else:
            print(f"worker logs kept in {work_dir}", file=sys.stderr)
    summaries = summarize(variants, samples)
    if summaries:
        print()
        print(render(summaries, settings))
        print()
        for variant in variants:
            print(f"  {variant.name:<15} {variant.note}")
    for text in profiles.values():
        print()
        print(text)
    headline = next((s for s in summaries if s.variant == TARGET_VARIANT), None)
    if args.check and status == 0 and (headline is None or not headline.meets_target):
        status = 1
    if args.json is not None:
        args.json.write_text(
            json.dumps(
                {
                    "environment": env,
                    "target_ratio": TARGET_RATIO,
                    "summary": [dataclasses.asdict(s) for s in summaries],
                    "samples": [dataclasses.asdict(s) for s in samples],
                },
                indent=2,
            )
            + "\n"
        )
    return status


def run_profiles(
    app: celery.Celery,
    endpoints: Endpoints,
    variants: Sequence[Variant],
    settings: Settings,
) -> dict[str, str]:
    """One more, untimed drain per variant with every prefork child under cProfile."""
    if settings.pool != "prefork":
        return {"": "--profile needs --pool prefork (cProfile sees one thread only)"}
    texts = {}
    for variant in variants:
        directory = settings.work_dir / f"profile-{variant.name}"
        directory.mkdir()
        sample = measure(app, endpoints, variant, -1, settings, profile_dir=directory)
        texts[variant.name] = render_profile(variant.name, directory, sample.tasks)
    return texts


if __name__ == "__main__":
    sys.exit(main())
