"""Races of the flow-control options (lock_rate, lock_limit, lock_group, lock_limit_for),
each interleaving forced: a gate in the predecessor, another session's lock."""

from __future__ import annotations

import threading
import time
import uuid

import pytest

from celery_pglock.task import groups
from tests.integration.task_support import define, trace_delivery


def _retrying(app, name, **options):
    """A task whose first attempt calls self.retry(countdown=0) and whose retry runs.
    Its retry message is 'delivered to another worker' at once: run in a thread (as
    the worker's pool would), while the attempt goes on to its task_postrun."""
    ran: list[int] = []

    def body(self, tenant):
        ran.append(self.request.retries)
        if self.request.retries == 0:
            raise self.retry(countdown=0)
        return "retried"

    body.__name__ = name
    task = define(
        app, body, bind=True, lock_args=("tenant",), lock_wait_timeout=5, **options
    )
    return task, ran


@pytest.mark.parametrize(
    "options",
    [
        pytest.param({"lock_scope": "transaction"}, id="transaction-scope"),
        pytest.param({"lock_limit": 2}, id="lock_limit-2"),
    ],
)
def test_a_retry_is_not_lost_to_its_own_predecessors_group_slot(
    app, monkeypatch, options
):
    """docs/guide/retries.md: a retry is never lost to its own predecessor's lock, which
    it keeps until task_postrun. Its group slot is kept as long; where it is a lock of its
    own (transaction scope, lock_limit > 1) it is given back after the key. The retry,
    delivered before that, takes the key (freed, or another slot) and finds the group's
    only slot held by its predecessor: under 'skip' it is skipped, and its work lost.
    Forced: the predecessor gives its slot back once the retry has ended, or after 1 s."""
    name = f"retried_{uuid.uuid4().hex[:8]}"
    task, ran = _retrying(
        app, name, lock_group=f"g-{name}", lock_group_limit=1, **options
    )
    outcome: dict[str, object] = {}
    retry_done = threading.Event()
    threads: list[threading.Thread] = []
    predecessor = threading.get_ident()

    def delivered(self, args=None, kwargs=None, task_id=None, **send):
        def run():
            try:
                outcome["retry"] = trace_delivery(
                    task,
                    task_id,
                    redelivered=False,
                    args=args,
                    retries=send.get("retries", 1),
                ).retval
            finally:
                task.backend.client.connection_pool.disconnect()  # this thread's own
                retry_done.set()

        thread = threading.Thread(target=run)
        threads.append(thread)
        thread.start()

    real_release = groups.release

    def gated_release(task_, execution):
        if threading.get_ident() == predecessor and execution.group_lock is not None:
            retry_done.wait(1.0)  # the retry, delivered, runs before this slot is free
        real_release(task_, execution)

    monkeypatch.setattr(type(task), "apply_async", delivered)
    monkeypatch.setattr(groups, "release", gated_release)
    task_id = str(uuid.uuid4())
    trace_delivery(task, task_id, redelivered=False, args=(1,))
    for thread in threads:
        thread.join(15)
    assert retry_done.is_set()
    assert [0, 1] == ran, f"the retry did not run: {outcome.get('retry')!r}"
    assert "retried" == outcome["retry"]


def _gate_first_call(monkeypatch, module, names):
    """Patch ``module.<name>`` for each of ``names``: its first call (in whichever
    thread) waits for ``go`` (up to 10 s) after setting ``entered``: an acquire held in
    flight, inside its lock statement."""
    entered, go, first = threading.Event(), threading.Event(), []
    guard = threading.Lock()
    for name in names:
        real = getattr(module, name)

        def gated(*args, _real=real, **kwargs):
            with guard:
                mine = not first
                first.append(threading.get_ident())
            if mine:
                entered.set()
                go.wait(10)
            return _real(*args, **kwargs)

        monkeypatch.setattr(module, name, gated)
    return entered, go


def _run_in_thread(task, args):
    """``task.apply(args)`` in a thread: (thread, dict with its outcome, done event)."""
    outcome: dict[str, object] = {}
    done = threading.Event()

    def run():
        try:
            outcome["result"] = task.apply(args).result
        finally:
            task.app.backend.client.connection_pool.disconnect()  # this thread's own
            done.set()

    thread = threading.Thread(target=run)
    thread.start()
    return thread, outcome, done


def _when_waiting_or_done(task, done):
    """Until ``done`` or a thread of the process waits on a claim (at most 5 s)."""
    from celery_pglock.lock import sessions

    claims = sessions.process_session(task.locks_engine()).claims
    deadline = time.monotonic() + 5
    while not done.is_set() and claims._waiting == 0 and time.monotonic() < deadline:
        time.sleep(0.01)


def test_a_slot_is_not_refused_for_another_threads_acquire_in_flight(app, monkeypatch):
    """lock_limit=2, two runs of one key in two threads of a process, none held: each
    should run. The first acquire claims every free slot for its statement (it may get
    any of them); the second, arriving while that statement is in flight, finds both
    claimed and is busy at once (no round trip), though the first takes one slot only:
    skipped with a slot free. Forced: the first statement waits until the second has
    answered (or waits on the claims)."""
    from celery_pglock.lock.sessions import base

    ran = []

    def limited(tenant):
        ran.append(tenant)
        return tenant

    task = define(app, limited, lock_args=("tenant",), lock_limit=2)
    entered, go = _gate_first_call(monkeypatch, base, ["try_slots"])
    first, first_outcome, _ = _run_in_thread(task, (1,))
    assert entered.wait(5)
    second, outcome, done = _run_in_thread(task, (1,))
    _when_waiting_or_done(task, done)
    go.set()
    first.join(15)
    second.join(15)
    assert 1 == first_outcome["result"]
    assert 1 == outcome["result"], f"the second run did not run: {outcome['result']!r}"
    assert [1, 1] == ran


def test_a_group_slot_is_not_refused_for_another_threads_acquire_in_flight(
    app, monkeypatch
):
    """lock_group_limit=2 and no slot held: a run of key 1 (its slot taken in the key's
    statement, or on a lock of its own) and a transaction-scope run of key 2 in another
    thread of the process should both run. The first claims both group slots for its
    statement; the second, meanwhile, finds both claimed and is skipped as 'group full'
    though the group has a slot free. Forced as above."""
    from celery_pglock.lock.sessions import base

    ran = []

    def first_member(tenant):
        ran.append(("first", tenant))
        return tenant

    def second_member(tenant):
        ran.append(("second", tenant))
        return tenant

    group = {"lock_group": f"g-{uuid.uuid4().hex[:8]}", "lock_group_limit": 2}
    one = define(app, first_member, lock_args=("tenant",), **group)
    two = define(
        app, second_member, lock_args=("tenant",), lock_scope="transaction", **group
    )
    entered, go = _gate_first_call(
        monkeypatch, base, ["try_with_companion", "try_slots"]
    )
    first, first_outcome, _ = _run_in_thread(one, (1,))
    assert entered.wait(5)
    second, outcome, done = _run_in_thread(two, (2,))
    _when_waiting_or_done(two, done)
    go.set()
    first.join(15)
    second.join(15)
    assert 1 == first_outcome["result"]
    assert 2 == outcome["result"], f"the second run did not run: {outcome['result']!r}"


def test_a_start_refused_as_its_window_ended_waits_no_whole_window(app, database_url):
    """lock_period=2, lock_on_busy='wait', lock_wait_timeout=1.5. A start sent 0.5 s
    before the period's end waits on the key's row (another session has it locked, as a
    racing start or an operator would) until 0.4 s after it. The row check uses the
    statement's now(), from before the end: refused; its seconds left, on
    clock_timestamp(), are then below 0, which start() takes for 'the refusing start is
    not in the snapshot' and turns into the whole period (2 s): more than the wait
    budget, so the run fails with LockBusy, though the period had ended. Expected: it
    starts (once more the statement would record it)."""
    from celery_pglock.testing import _support

    def tick():
        return "ran"

    task = define(
        app, tick, lock_period=2.0, lock_on_busy="wait", lock_wait_timeout=1.5
    )
    assert "ran" == task.apply().get()
    opened = time.monotonic()
    blocker = _support.connect(database_url, application_name="period row blocker")
    blocker.autocommit = False
    try:
        with blocker.cursor() as cursor:
            cursor.execute(
                "SELECT 1 FROM celery_pglock_periods "
                "WHERE (classid, objid, objsubid) = (%s, %s, %s) FOR UPDATE",
                task.lock_key_for().pg_locks_ids,
            )
        time.sleep(max(0.0, opened + 1.5 - time.monotonic()))
        thread, outcome, done = _run_in_thread(task, ())
        time.sleep(max(0.0, opened + 2.4 - time.monotonic()))
        assert not done.is_set()  # its statement waits on the row
    finally:
        blocker.rollback()
        blocker.close()
    thread.join(15)
    assert "ran" == outcome["result"], f"refused: {outcome['result']!r}"


def test_a_lowered_per_key_limit_counts_its_own_slots_only(app):
    """docs/guide/limits.md: tier 3 -> 1 for tenant 1 while three runs hold slots 0-2; the
    one on slot 0 ends. A new run takes slot 0 (the first of its N), beside the two older
    runs on slots 1 and 2: three at once, the old limit, until they end. With slot 0
    held too, the new run is refused."""
    from celery_pglock import SingletonTask, keys
    from tests.integration.task_support import hold_slots

    tiers = {1: 3}

    class Tiered(SingletonTask):
        abstract = True

        def lock_limit_for(self, tenant):
            return tiers[tenant]

    def tiered(tenant):
        return tenant

    task = app.task(
        base=Tiered,
        name=f"it.tiered_{uuid.uuid4().hex[:6]}",
        shared=False,
        lock_args=("tenant",),
    )(tiered)
    app.finalize(auto=True)
    task = app.tasks[task.name]
    slots = keys.slot_keys(task.lock_key_for(1), 3)
    runs = hold_slots(app, slots, 3)
    try:
        tiers[1] = 1
        assert 1 != task.apply((1,)).result  # slot 0 held: refused
        runs.pop(0).release()  # the run on slot 0 ends; slots 1 and 2 still run
        assert 1 == task.apply((1,)).result
    finally:
        for lock in runs:
            lock.release()


def test_a_session_ended_before_the_rate_statement_fails_the_run_as_lost(
    app, monkeypatch
):
    """The key's session ends between the grant and the rate's statement (the watcher,
    or another thread's failure, closed it): the key is free in PostgreSQL, so the start
    is not recorded elsewhere and the body does not run; the run fails LockLostError."""
    from celery_pglock import exceptions, signals
    from celery_pglock.lock.sessions import ProcessSession
    from celery_pglock.task import periods
    from celery_pglock.testing import lock_state

    ran: list[int] = []

    def body(tenant):
        ran.append(tenant)

    body.__name__ = f"rate_lost_{uuid.uuid4().hex[:6]}"
    task = define(app, body, lock_args=("tenant",), lock_period=60)
    real_start = periods.start

    def session_ends_first(lock, *args, **kwargs):
        if isinstance(lock.session, ProcessSession):
            lock.session.lose("closed by a test")
        else:
            lock_state.holding_connection(lock).close()
        return real_start(lock, *args, **kwargs)

    monkeypatch.setattr(periods, "start", session_ends_first)
    lost: list[str] = []

    def on_lost(sender=None, **kwargs):
        lost.append(kwargs.get("cause", ""))

    signals.lock_lost.connect(on_lost, weak=False)
    try:
        result = task.apply((1,))
    finally:
        signals.lock_lost.disconnect(on_lost)
    assert [] == ran
    assert isinstance(result.result, exceptions.LockLostError), result.result
    assert 1 == len(lost), lost  # reported: the lock_lost signal
    monkeypatch.setattr(periods, "start", real_start)
    assert "SUCCESS" == task.apply((1,)).state  # no start was recorded: the next runs
    assert [1] == ran
