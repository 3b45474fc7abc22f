"""Latest wins (lock_enqueue_on_duplicate='replace') in-process against real PostgreSQL and
Redis: what a send replaces, what a replaced message's delivery and its caller see, racing
senders, retries. Real workers and kills: tests/acceptance/test_latest_wins.py."""

from __future__ import annotations

import threading

import celery
import pytest
from celery import signals as celery_signals

from celery_pglock import ConfigurationError, TaskReplaced
from celery_pglock.db import engines
from celery_pglock.task import replacing
from tests.integration.task.test_enqueue import deliver, rows
from tests.integration.task_support import current_engine, define, hold, trace_delivery


@pytest.fixture
def published():
    ids: list[str] = []

    def count(sender=None, headers=None, **_):
        ids.append(headers["id"])

    celery_signals.after_task_publish.connect(count, weak=False)
    yield ids
    celery_signals.after_task_publish.disconnect(count)


def latest(app, name, ran, **options):
    """A replacing task ``it.latest_<name>`` recording the values its bodies ran with."""

    def body(tenant, value):
        ran.append(value)
        return value

    body.__name__ = f"latest_{name}"
    options.setdefault("lock_enqueue", "until_started")
    return define(
        app,
        body,
        lock_args=("tenant",),
        lock_enqueue_on_duplicate="replace",
        **options,
    )


def tombstones(app, ids):
    """{replaced id: the id that replaced it} of these task ids."""
    with (
        engines.autocommit(current_engine(app)) as dbapi,
        dbapi.cursor() as cursor,
    ):
        cursor.execute(
            "SELECT task_id, replaced_by FROM celery_pglock_replaced "
            "WHERE task_id = ANY(%s)",
            (list(ids),),
        )
        return dict(cursor.fetchall())


@pytest.mark.parametrize("mode", ["until_started", "until_finished"])
def test_a_send_replaces_the_unstarted_message(app, published, mode):
    """The second send is published and owns the key; the first one's result ends at
    once naming it, and its delivery runs no body: only the latest arguments run."""
    ran: list[int] = []
    task = latest(app, f"replaces_{mode}", ran, lock_enqueue=mode)
    first = task.delay(1, 10)
    second = task.delay(1, 20)
    assert first.id != second.id
    assert [first.id, second.id] == published
    assert second.id == rows(task, 1)[0]
    stored = task.AsyncResult(first.id)
    assert "FAILURE" == stored.state
    assert isinstance(stored.result, TaskReplaced)
    assert second.id == stored.result.replaced_by
    assert second.id in str(stored.result)
    deliver(task, first.id, 1, 10)
    assert [] == ran
    assert second.id == task.AsyncResult(first.id).result.replaced_by
    deliver(task, second.id, 1, 20)
    assert [20] == ran
    assert "SUCCESS" == task.AsyncResult(second.id).state
    assert rows(task, 1) is None


def test_during_a_run_exactly_one_follow_up_runs_with_the_latest_arguments(app):
    """until_started: sends 2..6 during a run each replace the one before; delivered in
    any order, one body runs after it, with 6."""
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
    assert 5 == len(set(ids))
    chain = tombstones(app, ids)
    # Each replaced send names the one right after it.
    assert {ids[i]: ids[i + 1] for i in range(4)} == chain
    for i in (4, 0, 2, 1, 3):  # the latest first, then the rest
        deliver(task, ids[i], 3, i + 2)
    assert [1, 6] == ran


def test_a_replaced_message_waiting_for_the_key_runs_no_body(app):
    """A follow-up waiting for the running key is replaced meanwhile: granted, it finds
    out and gives the key back; its result says by whom."""
    ran: list[int] = []
    task = latest(app, "waiting", ran, lock_wait_timeout=10)
    waiting = task.delay(4, 1)
    holder = hold(task, 4)
    outcome: list[object] = []
    thread = threading.Thread(
        target=lambda: outcome.append(deliver(task, waiting.id, 4, 1))
    )
    thread.start()
    try:
        newer = task.delay(4, 2)
    finally:
        holder.release()
    thread.join(timeout=30)
    assert [] == ran
    assert newer.id == task.AsyncResult(waiting.id).result.replaced_by
    deliver(task, newer.id, 4, 2)
    assert [2] == ran


def test_a_retry_yields_to_a_newer_send(app, published):
    """lock_on_busy='retry': a follow-up re-queued while the key runs is replaced by a
    newer send; its retry publishes nothing and it ends replaced."""
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
        deliver(task, follow_up.id, 5, 1)  # busy: a retry, the key's message still
        assert "RETRY" == task.AsyncResult(follow_up.id).state
        assert follow_up.id == rows(task, 5)[0]
        newer = task.delay(5, 2)
        trace_delivery(task, follow_up.id, redelivered=False, args=(5, 1), retries=1)
    finally:
        holder.release()
    assert [follow_up.id, follow_up.id, newer.id] == published
    result = task.AsyncResult(follow_up.id)
    assert "FAILURE" == result.state
    assert newer.id == result.result.replaced_by
    assert newer.id == rows(task, 5)[0]


def test_until_finished_a_send_during_the_run_is_its_duplicate(app, published):
    """A running message cannot be replaced: until_finished returns it, as 'return'."""
    ran: list[int] = []
    during: list[str] = []

    def body(tenant, value):
        ran.append(value)
        during.append(task.delay(tenant, value + 1).id)

    body.__name__ = "latest_finished"
    task = define(
        app,
        body,
        lock_args=("tenant",),
        lock_enqueue="until_finished",
        lock_enqueue_on_duplicate="replace",
    )
    first = task.delay(6, 1)
    deliver(task, first.id, 6, 1)
    assert [first.id] == during
    assert [first.id] == published


def test_racing_senders_replace_in_the_database_order(app, published):
    """40 threads send one key: every send is published; the replaced ids form one
    chain, each naming the next, ending at the key's message; only it runs."""
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
    assert 40 == len(ids) == len(set(ids.values())) == len(published)
    chain = tombstones(app, ids.values())
    last = rows(task, 7)[0]
    assert set(ids.values()) == set(chain) | {last}
    assert last not in chain
    order = [next(iter(set(chain) - set(chain.values())))]
    while order[-1] in chain:
        order.append(chain[order[-1]])
    assert 40 == len(order)
    assert last == order[-1]
    by_id = {task_id: value for value, task_id in ids.items()}
    for task_id in order:
        deliver(task, task_id, 7, by_id[task_id])
    assert [by_id[last]] == ran


def test_a_failed_publish_lets_the_replaced_message_run(app, published, monkeypatch):
    """The replacing send's publish fails: the replaced message is told nothing and
    runs; the key is freed."""
    ran: list[int] = []
    task = latest(app, "undo", ran)
    first = task.delay(8, 1)
    with monkeypatch.context() as patched:

        def broken(*args, **kwargs):
            raise ConnectionError("broker down")

        patched.setattr(celery.Task, "apply_async", broken)  # the publish itself
        with pytest.raises(ConnectionError):
            task.delay(8, 2)
    assert {} == tombstones(app, [first.id])
    assert rows(task, 8) is None
    deliver(task, first.id, 8, 1)
    assert [1] == ran


def test_the_check_keeps_the_tombstones_bounded(app):
    """A delivery drops tombstones past keep_until (a few per run)."""
    ran: list[int] = []
    task = latest(app, "prune", ran)
    first = task.delay(9, 1)
    second = task.delay(9, 2)
    with (
        engines.autocommit(current_engine(app)) as dbapi,
        dbapi.cursor() as cursor,
    ):
        cursor.execute(
            "INSERT INTO celery_pglock_replaced (task_id, replaced_by, task_name, "
            "keep_until) SELECT 'old-' || i, 'x', 'it', now() - interval '1 s' "
            "FROM generate_series(1, 5) i"
        )
    deliver(task, first.id, 9, 1)
    assert {first.id: second.id} == tombstones(app, [first.id])
    assert {} == tombstones(app, [f"old-{i}" for i in range(1, 6)])
    assert replacing.lookup(current_engine(app), first.id)[0] == second.id


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        ({"lock_enqueue_on_duplicate": "replace"}, "without lock_enqueue"),
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
