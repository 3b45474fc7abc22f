"""SingletonTask in-process (apply/direct calls) against real PostgreSQL and Redis.

Cross-process exclusivity, crashes and redelivery are proven with real worker processes
in tests/acceptance; these tests pin down the API and outcome semantics quickly.
"""

from __future__ import annotations

import re
import threading
import time

import pytest
import sqlalchemy as sa
from celery import Celery

from celery_pglock import (
    AdvisoryLock,
    ConfigurationError,
    DatabaseError,
    LockBusy,
    LockKeyError,
    PgLockError,
    SingletonTask,
    current_lock,
    make_key,
)
from tests.integration.task_support import current_engine, define, hold, ran


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


def test_a_subclass_overriding_lock_key_for_keys_every_run(app):
    """Keys that are not plain arguments: the override keys the run, not lock_args."""

    class PerCustomer(SingletonTask):
        abstract = True

        def lock_key_for(self, *args, **kwargs):
            order = args[0] if args else kwargs["order"]
            return make_key(
                self.lock_config.namespace,
                self.lock_config.name,
                {"customer": order["customer_id"]},
            )

    @app.task(base=PerCustomer, name="it.ship", shared=False)
    def ship(order):
        return current_lock().key

    app.finalize(auto=True)
    task = app.tasks["it.ship"]
    same_customer = task.lock_key_for({"customer_id": 7, "order_id": 2})
    assert same_customer == task.apply(args=({"customer_id": 7, "order_id": 1},)).get()
    holder = hold(task, {"customer_id": 7, "order_id": 3})
    try:
        busy = task.apply(args=({"customer_id": 7, "order_id": 4},))
        assert "FAILURE" == busy.state  # skipped: the same customer's key is held
        other = task.apply(args=({"customer_id": 8, "order_id": 5},))
        assert "SUCCESS" == other.state
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
    # The time it really waited (measured), then the bound it was given.
    waited = re.search(
        r"after waiting ([0-9.]+)s \(lock_wait_timeout 0.3s\)", str(result.result)
    )
    assert waited is not None, str(result.result)
    assert 0.25 <= float(waited.group(1)) < 2.0, str(result.result)
    skipped = [kw for name, kw in events if name == "lock_skipped"]
    assert "wait" == skipped[0]["action"]
    assert skipped[0]["wait_seconds"] >= 0.29


def test_retry_policy_retries_then_fails_when_retries_run_out(app, events):
    """lock_on_busy='retry' goes through Celery's retry and honours max_retries."""
    ran = []

    def count():
        ran.append(1)

    task = define(
        app,
        count,
        lock_on_busy="retry",
        lock_retry_delay=1,
        lock_wait_timeout=2,
        max_retries=2,
    )
    holder = hold(task)
    try:
        result = task.apply()
    finally:
        holder.release()
    assert [] == ran
    assert isinstance(result.result, LockBusy)
    # The first try and 2 retries, each at once: an eager retry's predecessor has
    # released its lock, so it does not wait lock_wait_timeout for it.
    skips = [kw for name, kw in events if name == "lock_skipped"]
    assert 3 == len(skips)
    assert all(skip["wait_seconds"] < 1 for skip in skips)


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


def test_a_direct_call_runs_with_its_own_request(app):
    """task(...) outside a worker pushes the call's request as Celery's Task.__call__
    does: the body sees its own arguments and itself as the current task."""
    from celery import current_task

    def introspect(tenant_id):
        return list(current_task.request.args), current_task.name

    task = define(app, introspect, lock_args=("tenant_id",))
    assert ([7], "it.introspect") == task(7)


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
