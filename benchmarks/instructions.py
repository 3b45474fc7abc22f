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
    import hot_path

    with hot_path.database() as url:
        call = dict(hot_path.configure(url))[case]
        for _ in range(50):  # warm: imports, the first connection, caches
            call()
        functools.reduce(lambda _, __: call(), range(calls), None)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--json")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.calls)
        return 0
    if shutil.which("valgrind") is None:
        raise SystemExit("valgrind is not installed (apt-get install valgrind).")
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


if __name__ == "__main__":
    sys.exit(main())
