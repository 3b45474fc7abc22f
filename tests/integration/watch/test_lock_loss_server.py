"""Lock loss when the lock server fails, in-process, on a private PostgreSQL.

A restart and a frozen server are detected in bounded time (a server idle-session timeout
no longer ends a lock session), and
no acquire or release waits on a frozen server for longer than its bound.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time

import psycopg2
import pytest

from celery_pglock import (
    AdvisoryLock,
    LockLostError,
    LockScope,
    SingletonTask,
    current_lock,
    keys,
)
from celery_pglock.db import engines as db_module
from celery_pglock.lock import sessions
from tests.integration.loss_support import dsn, make_app, wait_for


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
        pglock_on_lost="signal",  # the body goes on until it sees the loss
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


def test_server_idle_session_timeout_does_not_end_the_holder(
    private_postgres, broker_url, result_backend_url, namespace, lost_events
):
    """idle_session_timeout set server-wide no longer ends a session-scope holder that
    sits idle while its body runs (it used to: the lock was lost after 1 s). Lock
    sessions set it to 0 at connect; tests/integration/db/test_server_settings.py has the
    role-level settings and the overlap checks."""
    url = private_postgres.url()
    connection = psycopg2.connect(dsn(url))
    connection.autocommit = True
    with connection.cursor() as cursor:
        cursor.execute("ALTER SYSTEM SET idle_session_timeout = '1s'")
        cursor.execute("SELECT pg_reload_conf()")
    connection.close()
    app = make_app(
        url,
        broker_url,
        result_backend_url,
        namespace,
        pglock_watch_interval=0.3,
        pglock_on_lost="signal",  # the body goes on until it sees the loss
    )

    @app.task(base=SingletonTask, shared=False)
    def body():
        time.sleep(2.5)
        return "finished"

    result = body.apply()
    assert "finished" == result.get()
    assert [] == lost_events


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
        pglock_db_timeout=1.5,
        pglock_on_lost="signal",  # the body goes on, to time the detection
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
    # The release met the frozen server too: bounded by lock_db_timeout, not blocked.
    assert ended - times["noticed"] < 1.5 + 1.0, (started, times, ended)


def test_a_stopped_server_is_reported_unreachable_within_the_documented_bound(
    private_postgres, broker_url, result_backend_url, namespace, lost_events
):
    """PostgreSQL stopped under a running body: each reconnect is refused at once, and the
    watcher keeps trying for lock_db_timeout (a restart would answer), so the loss is
    reported within lock_watch_interval * 1.25 + lock_db_timeout of the stop
    (docs/operations/lock-loss.md), with a cause that says the server could not be
    reached, not that it was slow to answer."""
    interval, timeout = 0.4, 1.5
    app = make_app(
        private_postgres.url(),
        broker_url,
        result_backend_url,
        namespace,
        pglock_watch_interval=interval,
        pglock_db_timeout=timeout,
        pglock_on_lost="signal",  # the body goes on, to time the detection
    )
    times = {}

    @app.task(base=SingletonTask, shared=False)
    def body():
        lock = current_lock()
        time.sleep(0.8)  # one successful check first
        private_postgres.stop("fast")
        times["stopped"] = time.monotonic()
        wait_for(lambda: lock.lost, 10, "the stopped server to be noticed")
        times["noticed"] = time.monotonic()
        return "finished"

    result = body.apply()
    assert isinstance(result.result, LockLostError)
    assert times["noticed"] - times["stopped"] < interval * 1.25 + timeout + 0.5
    (event,) = lost_events
    cause = event["cause"]
    assert cause.startswith("unverifiable: the lock database could not be reached: ")
    assert f"attempt(s) within lock_db_timeout {timeout:g}s failed" in cause, cause
    assert "did not answer" not in cause


@pytest.mark.parametrize("scope", ["session", "transaction"])
def test_a_release_into_a_frozen_server_is_bounded(private_postgres, namespace, scope):
    """AdvisoryLock.release() on a server that does not answer gives up after
    round_trip_timeout: the socket is shut down, the session closed, DatabaseError says
    why; the worker is not blocked (25-214 s before)."""
    from celery_pglock import DatabaseError
    from celery_pglock.db import deadlines

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
    assert took < 0.5 + deadlines.TICK + 0.5, took
    assert not lock.owned()
    engine.dispose()


@pytest.mark.parametrize("scope", [LockScope.SESSION, LockScope.TRANSACTION])
def test_an_acquire_from_a_frozen_server_is_bounded(
    private_postgres, namespace, scope, session_mode
):
    """acquire() on a server that does not answer gives up after round_trip_timeout
    with DatabaseError (autoretry_for may then re-queue the run): no hang, and on the
    process's shared lock session no mutex held for as long as TCP waits."""
    from celery_pglock import DatabaseError
    from celery_pglock.db import deadlines

    engine = db_module.create_engine(
        private_postgres.url(),
        {
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
    assert took < 0.5 + deadlines.TICK + 2 + 1.5, took
    assert not lock.owned()
    sessions.close_for(engine)
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


def test_a_bounded_round_trip_is_cut_at_its_deadline(database_url):
    """deadlines.bounded shuts the socket down: a blocked statement returns at once."""
    from celery_pglock.db import deadlines

    connection = psycopg2.connect(dsn(database_url))
    try:
        started = time.monotonic()
        cursor = connection.cursor()
        with (
            pytest.raises(psycopg2.OperationalError),
            deadlines.bounded(connection, 0.5) as bound,
        ):
            cursor.execute("SELECT pg_sleep(30)")
        assert time.monotonic() - started < 0.5 + deadlines.TICK + 0.5
        assert bound.fired
    finally:
        connection.close()


def test_a_stall_after_the_answer_leaves_the_session_alone(database_url):
    """The answer came, then this thread was descheduled past the bound: nothing waits
    on the socket any more, so the reaper leaves it (and the session) alone."""
    from celery_pglock.db import deadlines

    connection = psycopg2.connect(dsn(database_url))
    try:
        cursor = connection.cursor()
        with deadlines.bounded(connection, 0.2) as bound:
            cursor.execute("SELECT 1")
            assert (1,) == cursor.fetchone()
            time.sleep(0.2 + deadlines.TICK + 0.3)  # the stall after the answer
        assert not bound.fired
        cursor.execute("SELECT 2")
        assert (2,) == cursor.fetchone()
    finally:
        connection.close()


def test_a_bound_that_fired_as_the_answer_came_still_fails_the_round_trip(
    database_url, monkeypatch
):
    """The reaper saw the statement under way and shut the socket down as the answer
    arrived (a race, made certain here): the server is ending the session, so the round
    trip must fail like a dead session, not report success."""
    from celery_pglock.db import deadlines

    monkeypatch.setattr(deadlines, "_in_statement", lambda connection: True)
    connection = psycopg2.connect(dsn(database_url))
    try:
        cursor = connection.cursor()
        bounds = []

        def answer_then_stall():
            with deadlines.bounded(connection, 0.2) as bound:
                bounds.append(bound)
                cursor.execute("SELECT 1")
                assert (1,) == cursor.fetchone()
                time.sleep(0.2 + deadlines.TICK + 0.3)  # the stall after the answer

        with pytest.raises(psycopg2.OperationalError, match="no answer in time"):
            answer_then_stall()
        assert bounds[0].fired
        with pytest.raises(psycopg2.Error):
            cursor.execute("SELECT 1")
    finally:
        connection.close()


@pytest.mark.parametrize("session_mode", ["per_process"], indirect=True)
def test_an_acquire_whose_bound_fired_after_the_grant_is_not_a_held_lock(
    lock_engine, database_url, namespace, monkeypatch
):
    """The same race after a granted try-lock: acquire() must not return True for a lock
    whose session the reaper has just cut (PostgreSQL frees it). The session is
    replaced once, as for any dead session, and the lock is really held after."""
    from celery_pglock.db import deadlines
    from celery_pglock.lock import sessions

    monkeypatch.setattr(deadlines, "_in_statement", lambda connection: True)

    try_once = sessions.ProcessSession._try
    stalls = []

    def stalled_try(self, *args, **kwargs):
        answer = try_once(self, *args, **kwargs)
        if not stalls:
            stalls.append(self._connection.info.backend_pid)
            time.sleep(0.2 + deadlines.TICK + 0.3)  # the stall after the answer
        return answer

    monkeypatch.setattr(sessions.ProcessSession, "_try", stalled_try)
    lock = AdvisoryLock(engine=lock_engine, key=keys.make_key(namespace, "stall"))
    lock.round_trip_timeout = 0.2
    assert lock.acquire()
    try:
        assert stalls
        assert stalls[0] != lock.backend_pid  # the cut session was replaced
        with contextlib.closing(psycopg2.connect(dsn(database_url))) as probe:
            probe.autocommit = True
            with probe.cursor() as cursor:
                cursor.execute("SELECT pg_try_advisory_lock(%s)", lock.key.ids)
                assert cursor.fetchone()[0] is False  # really held
    finally:
        lock.release()
