"""Where a SingletonTask's extra time per task goes, measured in one process.

    .venv/bin/python benchmarks/hot_path.py [--calls N] [--reps R] [--json out.json]

compare.py measures whole workers; this script takes the hot path apart without a broker
or a pool: it calls Celery's worker tracer (``build_tracer``, what a pool child runs per
message) for the plain and the locked tasks of bench_app, then each piece of the locked
path on its own: the key, the AdvisoryLock object, the pool checkout, the two SQL round
trips, and the Celery/celery_pglock bookkeeping around them. Every case is timed as wall
and CPU (``time.process_time``) microseconds per call, the cases interleaved over R
repetitions; the table shows the median and the minimum (the least disturbed repetition
on a shared machine).

Needs PostgreSQL only: CELERY_PGLOCK_DATABASE_URL, else CELERY_PGLOCK_TEST_DATABASE_URL,
else an embedded server (stopped at exit). Wall times include loopback latency to the
server, which is idle here; in a worker it competes with everything else for the CPUs.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

os.environ.setdefault("BENCH_CONTENDER", "pglock")  # bench_app: only our tasks
import bench_app

from celery_pglock import config
from celery_pglock.testing import DATABASE_URL_ENV as TEST_DATABASE_URL_ENV
from celery_pglock.testing import EmbeddedPostgres

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator, Sequence

REPO_ROOT = Path(__file__).resolve().parent.parent
LOCKED_CASE = "trace session, distinct keys"
SKIP_CASE = "trace session, skip (key held elsewhere)"
SKIP_SUCCESS_CASE = "trace session, skip ending SUCCESS"
FAILURE_CASE = "trace plain, raising LockSkipped"
HELD = "held"  # the argument whose key a separate session holds during the run
_HOLDERS: list[object] = []


@contextlib.contextmanager
def database() -> Iterator[str]:
    """A configured PostgreSQL URL, else an embedded server's."""
    url = os.environ.get(config.DATABASE_URL_ENV) or os.environ.get(
        TEST_DATABASE_URL_ENV
    )
    if url:
        yield url
        return
    server = EmbeddedPostgres()
    try:
        server.start()
        yield server.url()
    finally:
        server.cleanup()


class Counter:
    """Distinct argument values, so that per-argument keys differ per call."""

    def __init__(self) -> None:
        self.value = 0

    def next(self) -> int:
        self.value += 1
        return self.value


def cases(counter: Counter) -> list[tuple[str, Callable[[], object]]]:
    """(label, one call) for every case; bench_app must be imported with a database."""
    from celery.app.trace import build_tracer

    from celery_pglock import exceptions
    from celery_pglock.db import engines, sql_text
    from celery_pglock.lock import AdvisoryLock
    from celery_pglock.task import worker_hooks
    from celery_pglock.testing import _support, strategies

    app = bench_app.app
    app.finalize()
    plain = app.tasks[bench_app.PLAIN]
    locked: Any = app.tasks[bench_app.SESSION]  # a SingletonTask
    xact = app.tasks[bench_app.TRANSACTION]
    options = locked.lock_config
    engine = engines.engine_for(app.conf)
    key = locked.lock_key_for("7")

    def tracer(task: Any, same_key: str | None = None) -> Callable[[], object]:
        trace = build_tracer(task.name, task, app=app)
        # The request dict a pool child gets: the message headers plus what
        # celery.worker.request.Request adds; built once, outside the timing.
        template = {
            **app.amqp.as_task_v2("template", task.name, args=("0", 0.0)).headers,
            "properties": {"correlation_id": "template", "reply_to": None},
            "reply_to": None,
            "hostname": "bench@localhost",
            "delivery_info": {"exchange": "", "routing_key": "bench"},
            "ignore_result": True,
        }

        def call() -> object:
            task_id = str(uuid.uuid4())
            request = {
                **template,
                "id": task_id,
                "root_id": task_id,
                "correlation_id": task_id,
            }
            key = same_key or str(counter.next())
            return trace(task_id, [key, 0.0], {}, request)

        return call

    trace_plain = tracer(plain)

    def trace_plain_bare() -> object:
        # Celery skips task_postrun entirely when it has no receivers: measure the plain
        # task as a worker without celery_pglock runs it (hooks off for this call).
        worker_hooks.disconnect()
        try:
            return trace_plain()
        finally:
            worker_hooks.connect()

    def hooks_toggle() -> object:
        worker_hooks.disconnect()
        worker_hooks.connect()
        return None

    def lock_cycle(
        scope: config.LockScope, per_lock: bool = False
    ) -> Callable[[], object]:
        def call() -> object:
            strategies.use_per_lock_sessions(per_lock)
            try:
                lock = AdvisoryLock(engine=engine, key=key, scope=scope, label="bench")
            finally:
                strategies.use_per_lock_sessions(False)
            if not lock.acquire():
                raise RuntimeError(f"{key} is held by another session; cannot measure.")
            lock.release()
            return lock

        return call

    held = engine.raw_connection()
    dbapi: Any = held.dbapi_connection
    dbapi.autocommit = True
    # Every call of SKIP_CASE finds its key busy: held by a session of its own (a
    # session of this engine might be the process's lock session, where it re-enters).
    holder = _support.connect(
        engine.url.render_as_string(hide_password=False),
        application_name="celery_pglock bench holder",
    )
    skip_success: Any = app.tasks[bench_app.SKIP_SUCCESS]  # a SingletonTask
    with holder.cursor() as cursor:
        for task in (locked, skip_success):
            cursor.execute(
                sql_text.TRY_LOCK_SESSION_BARE[1], task.lock_key_for(HELD).ids
            )
    _HOLDERS.append(holder)  # closing it (garbage) would free the key
    holding = engines.application_name(
        "pglock-bench", engines.process_tag(), key, "bench"
    )
    idle = engines.application_name("pglock-bench", engines.process_tag(), "idle")

    def prepared(statement: str) -> str:
        """``statement`` as the process session sends it: an EXECUTE, prepared once."""
        with dbapi.cursor() as cursor:
            return sql_text.prepared(
                dbapi, cursor, sql_text.name_for(statement), statement
            )

    def statements(*pairs: tuple[str, tuple[Any, ...]]) -> Callable[[], object]:
        def call() -> object:
            row = None
            for statement, params in pairs:
                with dbapi.cursor() as cursor:
                    cursor.execute(statement, params)
                    row = cursor.fetchone()
            return row

        return call

    ids = key.ids

    # Celery's failure path alone, for the skip: a plain task whose body raises the
    # LockSkipped a skip ends with (same message and record), so the SKIP_CASE row minus
    # this one is what celery_pglock adds to a skip.
    skip_details = {
        "reason": "lock_busy",
        "task": locked.name,
        "lock": key.name,
        "key": str(key),
        "policy": "skip",
        "holder": None,
        "holder_pid": 4242,
        "holder_task": None,
    }
    skip_message = (
        f"Lock {key.name!r} (key {key}) is held by PostgreSQL backend 4242 (not a "
        "celery-pglock session); bench.session[<id>] did not run."
    )

    @app.task(name="bench.plain_raising_skipped", throws=(exceptions.LockSkipped,))
    def plain_raising_skipped(key: str, body: float = 0.0) -> None:
        raise exceptions.LockSkipped(skip_message, skip_details)

    def celery_call() -> object:
        # Task.__call__ (pushes a copy of the request) instead of calling run directly,
        # which is what the tracer does for a task without a custom __call__.
        return plain(str(counter.next()))

    return [
        ("trace plain, no celery_pglock hooks (*)", trace_plain_bare),
        ("  (*) minus this: hooks off+on", hooks_toggle),
        ("trace plain, hooks connected", trace_plain),
        (LOCKED_CASE, tracer(locked)),
        ("trace session, one key (key cached)", tracer(locked, same_key="7")),
        (SKIP_CASE, tracer(locked, same_key=HELD)),
        (FAILURE_CASE, tracer(plain_raising_skipped)),
        (SKIP_SUCCESS_CASE, tracer(skip_success, same_key=HELD)),
        ("trace transaction, distinct keys", tracer(xact)),
        ("trace lock_limit=3, distinct keys", tracer(app.tasks[bench_app.LIMIT])),
        ("trace lock_period, distinct keys", tracer(app.tasks[bench_app.PERIOD])),
        ("  key: lock_key_for(i)", lambda: locked.lock_key_for(str(counter.next()))),
        (
            "  AdvisoryLock(...) constructor",
            lambda: AdvisoryLock(
                engine=engine, key=key, scope=options.scope, label=options.task_name
            ),
        ),
        ("  acquire+release, process session", lock_cycle(config.LockScope.SESSION)),
        (
            "  acquire+release, per_lock session",
            lock_cycle(config.LockScope.SESSION, per_lock=True),
        ),
        ("  acquire+release, transaction", lock_cycle(config.LockScope.TRANSACTION)),
        ("  pool checkout+checkin", lambda: engine.raw_connection().close()),
        (
            "  SQL: as sent on the process session",
            statements(
                (prepared(sql_text.TRY_LOCK_SESSION_BARE[1]), ids),
                (prepared(sql_text.UNLOCK_SESSION_KEEP_NAME[1]), ids),
            ),
        ),
        (
            "  SQL: the same, not prepared",
            statements(
                (sql_text.TRY_LOCK_SESSION_BARE[1], ids),
                (sql_text.UNLOCK_SESSION_KEEP_NAME[1], ids),
            ),
        ),
        (
            "  SQL: as sent per_lock (relabel both)",
            statements(
                (sql_text.TRY_LOCK_SESSION[1], (*ids, holding)),
                (sql_text.UNLOCK_SESSION[1], (*ids, idle)),
            ),
        ),
        (
            "  SQL: SELECT 1 twice (floor)",
            statements(("SELECT 1", ()), ("SELECT 1", ())),
        ),
        ("  SQL: SELECT 1 (one statement)", statements(("SELECT 1", ()))),
        ("  Task.__call__ vs run (celery)", celery_call),
        ("  direct run() (for the above)", lambda: plain.run(str(counter.next()))),
        ("  empty call (timer floor)", lambda: None),
    ]


def configure(url: str) -> list[tuple[str, Callable[[], object]]]:
    """Point bench_app at ``url``; the cases (see :func:`cases`)."""
    os.environ[bench_app.DATABASE_URL_ENV] = url
    # Its own lock namespace: another run against the same database must not hold (or
    # see) this run's keys.
    bench_app.app.conf.update(
        pglock_database_url=url,
        pglock_namespace=f"hot-path-{uuid.uuid4().hex[:8]}",
    )
    return cases(Counter())


class ServerMeter:
    """CPU seconds of this process's lock-session backends (PostgreSQL on this host).

    The backends are found by the ``host:pid`` tag celery_pglock puts in their
    application_name; a separate probe session (not counted) reads pg_stat_activity.
    """

    def __init__(self, url: str) -> None:
        from celery_pglock.testing import _support

        self._connection = _support.connect(
            url, application_name="celery_pglock bench probe"
        )
        self._tag = f":{os.getpid()}"

    def seconds(self) -> float | None:
        import psutil  # type: ignore[import-untyped, unused-ignore]  # no stubs shipped

        with self._connection.cursor() as cursor:
            cursor.execute(
                "SELECT pid, application_name FROM pg_stat_activity "
                "WHERE application_name LIKE %s",
                (bench_app.APPLICATION_NAME + " %",),
            )
            rows = cursor.fetchall()
        total = 0.0
        for pid, name in rows:
            parts = name.split(" ")
            if len(parts) < 2 or not parts[1].endswith(self._tag):
                continue
            try:
                times = psutil.Process(pid).cpu_times()
            except psutil.Error:
                return None  # not on this host, or not readable
            total += times.user + times.system
        return total

    def close(self) -> None:
        self._connection.close()


#: Per repetition: wall, CPU and server CPU in us per call, and cyclic garbage
#: collections (any generation) per 1,000 calls.
Result = dict[str, list[tuple[float, float, float | None, float]]]


def measure(
    table: Sequence[tuple[str, Callable[[], object]]],
    calls: int,
    reps: int,
    meter: ServerMeter,
) -> Result:
    """{label: [(wall, CPU, server CPU, collections), one per repetition]}, interleaved."""
    results: Result = {label: [] for label, _ in table}
    for _label, call in table:  # warm up every path once (imports, first connection)
        for _ in range(20):
            call()
    for _rep in range(reps):
        for label, call in table:
            server0 = meter.seconds()
            collections0 = _collections()
            wall0, cpu0 = time.perf_counter(), time.process_time()
            for _ in range(calls):
                call()
            wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
            collected = (_collections() - collections0) * 1000 / calls
            server1 = meter.seconds()
            server = (
                None
                if server0 is None or server1 is None
                else (server1 - server0) * 1e6 / calls
            )
            results[label].append(
                (wall * 1e6 / calls, cpu * 1e6 / calls, server, collected)
            )
    return results


def _collections() -> int:
    """Cyclic garbage collections so far, all generations: a path that leaves cycles
    runs the collector more often (CPU that no single call shows)."""
    return sum(generation["collections"] for generation in gc.get_stats())


def render(results: Result) -> str:
    lines = [
        f"{'case':<40} {'wall us med (min)':>18} {'CPU us med (min)':>17} "
        f"{'PG CPU us med':>13} {'GC/1k':>6}",
        "-" * 98,
    ]
    for label, samples in results.items():
        walls = [sample[0] for sample in samples]
        cpus = [sample[1] for sample in samples]
        servers = [sample[2] for sample in samples if sample[2] is not None]
        wall = f"{statistics.median(walls):.1f} ({min(walls):.1f})"
        cpu = f"{statistics.median(cpus):.1f} ({min(cpus):.1f})"
        server = f"{statistics.median(servers):.1f}" if servers else "?"
        collected = statistics.median(sample[3] for sample in samples)
        lines.append(f"{label:<40} {wall:>18} {cpu:>17} {server:>13} {collected:>6.1f}")
    lines.append(
        "(*) toggling the hooks costs time itself: subtract the next row's figure. "
        "PG CPU: this\nprocess's lock-session backends, read with psutil (10 ms "
        "clock ticks: a coarse figure).\nGC/1k: cyclic garbage collections per 1,000 calls."
    )
    return "\n".join(lines)


def profile(
    table: Sequence[tuple[str, Callable[[], object]]],
    label: str,
    calls: int,
    top: int = 25,
) -> str:
    """cProfile one case: functions by own time, microseconds per call of the case."""
    import cProfile
    import pstats

    call = dict(table)[label]
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        call()
    profiler.disable()
    stats = pstats.Stats(profiler)
    rows = []
    for (filename, line, name), (_cc, count, own, cum, _callers) in stats.stats.items():  # type: ignore[attr-defined]
        where = filename.split("site-packages/")[-1].replace(str(REPO_ROOT) + "/", "")
        rows.append((own, cum, count, f"{where}:{line}({name})"))
    rows.sort(reverse=True)
    lines = [
        f"cProfile of {label.strip()!r}, {calls} calls: own/cumulative us per call "
        "(cProfile inflates small functions; compare rows, not totals)",
        f"  {'own us':>7} {'cum us':>7} {'calls':>6}  function",
    ]
    for own, cum, count, where in rows[:top]:
        lines.append(
            f"  {own * 1e6 / calls:>7.1f} {cum * 1e6 / calls:>7.1f} "
            f"{count / calls:>6.2f}  {where}"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--calls", type=int, default=500, help="calls per repetition")
    parser.add_argument("--reps", type=int, default=7, help="interleaved repetitions")
    parser.add_argument("--json", type=Path)
    parser.add_argument(
        "--profile",
        nargs="?",
        const=LOCKED_CASE,
        metavar="CASE",
        help="also cProfile one case (default: the locked tracer; 'skip' for the "
        "skip) and print its top functions",
    )
    args = parser.parse_args(argv)
    with database() as url:
        table = configure(url)
        started = time.monotonic()
        meter = ServerMeter(url)
        try:
            results = measure(table, args.calls, args.reps, meter)
        finally:
            meter.close()
        profiled = None
        if args.profile:
            case = SKIP_CASE if args.profile == "skip" else args.profile
            profiled = profile(table, case, args.calls * 4)
    print(
        f"celery_pglock hot path: {args.calls} calls x {args.reps} interleaved "
        f"repetitions in {time.monotonic() - started:.0f} s, "
        f"load {' '.join(f'{x:.2f}' for x in os.getloadavg())}"
    )
    print(render(results))
    if profiled is not None:
        print()
        print(profiled)
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
