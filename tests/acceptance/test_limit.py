"""lock_limit=3 across real worker processes: a semaphore, proven by the overlap detector."""

from __future__ import annotations

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
