"""The demo: two real Celery workers, a burst of duplicate tasks, and the proof.

Run it with ``bash scripts/demo.sh`` (or ``python examples/demo.py --help``). It:

1. uses the PostgreSQL named by CELERY_PGLOCK_TEST_DATABASE_URL and the broker named by
   CELERY_PGLOCK_TEST_BROKER_URL, or starts an embedded PostgreSQL 18 and Redis for the
   ones not set (``celery_pglock.testing.start_services``, the bootstrap the test suite
   uses too);
2. starts two ``celery worker`` processes (prefork, two children each) of
   ``examples.demo_app``;
3. sends 3 tenants x 20 duplicate ``build_tenant_export`` tasks at once, whose bodies
   hold their tenant's lock for 0.3 s;
4. shows the monitoring query (pg_locks joined with pg_stat_activity) of the article this
   library grew from (docs/design.md) while the burst runs, waits for every task to end, and prints
   sent / ran / skipped / failed / overlaps per tenant.

The exit status is 0 only if no two runs of one tenant overlapped and every task either
ran or was skipped. Everything is bounded (``--timeout``, 120 s by default) and cleaned
up: workers stopped, embedded servers stopped and deleted, also on Ctrl-C or SIGTERM.
The database URL is only ever printed with its password masked.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import contextlib
import importlib
import os
import shutil
import signal
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import sqlalchemy as sa

from celery_pglock import LockSkipped, config
from celery_pglock.testing import ServiceError, WorkerProcess, start_services

if TYPE_CHECKING:
    from types import FrameType, ModuleType

    from celery import Celery
    from celery.result import AsyncResult

ROOT = Path(__file__).resolve().parent.parent
#: How a task can end: it ran, it was skipped (FAILURE with LockSkipped, the default
#: lock_skip_result), or it failed.
ENDED = ("SUCCESS", "SKIPPED", "FAILURE")
#: Seconds a configured service may take to answer (a container may still be starting).
CONNECT_TIMEOUT = 20.0
#: The monitoring query of the article this library grew from (docs/design.md), limited to this database.
MONITOR_SQL = """
SELECT l.pid, l.classid, l.objid, l.objsubid, l.mode, l.granted, l.waitstart,
       a.application_name, a.state, a.query_start, a.query
FROM pg_locks AS l
LEFT JOIN pg_stat_activity AS a USING (pid)
WHERE l.locktype = 'advisory'
  AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
ORDER BY l.granted DESC, l.waitstart NULLS FIRST
"""


class DemoTimeout(BaseException):
    """The demo ran out of time.

    A BaseException, like KeyboardInterrupt, because it is raised from a signal handler
    wherever the demo happens to be, and helpers that retry on ``Exception`` must not
    swallow it.
    """


def main(argv: list[str] | None = None) -> int:
    """Run the demo; return the exit status (0: exclusion held, every task accounted for)."""
    args = _parser().parse_args(argv)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    signal.signal(signal.SIGALRM, _time_out)
    signal.alarm(max(1, round(args.timeout)))
    cleanup = contextlib.ExitStack()
    started = time.monotonic()
    status = 1
    try:
        status = _demo(args, cleanup, started + args.timeout)
    except KeyboardInterrupt:
        print("\nInterrupted.")
        status = 130
    except DemoTimeout:
        print(f"\nFAILED: the demo did not finish within {args.timeout:g} s.")
    except ServiceError as exc:
        print(f"\nFAILED: {exc}")
        status = 2
    finally:
        # Cleanup is bounded by its own timeouts; a second Ctrl-C must not cut it short
        # and leave workers consuming the broker or a server running.
        signal.alarm(0)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        try:
            cleanup.close()
        except Exception as exc:  # report it after the demo's own outcome
            print(f"FAILED to clean up: {exc}")
            status = status or 1
        elapsed = time.monotonic() - started
        print(f"Stopped everything the demo started; {elapsed:.1f} s in all.")
    return status


def _demo(
    args: argparse.Namespace, cleanup: contextlib.ExitStack, deadline: float
) -> int:
    services = start_services(timeout=CONNECT_TIMEOUT)
    cleanup.callback(services.stop)
    print("\n".join(services.describe()))
    database_url = services.database_url
    run = uuid.uuid4().hex[:8]
    worker_env = {
        # The variables Celery and celery-pglock read by themselves: demo_app configures
        # neither its broker nor its lock database in code.
        "CELERY_BROKER_URL": services.broker_url,
        "CELERY_RESULT_BACKEND": services.result_backend_url,
        config.DATABASE_URL_ENV: database_url,
        "PGLOCK_DEMO_RUN": run,
        "PYTHONPATH": os.pathsep.join(
            filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])
        ),
    }
    # demo_app reads its configuration at import, in this process as in the workers.
    os.environ.update(worker_env)
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    app: ModuleType = importlib.import_module("examples.demo_app")

    monitor = sa.create_engine(
        database_url,
        poolclass=sa.NullPool,
        connect_args={"application_name": "celery_pglock demo monitor"},
    )
    cleanup.callback(monitor.dispose)
    app.recorder.setup()
    cleanup.callback(app.recorder.close)
    cleanup.callback(_forget_intervals, monitor, app.INTERVALS_TABLE, run)

    log_dir = Path(tempfile.mkdtemp(prefix="celery-pglock-demo-"))
    keep_logs: list[bool] = []  # appended to when the demo fails: logs outlive it then
    cleanup.callback(_remove_logs, log_dir, keep_logs)
    # Callbacks run last-registered first: stop the workers, then remove their logs and
    # their queue.
    cleanup.callback(_delete_queue, app.app, app.QUEUE)
    began = time.monotonic()
    workers: list[WorkerProcess] = []
    cleanup.callback(_stop_workers, workers)
    for index in range(1, args.workers + 1):
        worker = WorkerProcess(
            "examples.demo_app",
            env=worker_env,
            concurrency=args.concurrency,
            hostname=f"pglock-demo-{index}-{run}@%h",
            queues=[app.QUEUE],
            log_path=log_dir / f"worker-{index}.log",
        )
        workers.append(worker)  # before start(): a half-started worker is stopped too
        worker.start(timeout=60)
    processes = args.workers * args.concurrency
    print(
        f"Workers:    {args.workers} x celery worker (prefork, concurrency "
        f"{args.concurrency}) ready in {time.monotonic() - began:.1f} s"
    )

    tenants = list(range(1, args.tenants + 1))
    task = app.build_tenant_export
    results: dict[int, list[AsyncResult[Any]]] = {tenant: [] for tenant in tenants}
    sent_at = time.monotonic()
    for _ in range(args.duplicates):  # interleaved: every tenant is busy at once
        for tenant in tenants:
            results[tenant].append(
                task.apply_async((tenant,), {"hold": args.hold}, queue=app.QUEUE)
            )
    sent = args.tenants * args.duplicates
    print(
        f"Burst:      {sent} tasks ({args.tenants} tenants x {args.duplicates} "
        f"duplicates), each body holding its tenant's lock for {args.hold:g} s"
    )

    _show_locks(monitor, app, run, tenants, min(len(tenants), processes))
    everything = [result for per_tenant in results.values() for result in per_tenant]
    # Leave a few seconds of the --timeout for the report; the alarm is the backstop.
    states = _wait_until_ended(everything, deadline - 3.0)
    elapsed = time.monotonic() - sent_at
    for result in everything:
        result.forget()  # do not leave the demo's results in someone's Redis

    overlaps = collections.Counter(
        overlap.first.key for overlap in app.recorder.overlaps(run)
    )
    counts: list[list[int]] = []
    for tenant in tenants:
        outcome = collections.Counter(states[result.id] for result in results[tenant])
        counts.append(
            [
                len(results[tenant]),
                app.recorder.count(run, f"tenant-{tenant}"),
                outcome["SKIPPED"],
                outcome["FAILURE"],
                overlaps[f"tenant-{tenant}"],
            ]
        )
    totals = [sum(column) for column in zip(*counts, strict=True)]
    labels = [*(f"tenant {tenant}" for tenant in tenants), "total"]
    print(f"\nOutcome, {elapsed:.1f} s after the burst was sent:")
    _print_table(
        ("", "sent", "ran", "skipped", "failed", "overlaps"),
        [(label, *row) for label, row in zip(labels, [*counts, totals], strict=True)],
        "  ",
    )

    total_sent, ran, skipped, failed, overlapped = totals
    unended = sum(1 for state in states.values() if state not in ENDED)
    problems = []
    if overlapped:
        problems.append(f"{overlapped} overlapping runs of one tenant")
    if ran + skipped != total_sent:
        problems.append(f"ran + skipped = {ran + skipped}, not {total_sent}")
    if failed:
        problems.append(f"{failed} failed tasks")
    if unended:
        problems.append(f"{unended} tasks had not ended")
    if problems:
        keep_logs.append(True)
        print(f"\nFAILED: {'; '.join(problems)}. Worker logs: {log_dir}")
        return 1
    print(
        f"\nOK: no two runs of one tenant overlapped, and each of the {total_sent} "
        f"tasks either ran ({ran}) or was skipped ({skipped}).\nA duplicate that "
        "arrives after the previous run released the lock runs again: the lock "
        "prevents concurrent runs, not repeated ones."
    )
    return 0


def _show_locks(
    monitor: sa.Engine, app: ModuleType, run: str, tenants: list[int], expect: int
) -> None:
    """Print the demo's rows of the monitoring query, once ``expect`` bodies are running."""
    deadline = time.monotonic() + 5.0
    while len(app.recorder.unfinished(run)) < expect and time.monotonic() < deadline:
        time.sleep(0.02)
    ours = {
        app.build_tenant_export.lock_key_for(tenant).pg_locks_ids: tenant
        for tenant in tenants
    }
    with monitor.connect() as connection:
        locks = connection.execute(sa.text(MONITOR_SQL)).all()
    shown = []
    for lock in locks:
        tenant = ours.get((lock.classid, lock.objid, lock.objsubid))
        if tenant is not None:
            key = app.build_tenant_export.lock_key_for(tenant)
            shown.append(
                (
                    lock.pid,
                    f"tenant {tenant}",
                    str(key),
                    "yes" if lock.granted else "no",
                    lock.state or "",
                    lock.application_name or "",
                )
            )
    print(
        "\nWho holds what, during the burst (the article's pg_locks + pg_stat_activity "
        "query):"
    )
    if shown:
        _print_table(
            ("pid", "lock", "key", "granted", "state", "application_name"),
            shown,
            "  ",
        )
    else:
        print("  (no demo lock was held at that instant)")
    others = len(locks) - len(shown)
    if others:
        print(f"  ({others} advisory locks of other applications not shown)")


def _wait_until_ended(
    results: list[AsyncResult[Any]], deadline: float
) -> dict[str, str]:
    """Poll every result's state until each has ended or ``deadline`` (monotonic) passes."""
    states = {result.id: "PENDING" for result in results}
    waiting = list(results)
    while waiting:
        still = []
        for result in waiting:
            state = result.state
            if state == "FAILURE" and isinstance(result.result, LockSkipped):
                state = "SKIPPED"
            states[result.id] = state
            if state not in ENDED:
                still.append(result)
        waiting = still
        if waiting:
            if time.monotonic() >= deadline:
                break
            time.sleep(0.1)
    return states


def _stop_workers(workers: list[WorkerProcess]) -> None:
    """Warm-shut down every worker at once (each takes seconds), killing stragglers."""
    if workers:
        with concurrent.futures.ThreadPoolExecutor(len(workers)) as pool:
            for stopped in [pool.submit(worker.stop, 10) for worker in workers]:
                stopped.result()


def _delete_queue(app: Celery, name: str) -> None:
    """Delete the run's queue and its bindings: the broker may be someone's Redis."""
    with app.connection_for_write() as connection:
        queue = app.amqp.queues[name](connection.default_channel)
        queue.declare()  # binds it in this channel, so that delete() finds the bindings
        queue.delete()


def _remove_logs(log_dir: Path, keep: list[bool]) -> None:
    if not keep:
        shutil.rmtree(log_dir, ignore_errors=True)


def _forget_intervals(monitor: sa.Engine, table: str, run: str) -> None:
    """Delete this run's recorded intervals: the demo may run on someone's database."""
    with monitor.begin() as connection:
        connection.execute(
            sa.text(f"DELETE FROM {table} WHERE run = :run"), {"run": run}
        )


def _print_table(
    header: tuple[str, ...], rows: list[tuple[Any, ...]], indent: str
) -> None:
    """Print ``rows`` under ``header``: integer columns right-aligned, text left-aligned."""
    numeric = [
        all(isinstance(row[column], int) for row in rows)
        for column in range(len(header))
    ]
    table = [header, *[tuple(str(cell) for cell in row) for row in rows]]
    widths = [max(len(row[column]) for row in table) for column in range(len(header))]
    for row in table:
        cells = [
            cell.rjust(width) if numeric[column] else cell.ljust(width)
            for column, (cell, width) in enumerate(zip(row, widths, strict=True))
        ]
        print(indent + "  ".join(cells).rstrip())


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="examples/demo.py",
        description="Two real Celery workers, a burst of duplicate singleton tasks, "
        "and proof that no two runs of one key overlapped.",
    )
    parser.add_argument(
        "--tenants", type=_positive_int, default=3, help="distinct lock keys"
    )
    parser.add_argument(
        "--duplicates", type=_positive_int, default=20, help="tasks per tenant"
    )
    parser.add_argument(
        "--hold", type=float, default=0.3, help="seconds each body holds its lock"
    )
    parser.add_argument(
        "--workers", type=_positive_int, default=2, help="celery worker processes"
    )
    parser.add_argument(
        "--concurrency", type=_positive_int, default=2, help="processes per worker"
    )
    parser.add_argument(
        "--timeout", type=float, default=120.0, help="seconds for the whole demo"
    )
    return parser


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1; got {value}")
    return value


def _exit_on_sigterm(signum: int, frame: FrameType | None) -> NoReturn:
    raise SystemExit(128 + signum)  # unwinds through main()'s cleanup


def _time_out(signum: int, frame: FrameType | None) -> NoReturn:
    raise DemoTimeout


if __name__ == "__main__":
    sys.exit(main())
