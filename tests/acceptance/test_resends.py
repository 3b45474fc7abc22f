"""lock_enqueue and lock_period under the ways real code re-sends a message, with real
prefork workers and Redis: a reused task id is a new send (never taken for a retry of the
message that had it), retries of an until_started run keep at most one follow-up per try,
and a message that ends without running gives its key back (unknown to the worker, or
due while the lock database is down)."""

from __future__ import annotations

import os
import time

import pytest
from celery import signals as celery_signals

from celery_pglock import SingletonTask
from celery_pglock.testing import DATABASE_URL_ENV, _support

from .conftest import wait_until

APP = "tests.acceptance.resend_app"
#: A confirmed row holds its key lock_enqueue_lost_after (an hour), far past PUBLISH_GRACE.
CONFIRMED = 60.0


@pytest.fixture(scope="module")
def resend_app(acceptance):
    import tests.acceptance.resend_app as module

    return module


@pytest.fixture(scope="module")
def worker(resend_app, start_workers):
    """One prefork worker, two children."""
    return start_workers(1, app=APP)[0]


@pytest.fixture
def published():
    """The task ids this process publishes during the test."""
    ids: list[str] = []

    def count(headers=None, **_):
        ids.append(headers["id"])

    celery_signals.after_task_publish.connect(count, weak=False)
    yield ids
    celery_signals.after_task_publish.disconnect(count)


def test_a_reused_id_of_a_queued_message_publishes_nothing(
    resend_app, worker, recorder, run, published
):
    """Two sends with one custom id while the first is queued: one message."""
    task_id = f"report-{run}"
    blocker = resend_app.finished.delay(run, "k", hold=2)
    wait_until(lambda: recorder.count(run, "k") == 1, timeout=30, what="the first run")
    # ``blocker`` runs, so the key's row is its: these are duplicates of it.
    first = resend_app.finished.apply_async((run, "k"), task_id=task_id)
    again = resend_app.finished.apply_async((run, "k"), task_id=task_id)
    assert [first.id, again.id] == [blocker.id, blocker.id]
    blocker.get(timeout=30)
    # Free key: the custom id is published once; its re-send is its duplicate.
    first = resend_app.finished.apply_async((run, "other", 1), task_id=task_id)
    again = resend_app.finished.apply_async((run, "other", 1), task_id=task_id)
    assert first.id == again.id == task_id
    assert published == [blocker.id, task_id]
    first.get(timeout=30)
    assert 1 == recorder.count(run, "other")


def test_a_reused_id_of_a_running_message_keeps_its_key(
    resend_app, worker, recorder, run, published
):
    """Re-sending the id of the running message is a duplicate: the key stays its, and a
    plain send of the key returns the running id instead of publishing beside it."""
    task_id = f"report-{run}"
    running = resend_app.finished.apply_async((run, "k", 2), task_id=task_id)
    wait_until(lambda: recorder.count(run, "k") == 1, timeout=30, what="the run")
    again = resend_app.finished.apply_async((run, "k"), task_id=task_id)
    time.sleep(0.5)  # had it been published, its delivery would have met the run by now
    plain = resend_app.finished.delay(run, "k")
    assert [again.id, plain.id] == [task_id, task_id]
    assert published == [task_id]
    running.get(timeout=30)
    assert 1 == recorder.count(run, "k")
    assert [] == recorder.overlaps(run)


def test_a_reused_id_is_a_new_start_for_lock_period(resend_app, worker, recorder, run):
    """lock_period=5, one task id re-sent every second for 8 s: at most 2 starts (the
    first, and one once the period has passed), never one per send. The gap is read from
    the period row (the server's instant of each start), not from the bodies' records:
    a body records later than its start by a varying delay (the first one connects)."""
    task_id = f"tick-{run}"
    ids = resend_app.periodic.lock_key_for(run).pg_locks_ids
    connection = _support.connect(
        os.environ[DATABASE_URL_ENV], application_name="resend test"
    )
    connection.autocommit = True
    period_starts = set()
    began = time.monotonic()
    try:
        while time.monotonic() - began < 9:
            if time.monotonic() - began < 8:
                resend_app.periodic.apply_async((run,), task_id=task_id)
            # Starts are >= 5 s apart: sampled twice a second, none is missed.
            time.sleep(0.5)
            with connection.cursor() as cursor:
                cursor.execute(
                    "SELECT started_at FROM celery_pglock_periods "
                    "WHERE (classid, objid, objsubid) = (%s, %s, %s)",
                    ids,
                )
                period_starts.update(found for (found,) in cursor.fetchall())
            time.sleep(0.5)
    finally:
        connection.close()
    starts = recorder.intervals(run)
    assert 1 <= len(starts) <= 2, [str(interval) for interval in starts]
    assert len(period_starts) == len(starts), (period_starts, starts)
    first, *later = sorted(period_starts)
    for second in later:
        assert (second - first).total_seconds() >= 5.0


def test_until_started_keeps_one_follow_up_across_a_runs_retries(
    resend_app, worker, recorder, run, published
):
    """A run that retries 3 times (1 s apart): 16 sends during its retries publish at most
    one follow-up per try, and every send's returned id runs."""
    first = resend_app.retrying.delay(run, "k", 3, 1.0)
    wait_until(lambda: recorder.count(run, "k") == 1, timeout=30, what="the first try")
    sent = []
    for _ in range(16):
        sent.append(resend_app.retrying.delay(run, "k"))
        time.sleep(0.2)
    first.get(timeout=60)
    for result in sent:
        result.get(timeout=60)
    follow_ups = {result.id for result in sent} - {first.id}
    # The run is 4 tries; each try's start frees the key for one follow-up.
    assert len(follow_ups) <= 4, (len(follow_ups), published)
    assert [] == recorder.overlaps(run)


def _queued_row(url: str, task_id: str) -> tuple | None:
    connection = _support.connect(url, application_name="resend test")
    try:
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT task_id, started_at FROM celery_pglock_queued WHERE task_id = %s",
                (task_id,),
            )
            return cursor.fetchone()
    finally:
        connection.close()


def test_a_message_no_worker_knows_gives_its_key_back(resend_app, worker, run):
    """A task this producer has and the worker lacks: the worker drops its message
    ("unregistered task") and frees its key, so the next send publishes again."""

    @resend_app.app.task(
        base=SingletonTask,
        shared=False,
        name=f"tests.acceptance.resend_app.unknown_{run}",
        lock_args=("run",),
        lock_enqueue="until_finished",
    )
    def unknown(run: str) -> None: ...

    database_url = os.environ[DATABASE_URL_ENV]
    first = unknown.delay(run)
    assert _queued_row(database_url, first.id) is not None
    wait_until(
        lambda: _queued_row(database_url, first.id) is None,
        timeout=20,
        what="the dropped message's row to be freed",
    )
    second = unknown.delay(run)
    assert second.id != first.id


@pytest.fixture
def outage(outage_workers):
    """tests.acceptance.outage_app and one worker for it (-c 2)."""
    return outage_workers(1)


def test_messages_due_while_the_lock_database_is_down_give_their_keys_back(
    outage, private_postgres, recorder, run
):
    """PostgreSQL is down for 8 s when two until_finished messages come due. The one with
    autoretry_for=DatabaseError is re-queued (its retries publish unchecked, keeping its
    key) and runs once the server is back; the one without fails unrun and its key is
    freed once the server answers. The producer's pooled connections died with the
    server: its first send afterwards retries on a fresh connection instead of failing."""
    lock_db = private_postgres.url()
    retried = outage.retried.apply_async((run, "r"), countdown=3)
    failed = outage.failed.apply_async((run, "f"), countdown=3)
    private_postgres.stop()
    time.sleep(8)
    private_postgres.start()
    failed.get(timeout=30, propagate=False)
    assert "FAILURE" == failed.state
    assert "DatabaseError" in type(failed.result).__name__
    retried.get(timeout=60)
    assert 1 == recorder.count(run, "r")
    assert 0 == recorder.count(run, "f")
    wait_until(
        lambda: _queued_row(lock_db, failed.id) is None,
        timeout=20,
        what="the failed message's row to be freed",
    )
    assert _queued_row(lock_db, retried.id) is None  # deleted at its run's end
    again = outage.failed.delay(run, "f")
    assert again.id != failed.id
    again.get(timeout=30)
    assert 1 == recorder.count(run, "f")


def _die_before_publishing(run: str, grace: float, answers) -> None:
    """A producer process SIGKILLed after its row's commit, before its publish."""
    import signal

    import tests.acceptance.resend_app as module
    from celery_pglock.task import queued

    queued.PUBLISH_GRACE = grace

    def die(headers=None, **_):
        answers.put(headers["id"])
        os.kill(os.getpid(), signal.SIGKILL)

    celery_signals.before_task_publish.connect(die, weak=False)
    module.finished.delay(run, "k")


def test_a_producer_killed_before_its_publish_blocks_its_key_for_the_grace_only(
    resend_app, worker, recorder, run
):
    """The row is provisional until its producer confirms the publish: a producer that
    died between the two leaves the key to its dead id for PUBLISH_GRACE (2 s here), not
    for lock_enqueue_lost_after (an hour); then a send publishes and runs."""
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    answers = context.SimpleQueue()  # written at once: the writer dies right after
    producer = context.Process(target=_die_before_publishing, args=(run, 2.0, answers))
    producer.start()
    producer.join(timeout=60)
    dead = answers.get()
    assert -9 == producer.exitcode
    assert dead == resend_app.finished.delay(run, "k").id  # within its grace
    time.sleep(2.5)
    fresh = resend_app.finished.delay(run, "k")
    assert fresh.id != dead
    fresh.get(timeout=30)
    assert 1 == recorder.count(run, "k")


def test_a_published_message_keeps_its_key_past_the_grace(
    resend_app, run, published, monkeypatch
):
    """Its producer confirmed the publish: a message waiting in a queue no worker reads
    keeps its key long after PUBLISH_GRACE (1 s here)."""
    from celery_pglock.task import queued, queued_writes

    monkeypatch.setattr(queued, "PUBLISH_GRACE", 1.0)
    nobody = f"pglock-nobody-{run}"
    first = resend_app.finished.apply_async((run, "k"), queue=nobody)
    queued_writes.drain_writers()
    time.sleep(1.5)
    again = resend_app.finished.apply_async((run, "k"), queue=nobody)
    assert again.id == first.id
    assert [first.id] == published
    with resend_app.app.connection_for_write() as connection:
        connection.default_channel.queue_purge(nobody)
    database_url = os.environ[DATABASE_URL_ENV]
    queued_row = _queued_row(database_url, first.id)
    assert queued_row is not None
    assert queued_row[1] is None  # queued, never started
    connection = _support.connect(database_url, application_name="resend test")
    try:
        with connection.cursor() as cursor:  # purged: free its key
            cursor.execute(
                "DELETE FROM celery_pglock_queued WHERE task_id = %s", (first.id,)
            )
    finally:
        connection.close()


def test_a_child_that_exits_after_publishing_confirms_its_publish_first(
    resend_app, run, start_workers
):
    """A prefork child ends in os._exit, skipping atexit: the publish confirmation its
    task queued is written at worker_process_shutdown, so the key is held past
    PUBLISH_GRACE. Here the child exits after each task (--max-tasks-per-child=1), and
    its writer gathers changes for 2 s, so the confirmation is still pending then."""
    inbox, nobody = f"pglock-exit-{run}", f"pglock-nobody-{run}"
    start_workers(
        1,
        app=APP,
        concurrency=1,
        queues=[inbox],
        extra_args=["--max-tasks-per-child=1"],
        env={"PGLOCK_TEST_WRITER_BATCH_WAIT": "2"},
    )
    sent = resend_app.publish_finished.apply_async((run, "k", nobody), queue=inbox)
    published = sent.get(timeout=30)
    database_url = os.environ[DATABASE_URL_ENV]
    connection = _support.connect(database_url, application_name="resend test")
    try:
        with connection.cursor() as cursor:
            held_for = None
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline:  # the exiting child writes it
                cursor.execute(
                    "SELECT extract(epoch FROM stale_at - published_at) "
                    "FROM celery_pglock_queued WHERE task_id = %s",
                    (published,),
                )
                held_for = float(cursor.fetchone()[0])
                if held_for > CONFIRMED:
                    break
                time.sleep(0.2)
            cursor.execute(
                "DELETE FROM celery_pglock_queued WHERE task_id = %s", (published,)
            )
    finally:
        connection.close()
    with resend_app.app.connection_for_write() as broker:
        broker.default_channel.queue_purge(nobody)
    assert held_for is not None
    assert held_for > CONFIRMED


def test_a_group_of_one_key_is_published_whole_and_meets_the_run_lock(
    resend_app, worker, recorder, run, published
):
    """Group members are never deduplicated (the GroupResult waits for every member's
    id): 5 sends of one key publish 5 messages, 1 runs, 4 are skipped by the run lock,
    and the group's result completes."""
    from celery import group

    from .conftest import outcomes

    sent = group(resend_app.finished.s(run, "g", 2.0) for _ in range(5)).apply_async()
    sent.join(timeout=60, propagate=False)
    assert 5 == len(published)
    assert ["SUCCESS", *["skipped"] * 4] == sorted(
        outcomes(sent.results), key=lambda outcome: outcome != "SUCCESS"
    )
    assert 1 == recorder.count(run, "g")
