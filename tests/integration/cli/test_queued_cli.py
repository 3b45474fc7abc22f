"""``pglock queued`` and ``queued clear``, ``pglock sql --enqueue`` and the queued-keys
footer of ``pglock locks``, against real PostgreSQL and Redis."""

from __future__ import annotations

import json
import time
import uuid

import pytest
from click.testing import CliRunner

from celery_pglock import AdvisoryLock, cli, keys
from tests.integration.task_support import current_engine, define


def run(database_url, *args, expect=0):
    result = CliRunner().invoke(
        cli.standalone_command, ["--database-url", database_url, *args]
    )
    assert expect == result.exit_code, result.output + repr(result.exception)
    return result.output


@pytest.fixture
def task(app):
    def export(tenant):
        return tenant

    export.__name__ = f"export_{uuid.uuid4().hex[:8]}"  # its rows only
    return define(
        app,
        export,
        lock_args=("tenant",),
        lock_enqueue="until_finished",
        lock_enqueue_lost_after=0.3,
    )


def listed(database_url, task):
    return json.loads(run(database_url, "queued", "--json", "--task", task.name))


def test_queued_lists_each_state_and_locks_counts_them(database_url, task):
    """queued, running (its run lock held; the holder named) and stale rows, oldest
    first; `pglock locks` ends with their count."""
    queued_one = task.delay(1)
    running = task.delay(2)
    run_lock = AdvisoryLock(
        engine=current_engine(task.app), key=keys.run_key(running.id)
    )
    assert run_lock.acquire()
    try:
        time.sleep(0.4)  # both past lost_after: 1 is stale, 2 is kept by its run lock
        fresh = task.delay(3)
        rows = {row["task_id"]: row for row in listed(database_url, task)}
        assert "stale" == rows[queued_one.id]["state"]
        assert "running" == rows[running.id]["state"]
        assert "queued" == rows[fresh.id]["state"]
        assert str(task.lock_key_for(3)) == rows[fresh.id]["key"]
        assert "until_finished" == rows[fresh.id]["mode"]
        text = run(database_url, "queued", "--task", task.name)
        assert fresh.id in text
        assert "TASK ID" in text
        assert "queued key(s)" in run(database_url, "locks")
    finally:
        run_lock.release()


def test_clear_by_key_stale_and_all(database_url, task):
    first, second = task.delay(1), task.delay(2)
    key = str(task.lock_key_for(1))
    assert "Freed 1 " in run(database_url, "queued", "clear", "--key", key)
    assert [second.id] == [r["task_id"] for r in listed(database_url, task)]
    time.sleep(0.4)
    run(database_url, "queued", "clear", "--stale")
    assert [] == listed(database_url, task)
    assert task.delay(1).id != first.id
    run(database_url, "queued", "clear", "--all")
    assert [] == listed(database_url, task)
    run(database_url, "queued", "clear", "--all", "--stale", expect=2)


def test_sql_enqueue_prints_the_table_and_its_grants(database_url):
    text = run(database_url, "sql", "--enqueue")
    assert "CREATE UNLOGGED TABLE IF NOT EXISTS" in text
    assert "SET UNLOGGED" in text
    assert '"public".celery_pglock_queued' in text
    assert "-- GRANT SELECT, INSERT, UPDATE, DELETE" in text
    assert "DROP TABLE" in run(database_url, "sql", "--enqueue", "--uninstall")


def test_queued_shows_a_debounced_keys_carrier_and_due_time(database_url, app):
    """Latest wins: the key's task id is the latest send, carried by the queued message;
    with lock_debounce, when it is due. Clearing by the carrier's id frees the key."""

    def debounced(tenant, value):
        return value

    debounced.__name__ = f"debounced_{uuid.uuid4().hex[:8]}"
    task = define(
        app,
        debounced,
        lock_args=("tenant",),
        lock_enqueue="until_started",
        lock_debounce=60,
    )
    carrier = task.delay(1, 1)
    latest = task.delay(1, 2)
    [row] = listed(database_url, task)
    assert (latest.id, carrier.id) == (row["task_id"], row["carrier"])
    assert 55 < row["due_in_seconds"] <= 60
    text = run(database_url, "queued", "--task", task.name)
    assert f"carried by {carrier.id}, due in " in text
    assert "Freed 1 " in run(database_url, "queued", "clear", carrier.id)
    assert [] == listed(database_url, task)


def test_sql_enqueue_prints_the_tombstones_table_too(database_url):
    text = run(database_url, "sql", "--enqueue")
    assert "ADD COLUMN IF NOT EXISTS carrier text" in text
    assert '"public".celery_pglock_replaced' in text
    assert "DROP TABLE IF EXISTS" in run(
        database_url, "sql", "--enqueue", "--uninstall"
    )
