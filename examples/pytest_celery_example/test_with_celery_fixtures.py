"""Singleton tasks tested through Celery's in-process worker and celery-pglock's lock
database: a duplicate is skipped while the first run holds the lock (the default busy
policy, ``skip``), another key runs meanwhile, and no two bodies of one key overlapped.
"""

from __future__ import annotations

import os
import uuid
from typing import TYPE_CHECKING

import pytest

import celery_pglock
from examples.pytest_celery_example import tasks

if TYPE_CHECKING:
    from collections.abc import Iterator

    import celery
    from celery.worker import WorkController

    from celery_pglock.testing.pytest_plugin import FinalStates, OverlapCheck


@pytest.fixture
def recorded(
    celery_session_app: celery.Celery,
    celery_session_worker: WorkController,
    pglock_overlap: OverlapCheck,
) -> OverlapCheck:
    """The overlap check, recording the bodies that the in-process worker runs."""
    pglock_overlap.record(celery_session_app)
    return pglock_overlap


@pytest.fixture
def gates() -> Iterator[list[str]]:
    """Names of gates for this test; every one is opened at the end, whatever happened."""
    names: list[str] = []
    yield names
    for name in names:
        tasks.GATES.pop(name).release.set()


def new_gate(gates: list[str]) -> str:
    name = uuid.uuid4().hex
    tasks.GATES[name] = tasks.Gate()
    gates.append(name)
    return name


def test_a_duplicate_is_skipped_while_the_first_run_holds_the_lock(
    recorded: OverlapCheck, pglock_final_states: FinalStates, gates: list[str]
) -> None:
    """The duplicate ends SKIPPED at once; another key runs meanwhile; one body per key."""
    report, other_report = (uuid.uuid4().int % 10**9 for _ in range(2))
    gate, other_gate = new_gate(gates), new_gate(gates)
    first = tasks.hold_report.delay(report, gate)
    assert tasks.GATES[gate].entered.acquire(timeout=30), "the first run never started"

    duplicate = tasks.hold_report.delay(report, gate)
    other = tasks.hold_report.delay(other_report, other_gate)

    assert ["SKIPPED"] == pglock_final_states([duplicate], timeout=15)
    skip = celery_pglock.skip_info(duplicate.result)
    assert skip is not None
    assert tasks.hold_report.name == skip["task"]
    # The holder is this process: Celery's worker runs in a thread of the test.
    assert f":{os.getpid()}" == skip["holder"][skip["holder"].rindex(":") :]
    assert tasks.GATES[other_gate].entered.acquire(timeout=30), "another key waited"
    assert "STARTED" == first.state  # still holding its lock
    tasks.GATES[gate].release.set()
    tasks.GATES[other_gate].release.set()
    assert ["SUCCESS", "SUCCESS"] == pglock_final_states([first, other], timeout=30)
    assert 1 == tasks.GATES[gate].bodies
    assert 2 == len(recorded.assert_no_overlap(min_intervals=2))


def test_duplicate_exports_never_overlap(
    recorded: OverlapCheck, pglock_final_states: FinalStates
) -> None:
    """Four threads, duplicates of three tenants: bodies of one tenant never overlap."""
    tenants = [uuid.uuid4().int % 10**9 for _ in range(3)]

    results = [
        tasks.export_tenant.delay(tenant) for _ in range(4) for tenant in tenants
    ]
    states = pglock_final_states(results, timeout=60)

    assert {"SUCCESS", "SKIPPED"} >= set(states)
    intervals = recorded.assert_no_overlap(min_intervals=len(tenants))
    assert "SKIPPED" in states  # duplicates met a held lock: the check saw contention
    assert len(intervals) == states.count("SUCCESS")
