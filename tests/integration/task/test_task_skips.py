"""A SingletonTask run whose lock is held, in-process against real PostgreSQL and Redis.

How a skip ends for its caller (lock_skip_result), who is named as the holder, a
redelivered message, the run lock of acks_late tasks, and shadow mode.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import threading
import uuid

import psycopg2
import pytest
import sqlalchemy as sa
from celery.result import AsyncResult

from celery_pglock import (
    AdvisoryLock,
    ConfigurationError,
    LockBusy,
    LockSkipped,
    current_lock,
    keys,
    skip_info,
)
from celery_pglock.db import engines as db_module
from celery_pglock.lock import holder_lookup, sessions
from celery_pglock.task import busy_policy
from tests.integration.task_support import (
    current_engine,
    define,
    hold,
    ran,
    trace_delivery,
)


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


def test_a_busy_direct_call_is_named_as_such(app):
    """A direct call has no task id: its LockBusy says "direct call", not "[None]"."""

    def direct(tenant_id):
        return tenant_id

    task = define(app, direct, lock_args=("tenant_id",))
    holder = hold(task, 3)
    try:
        with pytest.raises(LockBusy) as raised:
            task(3)
    finally:
        holder.release()
    assert str(raised.value).endswith(f"; {task.name} (direct call) did not run.")
    assert "[None]" not in str(raised.value)


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


def test_a_hot_keys_holder_is_looked_up_once_a_second_on_the_lock_session(
    app, session_mode, monkeypatch
):
    """Full contention: every message of a hot key is a skip. The holder is looked up
    on the first and reused for RECENT_SECONDS; a process's lock session looks it up on
    itself (no pooled connection)."""
    lookups = []
    original = sessions.LockSessions.holder_of  # both strategies ask through it

    def counted(self, key, *, bound):
        lookups.append(key)
        return original(self, key, bound=bound)

    monkeypatch.setattr(sessions.LockSessions, "holder_of", counted)
    task = define(app, ran)
    holder = hold(task)
    checkouts = []
    sa.event.listen(current_engine(app), "checkout", lambda *_: checkouts.append(1))
    try:
        skips = [task.apply().result for _ in range(5)]
        monkeypatch.setattr(holder_lookup, "RECENT_SECONDS", 0.0)
        skips.append(task.apply().result)
    finally:
        holder.release()
    assert all(isinstance(skip, LockSkipped) for skip in skips)
    assert {db_module.process_tag()} == {skip.holder for skip in skips}
    assert 2 == len(lookups)
    if session_mode == "per_process":
        assert [] == checkouts  # no pooled connection: the lock session itself


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


@contextlib.contextmanager
def killed_when_looked_at(monkeypatch, database_url, *held):
    """A first delivery's session holding the ``held`` keys. It ends (as PostgreSQL sees
    a killed child's connection close) a third of KILLED_HOLDER_GRACE after the
    redelivery first looks at its run lock. Yields what each look found."""
    session = psycopg2.connect(
        sa.make_url(database_url)
        .set(drivername="postgresql")
        .render_as_string(hide_password=False)
    )
    session.autocommit = True
    with session.cursor() as cursor:
        for key in held:
            ids = ", ".join(["%s"] * len(key.ids))
            cursor.execute(f"SELECT pg_advisory_lock({ids})", key.ids)
    closing = threading.Timer(busy_policy.KILLED_HOLDER_GRACE / 3, session.close)
    seen = []
    real = AdvisoryLock.run_alive

    def looking(lock, run_key):
        alive = real(lock, run_key)
        if not seen:
            closing.start()
        seen.append(alive)
        return alive

    monkeypatch.setattr(AdvisoryLock, "run_alive", looking)
    try:
        yield seen
    finally:
        if closing.is_alive():
            closing.join()
        session.close()


def test_a_redelivery_whose_first_delivery_was_killed_a_moment_ago_stores_its_skip(
    app, database_url, monkeypatch
):
    """A worker re-queues a killed child's message at once: the redelivery can find the
    child's run lock still held until PostgreSQL sees its connection close. It looks
    again after busy_policy.KILLED_HOLDER_GRACE and stores its skip."""
    task = define(app, ran, acks_late=True)
    task_id = str(uuid.uuid4())
    other = hold(task)  # another run holds the key
    try:
        run_lock = keys.run_key(task_id)
        with killed_when_looked_at(monkeypatch, database_url, run_lock) as seen:
            trace_delivery(task, task_id, redelivered=True)
    finally:
        other.release()
    assert [True, False] == seen[:2]  # held, then freed within the grace
    stored = AsyncResult(task_id, app=app)
    assert "FAILURE" == stored.state
    assert isinstance(stored.result, LockSkipped)


def test_a_redelivery_whose_first_delivery_held_the_key_and_was_killed_runs(
    app, database_url, monkeypatch
):
    """The killed first delivery held the key itself: once PostgreSQL frees its locks,
    the redelivery takes the key and runs the body (the message is not skipped by its
    own dead delivery)."""
    task = define(app, ran, acks_late=True)
    task_id = str(uuid.uuid4())
    held = (task.lock_key_for(), keys.run_key(task_id))
    with killed_when_looked_at(monkeypatch, database_url, *held) as seen:
        trace_delivery(task, task_id, redelivered=True)
    assert [True, False] == seen  # the key was busy: its first try failed
    stored = AsyncResult(task_id, app=app)
    assert "SUCCESS" == stored.state


def test_a_redelivery_that_waited_for_its_key_waits_once(
    app, database_url, monkeypatch
):
    """A wait (lock_on_busy='wait') gave a killed holder's key time to be freed: a busy
    redelivery does not wait a second time when its run lock is then found free."""
    task = define(app, ran, acks_late=True, lock_on_busy="wait", lock_wait_timeout=0.3)
    task_id = str(uuid.uuid4())
    other = hold(task)  # another run holds the key throughout
    waits = []
    real = AdvisoryLock.acquire

    def acquire(lock, *, timeout=None):
        waits.append(timeout)
        return real(lock, timeout=timeout)

    monkeypatch.setattr(AdvisoryLock, "acquire", acquire)
    try:
        run_lock = keys.run_key(task_id)
        with killed_when_looked_at(monkeypatch, database_url, run_lock):
            trace_delivery(task, task_id, redelivered=True)
    finally:
        other.release()
    assert [0.3] == waits


@pytest.mark.parametrize("failed_lookups", [1, 100])
def test_a_redelivery_whose_run_lock_lookup_fails_looks_again(
    app, monkeypatch, failed_lookups
):
    """A failed run-lock lookup (a database restart) is tried again for up to
    lock_db_timeout: a first delivery found dead then gets the skip stored; one never
    known stores nothing (docs/guide/skipped-results.md)."""
    task = define(app, ran, acks_late=True, lock_db_timeout=0.5)
    task_id = str(uuid.uuid4())
    lookups = []
    real = AdvisoryLock.run_alive

    def flaky(lock, run_key):
        lookups.append(run_key)
        return None if len(lookups) <= failed_lookups else real(lock, run_key)

    monkeypatch.setattr(AdvisoryLock, "run_alive", flaky)
    other = hold(task)
    try:
        trace_delivery(task, task_id, redelivered=True)
    finally:
        other.release()
    stored = AsyncResult(task_id, app=app)
    if failed_lookups == 1:
        # Failed; found free, so the key is tried again; the busy policy's own look.
        assert 3 == len(lookups)
        assert isinstance(stored.result, LockSkipped)
    else:
        assert 3 <= len(lookups) < failed_lookups  # 0.1 (+ 0.2) s pauses within 0.5 s
        assert "PENDING" == stored.state


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"lock_skip_result": "success"},
        {"lock_on_busy": "raise"},
        {"lock_on_busy": "wait", "lock_wait_timeout": 0.2},
        {"lock_on_busy": "retry", "max_retries": 3},
    ],
    ids=["skip", "skip-success", "raise", "wait", "retry"],
)
def test_a_redelivery_whose_first_delivery_runs_stores_nothing(app, options):
    """acks_late: the first delivery still runs (it holds the key and its run lock): the
    redelivery stores nothing, whatever the policy (no skip, no skip record, no LockBusy, no
    retry that would run the body again), and the first delivery's outcome is the one
    stored."""
    task = define(app, ran, acks_late=True, **options)
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


def test_app_wide_shadow_names_the_per_task_opt_out(app):
    """pglock_shadow = True with a transaction-scope task: the error names the setting
    and the task's way out (lock_shadow=False), which then works."""
    app.conf.pglock_shadow = True
    with pytest.raises(
        ConfigurationError, match=r"app\.conf\.pglock_shadow.*lock_shadow=False on this"
    ):
        define(app, ran, lock_scope="transaction")

    def opted_out():
        return "ran"

    task = define(app, opted_out, lock_scope="transaction", lock_shadow=False)
    assert "ran" == task.apply().get()
