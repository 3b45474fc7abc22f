"""lock_enqueue with real workers, real Redis and PostgreSQL: many producers publish one
message per key; until_started keeps exactly one follow-up; kills, revokes and purges
never leave a key blocked. Bodies are recorded by the overlap detector."""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time

import pytest
from celery import signals as celery_signals
from click.testing import CliRunner

from celery_pglock.cli import standalone_command
from celery_pglock.testing import WorkerProcess

from .conftest import wait_until

APP = "tests.acceptance.enqueue_app"
THREADS, PROCESSES, PER_PROCESS = 50, 4, 10


@pytest.fixture(scope="module")
def workers(acceptance_env, enqueue_app, tmp_path_factory):
    """Two prefork workers, two children each."""
    log_dir = tmp_path_factory.mktemp("enqueue-workers")
    started = [
        WorkerProcess(
            APP, env=acceptance_env, concurrency=2, log_path=log_dir / f"w{i}.log"
        )
        for i in range(2)
    ]
    for worker in started:
        worker.start(timeout=90)
    yield started
    for worker in started:
        worker.stop(timeout=20)


def _count_publishes() -> list[str]:
    ids: list[str] = []
    celery_signals.after_task_publish.connect(
        lambda headers=None, **_: ids.append(headers["id"]), weak=False
    )
    return ids


def _produce(run: str, barrier, answers) -> None:
    """A producer process: PER_PROCESS threads send the key at the barrier."""
    import tests.acceptance.enqueue_app as module

    published = _count_publishes()
    ids: list[str] = []

    def send() -> None:
        barrier.wait(timeout=60)
        ids.append(module.until_finished.delay(run, "k", hold=3).id)

    threads = [threading.Thread(target=send) for _ in range(PER_PROCESS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=90)
    answers.put((ids, published))


def test_many_producers_publish_one_message_and_run_one_body(
    enqueue_app, workers, recorder, run
):
    """50 threads here and 4 producer processes send one key at once: 1 message is
    published, every caller holds its id, 1 body runs; after it ends, a send publishes."""
    context = multiprocessing.get_context("spawn")
    barrier = context.Barrier(THREADS + PROCESSES * PER_PROCESS)
    answers = context.Queue()
    producers = [
        context.Process(target=_produce, args=(run, barrier, answers))
        for _ in range(PROCESSES)
    ]
    for producer in producers:
        producer.start()
    published = _count_publishes()
    ids: list[str] = []

    def send() -> None:
        barrier.wait(timeout=60)
        ids.append(enqueue_app.until_finished.delay(run, "k", hold=3).id)

    threads = [threading.Thread(target=send) for _ in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=90)
    for _ in producers:
        their_ids, their_published = answers.get(timeout=90)
        ids += their_ids
        published += their_published
    for producer in producers:
        producer.join(timeout=30)
    assert THREADS + PROCESSES * PER_PROCESS == len(ids)
    assert 1 == len(set(ids)), set(ids)
    assert 1 == len(published)
    enqueue_app.until_finished.AsyncResult(ids[0]).get(timeout=60)
    assert 1 == recorder.count(run, "k")
    after = enqueue_app.until_finished.delay(run, "k")
    assert after.id != ids[0]
    after.get(timeout=30)
    assert 2 == recorder.count(run, "k")
    assert [] == recorder.overlaps(run)


def test_until_started_keeps_exactly_one_follow_up(enqueue_app, workers, recorder, run):
    """During a 3 s run, 30 duplicates queue exactly one follow-up, which runs after it."""
    first = enqueue_app.until_started.delay(run, "k", hold=3)
    wait_until(lambda: recorder.count(run, "k") == 1, timeout=30, what="the first run")
    sent = [enqueue_app.until_started.delay(run, "k", hold=0.1) for _ in range(30)]
    follow_ups = {result.id for result in sent}
    assert 1 == len(follow_ups)
    assert first.id not in follow_ups
    first.get(timeout=30)
    sent[0].get(timeout=30)
    intervals = recorder.intervals(run)
    assert 2 == len(intervals)
    assert intervals[1].started_at >= intervals[0].ended_at
    assert [] == recorder.overlaps(run)


@pytest.mark.parametrize("task_name", ["until_started", "until_finished"])
def test_a_killed_holder_loses_neither_its_follow_up_nor_its_key(
    enqueue_app, workers, recorder, run, task_name
):
    """SIGKILL the pool child running a key: its session ends with its locks, the
    until_started follow-up runs, and a later send of the key publishes again."""
    task = getattr(enqueue_app, task_name)
    gate = f"{run}-never"
    first = task.delay(run, "k", gate=gate)
    wait_until(lambda: recorder.count(run, "k") == 1, timeout=30, what="the first run")
    follow_up = task.delay(run, "k")
    if task_name == "until_finished":
        assert follow_up.id == first.id  # running: a duplicate
    os.kill(recorder.intervals(run)[0].pid, signal.SIGKILL)
    with pytest.raises(Exception, match=r"(?i)worker|lost|signal"):
        first.get(timeout=30)
    if task_name == "until_started":
        follow_up.get(timeout=30)  # it was waiting for the key: it runs now
        assert 2 == recorder.count(run, "k")
    later = task.delay(run, "k")
    assert later.id not in (first.id, follow_up.id)
    later.get(timeout=30)
    assert [] == recorder.overlaps(run)


def _one_child_worker(acceptance_env, queue, tmp_path) -> WorkerProcess:
    return WorkerProcess(
        APP,
        env=acceptance_env,
        concurrency=1,
        queues=[queue],
        log_path=tmp_path / "worker.log",
    )


def _keep_busy(enqueue_app, recorder, run, queue):
    """Occupy the one child with a gated body: (gate, its result)."""
    gate = f"{run}-gate"
    busy = enqueue_app.protected.apply_async((run, "busy"), {"gate": gate}, queue=queue)
    wait_until(lambda: recorder.count(run, "busy") == 1, timeout=30, what="busy")
    return gate, busy


def test_a_revoked_message_frees_its_key_when_the_worker_drops_it(
    enqueue_app, acceptance_env, recorder, run, tmp_path
):
    """revoke(): the worker drops the message at receipt (task_revoked in its main
    process) and the key's row goes with it; a later send publishes again."""
    queue = f"revoke-{run}"
    with _one_child_worker(acceptance_env, queue, tmp_path):
        gate, busy = _keep_busy(enqueue_app, recorder, run, queue)
        message = enqueue_app.until_finished.apply_async((run, "k"), queue=queue)
        enqueue_app.app.control.revoke(message.id)
        time.sleep(0.5)  # the broadcast reaches the worker
        assert message.id == enqueue_app.until_finished.delay(run, "k").id
        enqueue_app.open_gate(gate)
        busy.get(timeout=30)
        sent: list[str] = []

        def published_again() -> bool:
            sent.append(
                enqueue_app.until_finished.apply_async((run, "k"), queue=queue).id
            )
            return sent[-1] != message.id

        wait_until(
            published_again, timeout=15, what="the revoked message's key to be freed"
        )
    # The new message may run before the worker stops; the revoked one never does.
    ran = [i.task_id for i in recorder.intervals(run) if i.key == "k"]
    assert set(ran) <= {sent[-1]}


def test_an_expired_message_frees_its_key_when_the_worker_drops_it(
    enqueue_app, acceptance_env, services, recorder, run, tmp_path
):
    """expires=: the message is already reserved by a busy worker when it expires; the
    worker drops it before the pool runs it (task_revoked, expired) and deletes its row,
    which `pglock queued` no longer lists (not even as stale); it never ran."""
    queue = f"expire-{run}"
    cli = CliRunner()
    task = enqueue_app.until_finished

    def listed() -> str:
        answer = cli.invoke(
            standalone_command,
            ["--database-url", services.database_url, "queued", "--task", task.name],
        )
        assert 0 == answer.exit_code, answer.output
        return answer.output

    with _one_child_worker(acceptance_env, queue, tmp_path):
        gate, busy = _keep_busy(enqueue_app, recorder, run, queue)
        message = task.apply_async((run, "k"), queue=queue, expires=1.5)
        assert message.id in listed()
        assert message.id == task.delay(run, "k").id  # queued until it expires
        time.sleep(2.0)  # expired, still reserved behind the busy child
        enqueue_app.open_gate(gate)
        busy.get(timeout=30)
        wait_until(
            lambda: message.id not in listed(),
            timeout=15,
            what="the worker to delete the expired message's row",
        )
    assert 0 == recorder.count(run, "k")


def test_a_purged_message_frees_its_key_after_its_bound_and_pglock_lists_it(
    enqueue_app, services, run
):
    """No signal tells of a purge: the key frees itself lock_enqueue_lost_after (2 s)
    past its due time. `pglock queued` lists it meanwhile, and clears it on request."""
    queue = f"nobody-{run}"
    task = enqueue_app.soon_lost
    first = task.apply_async((run, "k"), queue=queue)
    with enqueue_app.app.connection_for_write() as connection:
        connection.default_channel.queue_purge(queue)
    cli = CliRunner()
    url = ["--database-url", services.database_url]
    listed = cli.invoke(standalone_command, [*url, "queued", "--task", task.name])
    assert 0 == listed.exit_code, listed.output
    assert first.id in listed.output
    assert "queued" in listed.output
    assert first.id == task.apply_async((run, "k"), queue=queue).id
    time.sleep(2.3)
    second = task.apply_async((run, "k"), queue=queue)
    assert second.id != first.id  # taken over
    cleared = cli.invoke(standalone_command, [*url, "queued", "clear", second.id])
    assert 0 == cleared.exit_code, cleared.output
    assert "Freed 1" in cleared.output
    assert task.apply_async((run, "k"), queue=queue).id not in (first.id, second.id)
    with enqueue_app.app.connection_for_write() as connection:
        connection.default_channel.queue_purge(queue)
