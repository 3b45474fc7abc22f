"""What a busy run becomes, per option set: the pure rules the runs and `pglock check`
share (celery_pglock/task/busy_policy.py). No I/O."""

from __future__ import annotations

import pytest

from celery_pglock.config import Enqueue, LockConfig, OnBusy
from celery_pglock.task import busy_policy


def options(**values):
    return LockConfig(task_name="unit.t", name="unit.t", **values)


@pytest.mark.parametrize(
    ("on_busy", "direct", "expected"),
    [
        (OnBusy.SKIP, False, OnBusy.SKIP),
        (OnBusy.RETRY, False, OnBusy.RETRY),
        (OnBusy.SKIP, True, OnBusy.RAISE),
        (OnBusy.RETRY, True, OnBusy.RAISE),
        (OnBusy.WAIT, True, OnBusy.WAIT),
        (OnBusy.RAISE, True, OnBusy.RAISE),
    ],
)
def test_a_direct_call_raises_unless_it_waits(on_busy, direct, expected):
    """A direct call has no message to skip or re-queue; a worker's run follows
    lock_on_busy."""
    assert expected == busy_policy.busy_action(options(on_busy=on_busy), direct=direct)


@pytest.mark.parametrize(
    ("enqueue", "direct", "expected"),
    [
        (None, False, OnBusy.RAISE),
        (Enqueue.UNTIL_FINISHED, False, OnBusy.RAISE),
        (Enqueue.UNTIL_STARTED, False, OnBusy.RETRY),
        (Enqueue.UNTIL_STARTED, True, OnBusy.RAISE),
    ],
)
def test_a_wait_that_runs_out_re_queues_only_a_queued_follow_up(
    enqueue, direct, expected
):
    """Only a worker's run of lock_enqueue='until_started' re-queues a wait that ran out."""
    config = options(on_busy=OnBusy.WAIT, enqueue=enqueue)
    assert expected == busy_policy.after_wait(config, direct=direct)


def test_a_plain_wait_or_raise_has_nothing_to_show():
    """lock_on_busy='wait' or 'raise' without lock_enqueue runs as it reads."""
    assert [] == busy_policy.silent_changes(options(on_busy=OnBusy.WAIT))
    assert [] == busy_policy.silent_changes(options(on_busy=OnBusy.RAISE))


def test_debounce_shows_that_its_duplicates_replace():
    """lock_debounce sets lock_enqueue_on_duplicate='replace': pglock check says so."""
    config = options(on_busy=OnBusy.WAIT, enqueue=Enqueue.UNTIL_STARTED, debounce=1.5)
    assert (
        "a send of a queued key replaces it (lock_enqueue_on_duplicate='replace'), "
        "because lock_debounce=1.5"
    ) == busy_policy.silent_changes(config)[-1]


def test_an_explicit_wait_under_until_started_shows_only_its_re_queue():
    """A set lock_on_busy='wait' is not implied: only the re-queue of a wait that runs
    out is shown."""
    config = options(on_busy=OnBusy.WAIT, enqueue=Enqueue.UNTIL_STARTED)
    [change] = busy_policy.silent_changes(config)
    assert change.startswith("a 'wait' that runs out (lock_wait_timeout 10s) runs as")
