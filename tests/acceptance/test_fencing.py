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

from celery_pglock import _holder, db
from celery_pglock.lock import AdvisoryLock
from celery_pglock.testing import WorkerProcess

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
    engine = db.create_engine(database_url)
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
    holder = _holder.find(AdvisoryLock(engine=engine, key=key))
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
