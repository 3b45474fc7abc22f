"""Crashes, time limits, retries and chains with real worker processes.

The point of session-scoped advisory locks: whatever kills a run, PostgreSQL frees its
lock when the session ends, so the next run is never blocked by a TTL or a leaked lock.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import psutil
import pytest
import sqlalchemy as sa
from celery import chain

from celery_pglock import AdvisoryLock, LockSkipped
from celery_pglock.db import engines

from .conftest import outcomes, skipped, wait_until


@pytest.fixture(scope="module")
def workers(start_workers):
    """One prefork worker with two children."""
    return start_workers(1, concurrency=2)


@pytest.fixture(scope="module", params=["per_process", "per_lock"])
def threads_worker(request, acceptance, start_workers):
    """A threads-pool worker in each lock-session mode (its own queue per mode)."""
    mode = request.param
    queue = f"{acceptance.app.conf.task_default_queue}-threads-{mode}"
    start_workers(
        1,
        pool="threads",
        concurrency=4,
        queues=[queue],
        env={"PGLOCK_TEST_SESSION_MODE": mode},
    )
    return queue


def key_is_free(acceptance, task, *args):
    engine = engines.engine_for(acceptance.app.conf)
    return not AdvisoryLock(engine=engine, key=task.lock_key_for(*args)).locked()


def test_self_retry_publishes_and_reacquires(acceptance, workers, recorder, run):
    """self.retry() releases the lock, the retry is really delivered, and it runs locked."""
    result = acceptance.retries_once.delay(run)
    assert 1 == result.get(timeout=30)
    assert 2 == recorder.count(run)  # both attempts ran their body
    assert [] == recorder.overlaps(run)


def test_hard_time_limit_kill_frees_the_lock(acceptance, workers, recorder, run):
    """The pool SIGKILLs a child over its hard time limit: the lock goes with its session."""
    result = acceptance.overruns.delay(run, gate=f"{run}-never")
    wait_until(lambda: recorder.count(run) == 1, timeout=30, what="the run to start")
    wait_until(
        lambda: result.state == "FAILURE",
        timeout=30,
        what="the hard time limit to kill the run",
    )
    assert "TimeLimitExceeded" == type(result.result).__name__
    wait_until(
        lambda: key_is_free(acceptance, acceptance.overruns, run),
        timeout=10,
        what="the lock to be freed",
    )
    gate = f"{run}-open"
    acceptance.open_gate(gate)
    assert "finished" == acceptance.overruns.delay(run, gate=gate).get(timeout=30)


def test_sigkill_of_the_pool_child_frees_the_lock(acceptance, workers, recorder, run):
    """kill -9 of the process holding the lock: a duplicate runs as soon as PostgreSQL notices."""
    gate = f"{run}-gate"
    acceptance.protected.delay(run, "k", gate=gate)
    wait_until(
        lambda: recorder.count(run, "k") == 1, timeout=30, what="the holder to start"
    )
    holder_pid = recorder.intervals(run)[0].pid
    assert holder_pid in workers[0].child_pids()
    duplicate = acceptance.protected.delay(run, "k")
    with pytest.raises(LockSkipped):
        duplicate.get(timeout=30)
    holder = psutil.Process(holder_pid)
    os.kill(holder_pid, signal.SIGKILL)
    holder.wait(timeout=10)
    wait_until(
        lambda: key_is_free(acceptance, acceptance.protected, run, "k"),
        timeout=10,
        what="the lock to be freed",
    )
    acceptance.open_gate(gate)
    assert "k" == acceptance.protected.delay(run, "k").get(timeout=60)
    assert [] == recorder.overlaps(run)


def test_a_skipped_link_ends_its_chain(acceptance, workers, recorder, run):
    """A skipped link is not a success: the rest of its chain does not run, and the
    chain's result ends at once with LockSkipped instead of staying PENDING."""
    gate = f"{run}-gate"
    holder = acceptance.protected.delay(run, "k", gate=gate)
    wait_until(
        lambda: recorder.count(run, "k") == 1, timeout=30, what="the holder to start"
    )
    skipped_chain = chain(
        acceptance.protected.si(run, "k"), acceptance.after.s(run)
    ).delay()
    with pytest.raises(LockSkipped):
        skipped_chain.get(timeout=30)  # raises the first link's LockSkipped
    # Celery stores the skipped link's FAILURE, then the rest of the chain's: get() can
    # raise from the first before the last link's is stored.
    wait_until(skipped_chain.ready, timeout=10, what="the last link to end FAILURE")
    assert isinstance(skipped_chain.result, LockSkipped)
    acceptance.open_gate(gate)
    holder.get(timeout=30)
    ran = chain(acceptance.protected.si(run, "k"), acceptance.after.s(run)).delay()
    assert "k" == ran.get(timeout=30)
    assert 1 == recorder.count(run, "after")  # only the chain whose first link ran


def test_transaction_scope_commits_or_rolls_back_in_the_worker(
    acceptance, workers, run
):
    """Transaction scope in a worker: success commits the body's row, failure rolls it back."""
    assert 1 == acceptance.writes_in_lock.delay(run).get(timeout=30)
    failed = acceptance.writes_in_lock.delay(run, fail=True)
    wait_until(lambda: failed.state == "FAILURE", timeout=30, what="the failing run")
    engine = engines.engine_for(acceptance.app.conf)
    with engine.connect() as connection:
        rows = connection.execute(
            sa.text("SELECT count(*) FROM pglock_test_writes WHERE run = :r"),
            {"r": run},
        )
        assert 1 == rows.scalar()


def test_threads_pool_is_exclusive_too(acceptance, threads_worker, recorder, run):
    """--pool threads: tasks of one process exclude each other, on the shared session
    (in-process exclusion per key) and on sessions of their own (PostgreSQL)."""
    results = [
        acceptance.protected.apply_async(
            (run, "k"), {"hold": 0.02}, queue=threads_worker
        )
        for _ in range(40)
    ]
    wait_until(
        lambda: all(o in ("SUCCESS", "skipped") for o in outcomes(results)),
        timeout=60,
        what="every run to end",
    )
    assert recorder.count(run, "k") >= 1
    assert [] == recorder.overlaps(run)


def test_worker_refuses_to_start_without_a_database_url(acceptance_env, tmp_path):
    """A missing lock database is reported at worker start, naming setting and variable."""
    env = {
        k: v
        for k, v in {**os.environ, **acceptance_env}.items()
        if k != "CELERY_PGLOCK_DATABASE_URL"
    }
    env["PGLOCK_TEST_NO_DB_URL"] = "1"
    completed = subprocess.run(
        [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "tests.acceptance.app",
            "worker",
            "--pool",
            "solo",
            "--loglevel",
            "INFO",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert 0 != completed.returncode
    output = completed.stdout + completed.stderr
    assert "pglock_database_url" in output
    assert "CELERY_PGLOCK_DATABASE_URL" in output


def test_retry_without_throw_is_published_after_the_release(
    acceptance, workers, recorder, run
):
    """self.retry(throw=False): the retry is not lost to the attempt's own lock.

    (The result stays "first": Celery never overwrites a stored SUCCESS. The recorded
    intervals show that the retry attempt ran, after the first one.)
    """
    result = acceptance.retry_later.delay(run)
    wait_until(
        lambda: recorder.count(run) == 2 and not recorder.unfinished(run),
        timeout=30,
        what="both attempts",
    )
    first, second = recorder.intervals(run)
    assert result.id == first.task_id == second.task_id
    assert first.ended_at <= second.started_at
    assert [] == recorder.overlaps(run)


def test_worker_killed_after_self_retry_loses_no_retry(
    acceptance, workers, recorder, run
):
    """The pool child dies right after self.retry(), lock still held: the retry message was
    published by self.retry() itself, the dead session freed the lock, and the retry runs."""
    acceptance.retries_then_dies.delay(run)
    wait_until(
        lambda: recorder.count(run) == 2 and len(recorder.unfinished(run)) == 1,
        timeout=30,
        what="the retry to run after the kill",
    )
    killed, retried = recorder.intervals(run)
    assert killed.task_id == retried.task_id
    assert killed.ended_at is None  # SIGKILLed inside its body
    assert retried.ended_at is not None


def test_soft_time_limit_unwinds_and_releases(acceptance, workers, recorder, run):
    """SoftTimeLimitExceeded is an exception in the body: the finally releases the lock."""
    result = acceptance.soft_limited.delay(run, gate=f"{run}-never")
    wait_until(
        lambda: result.state == "FAILURE", timeout=30, what="the soft time limit"
    )
    assert "SoftTimeLimitExceeded" == type(result.result).__name__
    assert key_is_free(acceptance, acceptance.soft_limited, run)


def test_revoke_with_terminate_frees_the_lock(acceptance, workers, recorder, run):
    """revoke(terminate=True) kills the pool child; its session, and so its lock, end with it."""
    gate = f"{run}-gate"
    result = acceptance.protected.delay(run, "k", gate=gate)
    wait_until(
        lambda: recorder.count(run, "k") == 1, timeout=30, what="the run to start"
    )
    result.revoke(terminate=True, signal="SIGKILL")
    wait_until(
        lambda: key_is_free(acceptance, acceptance.protected, run, "k"),
        timeout=15,
        what="the lock to be freed",
    )
    acceptance.open_gate(gate)
    assert "k" == acceptance.protected.delay(run, "k").get(timeout=30)


def test_threads_pool_same_task_id_duplicate_keeps_the_holder_locked(
    acceptance, threads_worker, recorder, run
):
    """Threads pool: a duplicate delivered with the holder's task id (a redelivery, an
    explicit task_id) is skipped, and its end does not release the holder's lock."""
    gate, task_id = f"{run}-gate", f"{run}-id"
    acceptance.protected.apply_async(
        (run, "k"), {"gate": gate}, task_id=task_id, queue=threads_worker
    )
    wait_until(
        lambda: recorder.count(run, "k") == 1, timeout=30, what="the holder to start"
    )
    same_id = acceptance.protected.apply_async(
        (run, "k"), task_id=task_id, queue=threads_worker
    )
    wait_until(
        lambda: skipped(same_id),
        timeout=30,
        what="the same-id duplicate to be skipped",
    )
    other = acceptance.protected.apply_async((run, "k"), queue=threads_worker)
    wait_until(
        lambda: skipped(other),
        timeout=30,
        what="a later duplicate to be skipped too",
    )
    acceptance.open_gate(gate)
    wait_until(
        lambda: key_is_free(acceptance, acceptance.protected, run, "k"),
        timeout=30,
        what="the holder to end",
    )
    assert 1 == recorder.count(run, "k")


def test_threads_pool_retry_attempts_never_overlap(
    acceptance, threads_worker, recorder, run
):
    """Threads pool: self.retry() attempts share a task id and must not free each other's lock."""
    results = [
        acceptance.retries_once.apply_async((run,), queue=threads_worker)
        for _ in range(3)
    ]
    wait_until(
        lambda: all(o in ("SUCCESS", "skipped") for o in outcomes(results)),
        timeout=60,
        what="every attempt to end",
    )
    assert [] == recorder.overlaps(run)


def test_solo_pool_is_exclusive(acceptance, start_workers, recorder, run):
    """--pool solo: one task at a time per worker; two solo workers still exclude each other."""
    queue = f"{acceptance.app.conf.task_default_queue}-solo"
    start_workers(2, pool="solo", concurrency=1, queues=[queue])
    results = [
        acceptance.protected.apply_async((run, "k"), {"hold": 0.02}, queue=queue)
        for _ in range(30)
    ]
    wait_until(
        lambda: all(o in ("SUCCESS", "skipped") for o in outcomes(results)),
        timeout=60,
        what="every run to end",
    )
    assert recorder.count(run, "k") >= 1
    assert [] == recorder.overlaps(run)
