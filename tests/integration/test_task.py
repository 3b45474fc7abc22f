"""SingletonTask in-process (apply/direct calls) against real PostgreSQL and Redis.

Cross-process exclusivity, crashes and redelivery are proven with real worker processes
in tests/acceptance; these tests pin down the API and outcome semantics quickly.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
import uuid

import pytest
import sqlalchemy as sa
from celery import Celery
from celery.app.trace import build_tracer
from celery.result import AsyncResult

from celery_pglock import (
    SKIPPED,
    AdvisoryLock,
    ConfigurationError,
    DatabaseError,
    LockBusy,
    LockKeyError,
    LockSkipped,
    PgLockError,
    SingletonTask,
    _holder,
    _per_lock,
    _process_session,
    current_lock,
    keys,
    signals,
    skip_info,
)
from celery_pglock import db as db_module


@pytest.fixture
def app(database_url, broker_url, result_backend_url, namespace, session_mode):
    app = Celery(
        "it", broker=broker_url, backend=result_backend_url, set_as_current=False
    )
    app.conf.pglock_database_url = database_url
    app.conf.pglock_namespace = namespace
    app.conf.pglock_session_mode = session_mode
    yield app
    app.close()


@pytest.fixture
def events():
    """Every celery_pglock signal sent during the test, as (signal name, kwargs)."""
    seen = []
    receivers = []
    for name in (
        "lock_acquired",
        "lock_skipped",
        "lock_completed",
        "lock_failed",
        "lock_release_failed",
    ):

        def receiver(sender=None, signal=None, _name=name, **kwargs):
            seen.append((_name, kwargs))

        getattr(signals, name).connect(receiver, weak=False)
        receivers.append((getattr(signals, name), receiver))
    yield seen
    for signal, receiver in receivers:
        signal.disconnect(receiver)


def define(app, fun, **options):
    task = app.task(
        base=SingletonTask, name=f"it.{fun.__name__}", shared=False, **options
    )(fun)
    app.finalize(auto=True)
    return app.tasks[task.name]


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


def test_runs_under_the_lock_and_releases(app, events):
    """The body runs holding the key; afterwards the key is free and signals say so."""
    seen = {}

    def export(tenant_id, fmt="csv"):
        seen["key"] = current_lock().key
        seen["held"] = AdvisoryLock(
            engine=current_lock().engine, key=current_lock().key
        ).locked()
        return fmt

    task = define(app, export, lock_args=("tenant_id",))
    result = task.apply(args=(7,), kwargs={"fmt": "pdf"})
    assert "SUCCESS" == result.state
    assert "pdf" == result.result
    assert task.lock_key_for(7) == seen["key"]
    assert seen["held"]
    assert not AdvisoryLock(engine=current_engine(app), key=seen["key"]).locked()
    names = [name for name, _ in events]
    assert ["lock_acquired", "lock_completed"] == names
    acquired, completed = events[0][1], events[1][1]
    assert result.id == acquired["task_id"] == completed["task_id"]
    assert "it.export" == completed["task_name"]
    assert seen["key"] == completed["key"]
    assert "SUCCESS" == completed["state"]
    assert completed["held_seconds"] >= 0
    assert acquired["wait_seconds"] >= 0


def current_engine(app):
    return db_module.engine_for(app.conf)


def test_skip_ends_as_failure_with_lock_skipped_naming_the_holder(app, events, caplog):
    """Default lock_skip_result='failure': the busy run is ready at once, FAILURE with
    LockSkipped (an expected exception: in throws), naming the holder's host:pid; the
    body never runs."""
    ran = []

    def report(tenant_id):
        ran.append(tenant_id)

    task = define(app, report, lock_args=("tenant_id",))
    holder = hold(task, 3)
    try:
        with caplog.at_level(logging.INFO):
            result = task.apply(args=(3,))
    finally:
        holder.release()
    assert [] == ran
    assert "FAILURE" == result.state
    assert LockSkipped in task.throws
    assert result.ready()  # stored and ready for a real caller: tests/acceptance
    with pytest.raises(LockSkipped) as raised:
        result.get(timeout=5)
    skip = raised.value
    assert isinstance(skip, LockBusy)  # `except LockBusy` catches skips too
    assert str(holder.key) == skip.key
    assert db_module.process_tag() == skip.holder  # this process holds it
    details = skip_info(skip)
    assert {
        "reason": "lock_busy",
        "task": "it.report",
        "lock": "it.report",
        "key": str(holder.key),
        "policy": "skip",
        "holder": db_module.process_tag(),
        "holder_task": "it.report",
    } == {k: v for k, v in details.items() if k != "holder_pid"}
    assert isinstance(details["holder_pid"], int)
    assert db_module.process_tag() in str(skip)
    assert [("lock_skipped", "skip")] == [(name, kw["action"]) for name, kw in events]
    assert db_module.process_tag() == events[0][1]["holder"]
    # One line at INFO per skip: Celery's expected-failure line, carrying our message.
    lines = [r for r in caplog.records if r.levelno >= logging.INFO]
    assert 1 == len(lines), [r.getMessage() for r in lines]
    assert "raised expected" in lines[0].getMessage()
    assert db_module.process_tag() in lines[0].getMessage()
    assert app.conf.pglock_database_url not in lines[0].getMessage()


def test_skip_result_success_returns_a_skip_record_and_runs_no_callback(app, events):
    """lock_skip_result='success': SUCCESS with a skip record as the value; link
    callbacks do not run."""
    task = define(app, ran, lock_skip_result="success")
    holder = hold(task)
    try:
        result = task.apply(link=task.si())
    finally:
        holder.release()
    assert "SUCCESS" == result.state
    record = result.get(timeout=5)
    assert "skipped" == record["celery_pglock"]
    assert "lock_busy" == skip_info(record)["reason"]
    assert str(holder.key) == record["key"]
    assert None is skip_info("ran")
    assert [("lock_skipped", "skip")] == [(name, kw["action"]) for name, kw in events]


def test_skip_result_skipped_keeps_the_old_skipped_state(app, events):
    """lock_skip_result='skipped': the state SKIPPED with the skip record as meta."""
    task = define(app, ran, lock_skip_result="skipped", lock_args=())
    holder = hold(task)
    try:
        result = task.apply()
    finally:
        holder.release()
    assert "IGNORED" == result.state  # what Celery's tracer reports for Ignore
    stored = AsyncResult(result.id, app=app)
    assert SKIPPED == stored.state
    assert not stored.ready()
    assert "lock_busy" == stored.info["reason"]
    assert str(holder.key) == stored.info["key"]


def test_a_hot_keys_holder_is_looked_up_once_a_second_on_the_lock_session(
    app, session_mode, monkeypatch
):
    """Full contention: every message of a hot key is a skip. The holder is looked up
    on the first and reused for RECENT_SECONDS; a process's lock session looks it up on
    itself (no pooled connection)."""
    lookups = []
    strategy = (
        _process_session.ProcessSession
        if session_mode == "per_process"
        else _per_lock.PerLockSessions
    )
    original = strategy.holder_of

    def counted(self, key, *, bound):
        lookups.append(key)
        return original(self, key, bound=bound)

    monkeypatch.setattr(strategy, "holder_of", counted)
    task = define(app, ran)
    holder = hold(task)
    checkouts = []
    sa.event.listen(current_engine(app), "checkout", lambda *_: checkouts.append(1))
    try:
        skips = [task.apply().result for _ in range(5)]
        monkeypatch.setattr(_holder, "RECENT_SECONDS", 0.0)
        skips.append(task.apply().result)
    finally:
        holder.release()
    assert all(isinstance(skip, LockSkipped) for skip in skips)
    assert {db_module.process_tag()} == {skip.holder for skip in skips}
    assert 2 == len(lookups)
    if session_mode == "per_process":
        assert [] == checkouts  # no pooled connection: the lock session itself


def trace_delivery(task, task_id, *, redelivered):
    """Run ``task`` the way a worker's pool runs a message (Celery's tracer, results
    stored), with the broker's ``redelivered`` flag as given."""
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
    }
    return tracer(task_id, [], {}, request)


def test_a_skip_leaves_no_cycle_for_the_garbage_collector(app):
    """A skip through Celery's tracer is freed by reference counting, as a run is: the
    frames it unwound (holding its lock and execution) must not wait for a collection."""
    task = define(app, ran, lock_args=())
    holder = hold(task)
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        for _ in range(5):
            info = trace_delivery(task, str(uuid.uuid4()), redelivered=False)[1]
            assert isinstance(info.retval, LockSkipped)  # each run was a skip
        gc.collect()
        left = [type(o).__name__ for o in gc.garbage]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
        holder.release()
    assert "LockSkipped" not in left
    assert "AdvisoryLock" not in left


def test_a_redelivery_whose_first_delivery_died_stores_its_skip(app):
    """acks_late: the redelivered message finds the key held by another run and no run
    lock for its task id (its first delivery was killed): its caller gets the skip."""
    task = define(app, ran, acks_late=True)
    task_id = str(uuid.uuid4())
    other = hold(task)  # another run (another task id) holds the key
    try:
        trace_delivery(task, task_id, redelivered=True)
    finally:
        other.release()
    stored = AsyncResult(task_id, app=app)
    assert "FAILURE" == stored.state
    assert isinstance(stored.result, LockSkipped)


def test_a_redelivery_whose_first_delivery_runs_stores_nothing(app):
    """acks_late: the first delivery still runs (it holds the key and its run lock): the
    redelivery stores nothing, and the first delivery's outcome is the one stored."""
    task = define(app, ran, acks_late=True)
    task_id = str(uuid.uuid4())
    first = AdvisoryLock(
        engine=db_module.engine_for(task.app.conf), key=task.lock_key_for()
    )
    first.run_key = keys.run_key(task_id)
    assert first.acquire()
    try:
        trace_delivery(task, task_id, redelivered=True)
        assert "PENDING" == AsyncResult(task_id, app=app).state
    finally:
        first.release()
    trace_delivery(task, task_id, redelivered=False)  # the first delivery's outcome
    assert "ran" == AsyncResult(task_id, app=app).get(timeout=5)


@pytest.mark.parametrize("on_busy", ["skip", "wait"])  # try-lock, bounded-wait paths
@pytest.mark.parametrize("scope", ["session", "transaction"])
@pytest.mark.parametrize("acks_late", [True, False])
def test_an_acks_late_run_holds_its_run_lock_until_it_ends(
    app, acks_late, scope, on_busy
):
    task_id = str(uuid.uuid4())
    run = keys.run_key(task_id)
    seen = []

    def body():
        probe = AdvisoryLock(engine=current_lock().engine, key=run)
        seen.append(probe.locked())

    task = define(
        app, body, acks_late=acks_late, lock_scope=scope, lock_on_busy=on_busy
    )
    trace_delivery(task, task_id, redelivered=False)
    probe = AdvisoryLock(engine=db_module.engine_for(app.conf), key=run)
    assert [acks_late] == seen
    assert not probe.locked()


def test_the_run_lock_namespace_is_refused_as_a_lock_id(app):
    with pytest.raises(ConfigurationError, match="reserves for its run locks"):
        define(app, ran, lock_id=(keys.RUN_NAMESPACE, 1))


def test_skip_by_a_session_that_is_not_ours_names_its_backend_pid(app, database_url):
    """A lock held by some other program: the skip names its backend pid only."""
    task = define(app, ran)
    key = task.lock_key_for()
    other = sa.create_engine(database_url, poolclass=sa.pool.NullPool)
    with other.connect() as connection:
        connection.exec_driver_sql("SET application_name = 'psql'")
        connection.exec_driver_sql("SELECT pg_advisory_lock(%s)", key.ids)
        backend = connection.exec_driver_sql("SELECT pg_backend_pid()").scalar()
        result = task.apply()
        connection.exec_driver_sql("SELECT pg_advisory_unlock_all()")
    other.dispose()
    skip = result.result
    assert isinstance(skip, LockSkipped)
    assert None is skip.holder
    assert backend == skip.details["holder_pid"]
    assert f"backend {backend} (not a celery-pglock session)" in str(skip)


def test_shadow_mode_reports_the_would_be_skip_and_runs_the_body(app, events):
    """lock_shadow=True: the busy run is reported as skipped, and its body runs anyway."""
    seen = []

    def shadowed(tenant_id):
        seen.append(current_lock().owned())
        return tenant_id

    task = define(app, shadowed, lock_args=("tenant_id",), lock_shadow=True)
    holder = hold(task, 1)
    try:
        assert 1 == task.apply(args=(1,)).get()
    finally:
        holder.release()
    assert 2 == task.apply(args=(2,)).get()
    assert [False, True] == seen
    names = [(name, kw.get("shadow")) for name, kw in events]
    assert [
        ("lock_skipped", True),
        ("lock_acquired", None),
        ("lock_completed", None),
    ] == names


def test_shadow_mode_refuses_transaction_scope(app):
    """A shadowed busy run would have no lock transaction for its body: refused at bind."""
    with pytest.raises(ConfigurationError, match="lock_shadow=True is invalid"):
        define(app, ran, lock_shadow=True, lock_scope="transaction")


def test_different_arguments_do_not_contend(app):
    """Per-argument keys: tenant 1 runs while tenant 2 is held."""

    def echo(tenant_id):
        return tenant_id

    task = define(app, echo, lock_args=("tenant_id",))
    holder = hold(task, 2)
    try:
        assert 1 == task.apply(args=(1,)).get()
    finally:
        holder.release()


def test_raise_policy_fails_with_lock_busy(app, events):
    """lock_on_busy='raise': the run fails with LockBusy naming the key."""
    task = define(app, ran, lock_on_busy="raise")
    holder = hold(task)
    try:
        result = task.apply()
    finally:
        holder.release()
    assert "FAILURE" == result.state
    assert isinstance(result.result, LockBusy)
    assert str(holder.key) == result.result.key
    assert [("lock_skipped", "raise")] == [(name, kw["action"]) for name, kw in events]


def test_wait_policy_runs_once_the_holder_releases(app):
    """lock_on_busy='wait': the run waits (bounded) and then runs."""
    task = define(app, ran, lock_on_busy="wait", lock_wait_timeout=10)
    holder = hold(task)
    timer = threading.Timer(0.3, holder.release)
    timer.start()
    started = time.monotonic()
    try:
        assert "ran" == task.apply().get()
    finally:
        timer.join()
    assert time.monotonic() - started >= 0.25


def test_wait_policy_times_out_with_lock_busy(app, events):
    """A bounded wait that expires raises LockBusy; the signal carries the wait time."""
    task = define(app, ran, lock_on_busy="wait", lock_wait_timeout=0.3)
    holder = hold(task)
    try:
        result = task.apply()
    finally:
        holder.release()
    assert isinstance(result.result, LockBusy)
    assert "after waiting 0.3s" in str(result.result)
    skipped = [kw for name, kw in events if name == "lock_skipped"]
    assert "wait" == skipped[0]["action"]
    assert skipped[0]["wait_seconds"] >= 0.29


def test_retry_policy_retries_then_fails_when_retries_run_out(app, events):
    """lock_on_busy='retry' goes through Celery's retry and honours max_retries."""
    ran = []

    def count():
        ran.append(1)

    task = define(app, count, lock_on_busy="retry", lock_retry_delay=1, max_retries=2)
    holder = hold(task)
    try:
        result = task.apply()
    finally:
        holder.release()
    assert [] == ran
    assert isinstance(result.result, LockBusy)
    # The first try and 2 retries.
    assert 3 == sum(1 for name, _ in events if name == "lock_skipped")


def test_self_retry_releases_before_the_next_attempt(app, events):
    """self.retry() releases the lock first, so the retry is not blocked by its own lock."""
    attempts = []

    def flaky(self):
        attempts.append(self.request.retries)
        if len(attempts) == 1:
            raise self.retry(countdown=0)
        return "done"

    task = define(app, flaky, bind=True, max_retries=3)
    # Eager: the retry runs inline, while the first attempt is unwinding.
    result = task.apply()
    assert "done" == result.get()
    assert [0, 1] == attempts
    failed = [kw for name, kw in events if name == "lock_failed"]
    assert ["RETRY"] == [kw["state"] for kw in failed]


def test_failure_releases_and_reports(app, events):
    """An exception in the body releases the lock and emits lock_failed with it."""

    def boom(tenant_id):
        raise ValueError("boom")

    task = define(app, boom, lock_args=("tenant_id",))
    result = task.apply(args=(1,))
    assert isinstance(result.result, ValueError)
    assert not AdvisoryLock(
        engine=current_engine(app), key=task.lock_key_for(1)
    ).locked()
    failed = [kw for name, kw in events if name == "lock_failed"]
    assert "FAILURE" == failed[0]["state"]
    assert isinstance(failed[0]["exception"], ValueError)


@pytest.fixture
def table(app, namespace):
    name = f"t_{namespace.replace('-', '_')}"
    engine = current_engine(app)
    with engine.begin() as connection:
        connection.exec_driver_sql(f"CREATE TABLE {name} (v int)")
    yield name
    with engine.begin() as connection:
        connection.exec_driver_sql(f"DROP TABLE {name}")


def test_transaction_scope_commits_on_return_and_rolls_back_on_raise(app, table):
    """Transaction scope: the body's writes via current_lock().connection commit with success."""

    def write(value, fail=False):
        current_lock().connection.execute(
            sa.text(f"INSERT INTO {table} VALUES (:v)"), {"v": value}
        )
        if fail:
            raise RuntimeError("roll it back")
        return value

    task = define(app, write, lock_scope="transaction")
    assert 1 == task.apply(args=(1,)).get()
    assert "FAILURE" == task.apply(args=(2,), kwargs={"fail": True}).state
    with current_engine(app).connect() as connection:
        assert [1] == connection.exec_driver_sql(
            f"SELECT v FROM {table}"
        ).scalars().all()


def test_transaction_scope_commit_inside_the_body_fails_the_run(app):
    """Committing the lock's transaction would end the lock early: the run fails loudly."""

    def commit_early():
        current_lock().connection.commit()

    task = define(app, commit_early, lock_scope="transaction")
    result = task.apply()
    assert "FAILURE" == result.state
    assert "ended early" in str(result.result)


def test_direct_call_is_locked_and_busy_raises(app):
    """task(...) takes the lock too; when busy there is no message to skip, so it raises."""

    def double(tenant_id):
        return tenant_id * 2

    task = define(app, double, lock_args=("tenant_id",))
    assert 10 == task(5)
    holder = hold(task, 5)
    try:
        with pytest.raises(LockBusy):
            task(5)
    finally:
        holder.release()
    assert not AdvisoryLock(
        engine=current_engine(app), key=task.lock_key_for(5)
    ).locked()


def test_unstable_argument_fails_before_the_body(app):
    """An argument without a stable text form is an error at call time; the body never runs."""
    ran = []

    def report(tenant):
        ran.append(tenant)

    task = define(app, report, lock_args=("tenant",))
    result = task.apply(args=(object(),))
    assert isinstance(result.result, LockKeyError)
    assert "argument 'tenant'" in str(result.result)
    assert [] == ran


def test_missing_database_url_at_first_use(broker_url, monkeypatch):
    """Outside a worker the missing URL is reported at first use, naming setting and variable."""
    monkeypatch.delenv("CELERY_PGLOCK_DATABASE_URL", raising=False)
    app = Celery("it", broker=broker_url, set_as_current=False)
    task = define(app, ran)
    with pytest.raises(
        ConfigurationError, match=r"pglock_database_url.*CELERY_PGLOCK_DATABASE_URL"
    ):
        task()


def test_unreachable_database_never_runs_the_body(broker_url, namespace):
    """A dead lock database fails the run; it never runs without its lock."""
    ran = []
    app = Celery("it", broker=broker_url, set_as_current=False)
    app.conf.pglock_database_url = "postgresql+psycopg2://app:pw@127.0.0.1:1/app"
    app.conf.pglock_engine_options = {"connect_args": {"connect_timeout": 2}}

    def count():
        ran.append(1)

    task = define(app, count)
    result = task.apply()
    assert isinstance(result.result, DatabaseError)
    assert "pw@" not in str(result.result)
    assert [] == ran


def test_current_lock_outside_a_task_raises():
    """current_lock() is only meaningful inside a SingletonTask body."""
    with pytest.raises(PgLockError, match="outside a running SingletonTask"):
        current_lock()


def test_concurrent_threads_run_one_at_a_time(app):
    """Threads in one process use separate sessions: exactly one of two overlapping calls runs."""
    gate = threading.Event()
    outcomes = []

    def slow():
        gate.wait(5)
        return "ran"

    task = define(app, slow)

    def call():
        try:
            outcomes.append(task())
        except LockBusy:
            outcomes.append("busy")
            gate.set()

    threads = [threading.Thread(target=call) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert ["busy", "ran"] == sorted(outcomes)


def is_held(task, *args):
    return AdvisoryLock(
        engine=current_engine(task.app), key=task.lock_key_for(*args)
    ).locked()


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
    assert 7 == task.apply(args=(7,)).get()
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
        with (
            lock._hold.connection.cursor() as cursor
        ):  # someone unlocks behind our back
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
    """Recursion: the inner call is a direct call (busy -> LockBusy), never a SKIPPED store
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
    assert SKIPPED != AsyncResult(result.id, app=app).state
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
