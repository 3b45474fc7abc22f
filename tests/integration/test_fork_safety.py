"""A process that forks while another of its threads holds one of the package's locks:
the child takes the lock and finishes what uses it (db.forks.safe_lock).

Each test holds the real lock in a thread, forks, and lets the child do the operation
that takes it. A child that hangs on the lock is killed at a deadline and fails the test.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import threading
import time
import traceback
import warnings

from celery_pglock.db import engines, row_writer, server_probe
from celery_pglock.fencing import tokens as fencing_tokens
from celery_pglock.task import queued, queued_writes, runs
from celery_pglock.testing import lock_state
from tests.integration.task_support import current_engine, define

CHILD_DEADLINE = 20.0  #: Seconds; each operation takes well under one.


def in_forked_child(held: threading.Lock, work) -> str:
    """Fork while another thread holds ``held``; the child runs ``work`` (a falsy return
    or an exception fails it). "ok", the child's error, or "hung" if it was killed."""
    taken, done = threading.Event(), threading.Event()

    def hold():
        with held:
            taken.set()
            done.wait()

    holder = threading.Thread(target=hold, name="holder")
    holder.start()
    try:
        assert taken.wait(5)
        read_end, write_end = os.pipe()
        with warnings.catch_warnings():
            # 3.12+ warns that a fork of a multi-threaded process may deadlock: the point.
            warnings.simplefilter("ignore", DeprecationWarning)
            child = os.fork()
        if child == 0:  # pragma: no cover - the child reports through the pipe
            os.close(read_end)
            report = "ok"
            try:
                if not work():
                    report = "the child's work did not complete"
            except BaseException:
                report = traceback.format_exc()
            finally:
                os.write(write_end, report.encode())
                os._exit(0)
        os.close(write_end)
        with os.fdopen(read_end, "rb") as pipe:
            readable, _, _ = select.select([pipe], [], [], CHILD_DEADLINE)
            if not readable:
                os.kill(child, signal.SIGKILL)
                os.waitpid(child, 0)
                return "hung"
            report = pipe.read().decode()
        os.waitpid(child, 0)
        return report
    finally:
        done.set()
        holder.join()


def test_the_own_table_guard_is_free_in_a_forked_child(database_url):
    """OwnTable._guard (held across the CREATE round trip): a child forked while another
    thread holds it sets up the table on its own engine."""

    def work():
        engine = engines.create_engine(database_url)
        fencing_tokens.TABLE.ensure(engine)
        return engine in fencing_tokens.TABLE._ready

    assert "ok" == in_forked_child(fencing_tokens.TABLE._guard, work)


def test_the_server_probe_guard_is_free_in_a_forked_child(database_url):
    """server_probe._probing (held across the probe's round trips): a child forked while
    another thread probes probes its own engine."""

    def work():
        engine = engines.create_engine(database_url)
        return server_probe.facts_for(engine) is server_probe.known_facts(engine)

    assert "ok" == in_forked_child(server_probe._probing, work)


def test_the_row_writers_guard_is_free_in_a_forked_child(app):
    """row_writer._writers_guard: a child forked while another thread starts a writer starts
    its own (the parent's thread is not in the child), which frees the dropped row."""
    task = define(
        app,
        _fork_freed,
        lock_args=("tenant",),
        lock_enqueue="until_finished",
    )
    sent = task.delay(1)
    key = task.lock_key_for(1)
    row = queued.parse_header(queued.header_of(key))

    def queued_row():
        with (
            engines.autocommit(current_engine(task.app)) as dbapi,
            dbapi.cursor() as cursor,
        ):
            cursor.execute(
                "SELECT task_id FROM celery_pglock_queued "
                "WHERE (classid, objid, objsubid) = (%s, %s, %s)",
                key.pg_locks_ids,
            )
            return cursor.fetchone()

    assert (sent.id,) == queued_row()

    def work():
        queued_writes.free_later(task, row, sent.id)
        deadline = time.monotonic() + 10
        while queued_row() is not None and time.monotonic() < deadline:
            time.sleep(0.05)
        return queued_row() is None

    try:
        assert "ok" == in_forked_child(row_writer._writers_guard, work)
    finally:
        with contextlib.suppress(Exception):
            queued.give_back(current_engine(task.app), key, sent.id, 5)


def test_a_forked_child_sends_on_its_own_claim_connection(app):
    """A child forked while another thread's claim uses the kept claim connection sends
    on one of its own; the parent's kept connection still answers afterwards."""
    task = define(app, _fork_sent, lock_args=("tenant",), lock_enqueue="until_finished")
    first = task.delay(1)
    kept = lock_state.kept_connection(current_engine(task.app))

    def work():
        return (
            task.delay(2).id
            and lock_state.kept_connection(current_engine(app)) is not kept
        )

    assert "ok" == in_forked_child(kept.busy, work)
    assert first.id == task.delay(1).id  # a duplicate, told on the same connection
    assert lock_state.kept_connection(current_engine(task.app)) is kept


def _fork_sent(tenant):
    return tenant


def _fork_freed(tenant):
    return tenant


def _fork_ran(tenant):
    return f"ran {tenant}"


def test_the_held_registry_guard_is_free_in_a_forked_child(app):
    """runs.held_guard: a child forked while another thread registers a held
    lock runs a SingletonTask; the parent's held locks are not the child's."""
    task = define(app, _fork_ran, lock_args=("tenant",))
    parents = object()
    with runs.held_guard:
        runs.held.add(parents)

    def work():
        left = runs.held_locks()
        return "ran 7" == task.apply(args=(7,)).get() and [] == left

    try:
        assert "ok" == in_forked_child(runs.held_guard, work)
    finally:
        with runs.held_guard:
            runs.held.discard(parents)


def test_the_session_registry_guard_is_free_in_a_forked_child(database_url, namespace):
    """The sessions registry's guard (taken to make a process session): a child forked
    while another thread holds it takes a lock on a process session of its own."""
    from celery_pglock import keys
    from celery_pglock.lock import AdvisoryLock
    from celery_pglock.lock.sessions import process

    def work():
        engine = engines.create_engine(database_url)
        lock = AdvisoryLock(engine=engine, key=keys.make_key(namespace, "forked"))
        granted = lock.acquire()
        lock.release()
        return granted

    assert "ok" == in_forked_child(process._registry_guard, work)


def test_the_deadline_guard_is_free_in_a_forked_child(database_url):
    """deadlines.guard (taken by every bounded round trip): a child forked while another
    thread holds it sends a bounded statement."""
    from celery_pglock.db import deadlines

    def work():
        engine = engines.create_engine(database_url)
        with (
            engines.autocommit(engine) as dbapi,
            deadlines.bounded(dbapi, 5.0),
            dbapi.cursor() as cursor,
        ):
            cursor.execute("SELECT 1")
            return cursor.fetchone() == (1,)

    assert "ok" == in_forked_child(deadlines.guard, work)


def test_the_loss_watcher_mutex_is_free_in_a_forked_child(app):
    """The loss watcher's mutex (taken to watch each run): a child forked while another
    thread holds it runs a watched SingletonTask."""
    from celery_pglock.watch import loss_watcher

    task = define(app, _fork_ran, lock_args=("tenant",))
    assert "ok" == in_forked_child(
        loss_watcher._mutex, lambda: "ran 8" == task.apply(args=(8,)).get()
    )


def test_a_failing_reset_leaves_the_others_to_run(database_url, namespace, monkeypatch):
    """A reset that raises in the child (out of descriptors, say) is reported, and every
    later one still runs: the child does not keep its parent's lock session."""
    from celery_pglock import keys
    from celery_pglock.db import forks
    from celery_pglock.lock import AdvisoryLock
    from celery_pglock.lock.sessions import process

    def broken():
        raise OSError("out of descriptors")

    monkeypatch.setattr(forks, "_resets", [broken, *forks._resets])
    engine = engines.create_engine(database_url)
    with AdvisoryLock(engine=engine, key=keys.make_key(namespace, "parent")):
        pass  # the parent now has a process session on this engine
    assert process.open_process_session(engine) is not None

    def work():
        return process.open_process_session(engine) is None

    assert "ok" == in_forked_child(threading.Lock(), work)
