"""A lock_limit task in-process against real PostgreSQL and Redis: what a run holds, and
how a run finding every slot taken is skipped, naming a holder."""

from __future__ import annotations

import time
import uuid

import pytest

from celery_pglock import (
    AdvisoryLock,
    ConfigurationError,
    LockSkipped,
    SingletonTask,
    current_lock,
    keys,
)
from celery_pglock.db import engines
from celery_pglock.lock import sessions
from tests.integration import task_support
from tests.integration.task_support import current_engine, define, ran, trace_delivery


def hold_key_slots(task, count, *args, limit=None):
    """Hold ``count`` slots of the call's key (of ``limit``, else lock_limit)."""
    slots = keys.slot_keys(task.lock_key_for(*args), limit or task.lock_config.limit)
    return slots, task_support.hold_slots(task.app, slots, count)


def test_a_run_takes_a_free_slot_and_a_full_key_is_skipped_naming_a_holder(app):
    """With 2 of 2 slots held the run is skipped, its message naming the slots and a
    holder; with one freed, the run holds that slot (current_lock().key) for its body."""
    seen = []

    def report():
        seen.append(current_lock().key)

    task = define(app, report, lock_limit=2)
    slots, locks = hold_key_slots(task, 2)
    try:
        result = task.apply()
        assert "FAILURE" == result.state
        with pytest.raises(LockSkipped) as raised:
            result.get(timeout=5)
        message = str(raised.value)
        assert "has all 2 slots (lock_limit) held, one by " in message
        assert engines.process_tag() in message
        locks[0].release()
        assert "SUCCESS" == task.apply().state
        assert [slots[0]] == seen
    finally:
        for lock in locks:
            if lock.owned():
                lock.release()
    assert not any(
        AdvisoryLock(engine=current_engine(app), key=k).locked() for k in slots
    )


def test_an_acks_late_run_takes_its_run_lock_in_the_slot_statement(app):
    """acks_late: the run lock is taken beside the granted slot, in the same statement,
    and released with it."""
    task_id = uuid.uuid4().hex
    run = keys.run_key(task_id)
    during = []

    def report():
        during.append(AdvisoryLock(engine=current_engine(app), key=run).locked())

    task = define(app, report, lock_limit=3, acks_late=True)
    _, locks = hold_key_slots(task, 1)
    try:
        trace_delivery(task, task_id, redelivered=False)
    finally:
        locks[0].release()
    assert [True] == during
    assert not AdvisoryLock(engine=current_engine(app), key=run).locked()


def test_the_default_limit_sends_no_slot_statement(app, monkeypatch):
    """lock_limit=1 (the default) locks the key with the statements it always used."""
    sent = []
    real = sessions.base.try_slots
    monkeypatch.setattr(
        sessions.base, "try_slots", lambda *a, **k: sent.append(a) or real(*a, **k)
    )
    task = define(app, ran, lock_limit=1)
    assert "SUCCESS" == task.apply().state
    assert [] == sent


def test_the_watcher_checks_the_granted_slot(app, lost_events):
    """A body holding slot 1 while slot 0 is held elsewhere is not taken for lost: the
    watcher checks the slot the run holds."""

    def slow():
        time.sleep(1.0)

    task = define(app, slow, lock_limit=2, lock_watch_interval=0.2)
    _, locks = hold_key_slots(task, 1)
    try:
        assert "SUCCESS" == task.apply().state
    finally:
        locks[0].release()
    assert [] == lost_events


def test_shadow_mode_runs_the_body_when_every_slot_is_taken(app, events):
    task = define(app, ran, lock_limit=2, lock_shadow=True)
    _, locks = hold_key_slots(task, 2)
    try:
        assert "ran" == task.apply().get(timeout=5)
    finally:
        for lock in locks:
            lock.release()
    assert ["lock_skipped"] == [name for name, _ in events if name != "lock_completed"]


class Tiered(SingletonTask):
    """Two runs at once for the tenant "gold", one for any other (lock_limit_for)."""

    abstract = True

    def lock_limit_for(self, tenant, answer=None):
        return answer if answer is not None else (2 if tenant == "gold" else 1)


def tiered(app):
    def report(tenant, answer=None):
        return current_lock().key

    task = app.task(base=Tiered, name="it.tiered", shared=False, lock_args=("tenant",))
    app.finalize(auto=True)
    return app.tasks[task(report).name]


def test_lock_limit_for_gives_each_key_its_own_limit(app):
    """lock_limit_for: "gold" has 2 slots, "free" 1. With one gold slot held a gold run
    takes the second; with both held it is skipped naming 2 slots; a free run finds its
    one key held and is skipped as a plain busy key."""
    task = tiered(app)
    slots, locks = hold_key_slots(task, 1, "gold", limit=2)
    try:
        assert slots[1] == task.apply(("gold",)).get()
        locks += hold_key_slots(task, 1, "gold", limit=2)[1]
        skip = task.apply(("gold",)).result
        assert isinstance(skip, LockSkipped)
        assert "has all 2 slots (lock_limit) held" in str(skip)
        _, free = hold_key_slots(task, 1, "free", limit=1)
        locks += free
        skip = task.apply(("free",)).result
        assert isinstance(skip, LockSkipped)
        assert "slots" not in str(skip)
    finally:
        for lock in locks:
            lock.release()


@pytest.mark.parametrize("answer", [0, 65, "2", 2.0, True])
def test_a_bad_lock_limit_for_answer_fails_the_run_unrun(app, answer):
    """An answer that is not an int from 1 to 64 fails the run with ConfigurationError
    naming lock_limit_for and the value: never a run without its lock."""
    task = tiered(app)
    result = task.apply(("gold",), {"answer": answer})
    assert "FAILURE" == result.state
    assert isinstance(result.result, ConfigurationError)
    assert f"lock_limit_for returned {answer!r}; expected an int from 1 to 64" in str(
        result.result
    )


@pytest.mark.parametrize(
    ("option", "clash"),
    [
        ({"lock_fencing": True}, "lock_fencing=True"),
        ({"lock_enqueue": "until_finished"}, "lock_enqueue='until_finished'"),
    ],
)
def test_lock_limit_for_with_one_run_per_key_options_is_refused(app, option, clash):
    """lock_limit_for may give a key several slots: with fencing or lock_enqueue (one
    run per key) the task is refused when it is bound."""

    def report(tenant):
        return tenant

    app.task(base=Tiered, name="it.refused", shared=False, **option)(report)
    with pytest.raises(ConfigurationError, match=f"overrides lock_limit_for.*{clash}"):
        app.finalize(auto=True)
