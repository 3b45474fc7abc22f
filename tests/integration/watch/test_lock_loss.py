"""Lock loss, in-process, against a real PostgreSQL: the watcher, the outcome, the bounds.

Real workers (prefork, threads, forks inside a body) are in
tests/acceptance/test_lock_loss.py; these pin the mechanics down quickly. Tests that
restart or freeze the server use a private embedded PostgreSQL, never the shared one.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import threading
import time

import psycopg2
import pytest

from celery_pglock import (
    AdvisoryLock,
    ConfigurationError,
    LockLostError,
    LockSkipped,
    PgLockError,
    SingletonTask,
    current_lock,
    keys,
)
from celery_pglock.db import engines as db_module
from celery_pglock.lock import sessions
from celery_pglock.testing import lock_state
from celery_pglock.watch import loss_watcher
from tests.integration.loss_support import (
    dsn,
    holder_pid,
    make_app,
    terminate_backend,
    wait_for,
)


@pytest.fixture
def terminate_app(database_url, broker_url, result_backend_url, namespace):
    """An app whose lost locks end their bodies, checked every 0.2 s."""
    return make_app(
        database_url,
        broker_url,
        result_backend_url,
        namespace,
        pglock_watch_interval=0.2,
        pglock_on_lost="terminate",
    )


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
        pglock_on_lost="signal",  # the body goes on, to see what it sees
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

    with lock_state.watcher_checks() as checks:
        for _ in range(50):
            assert short.apply().get() == 1
        time.sleep(1.5)  # past the default interval: nothing was due
    assert checks() == 0


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
    database_url, terminate_app, lost_events
):
    """A threads-pool body: an asynchronous LockLostError at its next bytecode."""
    app = terminate_app
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


def test_terminate_policy_ends_a_sleeping_main_thread_body(database_url, terminate_app):
    """Prefork/solo bodies run in the main thread: a signal interrupts even a long sleep."""
    app = terminate_app

    @app.task(base=SingletonTask, shared=False)
    def body():
        terminate_backend(database_url, current_lock().backend_pid)
        time.sleep(20)
        return "slept"

    previous = signal.getsignal(loss_watcher.SIGNAL)
    started = time.monotonic()
    result = body.apply()
    assert time.monotonic() - started < 3
    assert isinstance(result.result, LockLostError)
    # Our handler chains whatever was there before; a stray signal now is harmless.
    assert signal.getsignal(loss_watcher.SIGNAL) is not previous or previous is not None


def test_settings_are_validated_at_bind(
    database_url, broker_url, result_backend_url, namespace
):
    app = make_app(
        database_url,
        broker_url,
        result_backend_url,
        namespace,
        pglock_watch_interval=50,
        pglock_db_timeout=8,
    )

    @app.task(base=SingletonTask, shared=False)
    def too_slow():
        pass

    with pytest.raises(
        ConfigurationError,
        match=r"lock_watch_interval.*pglock_watch_interval.*lock_db_timeout",
    ):
        too_slow.lock_config  # noqa: B018 - binds the task

    for number, bad in enumerate(
        (
            {"lock_on_lost": "kill"},
            {"lock_watch_interval": -1},
            {"lock_db_timeout": 0},
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


_FORK_SCRIPT = textwrap.dedent(
    """
    import gc, os, sys
    from celery_pglock import AdvisoryLock, LockNotOwnedError, keys
    from celery_pglock.db import engines
    from celery_pglock.lock import sessions
    from celery_pglock.testing import lock_state, strategies
    database_url, namespace, mode, how = sys.argv[1:5]
    strategies.use_per_lock_sessions(mode == "per_lock")
    engine = engines.create_engine(database_url)
    idle = engine.raw_connection(); idle.close()  # an idle pooled session too
    lock = AdvisoryLock(engine=engine, key=keys.make_key(namespace, "fork"))
    assert lock.acquire()
    backend = lock.backend_pid
    pid = os.fork()
    if pid == 0:
        if how == "release":  # what the task's frames do when the child unwinds them
            try:
                lock.release()
            except LockNotOwnedError as refused:  # the parent's lock: refused, untouched
                assert "belongs to process" in str(refused), refused
            else:
                raise AssertionError("the child released its parent's lock")
        elif how == "gc":  # the child drops the lock: the pool finalises its connection
            del lock
            gc.collect()
        elif how == "close":  # a library closing the connections it inherited
            lock_state.holding_connection(lock).close()  # psycopg2: PQfinish sends Terminate
            assert lock_state.holding_connection(lock).closed
        elif how == "dispose":  # SQLAlchemy's after-fork advice, then the pool is freed
            del lock
            engine.dispose(close=False)
            del engine
            gc.collect()
        if how == "os._exit":
            os._exit(0)
        sys.exit(0)  # interpreter shutdown; an error above exits 1
    _, status = os.waitpid(pid, 0)
    print(os.waitstatus_to_exitcode(status))  # 0: the child did what it names
    with engine.connect() as check:  # the parent's pool still works
        print(check.exec_driver_sql("SELECT pg_backend_pid()").scalar() > 0)
    with engine.connect() as check:  # the lock is still on the parent's very session
        print(check.exec_driver_sql(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted"
            " AND pid = %s", (backend,)).scalar())
    print(lock.locked(), lock.owned())
    lock.release()
    print(lock.locked())
    """
)


@pytest.mark.parametrize(
    "how", ["sys.exit", "os._exit", "release", "gc", "close", "dispose"]
)
def test_a_forked_child_never_touches_the_parents_lock_session(
    database_url, namespace, session_mode, how
):
    """Both session modes. Without _forks.py's os.dup2, "close" ends the parent's session
    (psycopg2's PQfinish sends Terminate from the child): the parent's lock is gone and
    its release fails. (The other cases still passed without it: "release" is refused by
    the pid check, and the pool's after-fork handling in engines.py keeps "gc" and "dispose"
    off the parent's socket.) The child must exit 0: a child that died of an error never
    did what its case names."""
    completed = subprocess.run(
        [
            sys.executable,
            "-c",
            _FORK_SCRIPT,
            database_url,
            namespace,
            session_mode,
            how,
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert completed.returncode == 0, completed.stderr
    assert completed.stdout.split() == ["0", "True", "1", "True", "True", "False"], (
        completed.stdout + completed.stderr
    )


@pytest.mark.pgbouncer
@pytest.mark.parametrize("scope", ["session", "transaction"])
def test_no_false_loss_through_pgbouncer_session_pooling(
    database_url,
    broker_url,
    result_backend_url,
    namespace,
    lost_events,
    pgbouncer_factory,
    scope,
):
    """PgBouncer invents the backend pid libpq reports, and refuses the default keepalive
    startup options: the watcher checks (on the process's lock session in session scope,
    on its own session, connected without the refused options, in transaction scope),
    learns the real pid (the session showing the lock's application_name) and reports no
    loss; a real termination is still detected."""
    url = pgbouncer_factory("session").url()
    app = make_app(
        url,
        broker_url,
        result_backend_url,
        namespace,
        pglock_watch_interval=0.2,
    )

    @app.task(base=SingletonTask, shared=False, lock_scope=scope)
    def body(terminate):
        lock = current_lock()
        time.sleep(1.0)  # several checks
        if not terminate:
            return lock.lost
        holder = holder_pid(database_url, lock.key)
        assert holder != lock.backend_pid  # libpq's pid is PgBouncer's
        terminate_backend(database_url, holder)
        wait_for(lambda: lock.lost, 5, "the loss to be detected")
        return lock.lost

    assert body.apply(args=(False,)).get() is False
    assert lost_events == []
    result = body.apply(args=(True,))
    assert isinstance(result.result, LockLostError)
    assert len(lost_events) == 1


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


def test_a_lost_key_is_refused_to_every_run_of_its_process_until_its_body_ends(
    database_url, broker_url, result_backend_url, namespace, session_mode
):
    """Issue 16: A's session is terminated while its body goes on (lock_on_lost
    'signal'). The duplicate C1 is refused in the process and its holder lookup finds
    the process session dead and closes it (per_process mode); C2, after that, must be
    refused too, not run beside A on a fresh session (or on a connection of its own,
    per_lock). A's loss is still reported, and once A's body has ended the key runs."""
    app = make_app(
        database_url,
        broker_url,
        result_backend_url,
        namespace,
        pglock_watch_interval=1.0,
        pglock_on_lost="signal",
    )
    terminated = threading.Event()
    ran = []

    @app.task(base=SingletonTask, shared=False)
    def body(who, seconds):
        ran.append(who)
        if who == "A":
            terminate_backend(database_url, current_lock().backend_pid)
            terminated.set()
        time.sleep(seconds)
        return who

    outcomes = {}

    def run(who, seconds):
        outcomes[who] = body.apply(args=(who, seconds))

    first = threading.Thread(target=run, args=("A", 3.0))
    first.start()
    assert terminated.wait(10)
    run("C1", 0.0)
    run("C2", 0.0)
    first.join(15)
    assert ran == ["A"]
    assert isinstance(outcomes["C1"].result, LockSkipped)
    assert isinstance(outcomes["C2"].result, LockSkipped)
    assert "FAILURE" == outcomes["A"].state
    assert isinstance(outcomes["A"].result, LockLostError)
    run("D", 0.0)
    assert "D" == outcomes["D"].get()


@pytest.mark.parametrize(
    ("scope", "timeout"),
    [("session", None), ("session", 0.3), ("transaction", None)],
    ids=["try", "bounded-wait", "transaction"],
)
def test_a_lost_key_stays_claimed_in_its_process_until_its_release(
    lock_engine, database_url, namespace, session_mode, scope, timeout
):
    """The lock layer under the test above: the key of a hold whose session was
    terminated is refused to every other lock of the process (without a round trip),
    across the process session being closed, replaced and lost again, until that hold is
    released; another process may take it (PostgreSQL freed it). A bounded wait in the
    process waits for the release, not for PostgreSQL."""
    key = keys.make_key(namespace, "it.lost")
    first = AdvisoryLock(engine=lock_engine, key=key, scope=scope)
    assert first.acquire(timeout=timeout)
    terminate_backend(database_url, first.backend_pid)
    wait_for(lambda: not _granted_elsewhere(database_url, key), 5, "the lock freed")
    for _ in range(3):
        duplicate = AdvisoryLock(engine=lock_engine, key=key, scope=scope)
        assert not duplicate.acquire(timeout=timeout)
        # Another key: in per_process mode, finds the session dead and reconnects once.
        other = AdvisoryLock(engine=lock_engine, key=keys.make_key(namespace, "other"))
        assert other.acquire()
        terminate_backend(database_url, other.backend_pid)  # lost again
        with pytest.raises(PgLockError):
            other.release()
        sessions.close_for(lock_engine)  # and closed
    assert not _granted_elsewhere(database_url, key)  # free for other processes
    waiter: dict = {}
    after = AdvisoryLock(engine=lock_engine, key=key)
    if timeout is not None:
        waiting = threading.Thread(
            target=lambda: waiter.update(
                granted=after.acquire(timeout=10), at=time.monotonic()
            )
        )
        waiting.start()
        time.sleep(0.3)
    with pytest.raises(PgLockError):
        first.release()
    released_at = time.monotonic()
    if timeout is not None:
        waiting.join(10)
        assert waiter["granted"] is True
        assert waiter["at"] - released_at < 0.5  # woken by the release
    else:
        assert after.acquire()
    after.release()


def _granted_elsewhere(url: str, key) -> bool:
    """Can another process take ``key`` now (and give it back)?"""
    args = ", ".join(["%s"] * len(key.ids))
    with psycopg2.connect(dsn(url)) as connection, connection.cursor() as cursor:
        cursor.execute(f"SELECT pg_try_advisory_lock({args})", key.ids)
        (free,) = cursor.fetchone()
        if free:
            cursor.execute(f"SELECT pg_advisory_unlock({args})", key.ids)
    connection.close()
    return not free


@pytest.mark.parametrize("in_main", [True, False], ids=["main-thread", "pool-thread"])
def test_a_terminate_landing_as_the_body_returns_still_releases_the_lock(
    terminate_app, monkeypatch, in_main
):
    """lock_on_lost='terminate': the watcher decides to interrupt while the body, just
    returned, waits for it in unwatch(). The interrupt lands there: the run still ends
    FAILURE with LockLostError, its lock is released, and the watcher keeps working
    (a pool thread's interrupt used to land inside the lock it had just taken)."""
    app = terminate_app
    deciding = threading.Event()

    def unverifiable(self, entries, deadline, session=None):
        return {id(entry): "unverifiable: simulated" for entry in entries}

    interrupt = loss_watcher._interrupt

    def late_interrupt(entry):
        deciding.set()
        time.sleep(0.3)  # the body returns meanwhile, and waits in unwatch()
        interrupt(entry)

    monkeypatch.setattr(loss_watcher.Observer, "check", unverifiable)
    monkeypatch.setattr(loss_watcher, "_interrupt", late_interrupt)

    @app.task(base=SingletonTask, shared=False)
    def body(name):
        deciding.wait(5)
        return name

    def call(name, outcome):
        try:
            outcome["value"] = body(name)  # a direct call: no task_postrun net
        except BaseException as exc:
            outcome["error"] = exc

    outcome: dict = {}
    if in_main:
        call("first", outcome)
    else:
        thread = threading.Thread(target=call, args=("first", outcome))
        thread.start()
        thread.join(10)
    assert isinstance(outcome.get("error"), LockLostError), outcome
    probe = AdvisoryLock(engine=db_module.engine_for(app.conf), key=body.lock_key_for())
    assert not probe.locked()
    assert not loss_watcher._mutex.locked()
    monkeypatch.undo()
    later: dict = {}
    thread = threading.Thread(target=call, args=("later", later), daemon=True)
    thread.start()
    thread.join(5)
    assert {"value": "later"} == later


def test_a_busy_lock_session_is_no_news_about_its_locks(
    database_url, broker_url, result_backend_url, namespace, lost_events
):
    """Other statements keep the process's lock session (here: its mutex, as a slow lock
    statement would) past the watcher's deadline: the check runs elsewhere with a budget
    of its own, and the held lock is not reported lost (nor its body ended)."""
    app = make_app(
        database_url,
        broker_url,
        result_backend_url,
        namespace,
        pglock_watch_interval=0.2,
        pglock_db_timeout=1,
    )
    seen = {}

    @app.task(base=SingletonTask, shared=False)
    def body():
        session = sessions.process_session(db_module.engine_for(app.conf))
        with session._mutex:  # busy for three check timeouts
            time.sleep(3)
        time.sleep(0.6)  # and checked again on the session itself
        seen["lost"] = current_lock().lost
        return "finished"

    assert "finished" == body.apply().get()
    assert {"lost": False} == seen
    assert [] == lost_events
