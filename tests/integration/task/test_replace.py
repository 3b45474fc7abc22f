"""Latest wins (lock_enqueue_on_duplicate='replace') in-process against real PostgreSQL and
Redis: a send into a queued key's row publishes nothing; the carrier message publishes the
latest send when taken and runs no body; racing senders, retries, stale carriers, bounds.
Real workers and kills: tests/acceptance/test_latest_wins.py."""

from __future__ import annotations

import threading
import uuid

import celery
import pytest
from celery import signals as celery_signals

from celery_pglock import AdvisoryLock, ConfigurationError, TaskReplaced, keys
from celery_pglock.db import engines
from celery_pglock.task import queued_writes, replacing, replacing_sweep
from celery_pglock.testing import lock_state
from tests.integration.task.test_enqueue import deliver, rows
from tests.integration.task_support import (
    current_engine,
    define,
    hold,
    lose_first_reply,
    trace_delivery,
)


@pytest.fixture
def published():
    """(task id, routing key) of each message published during the test."""
    sent: list[tuple[str, str]] = []

    def count(sender=None, headers=None, routing_key=None, **_):
        sent.append((headers["id"], routing_key))

    celery_signals.after_task_publish.connect(count, weak=False)
    yield sent
    celery_signals.after_task_publish.disconnect(count)


def ids_of(published):
    return [task_id for task_id, _ in published]


def latest(app, name, ran, **options):
    """A replacing task ``it.latest_<name>`` recording the values its bodies ran with."""

    def body(tenant, value):
        ran.append(value)
        return value

    body.__name__ = f"latest_{name}"
    return define(
        app,
        body,
        lock_args=("tenant",),
        lock_enqueue="until_started",
        lock_enqueue_on_duplicate="replace",
        **options,
    )


def replaced_by(task, task_id):
    result = task.AsyncResult(task_id)
    assert "FAILURE" == result.state, result.state
    assert isinstance(result.result, TaskReplaced)
    return result.result.replaced_by


def execute(app, sql, *params):
    # The batched publish confirmations first: one written after ``sql`` could undo it.
    queued_writes.drain_writers()
    with (
        engines.autocommit(current_engine(app)) as dbapi,
        dbapi.cursor() as cursor,
    ):
        cursor.execute(sql, params)
        return cursor.fetchall() if cursor.description else None


def test_a_send_into_a_queued_key_publishes_nothing_and_the_carrier_hands_over(
    app, published
):
    """The second send's arguments go into the key's row; its caller's id is the one that
    runs. The first's result ends at once, naming it; taken by a worker, the first
    message publishes the second and runs no body."""
    ran: list[int] = []
    task = latest(app, "replaces", ran)
    first = task.delay(1, 10)
    second = task.delay(1, 20)
    assert first.id != second.id
    assert [first.id] == ids_of(published)
    assert second.id == rows(task, 1)[0]
    assert second.id == replaced_by(task, first.id)
    assert second.id in str(task.AsyncResult(first.id).result)
    deliver(task, first.id, 1, 10)
    assert [] == ran
    assert [first.id, second.id] == ids_of(published)
    assert second.id == replaced_by(task, first.id)
    # Its publish confirmed (batched): the row holds its key for lock_enqueue_lost_after.
    queued_writes.drain_writers()
    [(confirmed, kept)] = execute(
        app,
        "SELECT stale_at > now() + interval '60 s', payload IS NOT NULL "
        "FROM celery_pglock_queued WHERE task_id = %s AND carrier IS NULL",
        second.id,
    )
    assert confirmed
    assert not kept  # the payload kept for a publish again goes with the confirmation
    deliver(task, second.id, 1, 20)
    assert [20] == ran
    assert "SUCCESS" == task.AsyncResult(second.id).state
    assert rows(task, 1) is None


def test_only_a_carrier_sends_the_hand_over_statement(app, published, monkeypatch):
    """A run whose grant took its own row (the key's latest send) carries nothing: it
    sends no statement more than an until_started run. A carrier's grant takes no row,
    so it checks, and hands over."""
    checked: list[str] = []
    hand_over = replacing._hand_over

    def spy(lock, task_id, task_name):
        checked.append(task_id)
        return hand_over(lock, task_id, task_name)

    monkeypatch.setattr(replacing, "_hand_over", spy)
    ran: list[int] = []
    task = latest(app, "checks", ran)
    alone = task.delay(2, 1)
    deliver(task, alone.id, 2, 1)
    assert [] == checked
    first = task.delay(2, 2)
    second = task.delay(2, 3)
    deliver(task, first.id, 2, 2)
    assert [first.id] == checked
    deliver(task, second.id, 2, 3)
    assert [first.id] == checked
    assert [1, 3] == ran


def test_during_a_run_exactly_one_follow_up_runs_with_the_latest_arguments(
    app, published
):
    """Sends 2..6 during a run: 2 is published (the follow-up), 3..6 only replace one
    another in the row, each caller told at once by whom. After the run, the follow-up
    publishes 6, and one body runs, with 6."""
    ran: list[int] = []
    sent = []

    def body(tenant, value):
        ran.append(value)
        if value == 1:
            sent.extend(task.delay(tenant, v) for v in range(2, 7))
        return value

    body.__name__ = "latest_follow_up"
    task = define(
        app,
        body,
        lock_args=("tenant",),
        lock_enqueue="until_started",
        lock_enqueue_on_duplicate="replace",
    )
    first = task.delay(3, 1)
    deliver(task, first.id, 3, 1)
    assert [1] == ran
    ids = [result.id for result in sent]
    assert [first.id, ids[0]] == ids_of(published)
    assert [ids[i + 1] for i in range(4)] == [replaced_by(task, i) for i in ids[:4]]
    deliver(task, ids[0], 3, 2)
    assert [first.id, ids[0], ids[4]] == ids_of(published)
    assert ids[4] == replaced_by(task, ids[0])  # the carrier names the one it published
    deliver(task, ids[4], 3, 6)
    assert [1, 6] == ran


def test_a_carrier_replaced_while_it_waits_for_the_key_hands_over(app, published):
    """The follow-up waits for the running key; a newer send goes into its row meanwhile.
    Granted, the follow-up publishes the newer send and gives the key back."""
    ran: list[int] = []
    task = latest(app, "waiting", ran, lock_wait_timeout=10)
    waiting = task.delay(4, 1)
    holder = hold(task, 4)
    thread = threading.Thread(target=lambda: deliver(task, waiting.id, 4, 1))
    thread.start()
    try:
        newer = task.delay(4, 2)
    finally:
        holder.release()
    thread.join(timeout=30)
    assert [] == ran
    assert newer.id == replaced_by(task, waiting.id)
    assert [waiting.id, newer.id] == ids_of(published)
    deliver(task, newer.id, 4, 2)
    assert [2] == ran


def test_a_retried_carrier_publishes_the_newer_send_instead(app, published):
    """lock_on_busy='retry': the follow-up is re-queued while the key runs, a newer send
    goes into its row; the follow-up's next retry publishes the newer send instead of
    itself and ends replaced."""
    ran: list[int] = []
    task = latest(
        app,
        "retry",
        ran,
        lock_on_busy="retry",
        lock_retry_delay=60,
        lock_wait_timeout=0.2,
    )
    follow_up = task.delay(5, 1)
    holder = hold(task, 5)
    try:
        deliver(task, follow_up.id, 5, 1)  # busy: a retry, the key's carrier still
        assert "RETRY" == task.AsyncResult(follow_up.id).state
        newer = task.delay(5, 2)
        trace_delivery(task, follow_up.id, redelivered=False, args=(5, 1), retries=1)
    finally:
        holder.release()
    assert [follow_up.id, follow_up.id, newer.id] == ids_of(published)
    assert newer.id == replaced_by(task, follow_up.id)
    assert newer.id == rows(task, 5)[0]
    deliver(task, newer.id, 5, 2)
    assert [2] == ran


def test_a_retry_that_carries_nothing_yields_to_a_newer_send(app, published):
    """A run that started and retries itself finds a newer send queued: its retry is
    not published and it ends replaced (latest wins over a retry's older arguments)."""
    ran: list[int] = []
    newer: list[str] = []

    def body(tenant, value):
        ran.append(value)
        if value == 1 and not newer:
            newer.append(task.delay(tenant, 2).id)
            raise task.retry(countdown=60)
        return value

    body.__name__ = "latest_retries"
    task = define(
        app,
        body,
        bind=False,
        lock_args=("tenant",),
        lock_enqueue="until_started",
        lock_enqueue_on_duplicate="replace",
    )
    first = task.delay(6, 1)
    trace_delivery(task, first.id, redelivered=False, args=(6, 1))
    assert [first.id, newer[0]] == ids_of(published)
    assert newer[0] == replaced_by(task, first.id)
    assert newer[0] == rows(task, 6)[0]


def test_racing_senders_replace_one_another_in_the_database_order(app, published):
    """40 threads send one key: one message is published; every other caller's result
    names the send right after it, in one chain that ends at the send that runs."""
    ran: list[int] = []
    task = latest(app, "race", ran)
    barrier = threading.Barrier(40)
    ids: dict[int, str] = {}

    def send(value):
        barrier.wait(timeout=30)
        ids[value] = task.apply_async((7, value), ignore_result=True).id

    threads = [threading.Thread(target=send, args=(v,)) for v in range(40)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert 40 == len(set(ids.values()))
    [carrier] = ids_of(published)
    last = rows(task, 7)[0]
    chain = {i: replaced_by(task, i) for i in ids.values() if i != last}
    order = [carrier]
    while order[-1] in chain:
        order.append(chain[order[-1]])
    assert 40 == len(order)  # one chain through every send
    assert last == order[-1]
    by_id = {task_id: value for value, task_id in ids.items()}
    deliver(task, carrier, 7, by_id[carrier])
    assert [carrier, last] == ids_of(published)
    deliver(task, last, 7, by_id[last])
    assert [by_id[last]] == ran


def test_the_handed_over_send_keeps_its_own_publish_options(app, published):
    """The send in the row is published with its own queue, not the carrier's."""
    ran: list[int] = []
    task = latest(app, "options", ran)
    first = task.apply_async((8, 1), queue="first-queue")
    second = task.apply_async((8, 2), queue="second-queue", priority=3, expires=600)
    deliver(task, first.id, 8, 1)
    assert [(first.id, "first-queue"), (second.id, "second-queue")] == published


def test_a_redelivered_carrier_runs_nothing(app, published):
    """A carrier delivered again after it handed over (acks_late, a worker killed) finds
    its tombstone: no body, nothing published again."""
    ran: list[int] = []
    task = latest(app, "redelivered", ran)
    first = task.delay(9, 1)
    second = task.delay(9, 2)
    deliver(task, first.id, 9, 1)
    deliver(task, second.id, 9, 2)
    trace_delivery(task, first.id, redelivered=True, args=(9, 1))
    assert [2] == ran
    assert [first.id, second.id] == ids_of(published)
    assert second.id == replaced_by(task, first.id)


def test_a_stale_carrier_is_taken_over_and_never_runs(app, published):
    """A carrier whose row went stale (its producer stalled, its message was lost): the
    next send publishes itself and tombstones it; delivered late, it runs nothing."""
    ran: list[int] = []
    task = latest(app, "stale", ran)
    first = task.delay(10, 1)
    key = task.lock_key_for(10)
    execute(
        app,
        "UPDATE celery_pglock_queued SET stale_at = now() - interval '1 s' "
        "WHERE (classid, objid, objsubid) = (%s, %s, %s)",
        *key.pg_locks_ids,
    )
    second = task.delay(10, 2)
    assert [first.id, second.id] == ids_of(published)
    assert second.id == replaced_by(task, first.id)
    deliver(task, first.id, 10, 1)
    deliver(task, second.id, 10, 2)
    assert [2] == ran


def test_a_send_takes_one_statement_and_only_the_rare_cases_take_the_full_claim(app):
    """New keys and sends into a fresh queued row are the upsert alone (one statement);
    a stale row is left to CLAIM, which takes it over."""
    task = latest(app, "one_statement", [])
    engine = current_engine(app)

    def executions():
        kept = lock_state.kept_connection(engine)
        with kept.busy:
            kept.cursor.execute(
                "SELECT name, generic_plans + custom_plans FROM pg_prepared_statements "
                "WHERE name IN (%s, %s)",
                (replacing.UPSERT_NAME, replacing.CLAIM_NAME),
            )
            return dict(kept.cursor.fetchall())

    task.delay(-1, 0)  # the tables, the connection
    before = executions()
    first = task.delay(20, 1)
    second = task.delay(20, 2)
    third = task.delay(20, 3)
    after = executions()
    assert before[replacing.UPSERT_NAME] + 3 == after[replacing.UPSERT_NAME]
    assert before.get(replacing.CLAIM_NAME) == after.get(replacing.CLAIM_NAME)
    assert second.id == replaced_by(task, first.id)
    assert third.id == replaced_by(task, second.id)
    execute(
        app,
        "UPDATE celery_pglock_queued SET stale_at = now() - interval '1 s' "
        "WHERE (classid, objid, objsubid) = (%s, %s, %s)",
        *task.lock_key_for(20).pg_locks_ids,
    )
    fourth = task.delay(20, 4)
    assert fourth.id == replaced_by(task, third.id)
    assert 1 == executions()[replacing.CLAIM_NAME] - (
        before.get(replacing.CLAIM_NAME) or 0
    )


def test_a_failed_publish_frees_the_key(app, published, monkeypatch):
    ran: list[int] = []
    task = latest(app, "undo", ran)
    with monkeypatch.context() as patched:

        def broken(*args, **kwargs):
            raise ConnectionError("broker down")

        patched.setattr(celery.Task, "apply_async", broken)  # the publish itself
        with pytest.raises(ConnectionError):
            task.delay(11, 1)
    assert rows(task, 11) is None
    task.delay(11, 2)
    assert 1 == len(published)


def test_a_failed_publish_keeps_a_later_send_it_carries(app, published, monkeypatch):
    """A send replaced into the row while its carrier's publish was failing is not lost
    with the carrier: its row is made stale, and the sweep publishes it."""
    ran: list[int] = []
    task = latest(app, "undo_carried", ran)
    publish = celery.Task.apply_async
    later = []

    def failing(self, args=None, *more, **options):
        if args == (12, 1):  # the first send's publish: a second send meanwhile
            later.append(task.delay(12, 2))
            raise ConnectionError("broker down")
        return publish(self, args, *more, **options)

    with monkeypatch.context() as patched:
        patched.setattr(celery.Task, "apply_async", failing)
        with pytest.raises(ConnectionError):
            task.delay(12, 1)
    assert [] == published
    assert later[0].id == rows(task, 12)[0]  # kept, and stale
    assert replacing_sweep.sweep(app) >= 1
    assert [later[0].id] == [i for i in ids_of(published) if i == later[0].id]
    deliver(task, later[0].id, 12, 2)
    assert [2] == ran


def test_a_revoked_carrier_hands_its_later_send_over(app, published):
    """A carrier revoked (or expired, or rejected) in the worker frees its key, but the
    later send it carries is handed over by the sweep, not deleted with it."""
    ran: list[int] = []
    task = latest(app, "revoked_carrier", ran)
    first = task.delay(14, 1)
    second = task.delay(14, 2)
    queued_writes.free_later(task, task.lock_key_for(14).pg_locks_ids, first.id)
    queued_writes.drain_writers()
    assert second.id == rows(task, 14)[0]
    assert replacing_sweep.sweep(app) >= 1
    assert second.id in ids_of(published)
    deliver(task, second.id, 14, 2)
    assert [2] == ran
    assert rows(task, 14) is None


def test_a_custom_task_id_sent_again_while_queued_is_a_duplicate(app, published):
    """docs/guide/enqueue.md: a custom task id sent again while its message is queued
    publishes nothing and returns its own id (it was published twice: two runs)."""
    ran: list[int] = []
    task = latest(app, "custom_id", ran)
    first = task.apply_async((15, 1), task_id="report-15")
    again = task.apply_async((15, 2), task_id="report-15")
    assert ["report-15"] == ids_of(published)
    assert "report-15" == again.id
    deliver(task, first.id, 15, 1)
    assert [1] == ran
    assert rows(task, 15) is None


def test_a_hand_over_whose_publish_fails_is_published_again_by_the_sweep(
    app, published, monkeypatch
):
    """The carrier handed the row over, then its publish of the latest send failed (or
    its worker was killed there): the row kept the payload, so the sweep publishes that
    send again, under a new id (the first may be in the broker after all: its tombstone
    names the new one), and exactly one of them runs."""
    ran: list[int] = []
    task = latest(app, "reissue", ran)
    first = task.delay(16, 1)
    second = task.delay(16, 2)
    publish = celery.Task.apply_async

    def failing(self, args=None, kwargs=None, task_id=None, **options):
        if task_id == second.id:
            raise ConnectionError("broker down")
        return publish(self, args, kwargs, task_id, **options)

    with monkeypatch.context() as patched:
        patched.setattr(celery.Task, "apply_async", failing)
        deliver(task, first.id, 16, 1)
    assert [] == ran
    assert [first.id] == ids_of(published)
    assert second.id == rows(task, 16)[0]
    assert 0 == replacing_sweep.sweep(app)  # within its grace: its publish may come
    execute(
        app,
        "UPDATE celery_pglock_queued SET stale_at = now() - interval '1 s' "
        "WHERE (classid, objid, objsubid) = (%s, %s, %s)",
        *task.lock_key_for(16).pg_locks_ids,
    )
    assert replacing_sweep.sweep(app) >= 1
    again = replaced_by(task, second.id)
    assert [first.id, again] == ids_of(published)
    deliver(task, second.id, 16, 2)  # had it been published after all: it runs nothing
    deliver(task, again, 16, 2)
    assert [2] == ran
    assert rows(task, 16) is None


def test_a_replacing_send_whose_reply_was_lost_tells_the_send_it_replaced(
    app, published, monkeypatch
):
    """Its upsert committed, then the connection died before the reply: checked again,
    the send finds itself in the row and tells the send it replaced. It used to replace
    itself the second time, and told its own caller that it was replaced by itself."""
    ran: list[int] = []
    task = latest(app, "lost_reply", ran)
    first = task.delay(17, 1)
    second = task.delay(17, 2)
    cut = lose_first_reply(monkeypatch)
    third = task.delay(17, 3)
    assert "replaced" == cut[0][0]
    assert [first.id] == ids_of(published)
    assert third.id == replaced_by(task, second.id)
    assert "PENDING" == task.AsyncResult(third.id).state
    monkeypatch.undo()
    deliver(task, first.id, 17, 1)
    deliver(task, third.id, 17, 3)
    assert [3] == ran


def test_the_hand_over_keeps_the_tombstones_bounded(app):
    """A hand-over drops the oldest few tombstones past keep_until (8 at most; on a
    shared test database others may be past it too: these are the oldest)."""
    ran: list[int] = []
    task = latest(app, "prune", ran)
    first = task.delay(12, 1)
    second = task.delay(12, 2)
    old = [f"old-{uuid.uuid4()}" for _ in range(5)]
    execute(
        app,
        "INSERT INTO celery_pglock_replaced (task_id, replaced_by, task_name, "
        "keep_until) SELECT unnest(%s::text[]), 'x', 'it', now() - interval '10 years'",
        old,
    )
    deliver(task, first.id, 12, 1)
    kept = execute(
        app,
        "SELECT task_id FROM celery_pglock_replaced WHERE task_id = ANY(%s)",
        [*old, first.id],
    )
    assert [(first.id,)] == kept
    assert second.id == replacing.lookup(current_engine(app), first.id)[0]


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        (
            {"lock_enqueue_on_duplicate": "replace"},
            "unless lock_enqueue='until_started'",
        ),
        (
            {"lock_enqueue": "until_finished", "lock_enqueue_on_duplicate": "replace"},
            "unless lock_enqueue='until_started'",
        ),
        (
            {
                "lock_enqueue": "until_started",
                "lock_enqueue_on_duplicate": "replace",
                "lock_on_busy": "skip",
            },
            "lock_on_busy='skip' is invalid",
        ),
    ],
)
def test_bad_replace_options_are_refused_at_bind(app, options, expected):
    def body(tenant):
        return tenant

    body.__name__ = "latest_bad"
    with pytest.raises(ConfigurationError) as raised:
        define(app, body, lock_args=("tenant",), **options)
    assert expected in str(raised.value)


def test_the_sweep_publishes_the_latest_send_of_a_carrier_that_never_comes(
    app, published
):
    """The carrier's producer died after its statement (its row never confirmed): a
    worker's sweep hands the row over as the carrier would, and tombstones the carrier.
    A carrier that is running (its run lock held) is left alone."""
    ran: list[int] = []
    task = latest(app, "sweep", ran)
    first = task.delay(13, 1)
    second = task.delay(13, 2)
    key = task.lock_key_for(13)
    execute(
        app,
        "UPDATE celery_pglock_queued SET stale_at = now() - interval '1 s' "
        "WHERE (classid, objid, objsubid) = (%s, %s, %s)",
        *key.pg_locks_ids,
    )
    mine = (first.id, second.id)  # a shared test database may hold others' rows
    running = AdvisoryLock(engine=current_engine(app), key=keys.run_key(first.id))
    assert running.acquire()
    try:
        replacing_sweep.sweep(app)
        assert [first.id] == [i for i in ids_of(published) if i in mine]
    finally:
        running.release()
    assert replacing_sweep.sweep(app) >= 1
    assert [first.id, second.id] == [i for i in ids_of(published) if i in mine]
    assert second.id == replaced_by(task, first.id)
    deliver(task, first.id, 13, 1)  # late: its tombstone
    deliver(task, second.id, 13, 2)
    assert [2] == ran
    replacing_sweep.sweep(app)
    assert [first.id, second.id] == [i for i in ids_of(published) if i in mine]
