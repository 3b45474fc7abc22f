"""When a SingletonTask run's lock is released, and by whom, in-process.

Before its result is stored (a client that saw it can send the next run at once), except
a published retry's, kept until RETRY is stored. Retries that keep the lock for their fallback, nested and same-id runs, Ignore and
Reject, a release that fails, a body calling its own task, a failing metrics sink.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
import sqlalchemy as sa
from celery.app.trace import build_tracer
from celery.result import AsyncResult

import celery_pglock
from celery_pglock import DatabaseError, LockBusy, current_lock
from celery_pglock.task import queued, replacing
from celery_pglock.testing import lock_state
from tests.integration.task_support import current_engine, define, hold, is_held, ran


def test_last_retry_keeps_the_lock_for_the_fallback(app):
    """When retry() will not publish (no retries left), the lock stays for the handler."""
    from celery.exceptions import MaxRetriesExceededError

    seen = {}

    def settle(self, day):
        try:
            raise self.retry(countdown=1, max_retries=2)
        except MaxRetriesExceededError:
            seen["held"] = is_held(self, day) and current_lock().owned()
            return "fallback"

    task = define(app, settle, bind=True, lock_args=("day",))
    assert "fallback" == task.apply(args=(1,), retries=2).get()
    assert seen["held"]


def test_a_nested_busy_retry_does_not_release_the_outer_lock(app):
    """A body calling another SingletonTask eagerly: the inner retry touches only its own lock."""
    seen = {}

    def child(item):
        return item

    def parent(self, order):
        seen["child"] = inner.apply(args=(5,)).state
        seen["outer_held"] = is_held(self, order) and current_lock().owned()
        return "done"

    inner = define(app, child, lock_args=("item",), lock_on_busy="retry", max_retries=0)
    outer = define(app, parent, bind=True, lock_args=("order",))
    holder = hold(inner, 5)
    try:
        assert "done" == outer.apply(args=(1,)).get()
    finally:
        holder.release()
    assert "FAILURE" == seen["child"]
    assert seen["outer_held"]


def test_same_task_id_duplicate_does_not_release_the_holder(app):
    """Two executions sharing a task id (redelivery, explicit task_id): the skipped one's
    task_postrun must not release the running one's lock."""
    inside, go = threading.Event(), threading.Event()
    states = {}

    def settle(day):
        inside.set()
        go.wait(10)
        return "ok"

    task = define(app, settle, lock_args=("day",))
    first = threading.Thread(
        target=lambda: states.setdefault(
            "first", task.apply(args=("d",), task_id="same-id").state
        )
    )
    first.start()
    try:
        assert inside.wait(10)
        assert "FAILURE" == task.apply(args=("d",), task_id="same-id").state
        assert is_held(task, "d")
        assert "FAILURE" == task.apply(args=("d",)).state
    finally:
        go.set()
        first.join(10)
    assert "SUCCESS" == states["first"]


@pytest.mark.parametrize(
    ("exception", "state"), [("ignore", "IGNORED"), ("reject", "REJECTED")]
)
def test_ignore_and_reject_from_the_body_release_the_lock(
    app, events, exception, state
):
    """Ignore/Reject skip Celery's after_return; the lock is still released and reported."""
    from celery.exceptions import Ignore, Reject

    def stop(kind):
        raise Ignore() if kind == "ignore" else Reject("no", requeue=False)

    task = define(app, stop, lock_args=("kind",))
    assert state == task.apply(args=(exception,)).state
    assert not is_held(task, exception)
    failed = [kw for name, kw in events if name == "lock_failed"]
    assert [state] == [kw["state"] for kw in failed]


def test_transaction_scope_leaves_nothing_on_the_pooled_session(app, namespace):
    """The body had the connection: its SETs and its own advisory locks do not outlive the run."""
    seen = []

    def work(tenant):
        connection = current_lock().connection
        seen.append(connection.exec_driver_sql("SHOW search_path").scalar())
        connection.exec_driver_sql(f"SET search_path TO tenant_{tenant}")
        connection.exec_driver_sql(
            "SELECT pg_advisory_lock(hashtext(%s))", (namespace,)
        )
        return tenant

    task = define(app, work, lock_args=("tenant",), lock_scope="transaction")
    assert 1000 == task.apply(args=(1000,)).get()  # and the session still works
    assert 8 == task.apply(args=(8,)).get()
    assert "tenant_7" not in seen[1]
    with current_engine(app).connect() as connection:
        taken = connection.exec_driver_sql(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND objid = (hashtext(%s)::bigint & 4294967295)",
            (namespace,),
        ).scalar()
    assert 0 == taken


def test_release_failure_is_reported_and_the_run_keeps_its_outcome(app, events):
    """Session scope: if the unlock finds the lock gone, the run stays SUCCESS and
    lock_release_failed says what happened."""

    def lose_it():
        lock = current_lock()
        with lock_state.holding_connection(
            lock
        ).cursor() as cursor:  # someone unlocks behind our back
            cursor.execute("SELECT pg_advisory_unlock(%s)", lock.key.ids)
        return "done"

    task = define(app, lose_it)
    result = task.apply()
    assert "done" == result.get()
    names = [name for name, _ in events]
    assert ["lock_acquired", "lock_release_failed", "lock_completed"] == names
    failure = events[1][1]
    assert "LockNotOwnedError" == type(failure["exception"]).__name__
    assert result.id == failure["task_id"]


def test_a_body_calling_its_own_task_directly_is_a_direct_call(app):
    """Recursion: the inner call is a direct call (busy -> LockBusy), never a skip stored
    against the outer run's task id, and the outer run is unaffected."""
    seen = {}

    def walk(self, node):
        if node == "root":
            try:
                walk_task("root")  # same key: busy, held by this very run
            except LockBusy:
                seen["inner"] = "busy"
            seen["child"] = walk_task("leaf")  # another key: runs, under its own lock
        return node

    walk_task = define(app, walk, bind=True, lock_args=("node",))
    result = walk_task.apply(args=("root",))
    assert "root" == result.get()
    assert {"inner": "busy", "child": "leaf"} == seen
    # Nothing was stored against the outer id.
    assert "PENDING" == AsyncResult(result.id, app=app).state
    assert not is_held(walk_task, "root")


def test_a_failing_metrics_sink_never_fails_a_task(app):
    """A Metrics implementation that raises is logged, and the run's outcome stands."""

    class Broken:
        def __getattr__(self, name):
            def fail(*args, **kwargs):
                raise RuntimeError("sink down")

            return fail

    from celery_pglock import metrics

    task = define(app, ran)
    metrics.install(Broken())
    try:
        assert "ran" == task.apply().get()
    finally:
        metrics.install(metrics.NullMetrics())
    assert not is_held(task)


def test_a_call_of_the_running_task_through_another_task_is_a_direct_call(app):
    """a's run calls b directly, and b calls a directly: the inner a is a direct call
    (its own lock, LockBusy on a's key), never a second run of a's message, so a's
    retry still releases a's lock once Celery has stored RETRY."""
    calls = {}

    def b(n):
        try:
            return calls["a"](n)
        except LockBusy as busy:
            return type(busy).__name__

    def a(self, n):
        if n == 0:
            calls["inner"] = [calls["b"](1), calls["b"](0)]
            raise self.retry(countdown=3600, queue=f"it-never-{uuid.uuid4().hex}")
        return "inner"

    calls["b"] = define(app, b, lock_name="it.b-of-a")
    calls["a"] = task = define(app, a, bind=True, lock_args=("n",), max_retries=3)
    task_id = str(uuid.uuid4())
    tracer = build_tracer(task.name, task, app=app)
    tracer(task_id, [0], {}, {"id": task_id, "delivery_info": {"redelivered": False}})
    # a(1) ran under its own lock; a(0) found a's own key held: LockBusy, not a skip.
    assert ["inner", "LockBusy"] == calls["inner"]
    assert "RETRY" == AsyncResult(task_id, app=app).state
    assert not is_held(task, 0)
    assert not is_held(task, 1)


def test_a_skip_of_a_nested_direct_call_leaves_the_outer_callbacks_alone(app):
    """lock_skip_result='success': the inner direct call raises LockBusy; the outer run's
    link callbacks are untouched (a skip record clears only its own run's)."""
    calls, seen = {}, {}

    def b():
        try:
            return calls["a"](0)
        except LockBusy as busy:
            return type(busy).__name__

    def a(self, n):
        seen["inner"] = calls["b"]()
        seen["callbacks"] = self.request.callbacks
        return "outer"

    calls["b"] = define(app, b, lock_name="it.b-of-a")
    calls["a"] = task = define(
        app, a, bind=True, lock_args=("n",), lock_skip_result="success"
    )
    link = {"task": "it.never", "args": [], "kwargs": {}, "options": {}}
    task_id = str(uuid.uuid4())
    tracer = build_tracer(task.name, task, app=app)
    # Celery sends the link after the run: to a queue nobody reads.
    link["options"] = {"queue": f"it-never-{uuid.uuid4().hex}"}
    tracer(task_id, [0], {}, {"id": task_id, "callbacks": [link], "delivery_info": {}})
    assert "LockBusy" == seen["inner"]
    assert [link] == seen["callbacks"]
    assert "outer" == AsyncResult(task_id, app=app).get(timeout=5)


def _unreachable(app, database_url):
    """Point the app at a port nobody listens on: every acquire fails to connect (a
    transient error, an outage)."""
    unreachable = sa.engine.make_url(database_url).set(
        host="127.0.0.1", port=1, query={}
    )
    app.conf.pglock_database_url = unreachable.render_as_string(hide_password=False)


def _deliver(task, retries=0):
    """Trace one delivery of ``task``; a re-queued message goes to a queue nobody reads."""
    task_id = str(uuid.uuid4())
    queue = f"it-never-{uuid.uuid4().hex}"
    tracer = build_tracer(task.name, task, app=task.app)
    request = {
        "id": task_id,
        "retries": retries,
        "delivery_info": {"routing_key": queue},
    }
    tracer(task_id, [], {}, request)
    return AsyncResult(task_id, app=task.app)


def test_a_database_error_at_acquire_fails_the_run_without_autoretry_for(
    app, database_url
):
    """Celery's default: a task without autoretry_for is not retried; the run ends
    FAILURE with DatabaseError and its body never ran."""
    _unreachable(app, database_url)
    calls = []

    def body():
        calls.append(1)

    task = define(app, body, max_retries=10)
    result = _deliver(task)
    assert "FAILURE" == result.state
    assert isinstance(result.result, DatabaseError)
    assert [] == calls


def test_autoretry_for_retries_a_database_error_with_celerys_backoff(
    app, database_url, caplog
):
    """autoretry_for covering DatabaseError: re-queued with retry_backoff's countdown
    (factor x 2**retries, capped by retry_backoff_max) and retry_kwargs' max_retries,
    as Celery retries the body."""
    _unreachable(app, database_url)
    task = define(
        app,
        ran,
        autoretry_for=(DatabaseError,),
        retry_backoff=2,
        retry_backoff_max=300,
        retry_jitter=False,
        retry_kwargs={"max_retries": 5},
    )
    with caplog.at_level(logging.WARNING, logger="celery_pglock"):
        assert "RETRY" == _deliver(task, retries=2).state
    assert "re-queued in 8s (retry 3 of 5)" in caplog.text
    assert "its body has not run" in caplog.text
    assert "override_max_retries" not in vars(task)  # not left for later runs
    assert "FAILURE" == _deliver(task, retries=5).state  # no retries left


def test_a_misconfigured_lock_database_is_not_retried_even_with_autoretry_for(
    app, database_url
):
    """A database that does not exist is no outage: the run fails at once with the
    DatabaseError saying so, although autoretry_for covers it."""
    missing = sa.engine.make_url(database_url).set(database="pglock_no_such_db")
    app.conf.pglock_database_url = missing.render_as_string(hide_password=False)
    task = define(app, ran, autoretry_for=(DatabaseError,), default_retry_delay=1)
    result = _deliver(task)
    assert "FAILURE" == result.state
    assert "not retried" in str(result.result)


def test_dont_autoretry_for_and_a_parent_class_are_honoured(app, database_url):
    """dont_autoretry_for wins over autoretry_for, and autoretry_for=(Exception,)
    covers DatabaseError, exactly as in Celery's own autoretry."""
    _unreachable(app, database_url)

    def first():
        return None

    def second():
        return None

    excluded = define(
        app, first, autoretry_for=(Exception,), dont_autoretry_for=(DatabaseError,)
    )
    assert "FAILURE" == _deliver(excluded).state
    covered = define(app, second, autoretry_for=(Exception,), default_retry_delay=1)
    assert "RETRY" == _deliver(covered).state


@pytest.mark.parametrize("session_mode", ["per_process"], indirect=True)
def test_a_commit_answered_after_its_bound_fired_still_succeeds(
    app, database_url, monkeypatch
):
    """Transaction scope: PostgreSQL answered the COMMIT, then the thread stalled past the
    round-trip bound and the reaper shut the socket down. The work is committed and the
    lock ended with the transaction: the run succeeds, and the dead connection is not
    pooled."""
    from sqlalchemy.engine import base

    from celery_pglock.db import deadlines

    table = f"it_late_commit_{uuid.uuid4().hex[:8]}"
    admin = sa.create_engine(database_url, poolclass=sa.pool.NullPool)
    with admin.begin() as connection:
        connection.exec_driver_sql(f"CREATE TABLE {table} (v int)")
    app.conf.pglock_db_timeout = 0.2

    def body():
        current_lock().connection.exec_driver_sql(f"INSERT INTO {table} VALUES (1)")
        return "done"

    task = define(app, body, lock_scope="transaction")
    commit = base.RootTransaction.commit

    def commit_then_stall(self, *args, **kwargs):
        answer = commit(self, *args, **kwargs)
        time.sleep(0.2 + deadlines.TICK + 0.3)  # the stall after the answer
        return answer

    monkeypatch.setattr(base.RootTransaction, "commit", commit_then_stall)
    try:
        result = task.apply()
        monkeypatch.undo()
        after = task.apply()  # the next run gets a live connection
    finally:
        monkeypatch.undo()
        with admin.begin() as connection:
            rows = connection.exec_driver_sql(f"SELECT count(*) FROM {table}").scalar()
            connection.exec_driver_sql(f"DROP TABLE {table}")
        admin.dispose()
    assert "done" == result.get(timeout=5)
    assert "done" == after.get(timeout=5)
    assert 2 == rows


def _observe_stores(app, task, key_args):
    """(state, key held?) for each result the backend stores, taken just before the store
    is written: what a client polling the result could see at the earliest."""
    seen = []
    store = app.backend.store_result

    def observed(task_id, result, state, *args, **kwargs):
        seen.append((state, is_held(task, *key_args)))
        return store(task_id, result, state, *args, **kwargs)

    app.backend.store_result = observed
    return seen


@pytest.mark.parametrize(
    ("how", "state", "held_at_store"),
    [
        ("return", "SUCCESS", False),
        ("raise", "FAILURE", False),
        # A published retry keeps its lock until Celery stored RETRY (its run waits
        # for it, bounded: SingletonTask.retry); task_postrun then releases it.
        ("retry", "RETRY", True),
    ],
)
def test_the_lock_is_free_before_the_result_is_stored(app, how, state, held_at_store):
    """task.py's promise: a client that sees the result can send the next run at once.

    The run goes through Celery's tracer as a worker's pool runs it (build_tracer, not
    eager: an eager run stores no result), with the real Redis result backend; the
    ordering of release, store and task_postrun is all inside that call, in the process
    that runs the body, so a worker process would add nothing to it. Caught mutations:
    releasing only on success (the task_postrun safety net then releases a failed run
    after its FAILURE is stored) fails "raise"; releasing after the store fails "return"
    and "raise"; a retry() that does not keep its lock fails "retry"."""

    def settle(self, day):
        if how == "raise":
            raise ValueError("the body failed")
        if how == "retry":
            raise self.retry(countdown=3600, queue=f"it-never-{uuid.uuid4().hex}")
        return day

    task = define(app, settle, bind=True, lock_args=("day",), max_retries=3)
    seen = _observe_stores(app, task, ("d",))
    task_id = str(uuid.uuid4())
    tracer = build_tracer(task.name, task, app=app)
    tracer(task_id, ["d"], {}, {"id": task_id, "delivery_info": {}})
    assert [(state, held_at_store)] == seen
    assert state == AsyncResult(task_id, app=app).state  # stored, visible to clients
    assert not is_held(task, "d")  # and free once the run is over


class _InterruptError(Exception):
    """Stands for a soft time limit (SoftTimeLimitExceeded) landing mid-release."""


_PACKAGE = str(Path(celery_pglock.__file__).parent)


def _interrupting(run, at):
    """``run()``, raising _InterruptError as the ``at``-th function (0-based) the library
    calls starts: where Python runs a signal handler (on entering a function). How many
    were called, with no interrupt if ``at`` is None."""
    seen = [0]

    def calls(frame, event, arg):
        mine = frame.f_code.co_filename.startswith(_PACKAGE)  # not a signal receiver's
        caller = frame.f_back
        if event == "call" and mine and caller.f_code.co_filename.startswith(_PACKAGE):
            seen[0] += 1
            if seen[0] - 1 == at:
                raise _InterruptError(
                    f"landed on entering {frame.f_code.co_name} from "
                    f"{Path(caller.f_code.co_filename).name}:{caller.f_code.co_name}"
                )

    old = sys.gettrace()
    sys.settrace(calls)
    try:
        run()
    finally:
        sys.settrace(old)
    return seen[0]


def test_an_interrupt_anywhere_in_a_run_leaves_nothing_behind(services):
    """An asynchronous exception (a soft time limit) may land as any function of the
    library starts during a run (its acquire, its end, its release): wherever it lands,
    once task_postrun has run, no key is held in PostgreSQL, no lock is watched, no socket
    shutdown is left armed, and the key's next run in the process runs. Each of these
    failed somewhere before its fix (docs/operations/failure-modes.md, "Exception in the
    body"). In a fresh interpreter (``case_`` below): the call tracing it needs hung there
    after some of the suite's tests had run."""
    done = subprocess.run(
        [
            *(sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"),
            *("-o", "python_functions=case_*", "-o", "addopts="),
            f"{__file__}::case_interrupted_anywhere",
        ],
        env={**os.environ, **services.env(), "PGLOCK_SKIP_LINT": "1"},
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert 0 == done.returncode, done.stdout[-4000:] + done.stderr[-2000:]
    assert "2 passed" in done.stdout, done.stdout[-2000:]


def _advisory_locks_of_this_process(app):
    """How many advisory locks this process's sessions hold, once a session the library
    closed has ended: its backend exits (and frees its locks) a moment after the close."""
    deadline = time.monotonic() + 5
    while True:
        with current_engine(app).connect() as connection:
            count = connection.exec_driver_sql(
                "SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a USING (pid) "
                "WHERE l.locktype = 'advisory' AND a.application_name LIKE %s",
                (f"%:{os.getpid()} %",),
            ).scalar()
        if count == 0 or time.monotonic() >= deadline:
            return count
        time.sleep(0.05)


def case_interrupted_anywhere(app):
    """The case of the test above (collected only with python_functions=case_*), for each
    kind of lock: no advisory lock of this process is left in PostgreSQL, nothing is
    watched, and the next run of the key in this process runs."""

    def anywhere(day):
        return day

    kinds = {
        "try": {},
        "wait": {"lock_on_busy": "wait"},
        "transaction": {"lock_scope": "transaction"},
        "slot": {"lock_limit": 2},
        "group": {"lock_group": f"g-{uuid.uuid4().hex}", "lock_group_limit": 2},
        "fencing": {"lock_fencing": True},
        "rate": {"lock_rate": "1000/h"},
        "enqueue": {"lock_enqueue": "until_finished"},
        "latest": {
            "lock_enqueue": "until_started",
            "lock_enqueue_on_duplicate": "replace",
        },
    }
    for kind, options in kinds.items():
        anywhere.__name__ = f"anywhere_{kind}"
        task = define(app, anywhere, lock_args=("day",), lock_wait_timeout=5, **options)
        tracer = build_tracer(task.name, task, app=app)
        if (
            "lock_enqueue" in options
        ):  # made by a producer's first send, which is skipped
            queued.TABLE.ensure(task.locks_engine())
            replacing.TABLE.ensure(task.locks_engine())

        def deliver(day, task=task, tracer=tracer):
            task_id = str(uuid.uuid4())
            request = {"id": task_id, "root_id": task_id, "hostname": "it@localhost"}
            return lambda: tracer(task_id, [day], {}, request)

        calls = _interrupting(deliver(0), None)
        assert calls > 10
        for at in range(calls):
            _interrupting(deliver(at + 1), at)
            where = f"{kind}, an interrupt at call {at}"
            assert 0 == _advisory_locks_of_this_process(app), f"held after {where}"
            assert [] == lock_state.watched_locks(), f"watched after {where}"
            assert at + 1 == task.apply(args=(at + 1,)).get(), f"refused after {where}"
