"""lock_limit=3 across real worker processes: a semaphore, proven by the overlap detector."""

from __future__ import annotations

import os
import signal
import time

import pytest

from .conftest import outcomes, wait_until

SENDS = 20


@pytest.fixture(scope="module")
def workers(start_workers):
    """One prefork worker with eight children: eight processes racing for three slots."""
    return start_workers(1, concurrency=8)


def test_limit_3_runs_at_most_three_bodies_of_a_key_and_loses_none(
    acceptance, workers, recorder, run
):
    """20 sends of one key, lock_limit=3, retried while busy: never more than 3 bodies at
    once, more than 1 (a semaphore, not a mutex), and all 20 ran."""
    results = [acceptance.limited.delay(run, "k", hold=0.5) for _ in range(SENDS)]
    wait_until(
        lambda: all(result.ready() for result in results),
        timeout=180,
        what="every run to end",
    )
    assert ["SUCCESS"] * SENDS == outcomes(results)
    assert SENDS == recorder.count(run, "k")
    assert [] == recorder.unfinished(run)
    peak = recorder.peak(run, "k")
    assert 1 < peak <= 3, f"peak concurrency {peak}"


def test_group_limit_2_with_one_run_per_key_across_4_keys(
    acceptance, workers, recorder, run
):
    """lock_group_limit=2 and one run per key (the default limit), 4 keys x 5 sends on
    eight children, retried while busy: never more than 2 bodies in the group, never 2
    of one key, 2 at once at some point, and all 20 ran."""
    results = [
        acceptance.grouped.delay(run, f"k{index % 4}", hold=0.3)
        for index in range(SENDS)
    ]
    wait_until(
        lambda: all(result.ready() for result in results),
        timeout=180,
        what="every run to end",
    )
    assert ["SUCCESS"] * SENDS == outcomes(results)
    assert [] == recorder.unfinished(run)
    assert acceptance.GROUP_LIMIT == recorder.peak(run, "group")
    assert [1, 1, 1, 1] == [recorder.peak(run, f"k{index}") for index in range(4)]
    assert SENDS == sum(recorder.count(run, f"k{index}") for index in range(4))


def test_a_group_slot_of_a_sigkilled_child_is_freed_with_its_session(
    acceptance, workers, recorder, run
):
    """Two gated runs fill the group; a third key is re-queued while they hold it. The
    child of one is SIGKILLed: the third runs while the other still holds its slot (the
    slot ended with the dead child's session: no lease, no expiry)."""
    gate = f"{run}-gate"
    for key in ("a", "b"):
        acceptance.grouped.delay(run, key, gate=gate)
    wait_until(
        lambda: recorder.count(run, "group") == 2, timeout=30, what="both to start"
    )
    third = acceptance.grouped.delay(run, "c")
    time.sleep(1.0)  # several retries of the third, every 0.2 s
    assert 0 == recorder.count(run, "c")
    victim = next(i for i in recorder.intervals(run) if i.key == "a").pid
    assert victim in workers[0].child_pids()
    os.kill(victim, signal.SIGKILL)
    assert "c" == third.get(timeout=30)
    assert 1 == recorder.count(run, "c")  # and "b" still waits for the gate
    acceptance.open_gate(gate)
    by_key = {interval.key: interval for interval in recorder.intervals(run)}
    # The killed body's last heartbeat came before the third started: 2 at once at most.
    assert by_key["a"].ended_at <= by_key["c"].started_at, by_key
