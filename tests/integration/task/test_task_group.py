"""lock_group in-process against real PostgreSQL and Redis: a slot of the group is taken
after the key, a full group ends the run by its busy policy with the key given back, and
the slot is given back with the run. Real workers: tests/acceptance/test_limit.py."""

from __future__ import annotations

import threading
import time
import uuid

import pytest
from celery import Celery

from celery_pglock import (
    AdvisoryLock,
    ConfigurationError,
    LockBusy,
    LockLostError,
    LockSkipped,
    SingletonTask,
    keys,
    metrics,
)
from celery_pglock.task import groups, runs
from celery_pglock.testing import _support
from tests.integration.task_support import (
    current_engine,
    define,
    hold,
    hold_slots,
    is_held,
    trace_delivery,
)


def group_slots(task):
    options = task.lock_config
    key = groups.group_key(options.namespace, options.group)
    return keys.slot_keys(key, options.group_limit)


def fill(task, count):
    """Hold ``count`` of the group's slots from other sessions (running group members)."""
    return hold_slots(task.app, group_slots(task), count)


def held_slots(task):
    return [
        AdvisoryLock(engine=current_engine(task.app), key=slot).locked()
        for slot in group_slots(task)
    ]


def exporter(app, name="export", **options):
    """A lock_group task ``it.<name>`` (group "exports", limit 2, one run per tenant)
    whose body records which group slots are held while it runs."""
    seen: list[list[bool]] = []

    def export(tenant):
        seen.append(held_slots(task))
        return tenant

    export.__name__ = name
    options = {"lock_group": "exports", "lock_group_limit": 2, **options}
    task = define(app, export, lock_args=("tenant",), **options)
    return task, seen


@pytest.mark.parametrize("scope", ["session", "transaction"])
def test_a_full_group_skips_the_run_and_gives_its_key_back(app, scope):
    """Both slots held elsewhere: the run is skipped (reason 'group', the group named)
    and its own key is free again. With one freed, the run holds that slot during its
    body and gives it back after. Both scopes."""
    task, seen = exporter(app, lock_scope=scope)
    locks = fill(task, 2)
    try:
        skip = task.apply((1,)).result
        assert isinstance(skip, LockSkipped)
        assert ("group", "exports") == (skip.details["reason"], skip.details["group"])
        message = str(skip)
        assert (
            "is free, but its group 'exports' has all 2 slots (lock_group_limit)"
            in (message)
        )
        assert not is_held(task, 1)
        assert [] == seen
        locks.pop().release()
        assert 1 == task.apply((1,)).get()
        assert [[True, True]] == seen
        assert [True, False] == held_slots(task)
    finally:
        for lock in locks:
            lock.release()
    assert [False, False] == held_slots(task)


def test_two_tasks_share_one_group_and_a_busy_key_takes_no_slot(app):
    """Two tasks naming "exports" count against one limit: with one slot held by a run
    of the other task, this one takes the second. A run whose key is busy is skipped as
    lock_busy and takes no group slot."""
    task, seen = exporter(app)
    other, _ = exporter(app, "other_export")
    assert group_slots(task) == group_slots(other)
    locks = fill(other, 1)
    try:
        assert 7 == task.apply((7,)).get()
        assert [[True, True]] == seen
        key = hold(task, 7)
        try:
            skip = task.apply((7,)).result
            assert "lock_busy" == skip.details["reason"]
            assert [True, False] == held_slots(task)
        finally:
            key.release()
    finally:
        for lock in locks:
            lock.release()


def test_the_slot_is_taken_in_the_keys_statement_and_released_with_it(
    app, session_mode
):
    """On the process session the group's slot is the key's companion: taken in the
    key's statement, released in its unlock, no lock of its own. Per-lock sessions take
    it after the key on a lock of its own, as transaction scope does."""
    seen = []

    def export(tenant):
        execution = runs.current.get()
        seen.append((execution.lock.companion_taken, execution.group_lock is None))
        seen.append(held_slots(task))
        return tenant

    task = define(
        app, export, lock_args=("tenant",), lock_group="exports", lock_group_limit=2
    )
    assert 4 == task.apply((4,)).get()
    together = session_mode == "per_process"
    assert [(True if together else None, together), [True, False]] == seen
    assert [False, False] == held_slots(task)
    assert not is_held(task, 4)


def test_a_nested_run_never_reenters_its_callers_slot(app):
    """A session lock is re-entrant: a run called from a run of the same process, on the
    same session, would be granted the slot its caller holds. Claimed in the process
    first, the group's only slot is full for it: the inner call is refused."""
    ran = []

    def inner(tenant):
        ran.append(tenant)

    def outer(tenant):
        with pytest.raises(LockBusy, match="group 'exports'"):
            inner_task(tenant + 1)
        ran.append(tenant)
        return held_slots(inner_task)

    options = {"lock_group": "exports", "lock_group_limit": 1}
    inner_task = define(app, inner, lock_args=("tenant",), **options)
    outer_task = define(app, outer, lock_args=("tenant",), **options)
    assert [True] == outer_task.apply((1,)).get()
    assert [1] == ran
    assert [False] == held_slots(inner_task)


def test_the_slot_is_given_back_when_the_body_raises(app):
    def failing(tenant):
        raise ValueError(tenant)

    task = define(
        app, failing, lock_args=("tenant",), lock_group="exports", lock_group_limit=1
    )
    result = task.apply((3,))
    assert isinstance(result.result, ValueError)
    assert [False] == held_slots(task)
    assert not is_held(task, 3)


def test_wait_waits_for_a_group_slot_within_the_wait_timeout(app):
    """lock_on_busy='wait': a slot freed 0.5 s later is taken and the run starts; with
    none freed the run fails with LockBusy after lock_wait_timeout."""
    task, seen = exporter(app, lock_on_busy="wait", lock_wait_timeout=3)
    locks = fill(task, 2)
    timer = threading.Timer(0.5, locks[0].release)
    timer.start()
    try:
        asked = time.monotonic()
        assert 1 == task.apply((1,)).get()
        assert 0.4 < time.monotonic() - asked < 3
        timer.join()
        locks.append(fill(task, 1)[0])
        short, _ = exporter(app, "short", lock_on_busy="wait", lock_wait_timeout=0.5)
        asked = time.monotonic()
        with pytest.raises(LockBusy, match="lock_group_limit"):
            short.apply((2,)).get()
        assert 0.4 < time.monotonic() - asked < 3
    finally:
        timer.cancel()
        for lock in locks:
            if lock.owned():
                lock.release()
    assert [[True, True]] == seen


def test_shadow_reports_a_full_group_and_runs_under_the_key(app):
    task, seen = exporter(app, lock_shadow=True)
    locks = fill(task, 2)
    try:
        assert 4 == task.apply((4,)).get()
    finally:
        for lock in locks:
            lock.release()
    assert [[True, True]] == seen


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        ({"lock_group": "g"}, "lock_group='g' is invalid; expected lock_group and"),
        ({"lock_group_limit": 2}, "lock_group_limit=2 is invalid; expected lock_group"),
        ({"lock_group": "g", "lock_group_limit": 0}, "an int from 1 to 64"),
        ({"lock_group": "", "lock_group_limit": 2}, "lock_group='' is invalid"),
    ],
)
def test_bad_group_options_are_refused_at_registration(options, expected):
    app = Celery("groups", broker="memory://", set_as_current=False)
    app.conf.pglock_database_url = "postgresql://h/db"
    app.task(base=SingletonTask, name="it.bad", shared=False, **options)(nothing)
    with pytest.raises(ConfigurationError, match=expected):
        app.finalize(auto=True)


def nothing():
    return None


def test_one_group_with_two_limits_is_refused(app):
    define(app, nothing, lock_group="g", lock_group_limit=2)
    second = app.task(
        base=SingletonTask,
        name="it.second",
        shared=False,
        lock_group="g",
        lock_group_limit=3,
    )
    with pytest.raises(ConfigurationError, match="a group has one limit"):
        second(nothing)  # bound at once: the app is finalized


def test_a_group_slot_lost_mid_body_fails_the_run(app, database_url):
    """Transaction scope keeps the group's slot on a connection of its own, which the
    loss watcher checks too: its backend terminated mid-body, the body is interrupted and
    the run fails with LockLostError naming the group's lock."""

    def long(tenant):
        group = runs.current.get().group_lock
        connection = _support.connect(database_url, application_name="group test")
        try:
            with connection.cursor() as cursor:
                cursor.execute("SELECT pg_terminate_backend(%s)", (group.backend_pid,))
        finally:
            connection.close()
        time.sleep(5)

    task = define(
        app,
        long,
        lock_args=("tenant",),
        lock_group="exports",
        lock_group_limit=2,
        lock_scope="transaction",
        lock_watch_interval=0.2,
    )
    asked = time.monotonic()
    result = task.apply((1,))
    assert time.monotonic() - asked < 4
    assert isinstance(result.result, LockLostError), result.result
    assert "celery_pglock.group:exports" in str(result.result)
    assert [False, False] == held_slots(task)
    assert not is_held(task, 1)


def test_a_full_group_counts_as_skipped_and_throttled(app):
    """The metrics: a group-full skip is in celery_pglock_skipped_total (its policy) and
    in celery_pglock_throttled_total with reason "group"; a busy key is not throttled."""
    import prometheus_client  # the dev extra's

    registry = prometheus_client.CollectorRegistry()
    metrics.install(metrics.PrometheusMetrics(registry))
    try:
        task, _ = exporter(app, "counted")
        locks = fill(task, 2)
        try:
            task.apply((1,))
        finally:
            for lock in locks:
                lock.release()
        key = hold(task, 2)
        try:
            task.apply((2,))
        finally:
            key.release()
    finally:
        metrics.install(metrics.NullMetrics())
    labels = {"task": task.name}
    assert 2 == registry.get_sample_value(
        "celery_pglock_skipped_total", {**labels, "policy": "skip"}
    )
    assert 1 == registry.get_sample_value(
        "celery_pglock_throttled_total", {**labels, "reason": "group"}
    )
    assert None is registry.get_sample_value(
        "celery_pglock_throttled_total", {**labels, "reason": "lock_busy"}
    )


def test_a_full_group_records_no_start_and_a_refused_start_frees_its_slot(app):
    """lock_group with lock_period=60: the group is taken first, so a run the full group
    skips uses no period (the next one runs); a run the period refuses gives its group
    slot back with its key."""
    task, seen = exporter(app, "periodic", lock_group_limit=1, lock_period=60)
    locks = fill(task, 1)
    try:
        skip = task.apply((1,)).result
        assert "group" == skip.details["reason"]
    finally:
        for lock in locks:
            lock.release()
    assert 1 == task.apply((1,)).get()  # no period was used by the skip
    skip = task.apply((1,)).result
    assert "period" == skip.details["reason"]
    assert [False] == held_slots(task)
    assert not is_held(task, 1)
    assert [[True]] == seen


def test_a_retried_message_is_requeued_not_kept_waiting_by_a_full_group(app):
    """lock_on_busy='retry': a retry of a message (Celery's retries 1) waits for its
    predecessor's key, but not for a group slot: with the group full it is re-queued at
    once instead of holding a worker for lock_wait_timeout."""
    task, seen = exporter(
        app, "requeued", lock_on_busy="retry", lock_retry_delay=30, lock_wait_timeout=5
    )
    locks = fill(task, 2)
    try:
        task_id = str(uuid.uuid4())
        asked = time.monotonic()
        trace_delivery(task, task_id, redelivered=False, args=(1,), retries=1)
        assert time.monotonic() - asked < 2
        assert "RETRY" == task.AsyncResult(task_id).state
    finally:
        for lock in locks:
            lock.release()
    assert [] == seen
