"""Latest wins (lock_enqueue_on_duplicate='replace') with real prefork workers, Redis and
PostgreSQL: sends during a run leave exactly one follow-up, with the latest arguments; the
replaced callers are told by whom; the follow-up survives its holder's SIGKILL; many
producers racing leave one chain of replaced ids, whose last send is the one that runs."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import threading
import time

import pytest
from click.testing import CliRunner

from celery_pglock import TaskReplaced, cli

from .conftest import wait_until

APP = "tests.acceptance.enqueue_app"
THREADS, PROCESSES, PER_PROCESS = 50, 4, 10


@pytest.fixture(scope="module")
def workers(start_workers, enqueue_app):
    return start_workers(2, app=APP, concurrency=2)


def _replaced_by(result) -> str:
    outcome = result.get(timeout=30, propagate=False)
    assert isinstance(outcome, TaskReplaced), outcome
    return str(outcome.replaced_by)


def _why(acceptance, task_id) -> dict:
    result = CliRunner().invoke(
        cli.standalone_command,
        ["--database-url", acceptance.database_url, "why", task_id, "--json"],
    )
    return dict(json.loads(result.output))


def test_sends_during_a_run_leave_one_follow_up_with_the_latest_arguments(
    acceptance, enqueue_app, workers, recorder, run
):
    """Send 1 runs for 3 s; sends 2..30 arrive meanwhile: 2 is published and waits, 3..30
    only replace one another in the key's row; 2..29 end 'replaced by' at once, each
    naming the next. After 1, 2 publishes 30, which runs once; its holder SIGKILLed, it
    runs again (acks_late)."""
    task = enqueue_app.latest
    gate = f"{run}-gate"
    first = task.delay(run, "k", 1, hold=3)
    wait_until(lambda: recorder.count(run, "k") == 1, timeout=30, what="the first run")
    sent = [task.delay(run, "k", value, gate=gate) for value in range(2, 31)]
    assert 29 == len({result.id for result in sent} | set())
    replaced = sent[:-1]
    chain = {result.id: _replaced_by(result) for result in replaced}  # at once
    assert {sent[i].id: sent[i + 1].id for i in range(28)} == chain
    assert 1 == first.get(timeout=30)
    wait_until(lambda: recorder.count(run, "k") == 2, timeout=30, what="the follow-up")
    follow_up = recorder.intervals(run)[1]
    assert sent[-1].id == follow_up.task_id
    assert follow_up.started_at >= recorder.intervals(run)[0].ended_at
    os.kill(follow_up.pid, signal.SIGKILL)  # its message comes back (acks_late)
    wait_until(lambda: recorder.count(run, "k") == 3, timeout=60, what="its rerun")
    enqueue_app.open_gate(gate)
    assert 30 == sent[-1].get(timeout=60)
    assert [sent[-1].id] * 2 == [i.task_id for i in recorder.intervals(run)[1:]]
    assert [] == recorder.overlaps(run)
    # The carrier (2) now names the send it published; the others are unchanged.
    expected = {**chain, sent[0].id: sent[-1].id}
    # Read past the backend's cache of results it has seen.
    stored = {r.id: task.backend.get_task_meta(r.id, cache=False) for r in replaced}
    assert expected == {i: meta["result"].replaced_by for i, meta in stored.items()}
    told = _why(acceptance, sent[0].id)  # its tombstone: no pglock_history here
    assert told["verdict"].startswith(f"replaced by {sent[-1].id}")


def _produce(run: str, barrier, answers, first_value: int) -> None:
    """A producer process: PER_PROCESS threads send the key at the barrier."""
    import tests.acceptance.enqueue_app as module

    ids: dict[int, str] = {}

    def send(value: int) -> None:
        barrier.wait(timeout=60)
        ids[value] = module.latest.apply_async(
            (run, "race", value), ignore_result=True
        ).id

    threads = [
        threading.Thread(target=send, args=(first_value + i,))
        for i in range(PER_PROCESS)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=90)
    answers.put(ids)


def test_racing_producers_run_the_last_send_in_the_database_order(
    acceptance, enqueue_app, workers, recorder, run
):
    """While a run holds the key, 50 threads here and 4 producer processes send it at
    once, each its own value: every caller but one is told it was replaced by a later
    send, every chain of them ends at that one (the last in the database's order), and
    after the run exactly one body runs: that one's."""
    gate = f"{run}-gate"
    holder = enqueue_app.latest.delay(run, "race", -1, gate=gate)
    wait_until(lambda: recorder.count(run, "race") == 1, timeout=30, what="the holder")
    context = multiprocessing.get_context("spawn")
    barrier = context.Barrier(THREADS + PROCESSES * PER_PROCESS)
    answers = context.Queue()
    producers = [
        context.Process(
            target=_produce, args=(run, barrier, answers, 1000 * (index + 1))
        )
        for index in range(PROCESSES)
    ]
    for producer in producers:
        producer.start()
    ids: dict[int, str] = {}

    def send(value: int) -> None:
        barrier.wait(timeout=60)
        ids[value] = enqueue_app.latest.apply_async(
            (run, "race", value), ignore_result=True
        ).id

    threads = [threading.Thread(target=send, args=(v,)) for v in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=90)
    for _ in producers:
        ids.update(answers.get(timeout=90))
    for producer in producers:
        producer.join(timeout=30)
    total = THREADS + PROCESSES * PER_PROCESS
    assert total == len(ids) == len(set(ids.values()))
    by = {}
    for task_id in ids.values():
        meta = enqueue_app.latest.backend.get_task_meta(task_id, cache=False)
        if meta["status"] == "FAILURE":
            assert isinstance(meta["result"], TaskReplaced), meta
            by[task_id] = meta["result"].replaced_by
    [last] = set(ids.values()) - set(by)  # the one every caller can find
    for start in by:
        seen = {start}
        while start in by:
            start = by[start]
            assert start not in seen, "a cycle"
            seen.add(start)
        assert last == start
    enqueue_app.open_gate(gate)
    assert -1 == holder.get(timeout=30)
    # Sent with ignore_result: the follow-up is seen by the recorder, by its id.
    wait_until(lambda: recorder.count(run, "race") == 2, timeout=60, what="the run")
    wait_until(lambda: not recorder.unfinished(run), timeout=30, what="its end")
    assert last == recorder.intervals(run)[1].task_id
    time.sleep(1)  # no other follow-up comes
    assert 2 == recorder.count(run, "race")
    assert [] == recorder.overlaps(run)
