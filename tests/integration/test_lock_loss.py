"""Lock loss, in-process, against a real PostgreSQL: the watcher, the outcome, the bounds.

Real workers (prefork, threads, forks inside a body) are in
tests/acceptance/test_lock_loss.py; these pin the mechanics down quickly. Tests that
restart or freeze the server use a private embedded PostgreSQL, never the shared one.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import psycopg2
import pytest
from celery import Celery

from celery_pglock import (
    AdvisoryLock,
    ConfigurationError,
    LockLostError,
    LockScope,
    SingletonTask,
    _observer,
    _session,
    _watch,
    current_lock,
    keys,
    signals,
)
from celery_pglock import db as db_module


def _dsn(url: str) -> str:
    return url.replace("postgresql+psycopg2://", "postgresql://")


@pytest.fixture
def lost_events():
    seen: list[dict] = []

    def receiver(sender=None, signal=None, **kwargs):
        seen.append(kwargs)

    signals.lock_lost.connect(receiver, weak=False)
    yield seen
    signals.lock_lost.disconnect(receiver)


def make_app(url, broker_url, result_backend_url, namespace, **conf):
    app = Celery(
        "loss", broker=broker_url, backend=result_backend_url, set_as_current=False
    )
    app.conf.pglock_database_url = url
    app.conf.pglock_namespace = namespace
    app.conf.update(conf)
    return app


def wait_for(predicate, timeout, what):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.02)


def terminate_backend(url: str, pid: int) -> None:
    with psycopg2.connect(_dsn(url)) as connection, connection.cursor() as cursor:
        cursor.execute("SELECT pg_terminate_backend(%s)", (pid,))
    connection.close()


@pytest.mark.parametrize("scope", ["session", "transaction"])
def test_terminated_holder_is_detected_signalled_and_fails_the_run(
    database_url, broker_url, result_backend_url, namespace, lost_events, scope
):
    app = make_app(
        database_url,
        broker_url,
        result_backend_url,
        namespace,
        pglock_watch_interval=0.2,
    )
    seen = {}

    @app.task(base=SingletonTask, bind=True, lock_scope=scope, shared=False)
    def body(self):
        lock = current_lock()
        lock.ensure_held()  # held: no error
        started = time.monotonic()
        terminate_backend(database_url, lock.backend_pid)
        wait_for(lambda: lock.lost, 5, "the loss to be detected")
        seen["after"] = time.monotonic() - started
        with pytest.raises(LockLostError, match="ended"):
            lock.ensure_held()
        return "finished"

    result = body.apply()
    assert result.state == "FAILURE"
    assert isinstance(result.result, LockLostError)
    assert "was lost while its body ran" in str(result.result)
    assert seen["after"] < 0.2 + 1.0  # interval + tick + one query, with room
    (event,) = lost_events
    assert event["task_name"] == body.name
    assert event["key"] == body.lock_key_for()
    assert "backend" in event["cause"]
    assert "ended" in event["cause"]


def test_short_tasks_run_no_check(
    database_url, broker_url, result_backend_url, namespace
):
    app = make_app(database_url, broker_url, result_backend_url, namespace)

    @app.task(base=SingletonTask, shared=False)
    def short():
        return 1

    before = _observer.checks_run
    for _ in range(50):
        assert short.apply().get() == 1
    time.sleep(1.5)  # past the default interval: nothing was due
    assert _observer.checks_run == before


def test_interval_zero_turns_checks_off(
    database_url, broker_url, result_backend_url, namespace, lost_events
):
    app = make_app(
        database_url,
        broker_url,
        result_backend_url,
        namespace,
        pglock_watch_interval=0,
    )

    @app.task(base=SingletonTask, shared=False)
    def body():
        terminate_backend(database_url, current_lock().backend_pid)
        time.sleep(0.6)
        return current_lock().lost

    assert body.lock_config.watch_interval == 0
    assert body.apply().get() is False
    assert lost_events == []


def test_terminate_policy_ends_a_body_in_another_thread(
    database_url, broker_url, result_backend_url, namespace, lost_events
):
    """A threads-pool body: an asynchronous LockLostError at its next bytecode."""
    app = make_app(
        database_url,
        broker_url,
        result_backend_url,
        namespace,
        pglock_watch_interval=0.2,
        pglock_on_lost="terminate",
    )
    progress = {"steps": 0}

    @app.task(base=SingletonTask, shared=False)
    def body():
        terminate_backend(database_url, current_lock().backend_pid)
        for _ in range(500):  # 10 s at most
            progress["steps"] += 1
            time.sleep(0.02)
        return "ran to the end"

    outcome = {}
    thread = threading.Thread(target=lambda: outcome.update(r=body.apply()))
    started = time.monotonic()
    thread.start()
    thread.join(15)
    assert not thread.is_alive()
    assert time.monotonic() - started < 3
    result = outcome["r"]
    assert result.state == "FAILURE"
    assert isinstance(result.result, LockLostError)
    assert "was lost" in str(result.result)  # the rich error, not the bare one
    assert progress["steps"] < 150
    assert len(lost_events) == 1


def test_terminate_policy_ends_a_sleeping_main_thread_body(
    database_url, broker_url, result_backend_url, namespace
):
    """Prefork/solo bodies run in the main thread: a signal interrupts even a long sleep."""
    app = make_app(
        database_url,
        broker_url,
        result_backend_url,
        namespace,
        pglock_watch_interval=0.2,
        pglock_on_lost="terminate",
    )

    @app.task(base=SingletonTask, shared=False)
    def body():
        terminate_backend(database_url, current_lock().backend_pid)
        time.sleep(20)
        return "slept"

    previous = signal.getsignal(_watch.SIGNAL)
    started = time.monotonic()
    result = body.apply()
    assert time.monotonic() - started < 3
    assert isinstance(result.result, LockLostError)
    # Our handler chains whatever was there before; a stray signal now is harmless.
    assert signal.getsignal(_watch.SIGNAL) is not previous or previous is not None


def test_settings_are_validated_at_bind(
    database_url, broker_url, result_backend_url, namespace
):
    app = make_app(
        database_url,
        broker_url,
        result_backend_url,
        namespace,
        pglock_watch_interval=50,
        pglock_check_timeout=8,
    )

    @app.task(base=SingletonTask, shared=False)
    def too_slow():
        pass

    with pytest.raises(
        ConfigurationError,
        match=r"lock_watch_interval.*pglock_watch_interval.*lock_check_timeout",
    ):
        too_slow.lock_config  # noqa: B018 - binds the task

    for number, bad in enumerate(
        (
            {"lock_on_lost": "kill"},
            {"lock_watch_interval": -1},
            {"lock_check_timeout": 0},
            {"lock_watch_interval": True},
        )
    ):

        @app.task(base=SingletonTask, shared=False, name=f"bad{number}", **bad)
        def bad_task():
            pass

        with pytest.raises(ConfigurationError, match=next(iter(bad))):
            bad_task.lock_config  # noqa: B018 - binds the task

    # Without server keepalives (PgBouncer setups) the server never frees the lock of a
    # silent client on its own, so a long interval is allowed.
    app.conf.pglock_server_keepalives = False

    @app.task(base=SingletonTask, shared=False)
    def allowed():
        pass

    assert allowed.lock_config.watch_interval == 50


def test_postgres_restart_during_a_body_is_detected(
    private_postgres, broker_url, result_backend_url, namespace, lost_events
):
    url = private_postgres.url()
    app = make_app(
        url,
        broker_url,
        result_backend_url,
        namespace,
        pglock_watch_interval=0.3,
    )

    @app.task(base=SingletonTask, shared=False)
    def body():
        lock = current_lock()
        time.sleep(0.8)  # one successful check first: the server's start time is known
        private_postgres.restart()
        wait_for(lambda: lock.lost, 10, "the restart to be detected")
        return "finished"

    result = body.apply()
    assert isinstance(result.result, LockLostError)
    (event,) = lost_events
    assert "restarted" in event["cause"] or "ended" in event["cause"], event["cause"]


def test_server_idle_session_timeout_ending_the_holder_is_detected(
    private_postgres, broker_url, result_backend_url, namespace, lost_events
):
    """idle_session_timeout ends a session-scope holder that sits idle while its body
    runs: the watcher reports it (the watcher's own session is never idle that long)."""
    url = private_postgres.url()
    connection = psycopg2.connect(_dsn(url))
    connection.autocommit = True
    with connection.cursor() as cursor:
        cursor.execute("ALTER SYSTEM SET idle_session_timeout = '1s'")
        cursor.execute("SELECT pg_reload_conf()")
    connection.close()
    app = make_app(
        url, broker_url, result_backend_url, namespace, pglock_watch_interval=0.3
    )

    @app.task(base=SingletonTask, shared=False)
    def body():
        lock = current_lock()
        wait_for(lambda: lock.lost, 10, "the idle timeout to be detected")
        return "finished"

    result = body.apply()
    assert isinstance(result.result, LockLostError)
    (event,) = lost_events
    assert "ended" in event["cause"], event["cause"]


def test_frozen_server_is_unverifiable_before_the_keepalive_deadline(
    private_postgres, broker_url, result_backend_url, namespace, lost_events
):
    """SIGSTOP the whole server: nothing answers. The watcher reports the lock as
    unverifiable within interval + check timeout, and the release does not block."""
    url = private_postgres.url()
    app = make_app(
        url,
        broker_url,
        result_backend_url,
        namespace,
        pglock_watch_interval=0.3,
        pglock_check_timeout=1.5,
    )
    postmaster = private_postgres._postmaster_pid()
    assert postmaster
    times = {}

    @app.task(base=SingletonTask, shared=False)
    def body():
        lock = current_lock()
        time.sleep(0.8)
        _stop_server(postmaster, signal.SIGSTOP)
        times["frozen"] = time.monotonic()
        wait_for(lambda: lock.lost, 10, "the frozen link to be noticed")
        times["noticed"] = time.monotonic()
        return "finished"

    try:
        started = time.monotonic()
        result = body.apply()
        ended = time.monotonic()
    finally:
        _stop_server(postmaster, signal.SIGCONT)
    assert isinstance(result.result, LockLostError)
    assert times["noticed"] - times["frozen"] < 0.3 + 1.5 + 1.0
    (event,) = lost_events
    assert event["cause"].startswith("unverifiable"), event["cause"]
    # The release met the frozen server too: bounded by lock_check_timeout, not blocked.
    assert ended - times["noticed"] < 1.5 + 1.0, (started, times, ended)


@pytest.mark.parametrize("scope", ["session", "transaction"])
def test_a_release_into_a_frozen_server_is_bounded(private_postgres, namespace, scope):
    """AdvisoryLock.release() on a server that does not answer gives up after
    round_trip_timeout: the socket is shut down, the session closed, DatabaseError says
    why; the worker is not blocked (25-214 s before)."""
    from celery_pglock import DatabaseError, _deadline

    engine = db_module.create_engine(private_postgres.url())
    lock = AdvisoryLock(
        engine=engine, key=keys.make_key(namespace, "frozen"), scope=scope
    )
    assert lock.acquire()
    lock.round_trip_timeout = 0.5
    postmaster = private_postgres._postmaster_pid()
    assert postmaster
    _stop_server(postmaster, signal.SIGSTOP)
    try:
        started = time.monotonic()
        with pytest.raises(DatabaseError, match="no answer in time"):
            lock.release()
        took = time.monotonic() - started
    finally:
        _stop_server(postmaster, signal.SIGCONT)
    assert took < 0.5 + _deadline.TICK + 0.5, took
    assert not lock.owned()
    engine.dispose()


@pytest.mark.parametrize("scope", [LockScope.SESSION, LockScope.TRANSACTION])
def test_an_acquire_from_a_frozen_server_is_bounded(
    private_postgres, namespace, scope, session_mode
):
    """acquire() on a server that does not answer gives up after round_trip_timeout
    with DatabaseError (lock_on_error then re-queues the run): no hang, and on the
    process's shared lock session no mutex held for as long as TCP waits."""
    from celery_pglock import DatabaseError, _deadline, config

    engine = db_module.create_engine(
        private_postgres.url(),
        {
            config.SESSION_MODE_SETTING: session_mode,
            "pglock_engine_options": {"connect_args": {"connect_timeout": 2}},
        },
    )
    warm = AdvisoryLock(
        engine=engine, key=keys.make_key(namespace, "warm"), scope=scope
    )
    assert warm.acquire()  # the session (or pooled connection) exists and answers
    warm.release()
    lock = AdvisoryLock(
        engine=engine, key=keys.make_key(namespace, "frozen-acquire"), scope=scope
    )
    lock.round_trip_timeout = 0.5
    postmaster = private_postgres._postmaster_pid()
    assert postmaster
    _stop_server(postmaster, signal.SIGSTOP)
    try:
        started = time.monotonic()
        with pytest.raises(DatabaseError):
            lock.acquire()
        took = time.monotonic() - started
    finally:
        _stop_server(postmaster, signal.SIGCONT)
    # The bounded try, then one reconnect (a dead session is replaced once), bounded by
    # connect_timeout (2 s here).
    assert took < 0.5 + _deadline.TICK + 2 + 1.5, took
    assert not lock.owned()
    _session.close_for(engine)
    engine.dispose()


def _stop_server(postmaster: int, signum: int) -> None:
    """Send ``signum`` to the postmaster and all its backends."""
    out = subprocess.run(
        ["ps", "-o", "pid=", "--ppid", str(postmaster)],
        capture_output=True,
        text=True,
        check=False,
        timeout=10,
    ).stdout
    for pid in [postmaster, *(int(p) for p in out.split())]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)


# -- forks ---------------------------------------------------------------------------------

_FORK_SCRIPT = textwrap.dedent(
    """
    import gc, os, sys
    from celery_pglock import AdvisoryLock, db, keys
    engine = db.create_engine(sys.argv[1])
    idle = engine.raw_connection(); idle.close()  # an idle pooled session too
    lock = AdvisoryLock(engine=engine, key=keys.make_key(sys.argv[2], "fork"))
    assert lock.acquire()
    how = sys.argv[3]
    pid = os.fork()
    if pid == 0:
        if how == "release":  # what the task's frames do when the child unwinds them
            lock.release()
        elif how == "gc":  # the child drops the lock: the pool finalises its connection
            del lock
            gc.collect()
        elif how == "close":  # a library closing the connections it inherited
            lock._pooled.dbapi_connection.close()
        elif how == "dispose":  # SQLAlchemy's after-fork advice, then the pool is freed
            del lock
            engine.dispose(close=False)
            del engine
            gc.collect()
        if how == "os._exit":
            os._exit(0)
        sys.exit(0)  # interpreter shutdown
    os.waitpid(pid, 0)
    with engine.connect() as check:  # the parent's pool still works
        print(check.exec_driver_sql("SELECT pg_backend_pid()").scalar() > 0)
    print(lock.locked(), lock.owned())
    lock.release()
    print(lock.locked())
    """
)


@pytest.mark.parametrize(
    "how", ["sys.exit", "os._exit", "release", "gc", "close", "dispose"]
)
def test_a_forked_child_never_touches_the_parents_lock_session(
    database_url, namespace, how
):
    """Without _forks.py, "gc", "close" and "dispose" end the parent's session (psycopg2
    sends Terminate from the child) and "release" unlocks the parent's lock."""
    completed = subprocess.run(
        [sys.executable, "-c", _FORK_SCRIPT, database_url, namespace, how],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert completed.returncode == 0, completed.stderr
    assert completed.stdout.split() == ["True", "True", "True", "False"], (
        completed.stdout + completed.stderr
    )


def test_a_bounded_round_trip_is_cut_at_its_deadline(database_url):
    """_deadline.bounded shuts the socket down: a blocked statement returns at once."""
    from celery_pglock import _deadline

    connection = psycopg2.connect(_dsn(database_url))
    try:
        started = time.monotonic()
        cursor = connection.cursor()
        with (
            _deadline.bounded(connection, 0.5) as bound,
            pytest.raises(psycopg2.OperationalError),
        ):
            cursor.execute("SELECT pg_sleep(30)")
        assert time.monotonic() - started < 0.5 + _deadline.TICK + 0.5
        assert bound.fired
    finally:
        connection.close()


@pytest.mark.pgbouncer
def test_no_false_loss_through_pgbouncer_session_pooling(
    database_url,
    broker_url,
    result_backend_url,
    namespace,
    lost_events,
    pgbouncer_factory,
):
    """PgBouncer invents the backend pid libpq reports, and refuses the default keepalive
    startup options: the watcher connects without them, learns the real pid (the session
    showing the lock's application_name) and reports no loss; a real termination is
    still detected."""
    url = pgbouncer_factory("session").url()
    app = make_app(
        url,
        broker_url,
        result_backend_url,
        namespace,
        pglock_watch_interval=0.2,
    )

    @app.task(base=SingletonTask, shared=False)
    def body(terminate):
        lock = current_lock()
        time.sleep(1.0)  # several checks
        if not terminate:
            return lock.lost
        holder = _holder_pid(database_url, lock.key)
        assert holder != lock.backend_pid  # libpq's pid is PgBouncer's
        terminate_backend(database_url, holder)
        wait_for(lambda: lock.lost, 5, "the loss to be detected")
        return lock.lost

    assert body.apply(args=(False,)).get() is False
    assert lost_events == []
    result = body.apply(args=(True,))
    assert isinstance(result.result, LockLostError)
    assert len(lost_events) == 1


def _holder_pid(url: str, key) -> int:
    with psycopg2.connect(_dsn(url)) as connection, connection.cursor() as cursor:
        cursor.execute(
            "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted "
            "AND classid = %s::oid AND objid = %s::oid AND objsubid = %s::int2",
            key.pg_locks_ids,
        )
        (pid,) = cursor.fetchone()
    connection.close()
    return pid


def test_ensure_held_never_stops_a_shadowed_body(
    database_url, broker_url, result_backend_url, namespace
):
    """Shadow mode runs the body even when the lock is busy; ensure_held() agrees."""
    app = make_app(database_url, broker_url, result_backend_url, namespace)

    @app.task(base=SingletonTask, shared=False, lock_shadow=True)
    def shadowed():
        lock = current_lock()
        lock.ensure_held()
        return lock.owned()

    engine = db_module.create_engine(database_url)
    holder = AdvisoryLock(engine=engine, key=shadowed.lock_key_for())
    assert holder.acquire()
    try:
        assert shadowed.apply().get() is False  # ran, unlocked, without an error
    finally:
        holder.release()
        engine.dispose()
