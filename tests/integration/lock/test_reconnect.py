"""A dead pooled session is replaced without orphaning its siblings; a refused connect
is not a dead session (issue 8, "every wait bounded, nothing dropped").

Every test runs on a private PostgreSQL: they kill backends, fill ``max_connections`` and
stop the server. The server is the judge: after every connection has been given back,
each lock session PostgreSQL still has open must be one the engine's pool holds (no
orphan), and no advisory lock may remain.

The cyclic garbage collector is paused while a test runs: a connection orphaned by a
replaced pool lives on until the collector happens to run (in a worker, minutes or
never), so a test that let it run would pass or fail by luck.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from typing import TYPE_CHECKING, Any

import pytest
import sqlalchemy as sa
from sqlalchemy import event

from celery_pglock import AdvisoryLock, DatabaseError, keys
from celery_pglock.db import driver_errors, engines
from celery_pglock.lock import sessions
from celery_pglock.testing import _support, strategies
from celery_pglock.testing import postgres as embedded

if TYPE_CHECKING:
    from collections.abc import Iterator

#: max_connections of the small server, and the slots kept for superusers.
MAX_CONNECTIONS = 12
RESERVED = 3
#: The lock engine's pool in the exhaustion test: every pooled connection busy means the
#: next acquire has to connect.
POOL_SIZE = 3
LOCK_SESSIONS = "application_name LIKE 'pglock %'"


@pytest.fixture(autouse=True)
def _no_cycle_collection() -> Iterator[None]:
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@pytest.fixture
def small_postgres(
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[embedded.EmbeddedPostgres]:
    """A private PostgreSQL with few connection slots, and a non-superuser role ``locker``
    (only it is refused with "remaining connection slots are reserved")."""
    monkeypatch.setitem(embedded.SETTINGS, "max_connections", str(MAX_CONNECTIONS))
    monkeypatch.setitem(
        embedded.SETTINGS, "superuser_reserved_connections", str(RESERVED)
    )
    server = embedded.EmbeddedPostgres()
    try:
        server.start()
        admin = _support.connect(server.url(), application_name="admin")
        try:
            with admin.cursor() as cursor:
                cursor.execute("CREATE ROLE locker LOGIN")
        finally:
            admin.close()
        yield server
    finally:
        server.cleanup()


@pytest.fixture
def admin(small_postgres: embedded.EmbeddedPostgres) -> Iterator[Any]:
    connection = _support.connect(small_postgres.url(), application_name="admin")
    yield connection
    connection.close()


def locker_url(server: embedded.EmbeddedPostgres) -> str:
    return f"postgresql+{_support.driver()}://locker@{_support.HOST}:{server.port}/postgres"


@contextlib.contextmanager
def lock_engine(
    url: str, conf: dict[str, Any], *, per_lock: bool = False
) -> Iterator[sa.Engine]:
    """``per_lock``: session-scope try-locks too on pooled connections of their own."""
    engine = engines.create_engine(url, conf)
    strategies.use_per_lock_sessions(per_lock)
    try:
        yield engine
    finally:
        strategies.use_per_lock_sessions(False)
        sessions.close_for(engine)
        engine.dispose()


def count_disposals(engine: sa.Engine) -> list[sa.Engine]:
    disposals: list[sa.Engine] = []
    event.listen(engine, "engine_disposed", disposals.append)
    return disposals


def query(admin: Any, sql: str, *params: Any) -> list[tuple[Any, ...]]:
    with admin.cursor() as cursor:
        cursor.execute(sql, params or None)
        return list(cursor.fetchall())


def lock_session_pids(admin: Any) -> set[int]:
    rows = query(admin, f"SELECT pid FROM pg_stat_activity WHERE {LOCK_SESSIONS}")
    return {pid for (pid,) in rows}


def advisory_locks(admin: Any) -> int:
    return int(
        query(admin, "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory'")[0][0]
    )


def terminate(admin: Any, pid: int) -> None:
    query(admin, "SELECT pg_terminate_backend(%s)", pid)
    gone = _support.wait_until(lambda: pid not in lock_session_pids(admin), timeout=10)
    assert gone, f"backend {pid} did not go away"


def assert_no_orphans(admin: Any, engine: sa.Engine) -> None:
    """Every lock session the server has open is one the engine's current pool holds.
    A backend leaves pg_stat_activity a moment after its client closed (the pool closes
    its overflow at check-in): a few seconds are waited for, a leak never goes away."""
    assert engine.pool.checkedout() == 0  # type: ignore[attr-defined]
    pooled = engine.pool.checkedin()  # type: ignore[attr-defined]
    _support.wait_until(lambda: len(lock_session_pids(admin)) <= pooled, timeout=5)
    open_sessions = len(lock_session_pids(admin))
    assert open_sessions == engine.pool.checkedin(), (  # type: ignore[attr-defined]
        f"{open_sessions} lock sessions open on the server, "
        f"{engine.pool.checkedin()} referenced by the engine's pool"  # type: ignore[attr-defined]
    )
    assert advisory_locks(admin) == 0


# How a held lock pins a pooled connection: per_lock try-locks and transaction scope. (A
# bounded wait pins one only while its key is busy, through the same PerLockSessions; a
# free key's wait is granted on the process session.)
HOLDS = {
    "per_lock": ({}, {}, None),
    "transaction": ({}, {"scope": "transaction"}, None),
}


@pytest.mark.parametrize("hold", sorted(HOLDS))
def test_a_dead_pooled_session_orphans_none_of_the_checked_out_ones(
    small_postgres: embedded.EmbeddedPostgres, admin: Any, hold: str
) -> None:
    """5 locks held, one idle pooled session killed, the next acquire finds it dead.

    The acquire reconnects and succeeds; the 5 holders keep their locks and release
    them normally; afterwards every server session is in the pool (none orphaned) and
    no advisory lock is left. The sessions opened before the death are replaced at
    their next checkout, not reused.
    """
    conf, lock_args, timeout = HOLDS[hold]
    with lock_engine(small_postgres.url(), conf, per_lock=hold == "per_lock") as engine:
        disposals = count_disposals(engine)

        def take(name: str) -> AdvisoryLock:
            lock = AdvisoryLock(
                engine=engine, key=keys.make_key("rc", name), **lock_args
            )
            assert lock.acquire(timeout=timeout)
            return lock

        holders = [take(f"held-{index}") for index in range(5)]
        idle = take("idle")
        dead_pid = idle.backend_pid
        idle.release()  # back in the pool, idle
        assert dead_pid is not None
        terminate(admin, dead_pid)
        assert advisory_locks(admin) == 5

        survivor = take("after-death")  # found the idle session dead; reconnected
        assert survivor.backend_pid != dead_pid
        assert advisory_locks(admin) == 6  # the holders' locks were not touched
        survivor.release()
        old_pids = {lock.backend_pid for lock in holders}
        for lock in holders:
            lock.release()

        assert_no_orphans(admin, engine)
        assert disposals == []
        # Sessions older than the death are replaced at their next checkout.
        again = [take(f"again-{index}") for index in range(6)]
        assert not old_pids & {lock.backend_pid for lock in again}
        for lock in again:
            lock.release()
        assert_no_orphans(admin, engine)
        assert len(lock_session_pids(admin)) <= 10  # the pool size: the old ones closed


def test_b_full_server_and_a_stopped_one_are_not_dead_sessions(
    small_postgres: embedded.EmbeddedPostgres,
    admin: Any,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Exhaustion ("remaining connection slots are reserved", "too many clients") and a
    stopped server ("connection refused") fail the acquire with a transient
    DatabaseError, and nothing else: no reconnect is tried (autoretry_for retries the
    run later), no pool is disposed, no healthy session is replaced, and afterwards no
    session is left beyond the pool's own.
    """
    conf = {
        "pglock_engine_options": {"pool_size": POOL_SIZE, "max_overflow": 10},
    }
    url = locker_url(small_postgres)
    with lock_engine(url, conf, per_lock=True) as engine:
        disposals = count_disposals(engine)
        holders = [
            AdvisoryLock(engine=engine, key=keys.make_key("rc", f"held-{index}"))
            for index in range(POOL_SIZE)
        ]
        for lock in holders:
            assert lock.acquire()  # every pooled connection busy from here on
        held_pids = {lock.backend_pid for lock in holders}
        blockers: list[Any] = []

        def fill(user_url: str, name: str) -> None:
            for _ in range(MAX_CONNECTIONS):  # bounded: never more than every slot
                try:
                    blockers.append(_support.connect(user_url, application_name=name))
                except Exception:
                    return
            raise AssertionError(f"{name}: the server never refused a connection")

        def refused(expected: str) -> None:
            for attempt in range(5):
                lock = AdvisoryLock(
                    engine=engine, key=keys.make_key("rc", f"x{attempt}")
                )
                with pytest.raises(DatabaseError, match=expected) as caught:
                    lock.acquire()
                assert driver_errors.is_transient(caught.value.__cause__)
                assert not driver_errors.is_dead_session(caught.value)
                assert not lock.owned()
            reconnects = [
                r
                for r in caplog.records
                if r.__dict__.get("action") == "lock_reconnect"
            ]
            assert reconnects == [], expected

        try:
            fill(url, "blocker")  # the locker role's slots
            refused("remaining connection slots are reserved")
            fill(small_postgres.url(), "blocker-su")  # the superusers' slots too
            refused("too many clients")
            # The healthy sessions were left alone: same backends, locks still held.
            assert held_pids <= lock_session_pids(admin)
            assert advisory_locks(admin) == POOL_SIZE
        finally:
            for blocker in blockers:
                blocker.close()
        small_postgres.stop()
        refused("Connection refused")
        small_postgres.start()
        for lock in holders:  # their sessions died with the server
            with pytest.raises(DatabaseError):
                lock.release()

        assert disposals == []
        again = [
            AdvisoryLock(engine=engine, key=keys.make_key("rc", f"again-{index}"))
            for index in range(POOL_SIZE + 2)
        ]
        for lock in again:
            assert lock.acquire()
        for lock in again:
            lock.release()
        # (The admin session died with the server too.)
        checker = _support.connect(small_postgres.url(), application_name="admin")
        try:
            assert_no_orphans(checker, engine)
            assert len(lock_session_pids(checker)) <= POOL_SIZE
        finally:
            checker.close()


def test_c_after_a_restart_the_process_session_is_not_replaced_by_a_dead_pooled_one(
    small_postgres: embedded.EmbeddedPostgres, admin: Any
) -> None:
    """per_process mode: a restart kills the process's lock session and the engine's idle
    pooled connections (those of busy keys' waits, lock_enqueue sends, fencing). The next
    try-lock finds its session dead and reconnects once: the replacement must be a fresh
    session, not one of the dead pooled ones (the acquire would then fail)."""
    with lock_engine(small_postgres.url(), {}) as engine:
        pooled = [engine.raw_connection() for _ in range(3)]
        for connection in pooled:
            connection.close()  # idle in the pool
        first = AdvisoryLock(engine=engine, key=keys.make_key("rc", "first"))
        assert first.acquire()  # on the process's own session
        first.release()
        small_postgres.crash()
        small_postgres.start()

        after = AdvisoryLock(engine=engine, key=keys.make_key("rc", "after"))
        assert after.acquire()
        after.release()
        assert after.acquire(timeout=5.0)  # a bounded wait, its key free: tried first
        after.release()
        checker = _support.connect(small_postgres.url(), application_name="admin")
        try:
            assert advisory_locks(checker) == 0
        finally:
            checker.close()


def test_d_threads_finding_one_restart_s_corpses_at_once_all_get_a_lock(
    small_postgres: embedded.EmbeddedPostgres,
) -> None:
    """A threads worker after a restart: 6 threads acquire at once, each checking out one
    of the 6 dead idle pooled sessions. Every acquire succeeds (one reconnect each at
    most), and afterwards no session is left outside the pool."""
    threads = 6
    with lock_engine(small_postgres.url(), {}, per_lock=True) as engine:
        disposals = count_disposals(engine)
        warm = [
            AdvisoryLock(engine=engine, key=keys.make_key("rc", f"warm-{index}"))
            for index in range(threads)
        ]
        for lock in warm:
            assert lock.acquire()
        for lock in warm:
            lock.release()  # 6 idle pooled sessions
        small_postgres.crash()
        small_postgres.start()

        start = threading.Barrier(threads, timeout=30)
        results: list[object] = []
        locks = [
            AdvisoryLock(engine=engine, key=keys.make_key("rc", f"t-{index}"))
            for index in range(threads)
        ]

        def run(lock: AdvisoryLock) -> None:
            start.wait()
            try:
                results.append(lock.acquire())
            except Exception as exc:  # reported below, with the others
                results.append(exc)

        workers = [threading.Thread(target=run, args=(lock,)) for lock in locks]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join(timeout=60)
        assert not any(worker.is_alive() for worker in workers)
        assert results == [True] * threads
        for lock in locks:
            lock.release()

        checker = _support.connect(small_postgres.url(), application_name="admin")
        try:
            assert_no_orphans(checker, engine)
        finally:
            checker.close()
        assert disposals == []
