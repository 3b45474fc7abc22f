"""Fencing tokens across real worker processes: every acquisition of a key, whichever
pool child took it, gets a token above all earlier ones, in the order the runs held the
lock (the overlap detector's start times, PostgreSQL's clock).
"""

from __future__ import annotations

import os
import random
import signal
import uuid

import pytest

from celery_pglock import LockLostError
from celery_pglock.db import engines
from celery_pglock.lock import AdvisoryLock, holder_lookup
from celery_pglock.testing import WorkerProcess
from tests.conftest import PROCESS_TAG

from .conftest import wait_until

QUEUE = f"pglock-fencing-{uuid.uuid4().hex[:8]}"
RUNS = 40


@pytest.fixture(scope="module")
def fencing_app(acceptance):
    import tests.acceptance.fencing_app as module

    return module


@pytest.fixture(scope="module")
def workers(acceptance_env, fencing_app, tmp_path_factory):
    """Two prefork workers with three children each: six processes racing for one key."""
    log_dir = tmp_path_factory.mktemp("fencing-workers")
    started = [
        WorkerProcess(
            "tests.acceptance.fencing_app",
            env={**acceptance_env, "PGLOCK_TEST_QUEUE": QUEUE},
            concurrency=3,
            log_path=log_dir / f"worker-{index}.log",
        )
        for index in range(2)
    ]
    try:
        for worker in started:
            worker.start(timeout=90)
        yield started
    finally:
        for worker in reversed(started):
            worker.stop(timeout=20)


def tokens_in_lock_order(recorder, run):
    """(pid, token) of each recorded run, ordered by when it started holding the key."""
    intervals = sorted(recorder.intervals(run), key=lambda i: i.started_at)
    return [(i.pid, int(i.task_id.rsplit(":", 1)[1])) for i in intervals]


def test_tokens_increase_in_lock_order_across_processes(
    fencing_app, workers, recorder, run
):
    """Runs of one key from six pool children: no overlap, every token distinct and
    increasing in the order the runs held the lock, more than one process involved."""
    rng = random.Random(run)  # noqa: S311 - reproducible test data, not crypto
    results = [
        fencing_app.fenced.apply_async(
            (run, "k"), {"hold": rng.choice([0, 0.005, 0.02])}, queue=QUEUE
        )
        for _ in range(RUNS)
    ]
    tokens = {r.id: r.get(timeout=120) for r in results}
    assert [] == recorder.overlaps(run)
    ordered = sorted(recorder.intervals(run), key=lambda i: i.started_at)
    assert RUNS == len(ordered)
    in_order = [tokens[i.task_id] for i in ordered]
    assert sorted(set(in_order)) == in_order
    assert len({i.pid for i in ordered}) > 1


def test_transaction_scope_tokens_increase_even_after_rollbacks(
    fencing_app, workers, recorder, run
):
    """Transaction scope, every third run rolling back: tokens still strictly increase
    in lock order (a rolled-back run's token is never issued again)."""
    results = [
        fencing_app.fenced_in_transaction.apply_async(
            (run, "k"), {"hold": 0.005, "fail": index % 3 == 0}, queue=QUEUE
        )
        for index in range(24)
    ]
    wait_until(
        lambda: all(r.state in ("SUCCESS", "FAILURE") for r in results),
        timeout=120,
        what="every fenced transaction-scope run to end",
    )
    assert 8 == sum(r.state == "FAILURE" for r in results)
    assert [] == recorder.overlaps(run)
    ordered = tokens_in_lock_order(recorder, run)
    tokens = [token for _, token in ordered]
    assert 24 == len(tokens)
    assert sorted(set(tokens)) == tokens


def test_a_paused_holders_late_write_is_refused(
    acceptance, fencing_app, workers, recorder, run, database_url
):
    """The case fencing exists for, on real workers: run A holds the key and is frozen
    (SIGSTOP of its pool child); its session is ended, as the server does after a
    partition or a restart; run B takes the key with a newer token and writes. A is
    thawed and writes with its older token: the guard refuses it."""
    engine = engines.create_engine(database_url)
    with engine.begin() as connection:
        connection.exec_driver_sql(
            f"CREATE TABLE IF NOT EXISTS {fencing_app.WRITES_TABLE} "
            "(run text PRIMARY KEY, body text, fencing_token bigint)"
        )
    gate = f"{run}-gate"
    first = fencing_app.fenced_write.apply_async(
        (run, "k", "A"), {"gate": gate}, queue=QUEUE
    )
    wait_until(lambda: recorder.count(run, "k") == 1, timeout=30, what="run A to start")
    child = recorder.intervals(run)[0].pid
    key = fencing_app.fenced_write.lock_key_for(run, "k", "A")
    holder = holder_lookup.find(AdvisoryLock(engine=engine, key=key))
    assert holder is not None
    os.kill(child, signal.SIGSTOP)
    try:
        with engine.connect() as connection:
            connection.exec_driver_sql(
                "SELECT pg_terminate_backend(%s, 10000)", (holder.backend_pid,)
            )
            connection.commit()
        acceptance.open_gate(gate)  # A cannot see it yet: it is frozen
        second = fencing_app.fenced_write.apply_async((run, "k", "B"), queue=QUEUE)
        assert second.get(timeout=60) is True
    finally:
        os.kill(child, signal.SIGCONT)
    assert first.get(timeout=60) is False
    tokens = sorted(int(i.task_id.rsplit(":", 1)[1]) for i in recorder.intervals(run))
    with engine.connect() as connection:
        stored = connection.exec_driver_sql(
            f"SELECT body, fencing_token FROM {fencing_app.WRITES_TABLE} WHERE run = %s",
            (run,),
        ).one()
    engine.dispose()
    assert ("B", tokens[1]) == tuple(stored)
    assert tokens[0] < tokens[1]
    # The two bodies did overlap: the lock could not prevent it, the token made it harmless.
    assert 1 == len(recorder.overlaps(run))


# -- issue 20: a token never goes to a run that lost its lock since the grant ------------


def one_value(engine, sql, params=()):
    with engine.connect() as connection:
        value = connection.exec_driver_sql(sql, params).scalar()
        connection.rollback()
    return value


#: pg_locks rows (as ``l``) of one advisory key; params: LockKey.pg_locks_ids.
OF_KEY = (
    "l.locktype = 'advisory' AND l.classid = %s::oid AND l.objid = %s::oid "
    "AND l.objsubid = %s::smallint"
)


def writes_table(engine, fencing_app):
    with engine.begin() as connection:
        connection.exec_driver_sql(
            f"CREATE TABLE IF NOT EXISTS {fencing_app.WRITES_TABLE} "
            "(run text PRIMARY KEY, body text, fencing_token bigint)"
        )


def stored_write(engine, fencing_app, run):
    with engine.connect() as connection:
        return tuple(
            connection.exec_driver_sql(
                f"SELECT body, fencing_token FROM {fencing_app.WRITES_TABLE} "
                "WHERE run = %s",
                (run,),
            ).one()
        )


def terminate_backend(engine, pid):
    with engine.connect() as connection:
        connection.exec_driver_sql("SELECT pg_terminate_backend(%s, 10000)", (pid,))
        connection.commit()


def test_a_waiter_granted_while_frozen_and_cut_off_gets_no_token(
    fencing_app, workers, recorder, run, database_url
):
    """Issue 20's sequence, wait policy: a session outside the worker holds the key and
    run A waits for it; A's pool child is frozen (SIGSTOP); the outside session unlocks,
    so the server grants the key to A's waiting session, which is then terminated. Run B
    takes the key, gets a token and writes. When A is thawed it reads the grant from its
    socket, but gets no token: it fails with LockLostError without running its body, and
    B's write stands."""
    engine = engines.create_engine(database_url)
    writes_table(engine, fencing_app)
    task = fencing_app.fenced_write_waiting
    key = task.lock_key_for(run, "fw", "A")
    ids = key.pg_locks_ids
    outside = engine.raw_connection()
    outside.dbapi_connection.autocommit = True
    with outside.dbapi_connection.cursor() as cursor:
        cursor.execute("SELECT pg_advisory_lock(%s)", key.ids)
    first = task.apply_async((run, "fw", "A"), queue=QUEUE)
    waiter = wait_until(
        lambda: one_value(
            engine, f"SELECT pid FROM pg_locks l WHERE {OF_KEY} AND NOT granted", ids
        ),
        timeout=30,
        what="run A to wait for the key",
    )
    name = one_value(
        engine,
        "SELECT application_name FROM pg_stat_activity WHERE pid = %s",
        (waiter,),
    )
    child = int(PROCESS_TAG.search(name).group(2))
    os.kill(child, signal.SIGSTOP)
    try:
        with outside.dbapi_connection.cursor() as cursor:
            cursor.execute("SELECT pg_advisory_unlock(%s)", key.ids)
        outside.close()
        # Granted, and the answer sent: the grant waits on A's socket.
        wait_until(
            lambda: one_value(
                engine,
                "SELECT state = 'idle' FROM pg_stat_activity WHERE pid = %s "
                f"AND EXISTS (SELECT 1 FROM pg_locks l WHERE {OF_KEY} AND granted "
                "AND pid = %s)",
                (waiter, *ids, waiter),
            ),
            timeout=30,
            what="the server to grant the key to A's frozen session",
        )
        terminate_backend(engine, waiter)
        second = task.apply_async((run, "fw", "B"), queue=QUEUE)
        assert second.get(timeout=60) is True
    finally:
        os.kill(child, signal.SIGCONT)
    with pytest.raises(LockLostError, match="no token was issued"):
        first.get(timeout=60)
    (b_interval,) = recorder.intervals(run)  # A's body never ran
    token_b = int(b_interval.task_id.rsplit(":", 1)[1])
    assert ("B", token_b) == stored_write(engine, fencing_app, run)
    third = task.apply_async((run, "fw", "C"), queue=QUEUE)
    assert third.get(timeout=60) is True  # the next holder writes, with a newer token
    assert "C" == stored_write(engine, fencing_app, run)[0]
    assert token_b < stored_write(engine, fencing_app, run)[1]
    engine.dispose()


def test_a_try_lock_cut_off_before_its_token_gets_no_token(
    fencing_app, workers, recorder, run, database_url
):
    """The try-lock twin: run A is granted the key at once, and its token statement is
    held up (here by a transaction outside the worker that locks the key's row of the
    fencing table). A's session is terminated meanwhile; run B takes the key. When the
    row is free, B gets its token and writes; A gets none (LockLostError, no body)."""
    engine = engines.create_engine(database_url)
    writes_table(engine, fencing_app)
    task = fencing_app.fenced_write
    assert task.apply_async((run, "fw", "first"), queue=QUEUE).get(timeout=60)
    ids = task.lock_key_for(run, "fw", "A").pg_locks_ids
    blocker = engine.connect()
    blocker.exec_driver_sql(
        "SELECT 1 FROM celery_pglock_fencing WHERE classid = %s::oid "
        "AND objid = %s::oid AND objsubid = %s::smallint FOR UPDATE",
        ids,
    ).one()
    try:
        # The key's holder, once a token statement waits for the blocked row.
        holder_waiting = (
            f"SELECT l.pid FROM pg_locks l WHERE {OF_KEY} AND l.granted "
            "AND EXISTS (SELECT 1 FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
            "AND query LIKE '%%celery_pglock_fencing%%')"
        )
        first = task.apply_async((run, "fw", "A"), queue=QUEUE)
        holder_a = wait_until(
            lambda: one_value(engine, holder_waiting, ids),
            timeout=30,
            what="run A to be granted the key and wait to issue its token",
        )
        terminate_backend(engine, holder_a)
        second = task.apply_async((run, "fw", "B"), queue=QUEUE)
        wait_until(
            lambda: one_value(engine, holder_waiting, ids) not in (None, holder_a),
            timeout=30,
            what="run B to be granted the key and wait to issue its token",
        )
    finally:
        blocker.rollback()
        blocker.close()
    assert second.get(timeout=60) is True
    with pytest.raises(LockLostError, match="no token was issued"):
        first.get(timeout=60)
    bodies = [i.task_id.split(":")[0] for i in recorder.intervals(run)]
    assert first.id not in bodies
    assert second.id in bodies
    assert "B" == stored_write(engine, fencing_app, run)[0]
    engine.dispose()
