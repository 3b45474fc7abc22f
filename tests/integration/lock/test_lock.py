"""AdvisoryLock against a real PostgreSQL: scopes, waits, bookkeeping, safety nets."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import sqlalchemy as sa

from celery_pglock import (
    AdvisoryLock,
    DatabaseError,
    LockBusy,
    LockLostError,
    LockNotOwnedError,
    LockScope,
    keys,
)
from celery_pglock.db import engines as db_module
from celery_pglock.lock import sessions
from celery_pglock.testing import lock_state

from ...unit.test_keys import VECTORS


@pytest.fixture
def single_engine(database_url, session_mode):
    """A lock engine whose pool holds exactly one connection, to inspect it after use."""
    engine = db_module.create_engine(
        database_url,
        {
            "pglock_engine_options": {"pool_size": 1, "max_overflow": 0},
        },
    )
    yield engine
    sessions.close_for(engine)
    engine.dispose()


def make_key(namespace, material=None):
    return keys.make_key(namespace, "it.lock", material)


def pg_locks_rows(engine, key):
    classid, objid, objsubid = key.pg_locks_ids
    with engine.connect() as connection:
        return connection.execute(
            sa.text(
                "SELECT a.application_name, l.granted FROM pg_locks l JOIN pg_stat_activity a USING (pid) "
                "WHERE l.locktype = 'advisory' AND l.classid = :c AND l.objid = :o AND l.objsubid = :s"
            ),
            {"c": classid, "o": objid, "s": objsubid},
        ).all()


def test_session_lock_excludes_a_second_holder_until_released(lock_engine, namespace):
    """Try-lock semantics: the second holder gets False, then True after release."""
    key = make_key(namespace)
    first, second = (
        AdvisoryLock(engine=lock_engine, key=key),
        AdvisoryLock(engine=lock_engine, key=key),
    )
    assert first.acquire()
    assert first.owned()
    assert not second.acquire()
    assert not second.owned()
    assert first.locked()
    first.release()
    assert not first.locked()
    assert second.acquire()
    second.release()


def test_a_try_refused_by_postgresql_leaves_the_key_free_in_the_process(
    lock_engine, database_url, namespace
):
    """A key held by another process's session is refused by PostgreSQL; the refusal
    keeps no claim in this process, so once that session lets go the key is granted."""
    key = make_key(namespace, "refused")
    other = db_module.create_engine(database_url)
    try:
        with other.connect() as holder:
            holder.exec_driver_sql("SELECT pg_advisory_lock(%s)", key.ids)
            assert not AdvisoryLock(engine=lock_engine, key=key).acquire()
            assert not lock_state.claimed(lock_engine, key.ids)
            holder.exec_driver_sql("SELECT pg_advisory_unlock(%s)", key.ids)
        again = AdvisoryLock(engine=lock_engine, key=key)
        assert again.acquire()
        again.release()
    finally:
        other.dispose()


def test_holder_is_visible_in_pg_locks_with_application_name(
    lock_engine, namespace, session_mode
):
    """The incident query of docs/design.md's article shows who holds the key: application_name names the
    host:pid and the label (a per-lock connection also shows the key; the process's
    shared session is not relabelled per key, pg_locks has the key)."""
    key = make_key(namespace)
    with AdvisoryLock(engine=lock_engine, key=key, label="billing.daily_settlement"):
        rows = pg_locks_rows(lock_engine, key)
        assert 1 == len(rows)
        name, granted = rows[0]
        assert granted
        assert name.startswith("pglock ")
        assert f":{os.getpid()} " in name
        if session_mode == "per_lock":
            assert str(key) in name
        assert name.endswith("billing.daily_settlement")
    assert [] == pg_locks_rows(lock_engine, key)


def test_idle_connection_is_relabelled_after_release(
    single_engine, namespace, session_mode
):
    """After release the lock's session no longer claims to hold anything: a pooled
    connection says idle; the process's session holds no advisory lock (it keeps the
    task's name: relabelling at every release would double the server's CPU per task)."""
    with AdvisoryLock(engine=single_engine, key=make_key(namespace)) as lock:
        dbapi = lock_state.holding_connection(
            lock
        )  # pooled (per_lock) or the process's session
    with dbapi.cursor() as cursor:
        cursor.execute(
            "SELECT current_setting('application_name'), (SELECT count(*) FROM pg_locks "
            "WHERE locktype = 'advisory' AND pid = pg_backend_pid())"
        )
        name, held = cursor.fetchone()
    assert 0 == held
    if session_mode == "per_lock":
        assert name.endswith(" idle")
    else:
        assert name.endswith(" it.lock")


def test_two_int_key_uses_the_two_int_key_space(lock_engine, namespace):
    """(42, 1001) shows as classid 42, objid 1001, objsubid 2, separate from bigint keys."""
    key = keys.explicit_key("it.pair", (42, 1001))
    assert (42, 1001, 2) == key.pg_locks_ids
    bigint_twin = keys.LockKey(name="it.pair", ids=((42 << 32) | 1001,))
    with AdvisoryLock(engine=lock_engine, key=key):
        assert 1 == len(pg_locks_rows(lock_engine, key))
        with AdvisoryLock(engine=lock_engine, key=bigint_twin):  # disjoint key spaces
            assert 1 == len(pg_locks_rows(lock_engine, bigint_twin))


def test_bounded_wait_times_out_server_side_without_leaking_lock_timeout(
    single_engine, lock_engine, namespace
):
    """acquire(timeout) waits about that long, returns False, and leaves lock_timeout as it was."""
    key = make_key(namespace)
    with AdvisoryLock(engine=lock_engine, key=key):
        waiter = AdvisoryLock(engine=single_engine, key=key)
        started = time.monotonic()
        assert not waiter.acquire(timeout=0.3)
        assert time.monotonic() - started >= 0.29
        assert waiter.wait_seconds >= 0.29
    with single_engine.connect() as connection:  # the very connection that waited
        assert "0" == connection.exec_driver_sql("SHOW lock_timeout").scalar()
        assert (
            not connection.in_transaction()
            or connection.exec_driver_sql("SELECT 1").scalar() == 1
        )


def test_a_cancelled_wait_closes_its_connection(
    single_engine, lock_engine, database_url, namespace
):
    """A cancel may land after the session lock was granted, and a session lock outlives
    the aborted statement: the waiting connection is closed, never pooled with a lock."""
    key = make_key(namespace)
    classid, objid, _ = key.pg_locks_ids
    admin = sa.create_engine(database_url, isolation_level="AUTOCOMMIT")
    cancelled = threading.Event()
    waiting: list[int] = []  # the waiting backend (a busy key's wait pins its own)

    def cancel_the_wait() -> None:
        deadline = time.monotonic() + 5
        with admin.connect() as connection:
            while not cancelled.is_set() and time.monotonic() < deadline:
                pids = connection.exec_driver_sql(
                    "SELECT pid FROM pg_locks WHERE locktype = 'advisory' "
                    "AND NOT granted AND classid = %s AND objid = %s",
                    (classid, objid),
                ).scalars()
                for pid in pids:
                    waiting.append(pid)
                    connection.exec_driver_sql("SELECT pg_cancel_backend(%s)", (pid,))
                    cancelled.set()
                time.sleep(0.02)

    canceller = threading.Thread(target=cancel_the_wait)
    try:
        with AdvisoryLock(engine=lock_engine, key=key):
            canceller.start()
            waiter = AdvisoryLock(engine=single_engine, key=key)
            assert not waiter.acquire(timeout=5)
            canceller.join()
        assert cancelled.is_set()
        with single_engine.connect() as connection:  # the pool's only connection
            pid = connection.exec_driver_sql("SELECT pg_backend_pid()").scalar()
        assert waiting
        assert pid not in waiting
    finally:
        cancelled.set()
        admin.dispose()


def test_an_interrupted_autocommit_connection_is_closed_not_pooled(single_engine):
    """Holder lookups, run checks and fencing share one pooled autocommit helper: a
    statement interrupted there (a soft time limit) leaves the session in an unknown
    state, so its connection is closed instead of going back to the pool."""

    class Interrupt(BaseException):
        pass

    with single_engine.connect() as connection:
        first_pid = connection.exec_driver_sql("SELECT pg_backend_pid()").scalar()
    with pytest.raises(Interrupt), db_module.autocommit(single_engine):
        raise Interrupt
    with single_engine.connect() as connection:  # the pool's only connection
        assert (
            first_pid != connection.exec_driver_sql("SELECT pg_backend_pid()").scalar()
        )


def test_bounded_wait_gets_the_lock_when_the_holder_releases(lock_engine, namespace):
    """A waiter is granted the lock as soon as the holder lets go."""
    key = make_key(namespace)
    holder = AdvisoryLock(engine=lock_engine, key=key)
    assert holder.acquire()
    releaser = threading.Timer(0.2, holder.release)
    releaser.start()
    waiter = AdvisoryLock(engine=lock_engine, key=key)
    try:
        assert waiter.acquire(timeout=5)
        assert 0.15 <= waiter.wait_seconds < 5
    finally:
        releaser.join()
        if waiter.owned():
            waiter.release()


def test_a_bounded_wait_is_tried_first_on_the_process_session(database_url, namespace):
    """per_process: a wait whose key is free is granted by the process session's
    try-lock, pinning no pooled connection; only a busy key's wait pins one, which holds
    the lock once the holder lets go."""
    engine = db_module.create_engine(database_url)
    try:
        free = AdvisoryLock(engine=engine, key=make_key(namespace, "free"))
        assert free.acquire(timeout=5)
        assert [free.key.ids] == lock_state.process_held_keys(engine)
        assert 0 == engine.pool.checkedout()
        busy_key = make_key(namespace, "busy")
        holder = AdvisoryLock(engine=engine, key=busy_key)
        assert holder.acquire()
        waiter = AdvisoryLock(engine=engine, key=busy_key)
        releaser = threading.Timer(0.2, holder.release)
        releaser.start()
        try:
            assert waiter.acquire(timeout=5)
            assert 1 == engine.pool.checkedout()  # the wait's own connection
            assert busy_key.ids not in lock_state.process_held_keys(engine)
        finally:
            releaser.join()
            waiter.release()
        free.release()
        assert 0 == engine.pool.checkedout()
    finally:
        sessions.close_for(engine)
        engine.dispose()


def test_release_without_holding_raises(lock_engine, namespace):
    """release() of a lock this object does not hold names the lock."""
    lock = AdvisoryLock(engine=lock_engine, key=make_key(namespace))
    with pytest.raises(LockNotOwnedError, match=r"it\.lock"):
        lock.release()


def test_unlock_that_returns_false_closes_the_connection(
    lock_engine, namespace, session_mode
):
    """If PostgreSQL says the key was not held: a pinned connection is closed, not
    pooled; the process's shared session is kept (closing it would free every other
    task's lock), and the release is reported either way."""
    lock = AdvisoryLock(engine=lock_engine, key=make_key(namespace))
    other = AdvisoryLock(engine=lock_engine, key=make_key(namespace, {"k": 2}))
    assert lock.acquire()
    assert other.acquire()
    dbapi = lock_state.holding_connection(lock)
    with dbapi.cursor() as cursor:  # someone unlocked behind our back
        cursor.execute("SELECT pg_advisory_unlock(%s)", lock.key.ids)
    with pytest.raises(LockNotOwnedError, match="no longer held"):
        lock.release()
    if session_mode == "per_lock":
        assert dbapi.closed
    else:
        assert not dbapi.closed
        assert other.locked()  # the other task's lock survived on the shared session
    other.release()
    with lock_engine.connect() as connection:  # the pool reconnects transparently
        assert 1 == connection.exec_driver_sql("SELECT 1").scalar()
    assert lock.acquire()
    lock.release()


def test_checkin_safety_net_unlocks_a_forgotten_lock(lock_engine, namespace):
    """A connection returned to the pool while holding a lock is unlocked on check-in."""
    lock = AdvisoryLock(
        engine=lock_engine, key=make_key(namespace), scope=LockScope.SESSION
    )
    hold = lock.acquire() and lock._hold
    if hold.pooled is not None:  # per_lock: a buggy path returns the connection
        hold.pooled.close()
    else:  # per_process: the session is closed (shutdown) with the lock still held
        sessions.process_session(lock_engine).close()
    lock._hold = None
    assert not lock.locked()


def test_closing_the_process_session_reports_its_holds_lost(database_url, namespace):
    """per_process: a hold whose session ended is lost, and its release says so."""
    engine = db_module.create_engine(database_url)
    try:
        lock = AdvisoryLock(engine=engine, key=make_key(namespace))
        assert lock.acquire()
        session = sessions.process_session(engine)
        assert [lock.key.ids] == lock_state.process_held_keys(engine)
        session.lose("terminated by a test")
        assert not lock.locked()
        with pytest.raises(LockNotOwnedError, match="terminated by a test"):
            lock.release()
        assert lock.acquire()  # the next acquire opens a new session
        lock.release()
    finally:
        sessions.close_for(engine)
        engine.dispose()


def test_transaction_scope_commits_work_with_the_lock(lock_engine, namespace):
    """Transaction scope: the lock's transaction carries the work; commit releases both."""
    table = f"t_{namespace.replace('-', '_')}"
    with lock_engine.begin() as connection:
        connection.exec_driver_sql(f"CREATE TABLE {table} (v int)")
    try:
        key = make_key(namespace)
        with AdvisoryLock(
            engine=lock_engine, key=key, scope=LockScope.TRANSACTION
        ) as lock:
            lock.connection.exec_driver_sql(f"INSERT INTO {table} VALUES (1)")
            assert not AdvisoryLock(
                engine=lock_engine, key=key
            ).acquire()  # excludes session holders too
        rolled_back = AdvisoryLock(engine=lock_engine, key=key, scope="transaction")
        try:
            with rolled_back as lock:
                lock.connection.exec_driver_sql(f"INSERT INTO {table} VALUES (2)")
                raise RuntimeError("roll back")
        except RuntimeError:
            pass
        assert not rolled_back.owned()
        with lock_engine.connect() as connection:
            assert [1] == connection.exec_driver_sql(
                f"SELECT v FROM {table}"
            ).scalars().all()
        assert not AdvisoryLock(engine=lock_engine, key=key).locked()
    finally:
        with lock_engine.begin() as connection:
            connection.exec_driver_sql(f"DROP TABLE {table}")


def test_transaction_scope_detects_a_commit_by_the_body(lock_engine, namespace):
    """Committing the lock's transaction ends the lock early; release() says so."""
    lock = AdvisoryLock(
        engine=lock_engine, key=make_key(namespace), scope=LockScope.TRANSACTION
    )
    assert lock.acquire()
    lock.connection.commit()
    with pytest.raises(LockLostError, match="ended early"):
        lock.release()
    assert not lock.owned()


def test_transaction_scope_wait_restores_lock_timeout_inside_the_transaction(
    lock_engine, namespace
):
    """The bounded wait's lock_timeout does not apply to the body's own statements."""
    lock = AdvisoryLock(
        engine=lock_engine, key=make_key(namespace), scope=LockScope.TRANSACTION
    )
    assert lock.acquire(timeout=2)
    try:
        assert "0" == lock.connection.exec_driver_sql("SHOW lock_timeout").scalar()
    finally:
        lock.release()


def test_session_lock_and_connection_are_not_shared(lock_engine, namespace):
    """Session scope does not lend its pinned connection to application code."""
    with (
        AdvisoryLock(engine=lock_engine, key=make_key(namespace)) as lock,
        pytest.raises(Exception, match="session scope"),
    ):
        _ = lock.connection


def test_context_manager_raises_lock_busy(lock_engine, namespace):
    """`with lock:` raises LockBusy with key and name when the lock is held."""
    key = make_key(namespace)
    second = AdvisoryLock(engine=lock_engine, key=key)
    with AdvisoryLock(engine=lock_engine, key=key), pytest.raises(LockBusy) as caught:
        second.__enter__()
    assert str(key) == caught.value.key
    assert "it.lock" == caught.value.name


def test_killed_holder_process_frees_the_lock(database_url, lock_engine, namespace):
    """SIGKILL of the holder: PostgreSQL frees the lock when the session dies; no TTL."""
    key = make_key(namespace)
    script = textwrap.dedent(
        f"""
        import sys, time
        from celery_pglock import AdvisoryLock, keys
        from celery_pglock.db import engines
        engine = engines.create_engine({database_url!r})
        lock = AdvisoryLock(engine=engine, key=keys.make_key({namespace!r}, "it.lock"))
        assert lock.acquire()
        print("held", flush=True)
        time.sleep(60)
        """
    )
    holder = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, text=True
    )
    try:
        assert "held" == holder.stdout.readline().strip()
        assert AdvisoryLock(engine=lock_engine, key=key).locked()
        holder.kill()
        holder.wait(timeout=10)
        deadline = time.monotonic() + 10
        while AdvisoryLock(engine=lock_engine, key=key).locked():
            assert time.monotonic() < deadline, (
                "lock still held 10 s after its holder was killed"
            )
            time.sleep(0.05)
    finally:
        holder.kill()
        holder.wait(timeout=10)
        holder.stdout.close()
    assert AdvisoryLock(engine=lock_engine, key=key).acquire()


def test_unreachable_database_raises_database_error_with_masked_url(namespace):
    """No silent run without a lock: a dead database is an error naming it (password masked)."""
    engine = db_module.create_engine(
        "postgresql+psycopg2://app:s3cret@127.0.0.1:1/app",
        {"pglock_engine_options": {"connect_args": {"connect_timeout": 2}}},
    )
    try:
        with pytest.raises(DatabaseError) as caught:
            AdvisoryLock(engine=engine, key=make_key(namespace)).acquire()
        assert "s3cret" not in str(caught.value)
        assert "127.0.0.1:1" in str(caught.value)
    finally:
        engine.dispose()


def test_vectors_are_importable():
    """The SQL-twin vectors module is shared with this file."""
    assert VECTORS


def test_dead_pooled_connection_is_replaced_transparently(
    single_engine, lock_engine, namespace
):
    """A lock session killed while idle (restart, idle timeout) costs no failed task."""
    key = make_key(namespace)
    with AdvisoryLock(engine=single_engine, key=key) as lock:
        idle_pid = lock_state.holding_connection(lock).info.backend_pid
    with lock_engine.connect() as connection:
        assert connection.exec_driver_sql(
            "SELECT pg_terminate_backend(%s)", (idle_pid,)
        ).scalar()
    lock = AdvisoryLock(engine=single_engine, key=key)
    assert lock.acquire()
    assert idle_pid != lock_state.holding_connection(lock).info.backend_pid
    lock.release()


@pytest.mark.parametrize("session_mode", ["per_process"], indirect=True)
def test_an_interrupt_between_the_grant_and_its_record_frees_the_lock(
    lock_engine, namespace, monkeypatch
):
    """A soft time limit (or SIGINT) landing after PostgreSQL granted the key but before
    the process recorded it: the key must not stay granted on the process's session,
    where no one would release it and a later run of the process would re-enter it."""
    try_once = sessions.ProcessSession._try

    def interrupted(self, *args, **kwargs):
        monkeypatch.setattr(sessions.ProcessSession, "_try", try_once)  # once
        assert (True, False) == try_once(self, *args, **kwargs)  # granted
        raise KeyboardInterrupt

    monkeypatch.setattr(sessions.ProcessSession, "_try", interrupted)
    key = make_key(namespace, "interrupted")
    lock = AdvisoryLock(engine=lock_engine, key=key)
    with pytest.raises(KeyboardInterrupt):
        lock.acquire()
    assert not lock.owned()
    assert [] == pg_locks_rows(lock_engine, key)
    again = AdvisoryLock(engine=lock_engine, key=key)
    assert again.acquire()
    again.release()
    assert [] == pg_locks_rows(lock_engine, key)


@pytest.mark.parametrize("session_mode", ["per_process"], indirect=True)
def test_an_interrupt_as_the_grant_is_returned_leaves_the_lock_owned(
    lock_engine, namespace
):
    """The same interrupt, landing once the process has recorded the grant, as the
    session's mutex is given back: the AdvisoryLock already owns the lock, so whoever
    handles the interrupt (task_postrun for a task) can release it."""
    key = make_key(namespace, "interrupted-late")
    lock = AdvisoryLock(engine=lock_engine, key=key)
    session = lock.session
    mutex = session._mutex

    class InterruptedOnExit:
        """The session's mutex, with a signal handler raising as it is given back."""

        def __enter__(self):
            return mutex.__enter__()

        def __exit__(self, *exc_info):
            mutex.__exit__(*exc_info)
            if exc_info[0] is None:
                session._mutex = mutex  # once
                raise KeyboardInterrupt

    session._mutex = InterruptedOnExit()
    try:
        with pytest.raises(KeyboardInterrupt):
            lock.acquire()
    finally:
        session._mutex = mutex
    assert lock.owned()
    ((_, granted),) = pg_locks_rows(lock_engine, key)
    assert granted
    lock.release()
    assert [] == pg_locks_rows(lock_engine, key)
    again = AdvisoryLock(engine=lock_engine, key=key)
    assert again.acquire()
    again.release()
