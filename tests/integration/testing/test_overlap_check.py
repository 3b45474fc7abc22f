"""OverlapCheck, the pytest plugin's assertion helper, on recorded intervals in PostgreSQL."""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING

import pytest

from celery_pglock.testing.pytest_plugin import OverlapCheck

if TYPE_CHECKING:
    from celery_pglock.testing import OverlapRecorder


@pytest.fixture
def check(overlap: OverlapRecorder) -> OverlapCheck:
    return OverlapCheck(overlap, uuid.uuid4().hex[:12])


def test_sequential_runs_pass_and_are_returned(check: OverlapCheck) -> None:
    """Two runs of one key, one after the other: no overlap; both intervals returned."""
    for task_id in ("a", "b"):
        with check.recorder.record(check.run, "export 1", task_id):
            pass
    assert ["a", "b"] == [i.task_id for i in check.assert_no_overlap()]


def test_overlapping_runs_fail_naming_both_tasks(check: OverlapCheck) -> None:
    """Two runs of one key at the same time fail the check, which names both."""
    with (
        check.recorder.record(check.run, "export 1", "first"),
        check.recorder.record(check.run, "export 1", "second"),
    ):
        pass
    with pytest.raises(AssertionError, match="1 overlapping runs") as failure:
        check.assert_no_overlap()
    assert "task first" in str(failure.value)
    assert "task second" in str(failure.value)


def test_concurrent_runs_of_different_keys_pass(check: OverlapCheck) -> None:
    """Exclusion is per key: two keys running together is not an overlap."""
    with (
        check.recorder.record(check.run, "export 1", "first"),
        check.recorder.record(check.run, "export 2", "second"),
    ):
        pass
    assert 2 == len(check.assert_no_overlap())


def test_too_few_runs_prove_nothing(check: OverlapCheck) -> None:
    """A check over fewer bodies than min_intervals fails: nothing ran, nothing proven."""
    with check.recorder.record(check.run, "export 1", "only"):
        pass
    with pytest.raises(AssertionError, match="Only 1 task bodies were recorded"):
        check.assert_no_overlap()
    assert 1 == len(check.assert_no_overlap(min_intervals=1))


def test_unfinished_runs_fail(check: OverlapCheck) -> None:
    """A body without an end (still running, or its worker was killed) fails the check."""
    with check.recorder.record(check.run, "export 1", "ended"):
        pass
    check.recorder.begin(check.run, "export 1", "running")
    with pytest.raises(AssertionError, match="1 task bodies have not ended"):
        check.assert_no_overlap()
