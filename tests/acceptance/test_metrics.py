"""Prometheus metrics served by a real prefork worker (app.conf.pglock_metrics_port).

The pool children count; the worker's main process serves /metrics, merging the
children's multiprocess files. ``--max-tasks-per-child`` makes the pool replace its
children during the test, so counts of exited children must survive (archived).
"""

from __future__ import annotations

import re
import socket
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

from celery_pglock import LockSkipped

from .conftest import wait_until

BURST = 15
TASK = "tests.acceptance.app.protected"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.fixture(scope="module")
def metrics_worker(acceptance, start_workers):
    """A prefork worker serving /metrics on its own queue; children replaced every 4 tasks."""
    port = free_port()
    queue = f"{acceptance.app.conf.task_default_queue}-metrics"
    (worker,) = start_workers(
        1,
        concurrency=2,
        queues=[queue],
        env={"PGLOCK_TEST_METRICS_PORT": str(port)},
        extra_args=("--max-tasks-per-child", "4"),
    )
    return worker, port, queue


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        return r.read().decode()


def sample(text: str, name: str, **labels: str) -> float:
    """The value of one sample, 0 if absent; labels must match exactly."""
    total = 0.0
    for line in text.splitlines():
        match = re.match(rf"^{name}\{{(.*)\}} (\S+)$", line)
        if match is None:
            continue
        found = dict(re.findall(r'(\w+)="([^"]*)"', match.group(1)))
        if found == labels:
            total += float(match.group(2))
    return total


def test_scraped_skips_equal_the_skips_callers_saw(
    acceptance, metrics_worker, recorder, run
):
    """After a burst of duplicates, celery_pglock_skipped_total equals the number of
    LockSkipped results the caller received; acquired/released/held count the runs."""
    _, port, queue = metrics_worker
    before = scrape(port)
    gate = f"{run}-gate"
    holder = acceptance.protected.apply_async((run, "k"), {"gate": gate}, queue=queue)
    wait_until(
        lambda: recorder.count(run, "k") == 1, timeout=30, what="the holder to start"
    )
    duplicates = [
        acceptance.protected.apply_async((run, "k"), queue=queue) for _ in range(BURST)
    ]
    skips = 0
    for result in duplicates:
        with pytest.raises(LockSkipped):
            result.get(timeout=30)
        skips += 1
    acceptance.open_gate(gate)
    assert "k" == holder.get(timeout=30)
    after = scrape(port)

    def delta(name: str, **labels: str) -> float:
        return sample(after, name, **labels) - sample(before, name, **labels)

    assert skips == delta("celery_pglock_skipped_total", task=TASK, policy="skip")
    assert 1 == delta("celery_pglock_acquired_total", task=TASK)
    assert 1 == delta("celery_pglock_released_total", task=TASK, state="SUCCESS")
    assert 1 == delta("celery_pglock_held_seconds_count", task=TASK)
    assert BURST + 1 == delta("celery_pglock_wait_seconds_count", task=TASK)
    assert run not in after  # labels never carry argument values


def test_an_idle_worker_serves_every_series_and_the_locks_held_now(
    acceptance, start_workers, recorder, run
):
    """Before its first task a worker's /metrics has every series at zero (alerts on a
    rate or on absence work on a worker that runs a daily task) and its info series;
    while a body runs, the held-locks gauge reads 1 and the oldest held lock's age
    grows; once released, both read 0 again."""
    port = free_port()
    queue = f"{acceptance.app.conf.task_default_queue}-metrics-idle"
    start_workers(
        1, concurrency=1, queues=[queue], env={"PGLOCK_TEST_METRICS_PORT": str(port)}
    )
    idle = scrape(port)
    assert re.search(r'^celery_pglock_info\{version="[^"]+"\} 1\.0$', idle, re.M), idle
    for name in (
        "celery_pglock_acquired_total",
        "celery_pglock_release_failed_total",
        "celery_pglock_lost_total",
        "celery_pglock_held_locks",
        "celery_pglock_oldest_held_seconds",
    ):
        assert f'{name}{{task="{TASK}"}} 0.0' in idle, name
    assert f'celery_pglock_skipped_total{{policy="skip",task="{TASK}"}} 0.0' in idle
    assert "celery_pglock_oldest_held_start_time_seconds" not in idle  # raw form

    gate = f"{run}-gate"
    holder = acceptance.protected.apply_async((run, "k"), {"gate": gate}, queue=queue)
    wait_until(
        lambda: recorder.count(run, "k") == 1, timeout=30, what="the body to start"
    )
    time.sleep(1.1)
    busy = scrape(port)
    acceptance.open_gate(gate)
    assert "k" == holder.get(timeout=30)
    assert 1 == sample(busy, "celery_pglock_held_locks", task=TASK)
    assert 1 <= sample(busy, "celery_pglock_oldest_held_seconds", task=TASK) < 60
    after = scrape(port)
    assert 0 == sample(after, "celery_pglock_held_locks", task=TASK)
    assert 0 == sample(after, "celery_pglock_oldest_held_seconds", task=TASK)
    assert 1 == sample(after, "celery_pglock_acquired_total", task=TASK)


def test_shadow_mode_counts_would_be_skips(acceptance, metrics_worker, recorder, run):
    """lock_shadow=True: every body runs, and the would-be skips are counted."""
    _, port, queue = metrics_worker
    task = "tests.acceptance.app.shadowed"
    before = sample(
        scrape(port), "celery_pglock_skipped_total", task=task, policy="skip"
    )
    gate = f"{run}-gate"
    holder = acceptance.shadowed.apply_async((run, "k"), {"gate": gate}, queue=queue)
    wait_until(
        lambda: recorder.count(run, "k") == 1, timeout=30, what="the holder to start"
    )
    duplicates = [
        acceptance.shadowed.apply_async((run, "k"), queue=queue) for _ in range(3)
    ]
    assert ["k"] * 3 == [result.get(timeout=30) for result in duplicates]
    acceptance.open_gate(gate)
    assert "k" == holder.get(timeout=30)
    after = sample(
        scrape(port), "celery_pglock_skipped_total", task=task, policy="skip"
    )
    assert 3 == after - before
    assert 4 == recorder.count(run, "k")


@pytest.mark.parametrize("pool", ["threads", "solo"])
def test_metrics_in_single_process_pools(
    acceptance, start_workers, recorder, run, pool
):
    """--pool threads / solo: the main process both counts and serves."""
    port = free_port()
    queue = f"{acceptance.app.conf.task_default_queue}-metrics-{pool}"
    start_workers(
        1,
        pool=pool,
        concurrency=4 if pool == "threads" else 1,
        queues=[queue],
        env={"PGLOCK_TEST_METRICS_PORT": str(port)},
    )
    gate = f"{run}-gate"
    holder = acceptance.protected.apply_async((run, "k"), {"gate": gate}, queue=queue)
    wait_until(
        lambda: recorder.count(run, "k") == 1, timeout=30, what="the holder to start"
    )
    skips = 0
    if pool == "threads":  # solo runs one task at a time: no duplicate can start
        for result in [
            acceptance.protected.apply_async((run, "k"), queue=queue) for _ in range(3)
        ]:
            with pytest.raises(LockSkipped):
                result.get(timeout=30)
            skips += 1
    acceptance.open_gate(gate)
    assert "k" == holder.get(timeout=30)
    text = scrape(port)
    assert 1 == sample(text, "celery_pglock_acquired_total", task=TASK)
    assert skips == sample(
        text, "celery_pglock_skipped_total", task=TASK, policy="skip"
    )
    assert 1 == sample(text, "celery_pglock_released_total", task=TASK, state="SUCCESS")


def test_counts_survive_replaced_children_and_the_directory_is_removed(
    acceptance, metrics_worker, recorder, run
):
    """Children exit every 4 tasks: their counts are archived, not lost, and the
    private multiprocess directory holds a bounded number of files. Stopping the worker
    removes the directory."""
    worker, port, queue = metrics_worker
    before = sample(scrape(port), "celery_pglock_acquired_total", task=TASK)
    results = [
        acceptance.protected.apply_async((run, f"k{i}"), queue=queue) for i in range(12)
    ]
    assert [f"k{i}" for i in range(12)] == [r.get(timeout=30) for r in results]
    # Children replaced at least twice: the scrape archives the exited children's files.
    text = scrape(port)
    assert 12 == sample(text, "celery_pglock_acquired_total", task=TASK) - before
    # The worker made its directory with tempfile.mkdtemp (this app logs no INFO lines
    # of celery_pglock): the newest one with an archive is this worker's.
    directory = max(
        (
            path
            for path in Path(tempfile.gettempdir()).glob("celery-pglock-metrics-*")
            if (path / "counter_archive.db").exists()
        ),
        key=lambda path: path.stat().st_mtime,
    )

    def settled() -> bool:
        # A child may exit (its 4th task done) just after a scrape: the next scrape
        # archives and forgets it. Per metric type (counter, histogram): two live
        # children, the main process (the series it declared at zero) and the archive.
        # Gauges (locks held now): live processes' files only.
        scrape(port)
        live = {str(worker.pid), *(str(pid) for pid in worker.child_pids())}
        files = sorted(path.name for path in directory.iterdir())
        counted = [f for f in files if f.startswith(("counter_", "histogram_"))]
        gauges = [f for f in files if f.startswith("gauge_")]
        return (
            len(counted) <= 8
            and "counter_archive.db" in files
            and all(f[:-3].rsplit("_", 1)[-1] in live for f in gauges)
        )

    wait_until(settled, timeout=15, what="only live processes' metric files")
    worker.stop(timeout=20)
    wait_until(
        lambda: not directory.exists(), timeout=10, what="the directory's removal"
    )
