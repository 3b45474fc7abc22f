"""SingletonTask's core where an interrupt, a retry or a redelivery meets another run of
the same message: a nested direct call's release, lock_limit slots, a waiting redelivery."""

from __future__ import annotations

import contextlib
import threading
import uuid

import pytest
from celery.app.trace import build_tracer
from celery.result import AsyncResult

from celery_pglock.lock.sessions import per_lock, process
from tests.integration.task_support import define, is_held, trace_delivery


class _InterruptError(Exception):
    """Stands for a soft time limit (SoftTimeLimitExceeded) landing mid-release."""


def _interrupt_release_of(monkeypatch, key_of):
    """The first release of the key ``key_of()`` is interrupted as it starts, before its
    unlock statement (the lock is still recorded as held, as an interrupt leaves it)."""
    fired = []
    for cls in (process.ProcessSession, per_lock.PerLockSessions):
        real = cls.release

        def release(self, hold, key, commit, timeout, _real=real):
            if not fired and key == key_of():
                fired.append(key)
                raise _InterruptError("a soft time limit landed in the release")
            return _real(self, hold, key, commit, timeout)

        monkeypatch.setattr(cls, "release", release)
    return fired


@pytest.mark.parametrize("scope", ["session", "transaction"])
def test_an_interrupted_release_of_a_nested_direct_call_is_released(
    app, monkeypatch, scope
):
    """A worker run's body calls another SingletonTask directly; a soft time limit lands
    in that inner call's release. The outer run's task_postrun must release the inner
    key, as it does for its own: else the key stays held until the process exits."""

    def inner_work(item):
        return item

    def outer_work(order):
        with contextlib.suppress(_InterruptError):
            inner("x")
        return order

    inner = define(app, inner_work, lock_args=("item",), lock_scope=scope)
    outer = define(app, outer_work, lock_args=("order",))
    fired = _interrupt_release_of(monkeypatch, lambda: inner.lock_key_for("x"))
    task_id = str(uuid.uuid4())
    tracer = build_tracer(outer.name, outer, app=app)
    tracer(task_id, [1], {}, {"id": task_id, "delivery_info": {}})
    assert fired  # the interrupt landed
    assert not is_held(outer, 1)
    assert not is_held(inner, "x"), "the nested direct call's key leaked"


@pytest.mark.parametrize("limit", [1, 2])
def test_a_retry_of_a_limited_key_waits_for_its_predecessor(app, monkeypatch, limit):
    """docs/guide/retries.md: the lock is kept until Celery stored the attempt's RETRY,
    and the retry waits for it, so the retry's result is stored last. Under lock_limit=2
    the predecessor keeps one slot, the retry takes the other at once and stores SUCCESS
    (here FAILURE) before the predecessor's RETRY lands over it: the task id ends RETRY."""
    seen = []

    def flaky(self, day):
        seen.append(self.request.retries)
        if self.request.retries == 0:
            raise self.retry(countdown=0)
        raise ValueError("the retry failed too")

    task = define(
        app,
        flaky,
        bind=True,
        lock_args=("day",),
        lock_limit=limit,
        lock_wait_timeout=5,
    )
    # The retry message is delivered by hand below, not through the broker.
    monkeypatch.setattr(type(task), "apply_async", lambda self, *a, **k: None)
    at_store, go = threading.Event(), threading.Event()
    backend_class = type(app.backend)  # app.backend is one per thread
    real = backend_class.mark_as_retry

    def slow_store(backend, *args, **kwargs):
        at_store.set()  # the attempt ended with Retry; its key is still held
        assert go.wait(10)
        return real(backend, *args, **kwargs)

    monkeypatch.setattr(backend_class, "mark_as_retry", slow_store)
    task_id = str(uuid.uuid4())
    first = threading.Thread(
        target=trace_delivery,
        args=(task, task_id),
        kwargs={"redelivered": False, "args": (1,)},
    )
    retry = threading.Thread(
        target=trace_delivery,
        args=(task, task_id),
        kwargs={"redelivered": False, "args": (1,), "retries": 1},
    )
    first.start()
    try:
        assert at_store.wait(10)
        retry.start()
        retry.join(1.0)  # a waiting retry is still waiting
        ran_early = not retry.is_alive()
    finally:
        go.set()
        first.join(10)
        if retry.ident is not None:
            retry.join(10)
    assert [0, 1] == seen
    # The retry's FAILURE is the final state, not its predecessor's RETRY (which a
    # result backend only refuses to write over SUCCESS): a caller's get() would hang.
    assert "FAILURE" == AsyncResult(task_id, app=app).state
    assert not ran_early, "the retry ran before its predecessor's RETRY was stored"


def test_a_redelivery_of_a_limited_key_never_runs_beside_its_first_delivery(app):
    """docs/guide/skipped-results.md: a redelivery whose first delivery still runs (its
    run lock held) stores nothing and never runs the body a second time. Under
    lock_limit=2 the first delivery keeps one slot, the redelivery takes the other and
    runs the same message's body beside it."""
    inside, go = threading.Event(), threading.Event()
    bodies = []

    def long_job(day):
        bodies.append(day)
        inside.set()
        assert go.wait(10)
        return "done"

    task = define(app, long_job, lock_args=("day",), lock_limit=2, acks_late=True)
    task_id = str(uuid.uuid4())
    first = threading.Thread(
        target=trace_delivery,
        args=(task, task_id),
        kwargs={"redelivered": False, "args": (1,)},
    )
    first.start()
    try:
        assert inside.wait(10)
        again = threading.Thread(
            target=trace_delivery,
            args=(task, task_id),
            kwargs={"redelivered": True, "args": (1,)},
        )
        again.start()
        again.join(1.0)
        twice = len(bodies)
    finally:
        go.set()
        first.join(10)
        again.join(10)
    assert 1 == twice, "the redelivery ran its body beside its first delivery"
    assert "SUCCESS" == AsyncResult(task_id, app=app).state


def test_a_waiting_redelivery_does_not_run_its_running_first_deliverys_body(app):
    """docs/guide/skipped-results.md: a redelivery whose first delivery still runs stores
    nothing "whatever lock_on_busy says", and never runs the body a second time. Under
    lock_on_busy='wait' it waits for that first delivery instead, then runs it again."""
    inside, go = threading.Event(), threading.Event()
    bodies = []

    def waited_job(day):
        bodies.append(day)
        inside.set()
        assert go.wait(10)
        return "done"

    task = define(
        app,
        waited_job,
        lock_args=("day",),
        acks_late=True,
        lock_on_busy="wait",
        lock_wait_timeout=5,
    )
    task_id = str(uuid.uuid4())
    first = threading.Thread(
        target=trace_delivery,
        args=(task, task_id),
        kwargs={"redelivered": False, "args": (1,)},
    )
    first.start()
    again = threading.Thread(
        target=trace_delivery,
        args=(task, task_id),
        kwargs={"redelivered": True, "args": (1,)},
    )
    try:
        assert inside.wait(10)
        again.start()
        again.join(0.5)  # it waits for the key its first delivery holds
    finally:
        go.set()
        first.join(10)
        if again.ident is not None:
            again.join(10)
    assert [1] == bodies, "the redelivery ran its first delivery's body again"
