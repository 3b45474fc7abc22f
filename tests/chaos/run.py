"""The chaos run of issue 8: real workers, a private PostgreSQL for the locks, and faults.

``python -m tests.chaos [--short] [--seed N] [--json PATH]`` (docs/operations/chaos.md).

Two phases, one after the other, so that each overlap has one possible cause:

1. *Main*: two prefork workers and a threads-pool worker run a stream of ``chaos.work``
   tasks on many keys (lock_on_lost='signal'), while the run SIGKILLs pool children and
   whole workers (a replacement is started), lets hard time limits kill bodies, restarts
   and crashes the private lock server, and ``pg_terminate_backend``s lock sessions.
2. *Partition*: a prefork worker whose lock connections go through a
   :class:`~tests.acceptance._proxy.FreezableProxy` (lock_on_lost='terminate') holds
   locks; the link freezes; the main workers keep sending duplicates of those keys; after
   ``CUT_AFTER`` seconds the proxy closes the frozen connections, which frees the locks on
   the server as its keepalives would, and the duplicates run.

The overlap recorder and the loss events live on the shared test database, which the chaos
never touches. Every wait has a deadline; every process is stopped in ``finally``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import random
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

#: loss_app's pglock_watch_interval and the check timeouts of the two phases.
INTERVAL = 0.5
CHECK_TIMEOUT = 5.0
PARTITION_CHECK_TIMEOUT = 2.0
#: When the proxy closes a frozen link's connections (the server's keepalive deadline,
#: 30 s with the library's defaults, made much shorter to be strict).
CUT_AFTER = INTERVAL + PARTITION_CHECK_TIMEOUT + 2.0
HARD_LIMIT = 1.0  #: time_limit of the "hang" tasks, which sleep HANG seconds.
HANG = 3.0
PARTITION_HOLD = 8.0  #: How long a partitioned holder's body would run if not ended.
#: Seconds from a fault to its loss signal, at most: the interval, the watcher's tick
#: (interval / 4) and one query (1 s, on a busy machine); a restart adds its downtime
#: (under 1 s here); a frozen link is only known once a check times out.
DETECTION_BOUND = {
    "terminate": INTERVAL * 1.25 + 1.0,
    "restart": INTERVAL * 1.25 + 2.0,
    "link frozen, then cut": INTERVAL * 1.25 + PARTITION_CHECK_TIMEOUT + 0.5,
}
#: What celery-pglock logs when it skips a redelivered message without storing a result.
REDELIVERY_SKIP = "was a redelivery, so no result was stored"
REPO_ROOT = Path(__file__).resolve().parents[2]
PROCESS_TAG = re.compile(r":(\d+)")


@dataclasses.dataclass(frozen=True)
class Plan:
    """How much of everything: :data:`SHORT` (CI) or :data:`FULL`."""

    tasks: int
    keys: int
    duration: float  #: Seconds over which the main phase sends its tasks.
    child_kills: int
    worker_kills: int
    restarts: int  #: Alternately pg_ctl restart (fast) and crash (immediate) + start.
    terminations: int
    partition_rounds: int


SHORT = Plan(
    tasks=300,
    keys=12,
    duration=30,
    child_kills=2,
    worker_kills=1,
    restarts=2,
    terminations=3,
    partition_rounds=1,
)
FULL = Plan(
    tasks=3000,
    keys=60,
    duration=240,
    child_kills=15,
    worker_kills=3,
    restarts=3,
    terminations=12,
    partition_rounds=3,
)


@dataclasses.dataclass
class Fault:
    """One injected fault, for the loss and recovery figures."""

    kind: str
    began: float  #: time.time() before the fault.
    done: float  #: time.time() once it was injected (a restart: when the server was down).
    pids: set[int] = dataclasses.field(default_factory=set)  #: Processes it hit.
    detail: str = ""
    #: The task ids holding locks through a link when it froze.
    holders: set[str] = dataclasses.field(default_factory=set)
    after: str = ""  #: The proxied worker's first task after the link came back.
    #: A termination: the advisory locks its backend held, as pg_locks shows them. A
    #: process also has sessions the fault did not touch (a retry's bounded wait is
    #: granted on a connection of its own), so only these keys were surely lost.
    locks: set[tuple[int, int, int]] | None = None


class Chaos:
    """One chaos run: start everything, run both phases, measure, stop everything."""

    def __init__(self, plan: Plan, env: dict[str, str], log_dir: Path, seed: int):
        self.plan = plan
        self.env = env
        self.log_dir = log_dir
        self.rng = random.Random(seed)  # noqa: S311 - reproducible chaos, not crypto
        self.run_id = uuid.uuid4().hex[:10]
        self.queue = f"pglock-chaos-{self.run_id}"
        self.faults: list[Fault] = []
        self.sent: dict[str, str] = {}  #: task id -> kind
        self.workers: list[Any] = []
        self.specs: dict[Any, tuple[str, int, dict[str, str], list[str]]] = {}
        self.partition_holders: set[str] = set()
        self.sent_at: dict[str, float] = {}
        self.t0 = time.time()  #: Fault times are printed from the main phase's start.

    # -- processes --------------------------------------------------------------------

    def _worker(
        self, pool: str, concurrency: int, env: dict[str, str], queues: list[str]
    ):
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
                "PGLOCK_TEST_CHECK_TIMEOUT": str(CHECK_TIMEOUT),
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
                "PGLOCK_TEST_CHECK_TIMEOUT": str(PARTITION_CHECK_TIMEOUT),
            }
            self.part_queue = f"{self.queue}-partition"
            self.proxied = self._worker("prefork", 2, proxied, [self.part_queue])
            self._start_all([*main, self.proxied])
            print(f"workers ready after {time.time() - started:.1f}s", flush=True)
            self._main_phase()
            self._partition_phase(proxy)
            report = self._report(started)
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
            getattr(self, f"_inject_{kind}")()
        thread.join(plan.duration + 60)
        if not done.is_set():
            raise RuntimeError("the sender did not finish in time")

    # -- faults -----------------------------------------------------------------------

    def _inject_restart(self) -> None:
        crash = sum(f.kind.startswith("restart") for f in self.faults) % 2 == 1
        began = time.time()
        if crash:
            self.lock_server.crash()
        else:
            self.lock_server.stop("fast")
        down = time.time()
        self.lock_server.start()
        kind = "restart (crash)" if crash else "restart (fast)"
        self.faults.append(
            Fault(kind, began, down, detail=f"down {time.time() - began:.2f}s")
        )
        print(f"{kind}: {time.time() - began:.2f}s", flush=True)

    def _inject_terminate(self) -> None:
        # A lock session holding a lock for longer than the interval: the watcher has a
        # lock to check (a shorter body learns of it at release, lock_release_failed).
        sql = (
            "SELECT DISTINCT a.pid, a.application_name FROM pg_locks l "
            "JOIN pg_stat_activity a ON a.pid = l.pid WHERE l.locktype = 'advisory' "
            "AND l.granted AND a.state_change < now() - interval '0.8 seconds'"
        )
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            rows = self._lock_query(sql)
            if rows:
                backend, name = self.rng.choice(rows)
                tag = PROCESS_TAG.search(name or "")
                locks = {
                    (int(classid), int(objid), int(objsubid))
                    for classid, objid, objsubid in self._lock_query(
                        "SELECT classid, objid, objsubid FROM pg_locks WHERE pid = %s "
                        "AND locktype = 'advisory' AND granted",
                        (backend,),
                    )
                }
                began = time.time()
                self._lock_query("SELECT pg_terminate_backend(%s)", (backend,))
                pids = {int(tag.group(1))} if tag else set()
                self.faults.append(
                    Fault(
                        "terminate",
                        began,
                        time.time(),
                        pids,
                        f"backend {backend}",
                        locks=locks,
                    )
                )
                return
            time.sleep(0.1)
        print(
            "terminate: no lock held long enough within 5 s; not injected", flush=True
        )

    def _inject_child_kill(self) -> None:
        prefork = [w for w in self.main_workers if w.pool == "prefork" and w.running]
        children = [pid for worker in prefork for pid in worker.child_pids()]
        if not children:
            return
        # Prefer a child running a body (its interval's heartbeat is fresh): its
        # message is rejected and redelivered (acks_late + reject_on_worker_lost).
        with self.app.loss_app._events_cursor() as cursor:
            cursor.execute(
                f"SELECT DISTINCT pid FROM {self.app.recorder.table} WHERE run = %s "
                "AND ended_at > clock_timestamp() - interval '0.3 seconds'",
                (f"{self.run_id}-main",),
            )
            busy = [row[0] for row in cursor.fetchall() if row[0] in children]
        pid = self.rng.choice(busy or children)
        began = time.time()
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            return  # it had just exited (a time limit): not a fault of ours
        self.faults.append(Fault("SIGKILL pool child", began, time.time(), {pid}))

    def _inject_worker_kill(self) -> None:
        victim = self.rng.choice([w for w in self.main_workers if w.running])
        pids = {victim.pid, *victim.child_pids()}
        began = time.time()
        victim.kill()
        fault = Fault(f"SIGKILL whole {victim.pool} worker", began, time.time(), pids)
        self.faults.append(fault)
        pool, concurrency, env, queues = self.specs[victim]
        replacement = self._worker(pool, concurrency, env, queues)
        self.main_workers[self.main_workers.index(victim)] = replacement
        replacement.start(timeout=120)
        fault.detail = f"replacement ready after {time.time() - began:.1f}s"

    def _lock_query(
        self, sql: str, params: tuple[Any, ...] = ()
    ) -> list[tuple[Any, ...]]:
        from celery_pglock.testing import _support

        connection = _support.connect(self.lock_server.url(), application_name="chaos")
        try:
            connection.autocommit = True
            with connection.cursor() as cursor:
                cursor.execute(sql, params)
                return list(cursor.fetchall()) if cursor.description else []
        finally:
            connection.close()

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
            if not _wait(
                lambda keys=keys: sum(recorder.count(run, k) for k in keys) >= 2, 30
            ):
                raise RuntimeError("the partitioned worker never took its locks")
            time.sleep(INTERVAL * 3)  # its locks were checked through the link
            proxy.freeze()
            fault = Fault("link frozen, then cut", time.time(), time.time())
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

    # -- results ----------------------------------------------------------------------

    def _outcomes(self, deadline: float) -> dict[str, tuple[str, str]]:
        """task id -> (state, reason) once every task is terminal or the deadline passed."""
        from celery_pglock import LockSkipped

        outcomes: dict[str, tuple[str, str]] = {}
        while True:
            for task_id in self.sent:
                if task_id in outcomes:
                    continue
                result = self.app.app.AsyncResult(task_id)
                state = result.state
                if state == "SUCCESS":
                    outcomes[task_id] = ("ran", "")
                elif state == "FAILURE":
                    error = result.result
                    if isinstance(error, LockSkipped):
                        outcomes[task_id] = ("skipped", "")
                    else:
                        outcomes[task_id] = ("failed", type(error).__name__)
            if len(outcomes) == len(self.sent) or time.monotonic() > deadline:
                return outcomes
            time.sleep(1.0)

    def _report(self, started: float) -> dict[str, Any]:
        recorder = self.app.recorder
        outcomes = self._outcomes(time.monotonic() + 90)
        missing = [
            self._trace(task_id) for task_id in sorted(set(self.sent) - set(outcomes))
        ]
        # Kombu's Redis transport takes a message off the queue (BRPOP) before it records
        # it as unacknowledged: a worker SIGKILLed in between loses it, whatever the task.
        # No worker ever logged it as received, so celery-pglock never saw it.
        worker_kills = [
            f.began for f in self.faults if f.kind.startswith("SIGKILL whole")
        ]
        broker_lost = [
            t
            for t in missing
            if not t["received"] and any(k >= t["sent_at"] for k in worker_kills)
        ]
        unaccounted = [t for t in missing if t not in broker_lost]
        intervals = [
            i
            for part in ("main", "part")
            for i in recorder.intervals(f"{self.run_id}-{part}")
        ]
        events = self._events()
        overlaps = [
            o
            for part in ("main", "part")
            for o in recorder.overlaps(f"{self.run_id}-{part}")
        ]
        left = self._locks_left()
        figures = _analyse(self, outcomes, intervals, events, overlaps)
        figures.update(
            unaccounted=len(unaccounted),
            unaccounted_ids=unaccounted[:20],
            lost_by_broker=len(broker_lost),
            lost_by_broker_ids=broker_lost[:20],
            advisory_locks_left=left,
            wall_seconds=round(time.time() - started, 1),
            **self._from_logs(),
        )
        return figures

    def _trace(self, task_id: str) -> dict[str, Any]:
        """What the logs say of a task that never reached a terminal state."""
        lines = [
            f"{worker.hostname.split('@')[0]}: {line.strip()}"
            for worker in self.workers
            for line in worker.log_text().splitlines()
            if task_id in line
        ]
        return {
            "id": task_id,
            # celery-pglock's documented gap (docs/guide/skipped-results.md): a
            # redelivery that finds the key held stores nothing, assuming its first
            # delivery still runs; when that one was killed, the caller never hears.
            "ignored_redelivery": any(REDELIVERY_SKIP in line for line in lines),
            "received": any("] received" in line for line in lines),
            "kind": self.sent[task_id],
            "sent_at": self.sent_at[task_id],
            "sent_at_s": round(self.sent_at[task_id] - self.t0, 2),
            "log": lines[:10],
        }

    def _events(self) -> dict[str, list[tuple[str, float]]]:
        from tests.acceptance.loss_app import LOST_TABLE

        with self.app.loss_app._events_cursor() as cursor:
            cursor.execute(
                f"SELECT task_id, cause, extract(epoch from at) FROM {LOST_TABLE} "
                "WHERE task_id = ANY(%s)",
                (list(self.sent),),
            )
            rows = cursor.fetchall()
        events: dict[str, list[tuple[str, float]]] = {}
        for task_id, cause, at in rows:
            events.setdefault(task_id, []).append((cause, float(at)))
        return events

    def _locks_left(self) -> int:
        sql = "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory'"
        count = -1
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            count = int(self._lock_query(sql)[0][0])
            if count == 0:
                break
            time.sleep(0.5)
        return count

    def _from_logs(self) -> dict[str, int]:
        """lock_on_error='retry' re-runs, and redeliveries (a message received again,
        not as a retry), counted from the worker logs."""
        pattern = re.compile(r"chaos\.work\[([0-9a-f-]+)\] (received|retry)")
        counts = {task_id: {"received": 0, "retry": 0} for task_id in self.sent}
        for worker in self.workers:
            for match in pattern.finditer(worker.log_text()):
                if match.group(1) in counts:
                    counts[match.group(1)][match.group(2)] += 1
        return {
            "retried": sum(c["retry"] for c in counts.values()),
            "redelivered": sum(
                max(0, c["received"] - 1 - c["retry"]) for c in counts.values()
            ),
        }


def _analyse(chaos: Chaos, outcomes, intervals, events, overlaps) -> dict[str, Any]:
    by_task: dict[str, list[Any]] = {}
    for interval in intervals:
        by_task.setdefault(interval.task_id, []).append(interval)
    counts = {"ran": 0, "skipped": 0, "failed": 0}
    reasons: dict[str, int] = {}
    for state, reason in outcomes.values():
        counts[state] += 1
        if reason:
            reasons[reason] = reasons.get(reason, 0) + 1

    def lost_at(task_id: str, after: float) -> tuple[str, float] | None:
        found = [e for e in events.get(task_id, []) if e[1] >= after - 0.05]
        return min(found, key=lambda e: e[1]) if found else None

    # Overlaps: explained when the earlier run's loss was signalled.
    explained, unexplained, windows = [], [], []
    for overlap in overlaps:
        first, second = overlap.first, overlap.second
        window = (
            min(first.ended_at, second.ended_at) - second.started_at
        ).total_seconds()
        event = lost_at(first.task_id, first.started_at.timestamp())
        row = {
            "key": first.key,
            "window_s": round(window, 3),
            "signal": event[0] if event else None,
            "run": "part" if first.run.endswith("part") else "main",
        }
        (explained if event else unexplained).append(row)
        windows.append(window)

    # Losses injected (runs whose lock the fault surely took away) vs detected.
    killed = {pid for f in chaos.faults if "SIGKILL" in f.kind for pid in f.pids}
    losses = []
    for fault in chaos.faults:
        if not (fault.kind.startswith(("restart", "terminate", "link"))):
            continue
        link = fault.kind.startswith("link")
        hit = [
            i
            for i in intervals
            if i.started_at.timestamp() < fault.began
            and i.ended_at is not None
            # A frozen link makes the lock unverifiable at once; a restart or a
            # termination surely took it once the fault was done.
            and i.ended_at.timestamp() > (fault.began if link else fault.done + 0.1)
            and i.run.endswith("part") == link
            and (not fault.pids or i.pid in fault.pids or link)
            and (
                fault.locks is None
                or chaos.app.work.lock_key_for(i.run, i.key, 0).pg_locks_ids
                in fault.locks
            )
        ]
        if link:
            hit = [i for i in hit if i.task_id in chaos.partition_holders]
        for interval in hit:
            event = lost_at(interval.task_id, interval.started_at.timestamp())
            killed_first = (
                interval.pid in killed
                or outcomes.get(interval.task_id, ("", ""))[1] == "TimeLimitExceeded"
            )
            losses.append(
                {
                    "fault": fault.kind,
                    "task": interval.task_id,
                    "detected_after_s": None
                    if event is None
                    else round(event[1] - fault.began, 3),
                    "signal": None if event is None else event[0],
                    "killed_before_detection": event is None and killed_first,
                }
            )

    recoveries = []
    starts = sorted(i.started_at.timestamp() for i in intervals)
    for fault in chaos.faults:
        after = [s for s in starts if s > fault.done]
        if fault.holders:
            ends = [
                i.ended_at.timestamp() - fault.began
                for task_id in fault.holders
                for i in by_task.get(task_id, [])
                if i.ended_at is not None
            ]
            again = [
                i.started_at.timestamp() - fault.began
                for i in by_task.get(fault.after, [])
            ]
            ended = sorted({_outcome(outcomes, task_id) for task_id in fault.holders})
            fault.detail = (
                f"holders' bodies ended {max(ends, default=float('nan')):.2f}s after "
                f"the freeze ({', '.join(ended)}); "
                f"cut at {CUT_AFTER:.1f}s; the proxied worker locked again at "
                f"{min(again, default=float('nan')):.2f}s"
            )
        recoveries.append(
            {
                "fault": fault.kind,
                "at_s": round(fault.began - chaos.t0, 1),
                "recovered_after_s": round(after[0] - fault.began, 2)
                if after
                else None,
                "detail": fault.detail,
                "pids": sorted(fault.pids),
            }
        )
    time_limited = reasons.get("TimeLimitExceeded", 0)
    reruns = sum(1 for runs in by_task.values() if len(runs) > 1)
    return {
        "sent": len(chaos.sent),
        **counts,
        "failed_reasons": reasons,
        "overlaps_explained": explained,
        "overlaps_unexplained": unexplained,
        "overlap_window_max_s": round(max(windows), 3) if windows else 0.0,
        "partition_overlaps": sum(
            1 for o in explained + unexplained if o["run"] == "part"
        ),
        "losses": losses,
        "faults": recoveries,
        "time_limit_kills": time_limited,
        "task_ids_run_more_than_once": reruns,
        "keys": chaos.plan.keys,
    }


def _outcome(outcomes: dict[str, tuple[str, str]], task_id: str) -> str:
    state, reason = outcomes.get(task_id, ("unaccounted", ""))
    return reason or state


def checks(figures: dict[str, Any], plan: Plan) -> list[tuple[str, bool]]:
    """(what, passed) for each acceptance check of the run."""
    losses = figures["losses"]
    undetected = [
        loss
        for loss in losses
        if loss["signal"] is None and not loss["killed_before_detection"]
    ]
    late = [
        loss
        for loss in losses
        if loss["detected_after_s"] is not None
        and loss["detected_after_s"] > DETECTION_BOUND[loss["fault"].split(" (")[0]]
    ]
    kinds = [f["fault"] for f in figures["faults"]]
    return [
        ("0 unaccounted", figures["unaccounted"] == 0),
        ("0 unexplained overlaps", not figures["overlaps_unexplained"]),
        (
            "0 overlaps under partitions (lock_on_lost=terminate)",
            figures["partition_overlaps"] == 0,
        ),
        ("every injected loss detected and signalled", bool(losses) and not undetected),
        ("every loss signalled within its bound (DETECTION_BOUND)", not late),
        ("0 advisory locks left", figures["advisory_locks_left"] == 0),
        (
            f">= {plan.restarts} lock server restarts",
            sum(k.startswith("restart") for k in kinds) >= plan.restarts,
        ),
        ("backend terminations injected", "terminate" in kinds),
        (
            "pool children and whole workers SIGKILLed",
            "SIGKILL pool child" in kinds
            and any(k.startswith("SIGKILL whole") for k in kinds),
        ),
        ("hard time-limit kills", figures["time_limit_kills"] > 0),
        ("broker redeliveries", figures["redelivered"] > 0),
        ("link frozen and cut", "link frozen, then cut" in kinds),
    ]


def _wait(condition, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def render(figures: dict[str, Any], results: list[tuple[str, bool]]) -> str:
    losses = figures["losses"]
    by_fault: dict[str, list[dict[str, Any]]] = {}
    for loss in losses:
        by_fault.setdefault(loss["fault"], []).append(loss)
    ignored = sum(t["ignored_redelivery"] for t in figures["unaccounted_ids"])
    ignored = (
        f" (a skipped redelivery stored nothing; its first delivery was killed: {ignored})"
        if ignored
        else ""
    )
    lines = [
        "| tasks | count |",
        "|---|---|",
        f"| sent | {figures['sent']} |",
        f"| ran (SUCCESS) | {figures['ran']} |",
        f"| skipped (lock busy) | {figures['skipped']} |",
        f"| failed, with reason | {figures['failed']} "
        f"({', '.join(f'{k} {v}' for k, v in sorted(figures['failed_reasons'].items())) or '-'}) |",
        f"| lost by the broker before any worker received it (a worker SIGKILLed "
        f"between Redis BRPOP and its unacked record) | {figures['lost_by_broker']} |",
        f"| unaccounted | {figures['unaccounted']}{ignored} |",
        f"| task ids whose body ran more than once (redelivered after a kill) | {figures['task_ids_run_more_than_once']} |",
        f"| messages redelivered (acks_late, after a kill) | {figures['redelivered']} |",
        f"| lock_on_error retries | {figures['retried']} |",
        f"| hard time-limit kills | {figures['time_limit_kills']} |",
        "",
        "| overlaps | count |",
        "|---|---|",
        f"| after a detected, signalled loss | {len(figures['overlaps_explained'])} "
        f"(window max {figures['overlap_window_max_s']:.3f}s) |",
        f"| unexplained | {len(figures['overlaps_unexplained'])} |",
        f"| in the partition phase (lock_on_lost=terminate) | {figures['partition_overlaps']} |",
        f"| advisory locks left at the end | {figures['advisory_locks_left']} |",
        "",
        "| losses by fault | injected | detected (lock_lost / at release) | killed first | detection delay max |",
        "|---|---|---|---|---|",
    ]
    for fault, rows in by_fault.items():
        lost = sum(
            1 for r in rows if r["signal"] and not r["signal"].startswith("release")
        )
        released = sum(
            1 for r in rows if r["signal"] and r["signal"].startswith("release")
        )
        killed = sum(1 for r in rows if r["killed_before_detection"])
        delays = [
            r["detected_after_s"] for r in rows if r["detected_after_s"] is not None
        ]
        worst = f"{max(delays):.2f}s" if delays else "-"
        lines.append(
            f"| {fault} | {len(rows)} | {lost} / {released} | {killed} | {worst} |"
        )
    lines += ["", "| fault | at | first lock after | detail |", "|---|---|---|---|"]
    for fault in figures["faults"]:
        recovered = fault["recovered_after_s"]
        lines.append(
            f"| {fault['fault']} | {fault['at_s']}s | "
            f"{'-' if recovered is None else f'{recovered:.2f}s'} | {fault['detail']} |"
        )
    lines += ["", "| check | result |", "|---|---|"]
    lines += [f"| {what} | {'ok' if ok else 'FAILED'} |" for what, ok in results]
    if figures["overlaps_unexplained"]:
        lines += ["", f"unexplained overlaps: {figures['overlaps_unexplained'][:10]}"]
    if figures["unaccounted"]:
        lines += ["", f"unaccounted task ids: {figures['unaccounted_ids']}"]
    if figures["lost_by_broker"]:
        lines += ["", f"lost by the broker: {figures['lost_by_broker_ids']}"]
    return "\n".join(lines)


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
    results = checks(figures, plan)
    if all(ok for _, ok in results):
        shutil.rmtree(logs, ignore_errors=True)
    else:
        print(f"worker logs kept in {logs}", flush=True)
    figures["checks"] = dict(results)
    figures["seed"] = seed
    print(render(figures, results), flush=True)
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1, default=str))
    return 0 if all(ok for _, ok in results) else 1


if __name__ == "__main__":
    sys.exit(main())
