"""lock_enqueue guards that only real sends and real workers reach (issue 32): a publish
the broker refuses gives its key back; a refused try leaves the follow-up's row as it
was; a revoked message's row is freed from what a real Celery request carries."""

from __future__ import annotations

import socket
import uuid
from typing import Any

import pytest
from click.testing import CliRunner
from kombu.exceptions import OperationalError

from celery_pglock.cli import standalone_command
from celery_pglock.testing import _support

from .conftest import wait_until

APP = "tests.acceptance.enqueue_app"
QUEUE = f"guards-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module")
def worker(enqueue_app, start_workers):
    """One prefork worker with two children, consuming this module's queue."""
    return start_workers(1, app=APP, queues=[QUEUE])[0]


@pytest.fixture(scope="module")
def db(acceptance):
    """An autocommit connection to the lock database, for looking at its rows and locks."""
    connection = _support.connect(
        acceptance.database_url, application_name="acceptance guards"
    )
    yield connection
    connection.close()


def _owner(db: Any, task: Any, run: str) -> str | None:
    """The task id holding ``(run, "k")``'s row in celery_pglock_queued, if any."""
    with db.cursor() as cursor:
        cursor.execute(
            "SELECT task_id FROM celery_pglock_queued WHERE (classid, objid, objsubid)"
            " = (%s::oid, %s::oid, %s::smallint)",
            task.lock_key_for(run, "k").pg_locks_ids,
        )
        row = cursor.fetchone()
    return None if row is None else str(row[0])


def _waiting(db: Any, task: Any, run: str) -> bool:
    """Does a session wait for ``(run, "k")``'s advisory lock (its try was refused)?"""
    with db.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted"
            " AND database = (SELECT oid FROM pg_database"
            " WHERE datname = current_database())"
            " AND (classid, objid, objsubid) = (%s::oid, %s::oid, %s::smallint)",
            task.lock_key_for(run, "k").pg_locks_ids,
        )
        row = cursor.fetchone()
    return row is not None and row[0] > 0


def _closed_port() -> int:
    with socket.socket() as probe:  # bound, then closed: nothing listens on it
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_a_publish_the_broker_refuses_gives_the_key_back(
    enqueue_app, worker, db, recorder, run
):
    """The broker refuses the publish: the send raises, the key's row is deleted, and
    the next send (broker up) publishes a message of its own, which runs."""
    task = enqueue_app.until_finished
    failed = str(uuid.uuid4())
    dead = enqueue_app.app.connection_for_write(
        f"redis://127.0.0.1:{_closed_port()}/0",
        transport_options={"max_retries": 0},  # refused at once, not retried
    )
    with dead, pytest.raises(OperationalError, match=r"(?i)refused"):
        task.apply_async(
            (run, "k"), task_id=failed, queue=QUEUE, connection=dead, retry=False
        )
    assert _owner(db, task, run) is None
    again = task.apply_async((run, "k"), queue=QUEUE)
    assert again.id != failed
    assert again.id == _owner(db, task, run)
    assert "k" == again.get(timeout=30)
    assert [again.id] == [i.task_id for i in recorder.intervals(run)]


@pytest.mark.parametrize("task_name", ["until_started", "until_finished_waits"])
def test_a_refused_try_keeps_the_follow_ups_row(
    enqueue_app, worker, db, recorder, run, task_name, services
):
    """A holds the key (gated); the follow-up B is published, delivered, refused and
    waits. Its refused try left its row as it was: a third send returns B's id. Under
    until_finished the holder's row is first cleared by the operator, so B is published."""
    task = getattr(enqueue_app, task_name)
    gate = f"{run}-gate"
    try:
        first = task.apply_async((run, "k"), {"gate": gate}, queue=QUEUE)
        wait_until(lambda: recorder.count(run, "k") == 1, timeout=30, what="A's run")
        if task_name == "until_finished_waits":
            cleared = CliRunner().invoke(
                standalone_command,
                ["--database-url", services.database_url, "queued", "clear", first.id],
            )
            assert 0 == cleared.exit_code, cleared.output
        follow_up = task.apply_async((run, "k"), queue=QUEUE)
        assert follow_up.id != first.id
        wait_until(
            lambda: _waiting(db, task, run),
            timeout=30,
            what="the follow-up to be refused and wait for the key",
        )
        assert follow_up.id == task.apply_async((run, "k"), queue=QUEUE).id
        assert follow_up.id == _owner(db, task, run)
    finally:
        enqueue_app.open_gate(gate)
    first.get(timeout=30)
    follow_up.get(timeout=30)
    assert [first.id, follow_up.id] == [i.task_id for i in recorder.intervals(run)]
    assert [] == recorder.overlaps(run)


def test_a_revoked_message_frees_its_row_from_a_real_request(
    enqueue_app, worker, db, recorder, run
):
    """revoke() of a message with a countdown: the worker drops it at its due time
    (task_revoked, whose request is the Context Celery builds from the message) and its
    row is deleted from the pglock_q header it carries; the next send publishes, and only
    that one runs. Celery 5.3 to 5.7 put the header both in that Context's ``headers``
    and in its attributes, so either of on_revoked's two readings frees the row."""
    task = enqueue_app.until_finished
    message = task.apply_async((run, "k"), queue=QUEUE, countdown=1)
    assert message.id == task.apply_async((run, "k"), queue=QUEUE).id  # queued
    enqueue_app.app.control.revoke(message.id)
    wait_until(
        lambda: _owner(db, task, run) is None,
        timeout=15,
        what="the worker to delete the revoked message's row",
    )
    again = task.apply_async((run, "k"), queue=QUEUE)
    assert again.id != message.id
    assert "k" == again.get(timeout=30)
    assert [again.id] == [i.task_id for i in recorder.intervals(run)]
