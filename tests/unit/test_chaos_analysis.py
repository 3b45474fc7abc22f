"""The chaos run's verdict on overlaps (tests/chaos/analysis.py), on made-up figures.

The chaos run fails CI on one unexplained overlap, so what it calls explained must be
exactly the overlaps a fault caused: a loss that was signalled, or a fault that took the
lock of a run whose process was then killed before it could tell.
"""

from __future__ import annotations

import datetime
import types

from celery_pglock.testing.overlap import Interval, Overlap
from tests.chaos import analysis, faults

T0 = datetime.datetime(2026, 12, 1, 12, 0, tzinfo=datetime.timezone.utc)
RUN = "r1-main"
FIRST_PID, SECOND_PID = 101, 202


def at(seconds: float) -> datetime.datetime:
    return T0 + datetime.timedelta(seconds=seconds)


def interval(row: int, task: str, pid: int, start: float, end: float) -> Interval:
    return Interval(
        id=row,
        run=RUN,
        key="k9",
        task_id=task,
        pid=pid,
        started_at=at(start),
        ended_at=at(end),
    )


def chaos(*injected: faults.Fault) -> types.SimpleNamespace:
    work = types.SimpleNamespace(
        lock_key_for=lambda run, key, _: types.SimpleNamespace(pg_locks_ids=(run, key))
    )
    return types.SimpleNamespace(
        app=types.SimpleNamespace(work=work),
        sent={"first": "long", "second": "short"},
        t0=T0.timestamp(),
        faults=list(injected),
        partition_holders=set(),
        plan=types.SimpleNamespace(keys=12),
    )


def terminate(began: float) -> faults.Fault:
    """A pg_terminate_backend of the first run's session, which held k9."""
    moment = at(began).timestamp()
    return faults.Fault(
        "terminate", moment, moment + 0.01, {FIRST_PID}, locks={(RUN, "k9")}
    )


def child_kill(began: float) -> faults.Fault:
    moment = at(began).timestamp()
    return faults.Fault("SIGKILL pool child", moment, moment + 0.01, {FIRST_PID})


# The first run held k9 from 1.0 s and was last seen alive at 2.2 s; the second took the
# freed lock at 2.1 s: 0.1 s together.
FIRST = interval(1, "first", FIRST_PID, 1.0, 2.2)
SECOND = interval(2, "second", SECOND_PID, 2.1, 2.4)
OUTCOMES = {"first": ("failed", "WorkerLostError"), "second": ("ran", "")}


def verdict(run: types.SimpleNamespace, events: dict | None = None) -> dict:
    return analysis.analyse(
        run,  # type: ignore[arg-type]
        OUTCOMES,
        [FIRST, SECOND],
        events or {},
        [Overlap(first=FIRST, second=SECOND)],
    )


def test_an_overlap_after_a_signalled_loss_is_explained():
    """The first run's task got lock_lost after it started: explained, not a failure."""
    figures = verdict(
        chaos(terminate(2.0)), {"first": [("lock_lost", at(2.3).timestamp())]}
    )
    assert 1 == len(figures["overlaps_explained"])
    assert [] == figures["overlaps_unexplained"]


def test_an_overlap_whose_holder_was_killed_after_a_fault_took_its_lock_is_counted_apart():
    """A fault took the first run's lock, then its process was SIGKILLed before the
    watcher's check: no signal could be sent, and the fault explains the overlap."""
    figures = verdict(chaos(terminate(2.0), child_kill(2.25)))
    assert ["terminate"] == [o["fault"] for o in figures["overlaps_killed_first"]]
    assert [] == figures["overlaps_unexplained"]


def test_an_overlap_without_a_signal_or_a_fault_that_took_the_lock_is_unexplained():
    """A kill alone frees a lock only with its process: an overlap then is a failure."""
    figures = verdict(chaos(child_kill(2.25)))
    (row,) = figures["overlaps_unexplained"]
    assert 0.1 == row["window_s"]
    assert ["first", "second"] == [r["task"] for r in row["runs"]]
    assert [] == figures["overlaps_killed_first"]


def test_a_fault_on_another_session_does_not_explain_an_overlap():
    """A termination of a session that did not hold the key took nothing from the run."""
    other = terminate(2.0)
    other.locks = {(RUN, "k3")}
    figures = verdict(chaos(other, child_kill(2.25)))
    assert 1 == len(figures["overlaps_unexplained"])


def test_a_fault_after_the_second_run_started_does_not_explain_an_overlap():
    """The second run took the lock before the fault: the fault did not free it."""
    figures = verdict(chaos(terminate(2.15), child_kill(2.25)))
    assert 1 == len(figures["overlaps_unexplained"])


# Tasks without an outcome: lost by the broker (evidence read from Redis) or unaccounted.


def missing(task_id: str, *, received: bool = False) -> dict:
    return {"id": task_id, "received": received}


def test_a_message_in_no_redis_record_received_by_no_worker_is_lost_by_a_killed_consumer():
    """The CI case: sent the instant a whole worker was SIGKILLed (after the kill began),
    never received, in no queue and not unacked: the dead consumer's BRPOP took it."""
    lost, unaccounted = analysis.broker_losses([missing("a")], {}, consumers_killed=1)
    assert ["a"] == [t["id"] for t in lost]
    assert [] == unaccounted


def test_without_a_killed_consumer_a_vanished_message_is_unaccounted():
    """A live consumer records every message it pops: nothing else explains the loss."""
    lost, unaccounted = analysis.broker_losses([missing("a")], {}, consumers_killed=0)
    assert [] == lost
    assert ["a"] == [t["id"] for t in unaccounted]


def test_a_message_still_unacked_or_queued_is_unaccounted_and_says_where():
    """Fetched and never acknowledged (kombu's unacked hash), or never fetched: Redis still
    has it, so nothing lost it; the visibility timeout should have brought it back."""
    where = {"a": "kombu 'unacked' hash", "b": "queue q"}
    lost, unaccounted = analysis.broker_losses(
        [missing("a"), missing("b")], where, consumers_killed=2
    )
    assert [] == lost
    assert where == {t["id"]: t["in_broker"] for t in unaccounted}


def test_a_received_message_without_an_outcome_is_unaccounted():
    """A worker logged it as received: from then on it is Celery's and the library's."""
    lost, unaccounted = analysis.broker_losses(
        [missing("a", received=True)], {}, consumers_killed=1
    )
    assert [] == lost
    assert ["a"] == [t["id"] for t in unaccounted]


def test_more_vanished_messages_than_killed_consumers_are_all_unaccounted():
    """A BRPOP returns one message: each dead consumer took at most one."""
    lost, unaccounted = analysis.broker_losses(
        [missing("a"), missing("b")], {}, consumers_killed=1
    )
    assert [] == lost
    assert ["a", "b"] == [t["id"] for t in unaccounted]
