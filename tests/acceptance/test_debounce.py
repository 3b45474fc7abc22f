"""lock_debounce (1 s, longest 5 s) with real prefork workers, Redis and PostgreSQL: a burst
runs once, a second after its last send, with the latest arguments; a stream runs at least
every 5 s; a producer SIGKILLed mid-send and a run SIGKILLed mid-body lose nothing and
double nothing. Bodies are recorded by the overlap detector, on the server's clock."""

from __future__ import annotations

import datetime
import os
import signal
import subprocess
import sys
import time

import pytest

from .conftest import wait_until

APP = "tests.acceptance.enqueue_app"
#: Between a send's clock and the recorder's (the server's), and a worker's wake-up.
SLACK = 0.6


@pytest.fixture(scope="module")
def workers(start_workers, enqueue_app):
    return start_workers(1, app=APP, concurrency=4)


def _send_every(task, run, key, seconds, first_value=1):
    """Send every 0.2 s for ``seconds``: [(server-ish time, value, result)]."""
    sent = []
    start = time.monotonic()
    value = first_value
    while time.monotonic() - start < seconds:
        result = task.delay(run, key, value)
        sent.append((datetime.datetime.now(datetime.timezone.utc), value, result))
        value += 1
        time.sleep(max(0.0, 0.2 - (time.monotonic() - start) % 0.2))
    return sent


def test_a_burst_runs_once_a_second_after_its_last_send(
    enqueue_app, workers, recorder, run
):
    task = enqueue_app.debounced
    sent = _send_every(task, run, "burst", 3)
    last_at, last_value, last = sent[-1]
    assert last_value == last.get(timeout=30)
    time.sleep(1.5)  # nothing else runs
    [interval] = recorder.intervals(run)
    assert last.id == interval.task_id
    waited = (interval.started_at - last_at).total_seconds()
    assert 1 - SLACK <= waited <= 1 + SLACK, waited
    for _, _, result in sent[:-1]:
        assert "FAILURE" == result.state  # replaced, told at once


def test_a_stream_runs_at_least_every_longest_wait(enqueue_app, workers, recorder, run):
    task = enqueue_app.debounced
    sent = _send_every(task, run, "stream", 12)
    _, last_value, last = sent[-1]
    assert last_value == last.get(timeout=30)
    starts = [i.started_at for i in recorder.intervals(run)]
    first_at = sent[0][0]
    gaps = [
        (later - earlier).total_seconds()
        for earlier, later in zip([first_at, *starts], starts, strict=False)
    ]
    assert 3 <= len(starts) <= 4, starts  # at 5 s, about 10.4 s, and after the last
    assert all(gap <= 5 + SLACK for gap in gaps[:-1]), gaps  # never past the longest
    ran_values = {i.task_id for i in recorder.intervals(run)}
    by_id = {result.id: value for _, value, result in sent}
    for interval in recorder.intervals(run):
        # The value that ran is the latest sent before the run started.
        before = [v for at, v, _ in sent if at <= interval.started_at]
        assert by_id[interval.task_id] >= max(before) - 1, (interval, before)
    assert last.id in ran_values
    assert [] == recorder.overlaps(run)


def test_a_killed_producer_and_a_killed_run_lose_and_double_nothing(
    acceptance_env, enqueue_app, workers, recorder, run
):
    """A producer SIGKILLed while it sends (perhaps between its statement and its
    publish): the next send still runs, within the sweep's bound. Then a run SIGKILLed
    mid-body runs again (acks_late) and nothing else runs."""
    task = enqueue_app.debounced
    producer = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import time, tests.acceptance.enqueue_app as m\n"
            "n = 0\n"
            "while True:\n"
            f"    m.debounced.delay({run!r}, 'k', n); n += 1; time.sleep(0.01)\n",
        ],
        env={**os.environ, **acceptance_env},
    )
    time.sleep(1.5)
    producer.send_signal(signal.SIGKILL)
    producer.wait(timeout=10)
    latest = task.delay(run, "k", 10_000)
    # At most the grace (10 s) and a sweep (5 s) past the quiet time, if the killed
    # producer left a row whose carrier it never published.
    assert 10_000 == latest.get(timeout=30)
    gate = f"{run}-gate"
    killed = task.delay(run, "k", 20_000, gate=gate)
    wait_until(
        lambda: any(i.task_id == killed.id for i in recorder.intervals(run)),
        timeout=30,
        what="the gated run",
    )
    [victim] = [i for i in recorder.intervals(run) if i.task_id == killed.id]
    os.kill(victim.pid, signal.SIGKILL)
    wait_until(
        lambda: sum(i.task_id == killed.id for i in recorder.intervals(run)) == 2,
        timeout=60,
        what="its rerun",
    )
    enqueue_app.open_gate(gate)
    assert 20_000 == killed.get(timeout=30)
    ran = [i.task_id for i in recorder.intervals(run)]
    assert ran.count(latest.id) == 1
    assert ran[-2:] == [killed.id, killed.id]
    assert [] == recorder.overlaps(run)
