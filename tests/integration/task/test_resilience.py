"""Safety nets and server-side failure modes: hooks, keepalives, a PostgreSQL restart."""

from __future__ import annotations

import os

import pytest
from celery import signals as celery_signals

from celery_pglock import AdvisoryLock, DatabaseError, LockNotOwnedError, keys
from celery_pglock.db import engines as db_module
from celery_pglock.lock import sessions
from celery_pglock.task import runs, singleton_task
from celery_pglock.task import worker_hooks as hooks
from celery_pglock.testing import lock_state


def make_key(namespace):
    return keys.make_key(namespace, "it.resilience")


@pytest.fixture(autouse=True)
def _hooks_connected():
    hooks.connect()


def test_task_postrun_releases_a_leftover_lock(lock_engine, namespace):
    """If the execution that just ended still holds its lock, task_postrun releases it."""
    lock = AdvisoryLock(engine=lock_engine, key=make_key(namespace))
    assert lock.acquire()
    execution = singleton_task.Execution("task-1", lock=lock)

    class Request:
        pglock_execution = execution

    class Task:
        request = Request()

    for _ in range(
        2
    ):  # idempotent: a second postrun (or any second release) is a no-op
        celery_signals.task_postrun.send(
            sender=None,
            task_id="task-1",
            task=Task(),
            args=(),
            kwargs={},
            state="SUCCESS",
        )
    assert not lock.owned()
    assert not lock.locked()


def test_task_postrun_of_another_execution_leaves_the_lock_alone(
    lock_engine, namespace
):
    """Executions sharing a task id never release each other's lock (per-execution lookup)."""
    lock = AdvisoryLock(engine=lock_engine, key=make_key(namespace))
    assert lock.acquire()
    try:

        class Task:
            request = type(
                "Request",
                (),
                {"pglock_execution": singleton_task.Execution("shared-id")},
            )()

        celery_signals.task_postrun.send(
            sender=None,
            task_id="shared-id",
            task=Task(),
            args=(),
            kwargs={},
            state="IGNORED",
        )
        assert lock.owned()
    finally:
        lock.release()


def test_worker_shutdown_releases_everything(database_url, namespace):
    """worker_process_shutdown releases what is still held and closes lock connections."""
    engine = db_module.engine_for({"pglock_database_url": database_url})
    lock = AdvisoryLock(engine=engine, key=make_key(namespace))
    assert lock.acquire()
    runs.held.add(lock)  # as a running body's lock is registered
    celery_signals.worker_process_shutdown.send(
        sender=None, pid=os.getpid(), exitcode=0
    )
    assert not lock.owned()
    assert [] == runs.held_locks()
    checker = AdvisoryLock(
        engine=db_module.engine_for({"pglock_database_url": database_url}), key=lock.key
    )
    assert not checker.locked()


def test_lock_sessions_carry_server_side_keepalives(lock_engine, namespace):
    """The server notices a vanished worker host in about a minute, not two hours."""
    with AdvisoryLock(engine=lock_engine, key=make_key(namespace)) as lock:
        cursor = lock_state.holding_connection(lock).cursor()
        cursor.execute(
            "SELECT current_setting('tcp_keepalives_idle'), current_setting('tcp_keepalives_count')"
        )
        assert ("30", "3") == cursor.fetchone()
        cursor.close()


def test_postgres_restart_loses_locks_and_the_next_acquire_reconnects(
    private_postgres, session_mode
):
    """A restart drops every advisory lock (they are not WAL-logged); nothing is left hanging.

    The holder learns it at release (per_lock: DatabaseError, connection closed;
    per_process: the next acquire found the shared session dead and replaced it, so the
    holder's release says its session ended), and the next acquire replaces the dead
    session without failing.
    """
    engine = db_module.create_engine(private_postgres.url())
    try:
        key = keys.make_key("restart", "it.restart")
        holder = AdvisoryLock(engine=engine, key=key)
        assert holder.acquire()
        private_postgres.crash()
        private_postgres.restart()
        # The lock vanished with the old server, but this process still counts the key
        # as its holder's until its release (issue 16): another key shows the reconnect.
        other = AdvisoryLock(engine=engine, key=keys.make_key("restart", "b"))
        assert other.acquire()  # reconnecting is transparent
        other.release()
        assert not AdvisoryLock(engine=engine, key=key).acquire()
        expected = DatabaseError if session_mode == "per_lock" else LockNotOwnedError
        with pytest.raises(expected):
            holder.release()
        assert not holder.owned()
        again = AdvisoryLock(engine=engine, key=key)
        assert again.acquire()
        again.release()
    finally:
        sessions.close_for(engine)
        engine.dispose()


def test_server_version_is_the_expected_one(services):
    """CI runs this file set on two servers; CELERY_PGLOCK_EXPECT_PG_MAJOR pins which."""
    expected = os.environ.get("CELERY_PGLOCK_EXPECT_PG_MAJOR")
    print(f"PostgreSQL server version: {services.postgres_version}")
    if expected:
        assert expected == services.postgres_version.split(".")[0]
    else:
        assert int(services.postgres_version.split(".")[0]) >= 12
