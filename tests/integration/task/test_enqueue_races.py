"""lock_enqueue (return / raise) under interleavings a race would rarely hit: each forced
in order, by a connection holding a row lock, a closed connection, or a monkeypatched
point."""

from __future__ import annotations

import threading
import time
import uuid

from celery_pglock import SingletonTask
from celery_pglock.db import engines
from celery_pglock.task import queued_writes, runs
from celery_pglock.testing import lock_state
from tests.integration.task.test_enqueue import (
    deliver,
    make,
    published,  # noqa: F401 (fixture)
    rows,
)
from tests.integration.task_support import current_engine, lock_waiters


def _terminate_kept(engine):
    """The server closes the producer's kept claim connection (an idle cut, a restart
    of a pooler): the next send's first statement fails at once."""
    kept = lock_state.kept_connection(engine)
    kept.cursor.execute("SELECT pg_backend_pid()")
    (pid,) = kept.cursor.fetchone()
    with engines.autocommit(engine) as dbapi, dbapi.cursor() as cursor:
        cursor.execute("SELECT pg_terminate_backend(%s)", (pid,))


def test_a_reused_id_sent_again_after_a_closed_connection_is_a_duplicate(
    app,
    published,  # noqa: F811
):
    """docs/guide/enqueue.md, custom task ids: sent again while its message is queued,
    a custom id is a duplicate. When the send's first statement fails on a connection
    the server closed, the second try finds the queued message's row, which names the
    same id: it was taken for the send's own committed claim, and published twice."""
    task = make(
        app,
        "reused_reconnect",
        lambda tenant: None,
        lock_args=("tenant",),
        lock_enqueue="until_finished",
    )
    engine = current_engine(app)
    task_id = f"report-{uuid.uuid4().hex[:8]}"
    first = task.apply_async((1,), task_id=task_id)
    assert [task_id] == published
    _terminate_kept(engine)
    again = task.apply_async((1,), task_id=task_id)
    assert again.id == first.id
    assert [task_id] == published  # nothing published: the message is still queued


def _stale_row(task, *args):
    key = task.lock_key_for(*args)
    with (
        engines.autocommit(current_engine(task.app)) as dbapi,
        dbapi.cursor() as cursor,
    ):
        cursor.execute(
            "UPDATE celery_pglock_queued SET stale_at = now() - interval '1 second' "
            "WHERE (classid, objid, objsubid) = (%s, %s, %s)",
            key.pg_locks_ids,
        )
        assert 1 == cursor.rowcount


def test_a_send_racing_a_stale_takeover_never_returns_the_lost_message(
    app,
    published,  # noqa: F811
):
    """A lost message's row (stale, its run lock free) is taken over by send A; send B
    comes while A's statement holds the lost message's run lock for its probe (the
    window between CLAIM's probe and its update: widened here by a row lock another
    session holds). B's probe fails on A's transient lock, and B returned the lost
    message's id, which never runs (its caller waits for ever, or AlreadyQueued names
    it). B must return A's message."""
    task = make(
        app,
        "stale_race",
        lambda tenant: None,
        lock_args=("tenant",),
        lock_enqueue="until_finished",
    )
    lost = task.delay(4)  # purged from the broker, say
    _stale_row(task, 4)
    key = task.lock_key_for(4)
    holder = current_engine(app).raw_connection()
    results: dict[str, object] = {}
    threads = []
    try:
        cursor = holder.cursor()
        cursor.execute("BEGIN")
        cursor.execute(
            "SELECT 1 FROM celery_pglock_queued WHERE (classid, objid, objsubid) = "
            "(%s, %s, %s) FOR UPDATE",
            key.pg_locks_ids,
        )

        def send(name):
            try:
                results[name] = task.delay(4).id
            except BaseException as exc:  # reported by the asserts below
                results[name] = exc

        a = threading.Thread(target=send, args=("a",), daemon=True)
        a.start()
        threads.append(a)
        deadline = time.monotonic() + 10
        while lock_waiters(app) < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert lock_waiters(app) == 1, "A did not reach its update"
        b = threading.Thread(target=send, args=("b",), daemon=True)
        b.start()
        threads.append(b)
        deadline = time.monotonic() + 10
        while "b" not in results and lock_waiters(app) < 2:
            assert time.monotonic() < deadline, "B neither answered nor waited"
            time.sleep(0.02)
        cursor.execute("COMMIT")
    finally:
        holder.close()
    for thread in threads:
        thread.join(20)
    assert results.get("b") != lost.id, "B returned the lost message"
    assert results["a"] == results["b"]
    assert [lost.id, results["a"]] == published
    assert results["a"] == rows(task, 4)[0]


def test_a_late_confirmation_never_sets_a_retrys_bound(app, published):  # noqa: F811
    """The producer's confirmation of a publish lands after its message ran and its
    retry (same id) re-claimed the row: CONFIRM_MANY matched the retry's row and set
    the first publish's bound on it (3600 s past its publish, not past the retry's due
    time 7200 s later), so a send an hour on would publish a second message while the
    retry waits for its countdown."""

    def flaky(self, tenant):
        if self.request.retries == 0:
            raise self.retry(countdown=7200)

    task = app.task(
        base=SingletonTask,
        bind=True,
        name=f"it.late_confirm.{uuid.uuid4().hex[:6]}",
        shared=False,
        lock_args=("tenant",),
        lock_enqueue="until_started",
        max_retries=2,
    )(flaky)
    app.finalize(auto=True)
    task = app.tasks[task.name]
    held_back = []
    real_write_later = queued_writes.write_later
    queued_writes.write_later = lambda _task, change: held_back.append(change)
    try:
        first = task.delay(5)  # its confirmation is late (a slow producer)
    finally:
        queued_writes.write_later = real_write_later
    assert 1 == len(held_back)
    deliver(task, first.id, 5)  # runs, retries: the retry's row, confirmed
    assert [first.id, first.id] == published
    queued_writes.drain_writers()
    queued_writes.write_later(task, held_back[0])  # the first publish's, at last
    queued_writes.drain_writers()
    key = task.lock_key_for(5)
    with (
        engines.autocommit(current_engine(app)) as dbapi,
        dbapi.cursor() as cursor,
    ):
        cursor.execute(
            "SELECT extract(epoch FROM stale_at - published_at) FROM "
            "celery_pglock_queued WHERE (classid, objid, objsubid) = (%s, %s, %s)",
            key.pg_locks_ids,
        )
        (bound,) = cursor.fetchone()
    assert bound >= 7200 + 3600 - 5, bound


def test_a_throttled_follow_up_keeps_its_key_through_its_start(
    app,
    published,  # noqa: F811
    monkeypatch,
):
    """docs/guide/period.md: under until_started a follow-up throttled at its start is
    re-queued for the period's end "and keeps its key, so later sends return it". Its
    grant deleted its row before the period refused it; a send between that and its
    retry's claim is published, and the retry then takes that send's row: two messages
    of the key queued for the period's end."""
    task = make(
        app,
        "throttled",
        lambda tenant: None,
        lock_args=("tenant",),
        lock_enqueue="until_started",
        lock_period=60,
    )
    first = task.delay(3)
    deliver(task, first.id, 3)  # opens the period
    follow_up = task.delay(3)
    during = []
    real = runs.release_unrun

    def release_then_send(*args, **kwargs):
        real(*args, **kwargs)
        if not during:  # a send while the throttled follow-up gives its lock back
            during.append(task.delay(3).id)

    monkeypatch.setattr(runs, "release_unrun", release_then_send)
    deliver(task, follow_up.id, 3)  # throttled: re-queued for the period's end
    assert during == [follow_up.id]
    assert [first.id, follow_up.id, follow_up.id] == published
