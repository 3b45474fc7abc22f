"""Exclusivity across real worker processes, proven by the overlap detector.

Every protected body records its interval with PostgreSQL's clock; the assertion is that
no two intervals of one key overlap, across processes, under bursts of duplicates.
"""

from __future__ import annotations

import random

import pytest

from celery_pglock.db import engines

from .conftest import outcomes, skipped, wait_until

BURST = 40


@pytest.fixture(scope="module")
def workers(start_workers):
    """Two prefork workers with two children each: four processes racing per key."""
    return start_workers(2, concurrency=2)


def test_burst_of_duplicates_runs_exactly_once(acceptance, workers, recorder, run):
    """While one run holds the key, a burst of duplicates from all workers is all skipped."""
    gate = f"{run}-gate"
    first = acceptance.protected.delay(run, "k", gate=gate)
    wait_until(
        lambda: recorder.count(run, "k") == 1, timeout=30, what="the first run to start"
    )
    duplicates = [acceptance.protected.delay(run, "k") for _ in range(BURST - 1)]
    wait_until(
        lambda: all(skipped(result) for result in duplicates),
        timeout=60,
        what="every duplicate to be skipped",
    )
    acceptance.open_gate(gate)
    assert "k" == first.get(timeout=30)
    assert 1 == recorder.count(run, "k")
    assert [] == recorder.overlaps(run)
    skip = duplicates[0].result.details
    assert "lock_busy" == skip["reason"]
    assert "tests.acceptance.app.protected" == skip["task"]
    # The holder is named by the host:pid of the pool child that ran the first body.
    host = engines.process_tag().rsplit(":", 1)[0]
    assert f"{host}:{recorder.intervals(run)[0].pid}" == skip["holder"]
    # application_name is at most 63 bytes: a long task name keeps its tail.
    assert skip["holder_task"].endswith(".acceptance.app.protected")


def test_random_bursts_never_overlap_and_account_for_every_message(
    acceptance, workers, recorder, run
):
    """Mixed keys and hold times under load: zero overlaps, ran + skipped == sent."""
    rng = random.Random(run)  # noqa: S311 - reproducible test data, not crypto
    results = [
        acceptance.protected.delay(
            run, f"k{rng.randrange(3)}", hold=rng.choice([0, 0.01, 0.03])
        )
        for _ in range(150)
    ]
    wait_until(
        lambda: all(o in ("SUCCESS", "skipped") for o in outcomes(results)),
        timeout=120,
        what="every run to end",
    )
    outcome = outcomes(results)
    ran, skips = outcome.count("SUCCESS"), outcome.count("skipped")
    assert len(results) == ran + skips
    assert ran == recorder.count(run)
    assert [] == recorder.overlaps(run)
    for key in ("k0", "k1", "k2"):
        assert recorder.count(run, key) >= 1


def test_different_keys_run_in_parallel(acceptance, workers, recorder, run):
    """Per-argument keys are independent: tenants A and B hold their locks at once."""
    gate = f"{run}-gate"
    a = acceptance.protected.delay(run, "tenant-a", gate=gate)
    b = acceptance.protected.delay(run, "tenant-b", gate=gate)
    wait_until(
        lambda: recorder.count(run) == 2,
        timeout=30,
        what="both tenants to be running together",
    )
    acceptance.open_gate(gate)
    assert ["tenant-a", "tenant-b"] == [a.get(timeout=30), b.get(timeout=30)]
    first, second = recorder.intervals(run)
    assert first.started_at < second.ended_at
    assert second.started_at < first.ended_at


def test_wait_policy_runs_every_duplicate_one_after_another(
    acceptance, workers, recorder, run
):
    """lock_on_busy='wait': duplicates queue up on the lock and all run, never together."""
    results = [acceptance.waiter.delay(run, "k", hold=0.2) for _ in range(4)]
    assert ["k"] * 4 == [result.get(timeout=60) for result in results]
    assert 4 == recorder.count(run, "k")
    assert [] == recorder.overlaps(run)


def test_retry_policy_reruns_after_the_holder_finishes(
    acceptance, workers, recorder, run
):
    """lock_on_busy='retry': the duplicate is re-queued until the lock is free, then runs."""
    gate = f"{run}-gate"
    holder = acceptance.retrier.delay(run, "k", gate=gate)
    wait_until(
        lambda: recorder.count(run, "k") == 1, timeout=30, what="the holder to start"
    )
    duplicate = acceptance.retrier.delay(run, "k")
    wait_until(
        lambda: duplicate.state == "RETRY",
        timeout=30,
        what="the duplicate to be retried",
    )
    acceptance.open_gate(gate)
    assert "k" == holder.get(timeout=30)
    assert "k" == duplicate.get(timeout=60)
    assert 2 == recorder.count(run, "k")
    assert [] == recorder.overlaps(run)


def test_raise_policy_fails_the_duplicate(acceptance, workers, recorder, run):
    """lock_on_busy='raise': the duplicate fails with LockBusy; the holder is unaffected."""
    gate = f"{run}-gate"
    holder = acceptance.raiser.delay(run, "k", gate=gate)
    wait_until(
        lambda: recorder.count(run, "k") == 1, timeout=30, what="the holder to start"
    )
    duplicate = acceptance.raiser.delay(run, "k")
    wait_until(
        lambda: duplicate.state == "FAILURE", timeout=30, what="the duplicate to fail"
    )
    assert "LockBusy" == type(duplicate.result).__name__
    acceptance.open_gate(gate)
    assert "k" == holder.get(timeout=30)


def test_send_task_by_name_is_locked_too(acceptance, workers, recorder, run):
    """Enforcement is worker-side: a producer without the task code is still deduplicated."""
    gate = f"{run}-gate"
    name = acceptance.protected.name
    first = acceptance.app.send_task(name, args=(run, "k"), kwargs={"gate": gate})
    wait_until(
        lambda: recorder.count(run, "k") == 1, timeout=30, what="the first run to start"
    )
    # The keyword form: the same key.
    second = acceptance.app.send_task(name, args=(run,), kwargs={"key": "k"})
    wait_until(
        lambda: skipped(second),
        timeout=30,
        what="the by-name duplicate to be skipped",
    )
    acceptance.open_gate(gate)
    assert "k" == first.get(timeout=30)
