"""Instructions per task, counted by valgrind: a figure that does not move with the load.

    .venv/bin/python benchmarks/instructions.py [--calls N] [--json out.json]

Throughput and CPU time on a shared virtual machine move by several percent between
runs, more than one change to the hot path saves. This script counts the instructions
the CPU executes instead (callgrind), which repeat to within about 0.2 %. Each case of
``hot_path.py`` named below runs N times in a child process under
``valgrind --tool=callgrind``, counting only inside that loop (``--toggle-collect``
on the C function that drives it), so imports and set-up are not counted. Waiting for
PostgreSQL costs no instructions: the two round trips count what psycopg2 and the kernel
interface do in this process, not the server's work or the time asleep.

Needs ``valgrind`` on the PATH and PostgreSQL (as hot_path.py). About 25 s per case.
``--publish`` counts ``delay()`` instead: publish_path.py's cases (a new key per call, or
a duplicate) for plain Celery, lock_enqueue and celery-once, in the calling thread only.
"""

from __future__ import annotations

import argparse
import functools
import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

#: hot_path.py cases, and what each row is called here.
CASES = {
    "trace plain, hooks connected": "plain task (Celery's tracer)",
    "  SQL: SELECT 1 twice (floor)": "two round trips alone (SELECT 1)",
    "trace session, distinct keys": "SingletonTask, distinct keys",
    "trace session, skip (key held elsewhere)": "SingletonTask, skipped",
    "trace plain, raising LockSkipped": "plain task raising LockSkipped",
    "trace session, skip ending SUCCESS": "SingletonTask, skip ending SUCCESS",
    "trace lock_limit=3, distinct keys": "SingletonTask lock_limit=3, distinct keys",
    "trace lock_period, distinct keys": "SingletonTask lock_period, distinct keys",
    "  SQL: SELECT 1 (one statement)": "one round trip alone (SELECT 1)",
}
#: ``delay()`` cases (``--publish``): a new key per call, or one key already queued.
#: Only the calling thread is counted: not lock_enqueue's background confirmations.
PUBLISH_CASES = {
    "plain": "delay(), plain Celery",
    "until_finished": "delay(), until_finished, new key",
    "until_finished duplicate": "delay(), until_finished, duplicate",
    "until_started": "delay(), until_started, new key",
    "replace": "delay(), replace, new key",
    "replace duplicate": "delay(), replace, replacing",
    "celery-once": "delay(), celery-once, new key",
    "celery-once duplicate": "delay(), celery-once, duplicate",
}
_COLLECTED = re.compile(r"Collected\s*:\s*(\d+)")


def count(case: str, calls: int) -> float:
    """Instructions per call of ``case`` (a hot_path.py label), under callgrind."""
    with tempfile.TemporaryDirectory() as scratch:
        done = subprocess.run(
            [
                "valgrind",
                "--tool=callgrind",
                "--collect-atstart=no",
                "--toggle-collect=functools_reduce",
                f"--callgrind-out-file={scratch}/out",
                sys.executable,
                __file__,
                "--child",
                case,
                "--calls",
                str(calls),
            ],
            capture_output=True,
            text=True,
            check=False,
        )
    match = _COLLECTED.search(done.stderr)
    if done.returncode != 0 or match is None:
        raise SystemExit(f"callgrind failed for {case!r}:\n{done.stderr[-2000:]}")
    return int(match.group(1)) / calls


def child(case: str, calls: int) -> None:
    """Run ``case`` ``calls`` times inside functools.reduce (what callgrind counts)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    if case in PUBLISH_CASES:
        publish_child(case, calls)
        return
    import hot_path

    with hot_path.database() as url:
        call = dict(hot_path.configure(url))[case]
        for _ in range(50):  # warm: imports, the first connection, caches
            call()
        functools.reduce(lambda _, __: call(), range(calls), None)


def publish_child(case: str, calls: int) -> None:
    """``delay()`` of publish_path.py's tasks to a queue nobody consumes."""
    import os
    import time
    import uuid

    os.environ.setdefault("BENCH_CONTENDER", "all")
    import bench_app
    import publish_path

    from celery_pglock.testing import start_services

    run = uuid.uuid4().hex[:8]
    with start_services() as services:
        app = publish_path.configure(services, run)
        name = case.removesuffix(" duplicate")
        task = app.tasks[
            {
                "plain": bench_app.PLAIN,
                "until_finished": bench_app.UNTIL_FINISHED,
                "until_started": bench_app.UNTIL_STARTED,
                "replace": bench_app.LATEST,
                "celery-once": bench_app.ONCE,
            }[name]
        ]
        queue = f"instructions-{run}"
        send = publish_path.Case(
            case, task, queue, f"{run}-dup" if name != case else None
        )
        with app.producer_or_acquire() as producer:
            send.producer = producer
            for _ in range(30):  # warm: the connections, the table, the duplicate's key
                send()
            time.sleep(0.3)  # the confirmations written: the writer idle
            functools.reduce(lambda _, __: send(), range(calls), None)
        import redis
        import sqlalchemy as sa

        publish_path.cleanup(
            app,
            redis.Redis.from_url(services.broker_url),
            run,
            queue,
            [send],
            sa.create_engine(services.database_url),
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--json")
    parser.add_argument(
        "--publish",
        action="store_true",
        help="count delay() instead (publish_path.py's cases; needs Redis too)",
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.calls)
        return 0
    if shutil.which("valgrind") is None:
        raise SystemExit("valgrind is not installed (apt-get install valgrind).")
    if args.publish:
        return publish(args.calls, args.json)
    counts = {label: count(case, args.calls) for case, label in CASES.items()}
    plain = counts[CASES["trace plain, hooks connected"]]
    print(f"instructions per call, {args.calls} calls per case (callgrind)")
    print(f"{'case':<44} {'k instr':>9} {'vs plain':>9}")
    for label, value in counts.items():
        extra = "" if value == plain else f"{(value - plain) / 1000:+9.1f}"
        print(f"{label:<44} {value / 1000:>9.1f} {extra:>9}")
    # Issue 18: a lock_limit or lock_period run costs at most a locked run plus one
    # statement (this process's half; the server's is compare.py's PostgreSQL column).
    locked = counts[CASES["trace session, distinct keys"]]
    one = counts[CASES["  SQL: SELECT 1 (one statement)"]]
    for case in (
        "trace lock_limit=3, distinct keys",
        "trace lock_period, distinct keys",
    ):
        over = counts[CASES[case]] - locked
        verdict = "PASS" if over <= one else "FAIL"
        print(
            f"{CASES[case]}: {over / 1000:+.1f} k over SingletonTask, "
            f"one statement {one / 1000:.1f} k: {verdict}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(counts, indent=2) + "\n")
    return 0


def publish(calls: int, json_path: str | None) -> int:
    counts = {label: count(case, calls) for case, label in PUBLISH_CASES.items()}
    plain = counts[PUBLISH_CASES["plain"]]
    print(
        f"instructions per delay(), {calls} calls per case (callgrind, calling thread)"
    )
    print(f"{'case':<44} {'k instr':>9} {'vs plain':>9}")
    for label, value in counts.items():
        extra = "" if value == plain else f"{(value - plain) / 1000:+9.1f}"
        print(f"{label:<44} {value / 1000:>9.1f} {extra:>9}")
    if json_path:
        Path(json_path).write_text(json.dumps(counts, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
