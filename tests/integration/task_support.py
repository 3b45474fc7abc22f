"""Helpers of the SingletonTask tests (test_task*.py): define a task, hold its key."""

from __future__ import annotations

import gc

import psycopg2
from celery.app.trace import build_tracer

from celery_pglock import AdvisoryLock, SingletonTask
from celery_pglock.db import engines as db_module


def define(app, fun, **options):
    task = app.task(
        base=SingletonTask, name=f"it.{fun.__name__}", shared=False, **options
    )(fun)
    app.finalize(auto=True)
    return app.tasks[task.name]


def close_app(app):
    """Close an in-process test app, its Redis result subscription first.

    Each send subscribes the result backend to its task id, and an ``AsyncResult``
    unsubscribes when it is collected: collect them while the subscription still
    works, then close it and forget its keys, or a late ``__del__`` reconnects and
    leaves a socket to the garbage collector (a ResourceWarning in a later test).
    """
    gc.collect()
    consumer = getattr(app.backend, "result_consumer", None)
    if consumer is not None:
        consumer.stop()
        consumer.subscribed_to.clear()
    app.close()


def ran():
    return "ran"


def hold(task, *args, **kwargs):
    """Hold the key a call would take, from another session (a 'running duplicate')."""
    lock = AdvisoryLock(
        engine=db_module.engine_for(task.app.conf),
        key=task.lock_key_for(*args, **kwargs),
    )
    assert lock.acquire()
    return lock


def current_engine(app):
    return db_module.engine_for(app.conf)


def hold_slots(app, slots, count):
    """Hold ``count`` of ``slots`` (keys.slot_keys) from other sessions, the first free
    ones, as running duplicates would: the locks."""
    locks = []
    for _ in range(count):
        lock = AdvisoryLock(engine=current_engine(app), key=slots[0])
        lock.slots = slots
        assert lock.acquire()
        locks.append(lock)
    return locks


def trace_delivery(task, task_id, *, redelivered, args=(), retries=0):
    """Run ``task`` the way a worker's pool runs a message (Celery's tracer, results
    stored), with the broker's ``redelivered`` flag and Celery's ``retries`` as given."""
    tracer = build_tracer(task.name, task, app=task.app)
    request = {
        "id": task_id,
        "root_id": task_id,
        "correlation_id": task_id,
        "hostname": "it@localhost",
        "reply_to": None,
        "delivery_info": {
            "exchange": "",
            "routing_key": "q",
            "redelivered": redelivered,
        },
        "retries": retries,
    }
    return tracer(task_id, list(args), {}, request)


def is_held(task, *args):
    return AdvisoryLock(
        engine=current_engine(task.app), key=task.lock_key_for(*args)
    ).locked()


def lose_first_reply(monkeypatch):
    """The next lock_enqueue claim commits, then its connection dies before the reply
    reaches the send (which then checks again on a fresh one). Returns the list that
    gets the committed row."""
    real = db_module.on_kept
    cut = []

    def reply_lost(engine, bound, work):
        row = real(engine, bound, work)
        if not cut:
            cut.append(row)
            raise psycopg2.OperationalError("server closed the connection unexpectedly")
        return row

    monkeypatch.setattr(db_module, "on_kept", reply_lost)
    return cut


def lock_waiters(app):
    """How many sessions of the test database wait on a heavyweight lock (a row lock)."""
    with db_module.autocommit(current_engine(app)) as dbapi, dbapi.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
            "AND wait_event_type = 'Lock'"
        )
        return cursor.fetchone()[0]
