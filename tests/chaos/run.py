"""The chaos run of issue 8: real workers, a private PostgreSQL for the locks, and faults.

``python -m tests.chaos [--short] [--seed N] [--json PATH]`` (docs/operations/chaos.md).

Five phases, one after the other, so that each overlap has one possible cause:

1. *Main*: two prefork workers and a threads-pool worker run a stream of ``chaos.work``
   tasks on many keys (lock_on_lost='signal'), while the run SIGKILLs pool children and
   whole workers (a replacement is started), lets hard time limits kill bodies, restarts
   and crashes the private lock server, and ``pg_terminate_backend``s lock sessions.
2. *Partition*: a prefork worker whose lock connections go through a
   :class:`~tests.acceptance._proxy.FreezableProxy` (lock_on_lost='terminate') holds
   locks; the link freezes; the main workers keep sending duplicates of those keys; after
   ``CUT_AFTER`` seconds the proxy closes the frozen connections, which frees the locks on
   the server as its keepalives would, and the duplicates run.
3. *Enqueue*: lock_enqueue under producer and pool-child kills, revokes, a purge and rows
   never published (tests/chaos/enqueue_phase.py).
4. *Flow*: lock_group and lock_rate under pool-child kills (tests/chaos/flow_phase.py).
5. *Latest wins*: lock_enqueue_on_duplicate='replace' under producer and pool-child
   kills (tests/chaos/latest_phase.py).

The overlap recorder and the loss events live on the shared test database, which the chaos
never touches. Every wait has a deadline; every process is stopped in ``finally``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import signal
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tests.chaos import enqueue_phase, faults, flow_phase, latest_phase
from tests.chaos import report as reporting
from tests.chaos.plan import (
    CHECK_TIMEOUT,
    CUT_AFTER,
    FULL,
    HANG,
    HARD_LIMIT,
    INTERVAL,
    PARTITION_CHECK_TIMEOUT,
    PARTITION_HOLD,
    REPO_ROOT,
    SHORT,
    Plan,
)

if TYPE_CHECKING:
    from collections.abc import Callable

    from celery_pglock.testing import WorkerProcess


class Chaos:
    """One chaos run: start everything, run both phases, measure, stop everything."""

    def __init__(self, plan: Plan, env: dict[str, str], log_dir: Path, seed: int):
        self.plan = plan
        self.env = env
        self.log_dir = log_dir
        self.rng = random.Random(seed)  # noqa: S311 - reproducible chaos, not crypto
        self.run_id = uuid.uuid4().hex[:10]
        self.queue = f"pglock-chaos-{self.run_id}"
        self.faults: list[faults.Fault] = []
        self.sent: dict[str, str] = {}  #: task id -> kind
        self.workers: list[Any] = []
        self.specs: dict[Any, tuple[str, int, dict[str, str], list[str]]] = {}
        self.partition_holders: set[str] = set()
        self.sent_at: dict[str, float] = {}
        self.t0 = time.time()  #: Fault times are printed from the main phase's start.
        self.enqueue_figures: dict[str, Any] = {}
        self.flow_figures: dict[str, Any] = {}
        self.latest_figures: dict[str, Any] = {}

    # -- processes --------------------------------------------------------------------

    def _worker(
        self, pool: str, concurrency: int, env: dict[str, str], queues: list[str]
    ) -> WorkerProcess:
        from celery_pglock.testing import WorkerProcess

        name = f"chaos-{pool}-{len(self.specs)}"
        worker = WorkerProcess(
            "tests.chaos.app",
            env=env,
            pool=pool,
            concurrency=concurrency,
            queues=queues,
            log_path=self.log_dir / f"{name}.log",
        )
        self.specs[worker] = (pool, concurrency, env, queues)
        self.workers.append(worker)
        return worker

    def _start_all(self, workers: list[Any]) -> None:
        errors: list[BaseException] = []

        def start(worker: Any) -> None:
            try:
                worker.start(timeout=120)
            except BaseException as error:  # reported below, after every thread ended
                errors.append(error)

        threads = [threading.Thread(target=start, args=(w,)) for w in workers]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(150)
        if errors:
            raise errors[0]

    # -- the run ----------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        from celery_pglock.testing import EmbeddedPostgres
        from tests.acceptance._proxy import FreezableProxy

        started = time.time()
        self.lock_server = EmbeddedPostgres()
        proxy = None
        try:
            self.lock_server.start()
            proxy = FreezableProxy(("127.0.0.1", self.lock_server.port))
            url = self.lock_server.url()
            base = {
                **self.env,
                "PGLOCK_TEST_LOCK_DATABASE_URL": url,
                "PGLOCK_TEST_NAMESPACE": f"chaos-{self.run_id}",
                "PGLOCK_TEST_QUEUE": self.queue,
                "PGLOCK_TEST_DB_TIMEOUT": str(CHECK_TIMEOUT),
            }
            os.environ.update(base)
            from tests.chaos import app as chaos_app

            self.app = chaos_app
            chaos_app.loss_app.setup_events()
            chaos_app.recorder.setup()
            main = [
                self._worker("prefork", 2, base, [self.queue]),
                self._worker("prefork", 2, base, [self.queue]),
                self._worker("threads", 4, base, [self.queue]),
            ]
            self.main_workers = list(main)
            proxied = {
                **base,
                "PGLOCK_TEST_LOCK_DATABASE_URL": url.replace(
                    f":{self.lock_server.port}/", f":{proxy.port}/"
                ),
                "PGLOCK_TEST_ON_LOST": os.environ.get(
                    "CHAOS_PARTITION_ON_LOST", "terminate"
                ),
                "PGLOCK_TEST_DB_TIMEOUT": str(PARTITION_CHECK_TIMEOUT),
            }
            self.part_queue = f"{self.queue}-partition"
            self.proxied = self._worker("prefork", 2, proxied, [self.part_queue])
            self._start_all([*main, self.proxied])
            print(f"workers ready after {time.time() - started:.1f}s", flush=True)
            self._main_phase()
            self._partition_phase(proxy)
            self.enqueue_figures = enqueue_phase.run(self)
            self.flow_figures = flow_phase.run(self)
            self.latest_figures = latest_phase.run(self)
            report = reporting.collect(self, started)
        finally:
            for worker in reversed(self.workers):
                with contextlib.suppress(Exception):
                    worker.stop(timeout=20)
            if proxy is not None:
                proxy.close()
            self.lock_server.cleanup()
        return report

    def _send(
        self, kind: str, key: str, seconds: float, queue: str, **options: Any
    ) -> str:
        run = f"{self.run_id}-{'part' if kind.startswith('part') else 'main'}"
        result = self.app.work.apply_async((run, key, seconds), queue=queue, **options)
        self.sent[result.id] = kind
        self.sent_at[result.id] = time.time()
        return str(result.id)

    def _main_phase(self) -> None:
        plan = self.plan
        self.t0 = time.time()
        done = threading.Event()

        def sender() -> None:
            start = time.monotonic()
            for n in range(plan.tasks):
                delay = start + plan.duration * n / plan.tasks - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
                key = f"k{self.rng.randrange(plan.keys)}"
                draw = self.rng.random()
                if draw < 0.05:
                    self._send("hang", key, HANG, self.queue, time_limit=HARD_LIMIT)
                elif draw < 0.2:
                    self._send("long", key, self.rng.uniform(1.0, 2.5), self.queue)
                else:
                    self._send("short", key, self.rng.uniform(0.02, 0.3), self.queue)
            done.set()

        kinds = (
            ["worker_kill"] * plan.worker_kills
            + ["child_kill"] * plan.child_kills
            + ["terminate"] * plan.terminations
        )
        self.rng.shuffle(kinds)
        # Restarts spread evenly; the rest at random times in between; a worker kill
        # early enough for its reserved messages to come back (visibility timeout).
        schedule = [
            (plan.duration * (i + 1) / (plan.restarts + 1), "restart")
            for i in range(plan.restarts)
        ]
        schedule += [
            (self.rng.uniform(0.1, 0.8) * plan.duration, kind) for kind in kinds
        ]
        schedule.sort()
        thread = threading.Thread(target=sender, daemon=True)
        begin = time.monotonic()
        thread.start()
        for offset, kind in schedule:
            delay = begin + offset - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            faults.INJECT[kind](self)
        thread.join(plan.duration + 60)
        if not done.is_set():
            raise RuntimeError("the sender did not finish in time")

    # -- partition --------------------------------------------------------------------

    def _partition_phase(self, proxy: Any) -> None:
        recorder = self.app.recorder
        run = f"{self.run_id}-part"
        for round_ in range(self.plan.partition_rounds):
            keys = [f"p{round_}-{n}" for n in range(2)]
            holders = {
                self._send("part-holder", key, PARTITION_HOLD, self.part_queue)
                for key in keys
            }

            def both_held(keys: list[str] = keys) -> bool:
                return sum(recorder.count(run, k) for k in keys) >= 2

            if not _wait(both_held, 30):
                raise RuntimeError("the partitioned worker never took its locks")
            time.sleep(INTERVAL * 3)  # its locks were checked through the link
            proxy.freeze()
            fault = faults.Fault("link frozen, then cut", time.time(), time.time())
            fault.pids = {self.proxied.pid, *self.proxied.child_pids()}
            self.faults.append(fault)
            # Duplicates from the main workers: skipped while the server holds the locks.
            deadline = fault.began + CUT_AFTER + 2.0
            cut = False
            while time.time() < deadline:
                if not cut and time.time() >= fault.began + CUT_AFTER:
                    proxy.cut()
                    proxy.thaw()
                    cut = True
                for key in keys:
                    self._send("part-duplicate", key, 0.3, self.queue)
                time.sleep(0.3)
            fault.done = fault.began + CUT_AFTER
            # The partitioned worker locks again through the thawed link.
            again = self._send("part-after", f"p{round_}-after", 0.05, self.part_queue)
            self.app.app.AsyncResult(again).get(timeout=60, propagate=False)
            fault.holders, fault.after = holders, again
            self.partition_holders |= holders


def _wait(condition: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.chaos", description=__doc__)
    parser.add_argument("--short", action="store_true", help="the CI variant (~90 s)")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument(
        "--json", type=Path, default=None, help="write the figures here"
    )
    args = parser.parse_args(argv)
    # SIGTERM (a test's timeout) unwinds through the finally blocks: nothing is left running.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    from celery_pglock.testing import start_services

    plan = SHORT if args.short else FULL
    seed = args.seed if args.seed is not None else random.randrange(1_000_000)  # noqa: S311
    services = start_services()
    try:
        env = {
            **services.env(),
            "PYTHONPATH": os.pathsep.join(
                filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])
            ),
        }
        print(
            f"chaos run: {'short' if args.short else 'full'}, seed {seed}, {plan}",
            flush=True,
        )
        for line in services.describe():
            print(line, flush=True)
        logs = Path(tempfile.mkdtemp(prefix="pglock-chaos-"))
        chaos = Chaos(plan, env, logs, seed)
        figures = chaos.run()
    finally:
        services.stop()
    results = reporting.checks(figures, plan)
    if all(ok for _, ok in results):
        shutil.rmtree(logs, ignore_errors=True)
    else:
        print(f"worker logs kept in {logs}", flush=True)
    figures["checks"] = dict(results)
    figures["seed"] = seed
    print(reporting.render(figures, results), flush=True)
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1, default=str))
    return 0 if all(ok for _, ok in results) else 1


if __name__ == "__main__":
    sys.exit(main())
