"""`pglock why` verdicts and `pglock queued clear` where the history, the clocks or the
tables are not what the happy path has, and a bad `--database-url`."""

from __future__ import annotations

import json
import time
import uuid

import pytest
from celery import Celery
from click.testing import CliRunner

from celery_pglock import cli
from celery_pglock.db import engines
from celery_pglock.task import history, queued_writes
from celery_pglock.testing import _support
from tests.integration.task_support import close_app, current_engine, define


@pytest.fixture
def app(database_url, broker_url, result_backend_url, namespace):
    app = Celery(
        "review", broker=broker_url, backend=result_backend_url, set_as_current=False
    )
    app.conf.update(
        pglock_database_url=database_url, pglock_namespace=namespace, pglock_history=600
    )
    yield app
    close_app(app)


def invoke(*args, expect=0):
    result = CliRunner().invoke(cli.standalone_command, list(args))
    assert expect == result.exit_code, result.output + repr(result.exception)
    return result.output


def why(database_url, task_id, until_event=None):
    deadline = time.monotonic() + 10
    while True:
        document = json.loads(
            invoke("--database-url", database_url, "why", task_id, "--json")
        )
        events = [e["event"] for e in document["events"]]
        if (until_event in events if until_event else events) or (
            time.monotonic() > deadline
        ):
            return document
        time.sleep(0.1)


def test_why_a_latest_send_dropped_by_a_stale_takeover_is_replaced(app, database_url):
    """Latest wins: the send waiting in a stale carrier row is dropped when a later send
    takes the row over (its result says TaskReplaced). With pglock_history on, `why`
    must not say it is still queued."""

    def latest(tenant):
        return tenant

    latest.__name__ = f"latest_{uuid.uuid4().hex[:8]}"
    task = define(
        app,
        latest,
        lock_args=("tenant",),
        lock_enqueue="until_started",
        lock_enqueue_on_duplicate="replace",
    )
    carrier = task.apply_async((1,))
    waiting = task.apply_async((1,))  # into the carrier's row, not published
    queued_writes.drain_writers()
    with (
        engines.autocommit(current_engine(app)) as dbapi,
        dbapi.cursor() as cursor,
    ):
        cursor.execute(
            "UPDATE celery_pglock_queued SET stale_at = now() - interval '1 s' "
            "WHERE (classid, objid, objsubid) = (%s, %s, %s)",
            task.lock_key_for(1).pg_locks_ids,
        )
    later = task.apply_async((1,))  # takes the stale row over: `waiting` never runs
    assert carrier.id != later.id
    taken = why(database_url, later.id)
    assert "took_over" == taken["events"][0]["outcome"]
    document = why(database_url, waiting.id)
    assert document["verdict"].startswith(f"replaced by {later.id}"), document


def test_why_a_carrier_skipped_as_replaced_names_the_send_that_replaced_it(
    app, database_url
):
    """Once its tombstone is gone (kept 2 h after its delivery; history is kept
    longer), a carrier's own `skipped` event still says by whom it was replaced."""
    engine = engines.engine_for(app.conf)
    history.TABLE.ensure(engine)
    task_id, by = f"carrier-{uuid.uuid4()}", f"latest-{uuid.uuid4()}"
    now = time.time()
    rows = [
        (task_id, now - 2, "sent", json.dumps({"outcome": "published", "key": "1"})),
        (
            task_id,
            now - 1,
            "skipped",
            json.dumps({"reason": "replaced", "policy": "replaced", "replaced_by": by}),
        ),
    ]
    with engines.autocommit_cursor(engine) as cursor:
        for row in rows:
            cursor.execute(
                "INSERT INTO celery_pglock_history VALUES (%s, to_timestamp(%s), %s, %s)",
                row,
            )
    document = why(database_url, task_id)
    assert document["verdict"].startswith(f"replaced by {by}"), document
    engine.dispose()


@pytest.fixture
def empty_database_url(database_url):
    """A database where no task ever used lock_enqueue (no queued table)."""
    name = f"review_empty_{uuid.uuid4().hex[:8]}"
    admin = _support.connect(database_url, application_name="review admin")
    admin.autocommit = True
    with admin.cursor() as cursor:
        cursor.execute(f'CREATE DATABASE "{name}"')
    url = database_url.rsplit("/", 1)[0] + f"/{name}"
    yield url
    with admin.cursor() as cursor:
        cursor.execute(f'DROP DATABASE "{name}" WITH (FORCE)')
    admin.close()


@pytest.mark.parametrize("how", [["--all"], ["--stale"], ["some-task-id"]])
def test_queued_clear_without_the_table_frees_nothing_and_succeeds(
    empty_database_url, how
):
    assert "No keys are held" in invoke("--database-url", empty_database_url, "queued")
    output = invoke("--database-url", empty_database_url, "queued", "clear", *how)
    assert "Freed 0 queued key(s)." in output


@pytest.mark.parametrize(
    "url",
    [
        "mysql://app:hunter2secret@db/x",  # not PostgreSQL
        "postgresql://app:p@hunter2secret@db/x",  # an unescaped '@'
    ],
)
@pytest.mark.parametrize("verb", [["locks"], ["queued"], ["why", "some-id"]])
def test_a_bad_database_url_is_a_usage_error_not_a_traceback(url, verb):
    """Exit 2 with the masked message (docs/operations/cli.md, Exit status), not an
    uncaught ConfigurationError."""
    result = CliRunner().invoke(cli.standalone_command, ["--database-url", url, *verb])
    assert "hunter2" not in result.output
    assert 2 == result.exit_code, (result.output, result.exception)
    assert "pglock_database_url" in result.output


def test_why_a_run_whose_worker_clock_is_behind_the_producers_ran(app, database_url):
    """`sent` is stamped by the producer's clock, `started`/`ended` by the worker's: a
    worker 50 ms behind (NTP keeps hosts only roughly in sync) that ran a short task
    must not make `why` say the message is still queued."""
    engine = engines.engine_for(app.conf)
    history.TABLE.ensure(engine)
    task_id = f"skewed-{uuid.uuid4()}"
    now = time.time()
    rows = [
        (now, "sent", {"outcome": "published", "key": "1", "by": "producer:1"}),
        (now - 0.05, "started", {"key": "1", "on": "worker:2", "waited": 0.0}),
        (now - 0.04, "ended", {"state": "SUCCESS", "held": 0.01}),
    ]
    with engines.autocommit_cursor(engine) as cursor:
        for at, event, detail in rows:
            cursor.execute(
                "INSERT INTO celery_pglock_history VALUES (%s, to_timestamp(%s), %s, %s)",
                (task_id, at, event, json.dumps(detail)),
            )
    document = why(database_url, task_id)
    assert document["verdict"].startswith("ran on worker:2, ended SUCCESS"), document
    engine.dispose()
