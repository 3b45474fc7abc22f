"""Latest wins under interleavings that a race would rarely hit: each forced in order,
by a transaction held open or by a producer dying at a chosen point."""

from __future__ import annotations

import contextlib
import threading
import time

import celery
import pytest

from celery_pglock.db import engines
from celery_pglock.task import queued, replacing_sweep
from tests.integration.task import test_replace
from tests.integration.task.test_enqueue import deliver, rows
from tests.integration.task.test_replace import execute, ids_of, latest, replaced_by
from tests.integration.task_support import (
    current_engine,
    define,
    lock_waiters,
    trace_delivery,
)

published = test_replace.published  # the fixture: (task id, routing key) per publish


def wait_for_lock_waiter(app, seconds=10.0):
    """Until some session of this database waits on a heavyweight lock."""
    deadline = time.monotonic() + seconds
    while not lock_waiters(app):
        assert time.monotonic() < deadline, "nobody waited on a lock"
        time.sleep(0.02)


class PausedCommit:
    """Stands in for replacing_sweep's ``engines``: the sweep's statement runs in a
    transaction that commits only once ``go`` is set (its statement has run: ``ran``).
    The window it opens is the one between the sweep's run-lock probe and its commit."""

    def __init__(self):
        self.ran = threading.Event()
        self.go = threading.Event()

    @contextlib.contextmanager
    def autocommit_cursor(self, engine, *args, **kwargs):
        if self.ran.is_set():  # only the sweep's own statement pauses
            with engines.autocommit_cursor(engine, *args, **kwargs) as cursor:
                yield cursor
            return
        raw = engine.raw_connection()
        try:
            cursor = raw.cursor()
            cursor.execute("BEGIN")  # the engine's connections are in autocommit
            yield cursor
            self.ran.set()
            assert self.go.wait(30)
            cursor.execute("COMMIT")  # autocommit: raw.commit() would be a no-op
        finally:
            raw.close()


def test_a_carrier_taken_while_the_sweep_hands_its_row_over_runs_nothing(
    app, published, monkeypatch
):
    """The carrier's row is stale (its confirmation never came) and a later send waits
    in it. The sweep locks the row, probes the carrier's run lock (free), hands the row
    over and tombstones the carrier; before it commits, a worker takes the carrier: its
    run lock is refused (the sweep's probe holds it), its HAND_OVER waits for the row,
    finds it handed (no longer its carrier) and, on its statement's older snapshot, no
    tombstone either: it must look again. A replaced message never runs its body."""
    ran: list[int] = []
    task = latest(app, "sweep_race", ran)
    queued.TABLE.ensure(current_engine(app))  # a fresh database has none yet
    execute(app, "DELETE FROM celery_pglock_queued WHERE task_name = %s", task.name)
    first = task.delay(31, 1)
    second = task.delay(31, 2)
    execute(
        app,
        "UPDATE celery_pglock_queued SET stale_at = now() - interval '1 s' "
        "WHERE (classid, objid, objsubid) = (%s, %s, %s)",
        *task.lock_key_for(31).pg_locks_ids,
    )
    paused = PausedCommit()
    monkeypatch.setattr(replacing_sweep, "engines", paused)
    swept: list[int] = []
    sweeper = threading.Thread(target=lambda: swept.append(replacing_sweep.sweep(app)))
    sweeper.start()
    assert paused.ran.wait(30)  # row locked, carrier's run lock probed, not committed
    worker = threading.Thread(target=lambda: deliver(task, first.id, 31, 1))
    worker.start()
    wait_for_lock_waiter(app)  # the carrier's HAND_OVER waits for the sweep's row lock
    paused.go.set()
    sweeper.join(30)
    worker.join(30)
    assert [1] == swept
    assert second.id in ids_of(published)  # the sweep published the latest send
    deliver(task, second.id, 31, 2)
    # Not [1, 2]: the replaced carrier must not run its older arguments.
    assert [2] == ran
    assert rows(task, 31) is None


def test_a_retry_does_not_yield_to_a_stale_send_that_was_never_published(
    app, published, monkeypatch
):
    """During a run, a send's producer dies between its statement and its publish: the
    key's row names a message that never reaches the broker (no carrier, no payload:
    nothing for the sweep to publish). Past its 10 s grace the row is stale and its run
    lock free: a later send would take it over. The run then retries itself (self.retry):
    the retry takes the row over and is published. Yielding ('superseded') would end it
    TaskReplaced naming a send that never comes, and nothing would run for the key."""
    ran: list[int] = []
    dead: list[str] = []
    publish = celery.Task.apply_async

    def killed_before_publish(self, args=None, kwargs=None, task_id=None, **options):
        if task_id in dead:
            raise SystemExit  # the producer dies: no publish (and, killed, no give_back)
        return publish(self, args, kwargs, task_id, **options)

    def body(tenant, value):
        ran.append(value)
        if value == 1 and not dead:
            dead.append("dead-send")
            with monkeypatch.context() as patched:
                patched.setattr(celery.Task, "apply_async", killed_before_publish)
                patched.setattr(queued, "give_back", lambda *a, **k: None)
                with pytest.raises(SystemExit):
                    task.apply_async((tenant, 2), task_id="dead-send")
            execute(
                app,
                "UPDATE celery_pglock_queued SET stale_at = now() - interval '1 s' "
                "WHERE task_id = 'dead-send'",
            )
            raise task.retry(countdown=60)
        return value

    body.__name__ = "latest_retry_stale"
    task = define(
        app,
        body,
        bind=False,
        lock_args=("tenant",),
        lock_enqueue="until_started",
        lock_enqueue_on_duplicate="replace",
    )
    first = task.delay(32, 1)
    trace_delivery(task, first.id, redelivered=False, args=(32, 1))
    # Not [first.id]: the retry must not yield to a send no broker holds.
    assert [first.id, first.id] == ids_of(published)


def test_a_retry_of_a_send_made_inside_another_task_yields_to_a_newer_send(
    app, published
):
    """The same as test_replace's test_a_retry_that_carries_nothing_yields_to_a_newer_send,
    but the message was sent from another task's body (a dispatcher), as most are: Celery
    adds parent_id to it, and the retry's options carry it from the request. parent_id
    marks a canvas only on a message published unchecked (no pglock_q header): this retry
    is checked, yields to the newer send and is not published again."""
    from celery import signals as celery_signals
    from celery.app.trace import build_tracer

    ran: list[int] = []
    newer: list[str] = []
    sent_headers: dict[str, dict] = {}

    def keep(sender=None, headers=None, **_):
        sent_headers[headers["id"]] = dict(headers)

    def body(tenant, value):
        ran.append(value)
        if value == 1 and not newer:
            newer.append(task.delay(tenant, 2).id)
            raise task.retry(countdown=60)
        return value

    body.__name__ = "latest_retries_child"
    task = define(
        app,
        body,
        bind=False,
        lock_args=("tenant",),
        lock_enqueue="until_started",
        lock_enqueue_on_duplicate="replace",
    )

    def dispatch(tenant):
        return task.delay(tenant, 1).id

    dispatcher = define(app, dispatch)
    celery_signals.after_task_publish.connect(keep, weak=False)
    try:
        trace_delivery(dispatcher, "dispatcher-33", redelivered=False, args=(33,))
        [first] = [i for i in ids_of(published) if i != "dispatcher-33"]
        assert "dispatcher-33" == sent_headers[first]["parent_id"]
        request = {
            **sent_headers[first],
            "hostname": "it@localhost",
            "reply_to": None,
            "correlation_id": first,
            "delivery_info": {"exchange": "", "routing_key": "q", "redelivered": False},
        }
        build_tracer(task.name, task, app=task.app)(first, [33, 1], {}, request)
    finally:
        celery_signals.after_task_publish.disconnect(keep)
    # Not [first, newer, first]: the retry must be checked, not published unchecked.
    assert [first, newer[0]] == [i for i in ids_of(published) if i != "dispatcher-33"]
    assert newer[0] == replaced_by(task, first)
