"""One lock session per worker process: connections, exclusion inside the process.

A threads-pool (and a gevent-pool) worker at concurrency 64 carries all of its session-scope locks on one
PostgreSQL session (the default ``pglock_session_mode='per_process'``), counted here in
``pg_stat_activity``; the tasks of that process exclude each other per key in front of
PostgreSQL (whose session locks are re-entrant within one session), proven with the
overlap detector.
"""

from __future__ import annotations

import threading
import time

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
        acceptance.protected.apply_async(
            (run, f"k{i % 4}"), {"hold": 0.02}, queue=queue
        )
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
