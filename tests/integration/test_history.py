"""pglock_history and `pglock why` against real PostgreSQL and Redis: each outcome of a
message is recorded off the run's thread and told back; nothing is connected or sent
when the setting is unset; rows past retention are pruned."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid

import pytest
from celery import Celery
from click.testing import CliRunner

from celery_pglock import ConfigurationError, SingletonTask, cli
from celery_pglock.db import engines
from celery_pglock.task import history
from celery_pglock.testing import _support
from tests.integration.task.test_enqueue import deliver
from tests.integration.task_support import close_app, define, hold


@pytest.fixture
def app(database_url, broker_url, result_backend_url, namespace):
    app = Celery(
        "history", broker=broker_url, backend=result_backend_url, set_as_current=False
    )
    app.conf.update(
        pglock_database_url=database_url, pglock_namespace=namespace, pglock_history=600
    )
    yield app
    close_app(app)


def why(database_url, task_id):
    """`pglock why --json` once the task's events are written (batched, ~0.2 s)."""
    deadline = time.monotonic() + 10
    while True:
        result = CliRunner().invoke(
            cli.standalone_command,
            ["--database-url", database_url, "why", task_id, "--json"],
        )
        assert 0 == result.exit_code, result.output
        document = json.loads(result.output)
        if document["events"] or time.monotonic() > deadline:
            return document
        time.sleep(0.1)


def until(document, event, database_url):
    """Wait for ``event`` among the task's events (a later batch than the first)."""
    deadline = time.monotonic() + 10
    while event not in [e["event"] for e in document["events"]]:
        assert time.monotonic() < deadline, document
        time.sleep(0.1)
        document = why(database_url, document["task_id"])
    return document


def test_a_run_is_told_started_where_and_ended_how(app, database_url):
    def report(tenant):
        return tenant

    task = define(app, report, lock_args=("tenant",))
    result = task.apply((1,))
    document = until(why(database_url, result.id), "ended", database_url)
    started, ended = document["events"]
    assert ("started", engines.process_tag()) == (started["event"], started["on"])
    assert ("ended", "SUCCESS") == (ended["event"], ended["state"])
    assert document["verdict"].startswith(
        f"ran on {engines.process_tag()}, ended SUCCESS"
    )
    text = CliRunner().invoke(
        cli.standalone_command, ["--database-url", database_url, "why", result.id]
    )
    assert f"{result.id}: ran on " in text.output


def test_a_skip_is_told_with_its_reason_and_holder(app, database_url):
    def report(tenant):
        return tenant

    task = define(app, report, lock_args=("tenant",))
    held = hold(task, 2)
    try:
        result = task.apply((2,))
    finally:
        held.release()
    [skipped] = why(database_url, result.id)["events"]
    assert ("skipped", "lock_busy", "skip") == (
        skipped["event"],
        skipped["reason"],
        skipped["policy"],
    )
    verdict = why(database_url, result.id)["verdict"]
    assert verdict.startswith("did not run: lock_busy, held by ")


def test_a_duplicate_send_is_told_whose_duplicate_it_is(app, database_url):
    def export(tenant):
        return tenant

    task = define(app, export, lock_args=("tenant",), lock_enqueue="until_finished")
    first = task.apply_async((3,))
    mine = str(uuid.uuid4())
    second = task.apply_async((3,), task_id=mine)
    assert first.id == second.id
    assert "duplicate" == why(database_url, mine)["events"][0]["outcome"]
    verdict = why(database_url, mine)["verdict"]
    assert verdict.startswith(f"returned as a duplicate of {first.id}")
    sent = why(database_url, first.id)["events"][0]
    assert ("sent", "published") == (sent["event"], sent["outcome"])


def latest_task(app):
    """A latest-wins task keyed by its tenant."""

    def latest(tenant):
        return tenant

    return define(
        app,
        latest,
        lock_args=("tenant",),
        lock_enqueue="until_started",
        lock_enqueue_on_duplicate="replace",
    )


def test_a_replaced_message_is_told_by_whom_with_history_and_without(app, database_url):
    """Latest wins: the replaced id's events say by whom; without history, a carrier
    that handed over is told by its tombstone alone."""
    task = latest_task(app)
    first = task.apply_async((4,))
    second = task.apply_async((4,))
    document = until(why(database_url, first.id), "sent", database_url)
    assert [("sent", "published"), ("replaced", None)] == [
        (e["event"], e.get("outcome")) for e in document["events"]
    ]
    assert second.id == document["events"][1]["by_task"]
    assert document["verdict"].startswith(f"replaced by {second.id}, ")
    sent = why(database_url, second.id)["events"][0]
    assert ("replaced", first.id) == (sent["outcome"], sent["queued"])
    app.conf.pglock_history = None  # this process keeps no more history
    carrier = task.apply_async((5,))
    later = task.apply_async((5,))
    deliver(task, carrier.id, 5)  # hands over to ``later``: a tombstone says so
    document = why(database_url, carrier.id)
    assert ["replaced"] == [e["event"] for e in document["events"]]
    assert document["verdict"].startswith(f"replaced by {later.id}, ")


#: The app `pglock why --app` loads below: the test's own (its result backend).
WHY_APP = None


def verdict_of(task_id, *options):
    """`pglock why`'s verdict at once (no events to wait for)."""
    result = CliRunner().invoke(cli.standalone_command, [*options, "why", task_id])
    assert 0 == result.exit_code, result.output
    return result.output.strip().splitlines()[-1].partition(": ")[2]


def test_without_events_the_queued_row_and_the_result_tell(
    app, database_url, monkeypatch
):
    """pglock_history unset: a send waiting in its key's row and the carrier that will
    publish it are told from the row; a replaced send, from its result (with --app)."""
    app.conf.pglock_history = None
    task = latest_task(app)
    carrier = task.apply_async((6,))
    middle = task.apply_async((6,))
    waiting = task.apply_async((6,))
    told = verdict_of(waiting.id, "--database-url", database_url)
    assert told.startswith("queued: the latest send of key ")
    assert f"until its carrier {carrier.id} is taken" in told
    told = verdict_of(carrier.id, "--database-url", database_url)
    assert told.startswith(f"queued: its message carries {waiting.id}, ")
    assert verdict_of(middle.id, "--database-url", database_url).startswith("unknown")
    monkeypatch.setattr(sys.modules[__name__], "WHY_APP", app)
    told = verdict_of(middle.id, "--app", f"{__name__}:WHY_APP")
    assert told.startswith(f"replaced by {waiting.id}, ")
    deliver(task, carrier.id, 6)
    deliver(task, waiting.id, 6)
    told = verdict_of(waiting.id, "--app", f"{__name__}:WHY_APP")
    assert "ended SUCCESS (its result says so" in told


def test_an_id_nothing_is_known_of_is_unknown(app, database_url):
    assert why(database_url, "no-such-id")["verdict"].startswith("unknown: ")


def test_rows_past_retention_are_pruned_by_the_next_write(app, database_url):
    """A row older than pglock_history (600 s here) is deleted by a writer's prune,
    which a process runs with its first write and then once a minute."""
    engine = engines.engine_for(app.conf)
    history.TABLE.ensure(engine)
    old = f"old-{uuid.uuid4()}"
    connection = _support.connect(database_url, application_name="history test")
    connection.autocommit = True
    try:
        with connection.cursor() as cursor:
            cursor.execute(  # more than one prune batch: all of them go
                "INSERT INTO celery_pglock_history SELECT %s, "
                "now() - interval '700 seconds', 'sent', '{}' FROM generate_series(1, %s)",
                (old, 2 * history.PRUNE_BATCH + 500),
            )
        history._pruned_at.pop(engine, None)  # as in a process yet to write
        history._retention_of[engine] = 600.0
        with engines.autocommit_cursor(engine) as cursor:
            batch = [(f"new-{uuid.uuid4()}", time.time(), "sent", "{}")]
            history._write_events(engine, cursor, batch)
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT count(*) FROM celery_pglock_history WHERE task_id = %s", (old,)
            )
            assert (0,) == cursor.fetchone()
    finally:
        connection.close()


def test_with_the_setting_unset_nothing_is_connected_or_sent():
    """A fresh process binding a SingletonTask without pglock_history connects no
    receiver: the signals cost their usual check, and no history is sent."""
    code = (
        "from celery import Celery\n"
        "from celery_pglock import SingletonTask, signals\n"
        "app = Celery('off', broker='memory://')\n"
        "app.conf.pglock_database_url = 'postgresql://h/db'\n"
        "@app.task(base=SingletonTask)\n"
        "def t(): pass\n"
        "app.finalize(auto=True); t.lock_config\n"
        "print(sum(len(s.receivers) for s in (signals.lock_acquired, signals.lock_skipped,"
        " signals.lock_completed, signals.lock_failed, signals.lock_lost,"
        " signals.lock_enqueued)))\n"
    )
    output = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert "0" == output.stdout.strip(), output.stderr


def test_a_bad_setting_is_refused_at_registration():
    app = Celery("bad", broker="memory://", set_as_current=False)
    app.conf.update(pglock_database_url="postgresql://h/db", pglock_history=-1)

    def nothing():
        return None

    app.task(base=SingletonTask, shared=False)(nothing)
    with pytest.raises(ConfigurationError, match="pglock_history=-1 is invalid"):
        app.finalize(auto=True)
