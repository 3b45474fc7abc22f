"""Lock loss and forks inside a body, with real workers and a private PostgreSQL.

The workers' locks live on a private embedded PostgreSQL whose backends these tests
terminate; the overlap recorder, gates and recorded ``lock_lost`` events live on the
shared test database. See docs/operations/lock-loss.md.
"""

from __future__ import annotations

import importlib
import time
import uuid

import psycopg2
import pytest

from celery_pglock import LockLostError, LockSkipped, OnLost
from celery_pglock.testing import EmbeddedPostgres, WorkerProcess
from tests.integration.loss_support import dsn

from .conftest import wait_until

INTERVAL = 0.5  # loss_app's pglock_watch_interval


@pytest.fixture(scope="module")
def lock_server():
    server = EmbeddedPostgres()
    try:
        yield server.start()
    finally:
        server.cleanup()


@pytest.fixture(scope="module")
def loss(acceptance_env, lock_server):
    import os

    os.environ["PGLOCK_TEST_LOCK_DATABASE_URL"] = lock_server.url()
    module = importlib.import_module("tests.acceptance.loss_app")
    module.setup_events()
    importlib.import_module("tests.acceptance.app").setup_gates()
    module.recorder.setup()
    return module


@pytest.fixture(scope="module")
def loss_logs(tmp_path_factory):
    """The module workers' logs: <pool>.log."""
    return tmp_path_factory.mktemp("loss-workers")


@pytest.fixture(scope="module")
def loss_workers(loss, acceptance_env, lock_server, loss_logs):
    """One worker per pool, each on its own queue: prefork (2 children), threads (2),
    solo and gevent (2 greenlets)."""
    queue = f"pglock-loss-{uuid.uuid4().hex[:8]}"
    env = {**acceptance_env, "PGLOCK_TEST_LOCK_DATABASE_URL": lock_server.url()}
    started = {}
    for pool, concurrency in (
        ("prefork", 2),
        ("threads", 2),
        ("solo", 1),
        ("gevent", 2),
    ):
        worker = WorkerProcess(
            "tests.acceptance.loss_app",
            env=env,
            pool=pool,
            concurrency=concurrency,
            queues=[f"{queue}-{pool}"],
            log_path=loss_logs / f"{pool}.log",
        )
        started[pool] = worker.start(timeout=90)
    yield {pool: f"{queue}-{pool}" for pool in started}
    for worker in started.values():
        worker.stop(timeout=20)


def query(lock_server, sql: str, params: tuple = ()) -> list[tuple]:
    """One statement on the private lock server, on a connection of its own."""
    connection = psycopg2.connect(dsn(lock_server.url()))
    try:
        connection.autocommit = True
        with connection.cursor() as cursor:
            cursor.execute(sql, params)
            return cursor.fetchall()
    finally:
        connection.close()


def holder_pid(lock_server, key) -> int | None:
    rows = query(
        lock_server,
        "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted "
        "AND classid = %s::oid AND objid = %s::oid AND objsubid = %s::int2",
        key.pg_locks_ids,
    )
    return rows[0][0] if rows else None


def terminate(lock_server, pid: int) -> float:
    """pg_terminate_backend(pid) on the private server; returns time.time() after it."""
    query(lock_server, "SELECT pg_terminate_backend(%s)", (pid,))
    return time.time()


def test_short_tasks_open_no_watcher_session(loss, loss_workers, lock_server, run):
    """Bodies shorter than the interval cost no check: the watcher never even
    connects (its session would show as '<prefix> <host:pid> watch')."""
    queue = loss_workers["threads"]
    before = _watch_sessions(lock_server)
    results = [
        loss.duplicate.apply_async((f"{run}-{n}",), queue=queue) for n in range(40)
    ]
    assert [r.get(timeout=60) for r in results] == ["ran"] * 40
    time.sleep(INTERVAL * 3)
    assert _watch_sessions(lock_server) == before


def _watch_sessions(lock_server) -> int:
    sql = "SELECT count(*) FROM pg_stat_activity WHERE application_name LIKE '%% watch'"
    return int(query(lock_server, sql)[0][0])


@pytest.mark.parametrize("pool", ["prefork", "solo", "gevent"])
def test_terminated_holder_is_signalled_within_the_interval_and_fails_the_run(
    loss, loss_workers, lock_server, recorder, run, pool
):
    """pg_terminate_backend frees the lock at once: a duplicate gets it and overlaps
    (that is what fencing is for), but the holder's process signals lock_lost within
    about one interval, and its run ends FAILURE with LockLostError. In every pool
    whose body cannot be in a thread of its own (solo, gevent), too."""
    queue = loss_workers[pool]
    gate = f"gate-{run}"
    first = loss.hold.apply_async((run, gate), queue=queue)
    key = loss.hold.lock_key_for(run, gate)
    pid = wait_until(lambda: holder_pid(lock_server, key), timeout=30, what="the lock")
    time.sleep(INTERVAL * 2)  # the holder was checked at least once
    terminated_at = terminate(lock_server, pid)
    (event,) = wait_until(
        lambda: loss.lost_events(first.id), timeout=10, what="lock_lost"
    )
    task_name, cause, _, at = event
    assert task_name == loss.hold.name
    assert "ended" in cause
    detected_after = at.timestamp() - terminated_at
    print(f"pg_terminate_backend ({pool}): lock_lost after {detected_after:.2f}s")
    # interval + the watcher's tick (interval/4) + one query; loose on a busy machine
    assert detected_after < INTERVAL * 1.25 + 1.0, detected_after
    # Another process takes the lock: solo is busy with the holder, and a gevent
    # worker's one process still refuses the key while the lost holder's body runs.
    other = queue if pool == "prefork" else loss_workers["prefork"]
    second = loss.hold.apply_async((run, gate), queue=other)
    wait_until(lambda: recorder.count(run) == 2, timeout=30, what="the duplicate")
    _open(gate)
    assert second.get(timeout=30) == "finished"
    with pytest.raises(LockLostError, match="was lost while its body ran"):
        first.get(timeout=30)
    # The one overlap is explained: it started after the detected, signalled loss.
    (overlap,) = recorder.overlaps(run)
    assert overlap.second.started_at.timestamp() > terminated_at - 0.5


def test_terminate_policy_acts_as_signal_under_gevent(
    loss, loss_workers, loss_logs, lock_server, recorder, run
):
    """What the docs promise for gevent: lock_on_lost='terminate' cannot end a greenlet
    body, so it acts as 'signal': lock_lost is sent, one WARNING per process says so,
    the body goes on to its end, and the run still ends FAILURE with LockLostError."""
    gate = f"gate-{run}"
    result = loss.hold_gate_terminate.apply_async(
        (run, gate), queue=loss_workers["gevent"]
    )
    key = loss.hold_gate_terminate.lock_key_for(run, gate)
    pid = wait_until(lambda: holder_pid(lock_server, key), timeout=30, what="the lock")
    terminated_at = terminate(lock_server, pid)
    ((_, cause, _, at),) = wait_until(
        lambda: loss.lost_events(result.id), timeout=10, what="lock_lost"
    )
    assert "ended" in cause, cause
    assert at.timestamp() - terminated_at < INTERVAL * 1.25 + 1.0
    time.sleep(INTERVAL * 3)  # 'terminate' would have ended the body by now
    (interval,) = recorder.intervals(run)
    # Still running: its gate wait keeps refreshing the interval's end.
    assert interval.ended_at.timestamp() > at.timestamp() + INTERVAL * 2
    assert result.state == "PENDING"
    log = (loss_logs / "gevent.log").read_text()
    assert log.count("lock_on_lost='terminate' cannot end a gevent/eventlet body") == 1
    # The process's lock session (terminated with the holder's lock) is replaced: another
    # key locks in the same process while the lost body still runs.
    other = loss.duplicate.apply_async((f"{run}-other",), queue=loss_workers["gevent"])
    assert other.get(timeout=30) == "ran"
    assert result.state == "PENDING"
    _open(gate)
    with pytest.raises(LockLostError, match="was lost while its body ran"):
        result.get(timeout=30)
    again = loss.duplicate.apply_async((f"{run}-2",), queue=loss_workers["gevent"])
    assert again.get(timeout=30) == "ran"


@pytest.mark.parametrize("pool", ["threads", "gevent"])
def test_a_lost_key_never_runs_twice_in_one_process(
    loss, loss_workers, lock_server, recorder, run, pool
):
    """Issue 16, on a one-process worker: the holder's backend is terminated while its
    body goes on (lock_on_lost='signal'). The next duplicate is skipped, and its holder
    lookup finds the process's lock session dead and closes it; every duplicate after
    that is skipped too, instead of locking on a fresh session beside the first body.
    0 overlaps; once the first body has ended, the key runs again in that process."""
    queue = loss_workers[pool]
    gate, open_gate = f"gate-{run}", f"open-{run}"
    _open(open_gate)
    first = loss.hold.apply_async((run, gate), queue=queue)
    key = loss.hold.lock_key_for(run, gate)
    pid = wait_until(lambda: holder_pid(lock_server, key), timeout=30, what="the lock")
    terminate(lock_server, pid)
    wait_until(lambda: holder_pid(lock_server, key) is None, timeout=10, what="free")
    for _ in range(3):
        duplicate = loss.hold.apply_async((run, open_gate), queue=queue)
        with pytest.raises(LockSkipped):
            duplicate.get(timeout=30)
    assert recorder.count(run) == 1
    wait_until(lambda: loss.lost_events(first.id), timeout=10, what="lock_lost")
    _open(gate)
    with pytest.raises(LockLostError):
        first.get(timeout=30)
    after = loss.hold.apply_async((run, open_gate), queue=queue)
    assert after.get(timeout=30) == "finished"
    assert recorder.count(run) == 2
    assert recorder.overlaps(run) == []


@pytest.mark.parametrize(("pool", "chunk"), [("prefork", 60.0), ("threads", 0.05)])
def test_with_no_lock_option_a_server_ended_lock_overlaps_only_until_detection(
    loss, loss_workers, lock_server, recorder, run, pool, chunk
):
    """Issue 16: with no lock_on_lost set, pg_terminate_backend of the holder's lock
    session (what a restart, failover or idle timeout also do) frees the lock; a
    duplicate in another process takes it at once. The holder's body is ended when the
    loss is detected (prefork: even inside one long sleep), so the two overlap for no
    longer than the detection (interval + tick + one check), not for the rest of the
    body. The run fails with LockLostError."""
    assert loss.hold_default.lock_config.on_lost is OnLost.TERMINATE
    first = loss.hold_default.apply_async((run, 60.0, chunk), queue=loss_workers[pool])
    key = loss.hold_default.lock_key_for(run, 60.0, chunk)
    pid = wait_until(lambda: holder_pid(lock_server, key), timeout=30, what="the lock")
    # Checked at least once (a running, watched body); and the termination lands about
    # mid-interval, not just before a check, so the duplicate has time to start.
    time.sleep(INTERVAL * 2.5)
    terminated_at = terminate(lock_server, pid)
    # Solo: another process, which takes the key the server freed.
    second = loss.hold_default.apply_async((run, 3.0, 0.05), queue=loss_workers["solo"])
    with pytest.raises(LockLostError, match="was lost while its body ran"):
        first.get(timeout=30)
    assert second.get(timeout=30) == "slept"
    first_interval = recorder.intervals(run)[0]
    ended_after = first_interval.ended_at.timestamp() - terminated_at
    overlaps = recorder.overlaps(run)
    overlapped = [
        (o.first.ended_at - o.second.started_at).total_seconds() for o in overlaps
    ]
    print(
        f"defaults ({pool}): body ended {ended_after:.2f}s after pg_terminate_backend; "
        f"overlap {overlapped}s (interval {INTERVAL}s)"
    )
    assert len(overlaps) <= 1
    # Detection: interval + the watcher's tick (interval/4) + one query; loose on a
    # busy machine, and far below the duplicate's 3 s body ('signal' overlaps all of it).
    assert ended_after < INTERVAL * 1.25 + 1.0, ended_after
    assert all(seconds < INTERVAL * 1.25 + 1.0 for seconds in overlapped), overlapped


def _open(gate: str) -> None:
    importlib.import_module("tests.acceptance.app").open_gate(gate)


@pytest.mark.parametrize(
    ("pool", "chunk"), [("prefork", 60.0), ("solo", 60.0), ("threads", 0.05)]
)
def test_terminate_policy_ends_the_body(
    loss, loss_workers, lock_server, recorder, run, pool, chunk
):
    """lock_on_lost='terminate': prefork and solo interrupt even one long sleep (a
    signal to the main thread); the threads pool raises at the body's next bytecode."""
    result = loss.hold_terminate.apply_async((run, chunk), queue=loss_workers[pool])
    key = loss.hold_terminate.lock_key_for(run, chunk)
    pid = wait_until(lambda: holder_pid(lock_server, key), timeout=30, what="the lock")
    terminated_at = terminate(lock_server, pid)
    with pytest.raises(LockLostError, match="was lost while its body ran"):
        result.get(timeout=30)
    (interval,) = recorder.intervals(run)
    assert interval.ended_at.timestamp() - terminated_at < INTERVAL * 1.25 + 1.5
    # The worker (and, in prefork, its child) lives on and runs the next task.
    again = loss.duplicate.apply_async((f"{run}-2",), queue=loss_workers[pool])
    assert again.get(timeout=30) == "ran"


@pytest.mark.parametrize(
    "how",
    [
        "os.fork-raise",
        "os.fork-return",
        "os.fork-os._exit",
        "os.fork-gc",
        "mp-raise",
        "mp-return",
        "mp-sys.exit",
        "mp-os._exit",
    ],
)
def test_a_forked_child_leaves_the_parents_lock_alone(
    loss, loss_workers, lock_server, recorder, run, how
):
    """However the child of a body's fork ends, the parent's lock stays held (pg_locks,
    and a duplicate is skipped) until the parent's body ends."""
    gate = f"gate-{run}"
    parent = loss.forks.apply_async((run, how, gate), queue=loss_workers["prefork"])
    key = loss.forks.lock_key_for(run, how, gate)
    pid = wait_until(lambda: holder_pid(lock_server, key), timeout=30, what="the lock")
    (noted,) = wait_until(
        lambda: loss.notes(parent.id), timeout=30, what="the child to exit"
    )
    assert noted == "held=True"
    assert holder_pid(lock_server, key) == pid  # same session, still granted
    duplicate = loss.duplicate.apply_async((run,), queue=loss_workers["prefork"])
    with pytest.raises(LockSkipped):
        duplicate.get(timeout=30)
    _open(gate)
    wait_until(
        lambda: holder_pid(lock_server, key) is None, timeout=30, what="the release"
    )
    assert recorder.overlaps(run) == []
    assert loss.lost_events(parent.id) == []


CHECK_TIMEOUT = 2.0


def test_frozen_link_is_unverifiable_the_body_ends_and_the_release_is_bounded(
    loss, lock_server, acceptance_env, tmp_path, recorder, run
):
    """The link to the server freezes (TCP open, nothing forwarded: a stalled middlebox).
    The holder's watcher cannot verify its lock and reports it lost before the
    server's keepalive deadline; with lock_on_lost='terminate' the body ends, and the
    release into the frozen link gives up after lock_db_timeout instead of blocking
    (it blocked 25.6 s before). When the link thaws, the lock is freed."""
    from ._proxy import FreezableProxy

    proxy = FreezableProxy(("127.0.0.1", lock_server.port))
    queue = f"pglock-loss-frozen-{uuid.uuid4().hex[:8]}"
    url = lock_server.url().replace(f":{lock_server.port}/", f":{proxy.port}/")
    worker = WorkerProcess(
        "tests.acceptance.loss_app",
        env={
            **acceptance_env,
            "PGLOCK_TEST_LOCK_DATABASE_URL": url,
            "PGLOCK_TEST_DB_TIMEOUT": str(CHECK_TIMEOUT),
        },
        concurrency=1,
        queues=[queue],
        log_path=tmp_path / "frozen.log",
    )
    try:
        worker.start(timeout=90)
        result = loss.hold_terminate.apply_async((run, 60.0), queue=queue)
        key = loss.hold_terminate.lock_key_for(run, 60.0)
        wait_until(lambda: holder_pid(lock_server, key), timeout=30, what="the lock")
        time.sleep(INTERVAL * 3)  # checked through the proxy at least once
        proxy.freeze()
        frozen_at = time.time()
        with pytest.raises(LockLostError, match="unverifiable"):
            result.get(timeout=30)
        ended_after = time.time() - frozen_at
        ((_, cause, _, at),) = loss.lost_events(result.id)
        assert cause.startswith("unverifiable"), cause
        detected_after = at.timestamp() - frozen_at
        # Detection: interval + check timeout (+ the watcher's tick); the body then ends
        # and its release into the frozen link is cut after the check timeout.
        assert detected_after < INTERVAL * 1.25 + CHECK_TIMEOUT + 1.0, detected_after
        assert ended_after < detected_after + CHECK_TIMEOUT + 2.0, ended_after
        assert ended_after < 60  # well before the server's keepalives could free it
        print(
            f"frozen link: lock_lost after {detected_after:.2f}s, run ended after "
            f"{ended_after:.2f}s (interval {INTERVAL}s, check timeout {CHECK_TIMEOUT}s)"
        )
        # A frozen link never tells the server: it still holds the lock...
        assert holder_pid(lock_server, key) is not None
        proxy.thaw()
        # ...until the link thaws and the closed session reaches it.
        wait_until(
            lambda: holder_pid(lock_server, key) is None,
            timeout=30,
            what="the lock to be freed after the thaw",
        )
        # The worker lives on and locks through the thawed link.
        again = loss.duplicate.apply_async((f"{run}-2",), queue=queue)
        assert again.get(timeout=60) == "ran"
    finally:
        proxy.thaw()
        worker.stop(timeout=20)
        proxy.close()


def test_postgres_restart_during_a_body_is_signalled(
    loss, loss_workers, lock_server, recorder, run
):
    """A restart of the (private) server frees every lock at once; the holder's process
    signals lock_lost (restart, or its session ended) and the run fails. Last in the
    module: it restarts the server the other tests use."""
    gate = f"gate-{run}"
    first = loss.hold.apply_async((run, gate), queue=loss_workers["prefork"])
    key = loss.hold.lock_key_for(run, gate)
    wait_until(lambda: holder_pid(lock_server, key), timeout=30, what="the lock")
    time.sleep(INTERVAL * 3)  # the watcher knows the server's start time
    lock_server.restart()
    restarted_at = time.time()
    ((_, cause, _, at),) = wait_until(
        lambda: loss.lost_events(first.id), timeout=30, what="lock_lost"
    )
    assert "restarted" in cause or "ended" in cause, cause
    assert at.timestamp() - restarted_at < INTERVAL * 1.25 + 5.0 + 1.0
    print(
        f"restart: lock_lost {at.timestamp() - restarted_at:+.2f}s after restart() "
        f"returned ({cause})"
    )
    _open(gate)
    with pytest.raises(LockLostError):
        first.get(timeout=30)
