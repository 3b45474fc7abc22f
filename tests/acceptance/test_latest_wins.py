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

import pytest
from click.testing import CliRunner

from celery_pglock import TaskReplaced, cli

from .conftest import wait_until

APP = "tests.acceptance.enqueue_app"
THREADS, PROCESSES, PER_PROCESS = 50, 4, 10


@pytest.fixture(scope="module")
def enqueue_app(acceptance):
    import tests.acceptance.enqueue_app as module

    return module


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
    """Send 1 runs for 3 s; sends 2..30 arrive meanwhile: 2..29 end 'replaced by', each
    naming the next; 30 runs once, after 1. Its holder SIGKILLed, it runs again."""
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
    for result in replaced:  # delivered too, and still told the same
        assert chain[result.id] == _replaced_by(result)
    told = _why(acceptance, sent[0].id)
    assert told["verdict"].startswith(f"replaced by {sent[1].id}")


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
    """50 threads here and 4 producer processes send one key at once, each its own
    value: every caller's id is in one chain of replacements, and exactly one body runs:
    the chain's last."""
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
    by_id = {task_id: value for value, task_id in ids.items()}
    chain = {
        task_id: _replaced_by(enqueue_app.latest.AsyncResult(task_id))
        for task_id in by_id
        if enqueue_app.latest.AsyncResult(task_id).state == "FAILURE"
    }
    last = set(by_id) - set(chain)
    assert 1 == len(last), last
    (last_id,) = last
    order = list(set(chain) - set(chain.values()))
    assert 1 == len(order)  # one start
    while order[-1] in chain:
        order.append(chain[order[-1]])
    assert total == len(order)
    assert last_id == order[-1]
    # Sent with ignore_result: the run is seen by the recorder, as its message's id.
    wait_until(lambda: recorder.count(run, "race") == 1, timeout=60, what="the run")
    wait_until(lambda: not recorder.unfinished(run), timeout=30, what="the run's end")
    assert [last_id] == [i.task_id for i in recorder.intervals(run)]
    assert [] == recorder.overlaps(run)
