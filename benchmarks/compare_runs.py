"""compare.py's runs besides the comparison.

Threads at concurrency 64 (lock connections), memory-flat (skips, then runs), and one
drain with the pool children under cProfile.
"""

from __future__ import annotations

import contextlib
import tempfile
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import bench_app
import measuring
from contenders import CONTENDERS, SESSION, THREADS, WORKLOADS

if TYPE_CHECKING:
    from compare import Bench
    from contenders import Sample


def threads64(bench: Bench) -> tuple[int, Sample]:
    """Lock connections of a threads worker at concurrency 64, sampled during a drain."""
    worker, record_dir = bench.worker("pglock", pool="threads", concurrency=64)
    # Its own connection: it is used from the sampler thread.
    probe = measuring.Probe(bench.services)
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
        count = max(640, bench.args.messages // 2)
        result = bench.drain(worker, record_dir, CONTENDERS[SESSION], THREADS, count)
    finally:
        stop.set()
        sampler.join(timeout=10)
        probe.close()
        worker.stop(timeout=30)
    return peak, result


def flat(bench: Bench) -> dict[str, float]:
    """Skip N messages, then run N; RSS of the task processes along the way."""
    count = bench.args.flat
    worker, record_dir = bench.worker("pglock")
    contender = CONTENDERS[SESSION]
    task = bench.app.tasks[contender.task]
    queue = f"bench-{bench.run_id}-flat"
    marks: dict[str, float] = {}
    chunk = 5000
    try:
        bench.app.control.add_consumer(
            queue, destination=[worker.hostname], reply=True, timeout=10
        )
        for phase in ("skip", "run"):
            held = bench.hot_key_held(
                contender,
                WORKLOADS["one hot key" if phase == "skip" else "distinct keys"],
            )
            with held, bench.app.producer_or_acquire() as producer:
                done_before = len(measuring.records(record_dir))
                deadline = time.monotonic() + max(120.0, count / 50)
                for start in range(0, count, chunk):
                    for i in range(start, min(start + chunk, count)):
                        key = "hot" if phase == "skip" else f"{bench.run_id}-f{i}"
                        task.apply_async((key, 0.0), queue=queue, producer=producer)
                    # Keep the queue short: wait until all but a chunk is consumed.
                    while (
                        len(measuring.records(record_dir)) - done_before
                        < min(start + chunk, count) - chunk
                    ):
                        if time.monotonic() > deadline:
                            raise measuring.BenchError(
                                f"flat run too slow; log {worker.log_path}"
                            )
                        time.sleep(0.1)
                    if (
                        phase == "skip"
                        and "warm" not in marks
                        and start + chunk >= count // 10
                    ):
                        marks["warm"] = measuring.rss(worker)
                while len(measuring.records(record_dir)) - done_before < count:
                    if time.monotonic() > deadline:
                        raise measuring.BenchError(
                            f"flat run too slow; log {worker.log_path}"
                        )
                    time.sleep(0.1)
                marks[f"after {phase}"] = measuring.rss(worker)
        outcomes = [record[2] for record in measuring.records(record_dir)]
        marks["skipped"] = float(outcomes.count(bench_app.SKIPPED))
        marks["ran"] = float(outcomes.count(bench_app.RAN))
    finally:
        bench.app.control.cancel_consumer(
            queue, destination=[worker.hostname], reply=True, timeout=10
        )
        bench.forget(queue)
        worker.stop(timeout=30)
    return marks


def profile(bench: Bench) -> str:
    """One untimed drain per contender, pool children under cProfile."""
    import pstats

    out = []
    for name in ("plain", SESSION):
        contender = CONTENDERS[name]
        directory = Path(tempfile.mkdtemp(dir=bench.tmp, prefix="profile-"))
        worker, record_dir = bench.worker(contender.worker, profile_dir=directory)
        try:
            bench.drain(
                worker,
                record_dir,
                contender,
                WORKLOADS[bench.args.profile],
                bench.args.messages,
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
        per = bench.args.messages
        out.append(
            f"{name}: own / cumulative CPU µs per message (cProfile inflates small calls)"
        )
        out.extend(
            f"  {own * 1e6 / per:7.1f} {cum * 1e6 / per:8.1f}  {where}"
            for own, cum, where in rows
        )
    return "\n".join(out)
