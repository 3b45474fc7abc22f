"""One lock session per worker process: connections, exclusion inside the process.

A threads-pool (and a gevent-pool) worker at concurrency 64 carries all of its session-scope locks on one
PostgreSQL session (the process's lock session), counted here in
``pg_stat_activity``; the tasks of that process exclude each other per key in front of
PostgreSQL (whose session locks are re-entrant within one session), proven with the
overlap detector.
"""

from __future__ import annotations

import subprocess
import threading
import time
from collections import Counter

import pytest

from celery_pglock.testing import _support

from .conftest import outcomes, states, wait_until

CONCURRENCY = 64
#: Lock sessions of one worker process: application_name "pglock <host>:<pid> ...".
LOCK_SESSIONS_SQL = (
    "SELECT count(*) FROM pg_stat_activity WHERE application_name LIKE %s "
    "AND backend_type = 'client backend'"
)


@pytest.fixture(scope="module", params=["threads", "gevent"])
def threads64(request, acceptance, start_workers):
    """A threads (or gevent) pool worker at concurrency 64, default session mode."""
    queue = f"{acceptance.app.conf.task_default_queue}-{request.param}64"
    (worker,) = start_workers(
        1, pool=request.param, concurrency=CONCURRENCY, queues=[queue]
    )
    return worker, queue


class SessionCounter:
    """Samples the worker's lock sessions in pg_stat_activity until stopped."""

    def __init__(self, database_url: str, pid: int) -> None:
        self.database_url = database_url
        self.pattern = f"pglock %:{pid} %"
        self.samples: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def __enter__(self) -> SessionCounter:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _sample(self) -> None:
        connection = _support.connect(
            self.database_url, application_name="acceptance session counter"
        )
        connection.autocommit = True
        try:
            deadline = time.monotonic() + 120  # bounded even if never stopped
            while not self._stop.is_set() and time.monotonic() < deadline:
                with connection.cursor() as cursor:
                    cursor.execute(LOCK_SESSIONS_SQL, (self.pattern,))
                    self.samples.append(cursor.fetchone()[0])
                time.sleep(0.01)
        finally:
            connection.close()


def max_concurrency(intervals) -> int:
    """The most bodies that ran at the same instant (by the server's clock)."""
    edges = sorted(
        [(i.started_at, 1) for i in intervals] + [(i.ended_at, -1) for i in intervals],
        key=lambda edge: (edge[0], edge[1]),
    )
    running = peak = 0
    for _, step in edges:
        running += step
        peak = max(peak, running)
    return peak


def test_threads_worker_at_concurrency_64_uses_at_most_two_lock_connections(
    acceptance, threads64, recorder, run, database_url
):
    """64 threads running locked tasks on distinct keys: ≤ 2 lock sessions, not 64."""
    worker, queue = threads64
    with SessionCounter(database_url, worker.pid) as counter:
        results = [
            acceptance.protected.apply_async((run, f"k{i}"), {"hold": 0.2}, queue=queue)
            for i in range(256)
        ]
        wait_until(
            lambda: all(state == "SUCCESS" for state in states(results)),
            timeout=120,
            what="every run to succeed",
        )
    assert 256 == recorder.count(run)
    peak = max_concurrency(recorder.intervals(run))
    assert peak >= 16, f"only {peak} bodies ran at once: the test did not load the pool"
    assert counter.samples, "pg_stat_activity was never sampled"
    assert max(counter.samples) <= 2, (
        f"{max(counter.samples)} lock sessions for one threads worker at concurrency "
        f"{CONCURRENCY} ({peak} bodies at once)"
    )


def test_shared_session_excludes_per_key_inside_the_process(
    acceptance, threads64, recorder, run
):
    """64 threads on one shared session, 4 keys: zero overlaps, every message accounted."""
    _, queue = threads64
    results = [
        acceptance.protected.apply_async((run, f"k{i % 4}"), {"hold": 0.1}, queue=queue)
        for i in range(300)
    ]
    wait_until(
        lambda: all(o in ("SUCCESS", "skipped") for o in outcomes(results)),
        timeout=120,
        what="every run to end",
    )
    outcome = outcomes(results)
    ran, skipped = outcome.count("SUCCESS"), outcome.count("skipped")
    assert len(results) == ran + skipped
    assert ran == recorder.count(run)
    assert skipped > 0, "no duplicate ever met a running holder: nothing was tested"
    assert [] == recorder.overlaps(run)
    assert max_concurrency(recorder.intervals(run)) >= 2  # the keys ran side by side


#: Lock connections per process of this host: application_name "pglock <host>:<pid> ...",
#: the lock session's and any other (the watcher's own was "pglock <host>:<pid> watch").
PER_PROCESS_SQL = (
    "SELECT split_part(split_part(application_name, ' ', 2), ':', 2)::int, count(*) "
    "FROM pg_stat_activity WHERE application_name LIKE 'pglock %%' "
    "AND backend_type = 'client backend' GROUP BY 1"
)


class PerProcessCounter(SessionCounter):
    """Samples the lock connections of each process in ``pids`` (the worker's children)."""

    def __init__(self, database_url: str, pids: set[int]) -> None:
        super().__init__(database_url, 0)
        self.pids = pids
        self.peaks: Counter[int] = Counter()
        self.names: set[tuple[str, str, str]] = set()

    def _sample(self) -> None:
        connection = _support.connect(
            self.database_url, application_name="acceptance session counter"
        )
        connection.autocommit = True
        try:
            deadline = time.monotonic() + 120  # bounded even if never stopped
            while not self._stop.is_set() and time.monotonic() < deadline:
                with connection.cursor() as cursor:
                    cursor.execute(PER_PROCESS_SQL)
                    for pid, count in cursor.fetchall():
                        if pid in self.pids:
                            self.peaks[pid] = max(self.peaks[pid], count)
                    cursor.execute(
                        "SELECT application_name, state, query FROM pg_stat_activity "
                        "WHERE application_name LIKE 'pglock %%'"
                    )
                    self.names.update(cursor.fetchall())
                self.samples.append(1)
                time.sleep(0.02)
        finally:
            connection.close()


def children(pid: int) -> set[int]:
    out = subprocess.run(
        ["ps", "-o", "pid=", "--ppid", str(pid)],
        capture_output=True,
        text=True,
        check=False,
        timeout=10,
    ).stdout
    return {int(line) for line in out.split()}


@pytest.fixture(scope="module")
def prefork2(acceptance, start_workers):
    """A prefork worker with 2 children, default session mode and watch interval (1 s)."""
    queue = f"{acceptance.app.conf.task_default_queue}-prefork2"
    (worker,) = start_workers(1, pool="prefork", concurrency=2, queues=[queue])
    return worker, queue


def _warm(acceptance, task, run, queue, pids, database_url):
    """Until every process in ``pids`` has taken a lock: its first lock probes the server
    on two short-lived connections of its own (_server.probe), closed before its lock
    session opens. Counted from then on: what a process holds, not its first second."""

    def lock_connections() -> dict[int, int]:
        connection = _support.connect(database_url, application_name="warm")
        try:
            with connection.cursor() as cursor:
                cursor.execute(PER_PROCESS_SQL)
                return {pid: n for pid, n in cursor.fetchall() if pid in pids}
        finally:
            connection.close()

    for round_ in range(20):  # bounded: a child that never gets a task fails the test
        results = [
            task.apply_async((run, f"warm{round_}-{i}"), {"hold": 0.2}, queue=queue)
            for i in range(2 * len(pids))
        ]
        wait_until(
            lambda results=results: all(s == "SUCCESS" for s in states(results)),
            timeout=60,
            what="the warm-up runs",
        )
        if set(lock_connections()) == pids:
            return
    pytest.fail(f"not every process of {pids} took a lock: {lock_connections()}")


def _run_long_bodies(acceptance, task, run, queue, count, hold=2.6):
    results = [
        task.apply_async((run, f"long{i}"), {"hold": hold}, queue=queue)
        for i in range(count)
    ]
    wait_until(
        lambda: all(state == "SUCCESS" for state in states(results)),
        timeout=120,
        what="every long run to succeed",
    )


def test_a_prefork_child_holds_one_lock_connection_while_a_long_body_runs(
    acceptance, prefork2, recorder, run, database_url
):
    """Bodies longer than lock_watch_interval are checked by the watcher, through the
    child's own lock session: 1 connection per child (it used to open a second one, its
    watcher's, so 100 workers x 16 children held 3,200 backends, not 1,600)."""
    worker, queue = prefork2
    pids = children(worker.pid)
    assert 2 == len(pids), pids
    _warm(acceptance, acceptance.protected, run, queue, pids, database_url)
    with PerProcessCounter(database_url, pids) as counter:
        _run_long_bodies(acceptance, acceptance.protected, run, queue, 4)
    assert 4 == sum(recorder.count(run, key=f"long{i}") for i in range(4))
    assert counter.samples, "pg_stat_activity was never sampled"
    assert set(counter.peaks) == pids, (counter.peaks, pids)  # both children ran bodies
    assert {1} == set(counter.peaks.values()), (counter.peaks, sorted(counter.names))


def test_a_prefork_child_in_transaction_scope_holds_two(
    acceptance, prefork2, recorder, run, database_url
):
    """Transaction scope: the body uses its lock's connection, so the watcher checks on a
    connection of its own: 2 per child while a long body runs (counted so in the docs
    and by `pglock check`)."""
    worker, queue = prefork2
    pids = children(worker.pid)
    with PerProcessCounter(database_url, pids) as counter:
        _run_long_bodies(acceptance, acceptance.protected_in_transaction, run, queue, 4)
    assert 4 == recorder.count(run)
    assert max(counter.peaks.values()) == 2, counter.peaks


def test_threads_worker_holds_one_lock_connection_while_long_bodies_run(
    acceptance, threads64, recorder, run, database_url
):
    """64 bodies longer than lock_watch_interval at once, in a threads (or gevent) worker:
    every lock, and every check of them, on one connection."""
    worker, queue = threads64
    _warm(acceptance, acceptance.protected, run, queue, {worker.pid}, database_url)
    with PerProcessCounter(database_url, {worker.pid}) as counter:
        _run_long_bodies(acceptance, acceptance.protected, run, queue, 64)
    assert 64 == sum(recorder.count(run, key=f"long{i}") for i in range(64))
    assert max_concurrency(recorder.intervals(run)) >= 16
    assert {worker.pid: 1} == dict(counter.peaks), counter.peaks
