"""lock_period and lock_enqueue with two real ``celery beat`` processes and a real
worker: both beats publish the same one-second ticks; one run of the period task's key
starts per period, and the lock_enqueue task's ticks publish one message at a time.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import subprocess
import sys
import time
import uuid

import redis

from celery_pglock.testing import WorkerProcess, _support

from .conftest import wait_until

QUEUE = f"pglock-period-{uuid.uuid4().hex[:8]}"
#: How long both beats publish their ticks.
BEATING = 12.0


@contextlib.contextmanager
def beat(env, schedule, log_path):
    """A ``celery beat`` subprocess (own schedule and pid files), stopped when done."""
    with log_path.open("ab") as log:
        process = subprocess.Popen(
            [
                *(sys.executable, "-m", "celery", "-A", "tests.acceptance.period_app"),
                *("beat", "--loglevel", "INFO", "-s", str(schedule)),
                *("--pidfile", f"{schedule}.pid"),
            ],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    try:
        yield process
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(10)


def test_two_beats_firing_every_second_start_one_run_per_period(
    acceptance, acceptance_env, broker_url, tmp_path
):
    """Two beats publish a lock_period=5 task every second for 12 s, a worker with two
    children consumes all ~24 messages. Each body's period start (PostgreSQL's now(),
    the one clock) is its own and at least 5 s after the previous one; the bodies'
    own clock_timestamp() starts follow them, so they are 5 s apart less the few ms
    between a start's commit and its body (a run's start is its period row).

    The same beats tick a lock_enqueue='until_finished' task whose body lasts 3 s (beat
    imports the task, so it sends through apply_async): every message delivered runs
    (none is skipped by its run lock: the ticks meanwhile published nothing), and the
    runs follow one another."""
    import tests.acceptance.period_app as period_app

    period_app.setup()
    run = uuid.uuid4().hex[:12]
    env = {
        **acceptance_env,
        "PGLOCK_TEST_QUEUE": QUEUE,
        period_app.RUN_ENV: run,
        "PYTHONUNBUFFERED": "1",
    }
    worker = WorkerProcess(
        "tests.acceptance.period_app",
        env=env,
        concurrency=2,
        log_path=tmp_path / "worker.log",
    )
    logs = [tmp_path / f"beat-{index}.log" for index in range(2)]
    try:
        worker.start(timeout=90)
        with (
            beat({**os.environ, **env}, tmp_path / "schedule-0", logs[0]) as first,
            beat({**os.environ, **env}, tmp_path / "schedule-1", logs[1]) as second,
        ):
            for log in logs:
                wait_until(
                    lambda log=log: "beat: Starting" in log.read_text(),
                    timeout=60,
                    what=f"{log.name} to start",
                )
            time.sleep(BEATING)  # the test's subject: 12 s of ticks from both beats
            assert None is first.poll(), logs[0].read_text()
            assert None is second.poll(), logs[1].read_text()
        queue = redis.Redis.from_url(broker_url)
        wait_until(
            lambda: 0 == queue.llen(QUEUE), timeout=60, what="the worker to drain"
        )
        worker.stop(timeout=30)  # warm: a body still running ends and records
    finally:
        worker.kill()
        queue = redis.Redis.from_url(broker_url)
        queue.delete(QUEUE)
    published = sum(log.read_text().count("Sending due task tick ") for log in logs)
    queued_ticks = sum(
        log.read_text().count("Sending due task queued-tick ") for log in logs
    )
    connection = _support.connect(
        acceptance.database_url,
        application_name="period test",
    )
    try:
        with connection.cursor() as cursor:
            cursor.execute(
                f"SELECT task_id, period_task, body_at, period_at "
                f"FROM {period_app.STARTS_TABLE} WHERE run = %s ORDER BY period_at",
                (run,),
            )
            starts = cursor.fetchall()
            cursor.execute(
                f"SELECT task_id, event, at FROM {period_app.ENQUEUED_TABLE} "
                "WHERE run = %s ORDER BY at",
                (run,),
            )
            events = cursor.fetchall()
    finally:
        connection.close()
    delivered = [task for task, event, _ in events if event == "delivered"]
    started = {task: at for task, event, at in events if event == "start"}
    ended = {task: at for task, event, at in events if event == "end"}
    runs = {task: (at, ended[task]) for task, at in started.items()}
    print(f"{queued_ticks} lock_enqueue ticks, {len(delivered)} delivered, {runs}")
    assert queued_ticks >= 20, queued_ticks
    assert len(runs) >= 2, events
    assert sorted(delivered) == sorted(runs), events  # no delivery was skipped
    spans = sorted(runs.values())
    assert all(later[0] >= earlier[1] for earlier, later in itertools.pairwise(spans))
    assert published >= 20, published  # both beats ticked about every second
    assert len(starts) >= 2, starts
    # Every body ran under a start of its own, recorded before it began.
    assert [task_id for task_id, *_ in starts] == [task for _, task, *_ in starts]
    assert all(period_at <= body_at for _, _, body_at, period_at in starts)
    period_gaps = [
        (later[3] - earlier[3]).total_seconds()
        for earlier, later in itertools.pairwise(starts)
    ]
    body_gaps = [
        (later[2] - earlier[2]).total_seconds()
        for earlier, later in itertools.pairwise(starts)
    ]
    latency = max(
        (body_at - period_at).total_seconds() for *_, body_at, period_at in starts
    )
    print(
        f"{published} ticks, {len(starts)} starts, period gaps {period_gaps}, "
        f"body gaps {body_gaps}, start->body at most {latency:.3f}s"
    )
    assert all(gap >= period_app.PERIOD for gap in period_gaps), period_gaps
    assert all(gap >= period_app.PERIOD - latency for gap in body_gaps), body_gaps
    # 12 s of ticks hold at most three 5 s periods (plus what drained after).
    assert len(starts) <= 4, starts
