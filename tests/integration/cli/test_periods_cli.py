"""``pglock periods`` and ``periods prune`` against real PostgreSQL: rows past the longest
lock_period of the app's tasks are deleted, rows within it never are."""

from __future__ import annotations

import json
import threading
import uuid

import pytest
from click.testing import CliRunner
from sqlalchemy.engine import make_url

from celery_pglock import cli
from celery_pglock.db import engines
from celery_pglock.task import periods
from celery_pglock.testing import _support

APP = "tests.integration.cli_app:app"  # its longest lock_period: 3600 s (throttled)


def run(*args, expect=0):
    result = CliRunner().invoke(cli.standalone_command, list(args))
    assert expect == result.exit_code, result.output + repr(result.exception)
    return result.output


@pytest.fixture
def cli_app(database_url, monkeypatch):
    monkeypatch.setenv("CELERY_PGLOCK_TEST_DATABASE_URL", database_url)
    from tests.integration import cli_app

    cli_app.app.conf.pglock_database_url = database_url
    return cli_app


@pytest.fixture
def connection(database_url):
    engine = engines.create_engine(database_url)
    periods.TABLE.ensure(engine)
    engine.dispose()
    connection = _support.connect(database_url, application_name="periods test")
    yield connection
    connection.close()


def started(connection, *ages):
    """A row per age (seconds ago) under keys of this test's own; their (classid, objid)."""
    classid = (1 << 30) + uuid.uuid4().int % (1 << 30)  # no real key's in this database
    rows = [(classid, objid) for objid in range(len(ages))]
    with connection.cursor() as cursor:
        for (c, o), age in zip(rows, ages, strict=True):
            cursor.execute(
                "INSERT INTO celery_pglock_periods VALUES "
                "(%s, %s, 1, now() - make_interval(secs => %s), %s)",
                (c, o, age, str(uuid.uuid4())),
            )
    return rows


def ages(connection, rows):
    """The ages left of ``rows``, in their order (None: deleted)."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT objid, extract(epoch FROM now() - started_at)::int "
            "FROM celery_pglock_periods WHERE classid = %s",
            (rows[0][0],),
        )
        found = dict(cursor.fetchall())
    return [found.get(objid) for _, objid in rows]


def test_prune_deletes_only_rows_past_the_longest_period(cli_app, connection):
    rows = started(connection, 30, 1800, 7200, 864000)
    summary = json.loads(run("--app", APP, "periods", "--json"))
    assert (3600, "tests.integration.cli_app.throttled") == (
        summary["longest_period"],
        summary["longest_period_task"],
    )
    assert summary["rows"] >= 4
    assert summary["prunable"] >= 2
    assert "past the longest period" in run("--app", APP, "periods")

    # Shorter than the app's longest period: refused, nothing deleted.
    refused = run("--app", APP, "periods", "prune", "--older-than", "60", expect=2)
    assert "period of tests.integration.cli_app.throttled (3600 s)" in refused
    assert [30, 1800, 7200, 864000] == ages(connection, rows)

    assert "Deleted " in run("--app", APP, "periods", "prune")
    assert [30, 1800, None, None] == ages(connection, rows)


def test_prune_without_an_app_needs_older_than(cli_app, connection, database_url):
    rows = started(connection, 30, 7200)
    url = ("--database-url", database_url)
    text = run(*url, "periods", "prune", expect=2)
    assert "pass --app" in text
    assert "--older-than" in text
    run(*url, "periods", "prune", "--older-than", "0", expect=2)
    run(*url, "periods", "prune", "--older-than", "nan", expect=2)
    assert [30, 7200] == ages(connection, rows)
    run(*url, "periods", "prune", "--older-than", "3600")
    assert [30, None] == ages(connection, rows)
    assert "the rows a prune may delete are unknown" in run(*url, "periods")


def test_prune_goes_on_until_no_old_row_is_left(connection, database_url):
    """Batches smaller than the rows to delete: every old row goes, the young one stays."""
    rows = started(connection, *[7200] * 7, 10)
    engine = engines.create_engine(database_url)
    try:
        assert periods.prune(engine, 3600, batch=2) >= 7
    finally:
        engine.dispose()
    assert [None] * 7 + [10] == ages(connection, rows)


def test_without_the_table_both_say_so(database_url):
    """A database where no lock_period task has started: a fresh one of this test's own."""
    name = f"periods_{uuid.uuid4().hex[:8]}"
    admin = _support.connect(database_url, application_name="periods test")
    try:
        with admin.cursor() as cursor:
            cursor.execute(f'CREATE DATABASE "{name}"')
        url = make_url(database_url).set(database=name).render_as_string(False)
        assert "No lock_period table" in run(
            "--database-url", url, "periods", "prune", "--older-than", "60"
        )
        assert "No lock_period table" in run("--database-url", url, "periods")
    finally:
        with admin.cursor() as cursor:
            cursor.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.close()


def test_prune_skips_a_row_a_start_has_locked(connection, database_url):
    """A start's row lock (here: an open transaction updating the row) neither stops the
    prune nor is waited for: the locked row stays, for the next prune."""
    rows = started(connection, 7200, 7200)
    holder = _support.connect(database_url, application_name="periods test holder")
    holder.autocommit = False
    engine = engines.create_engine(database_url)
    done: list[int | None] = []
    pruning = threading.Thread(target=lambda: done.append(periods.prune(engine, 3600)))
    try:
        with holder.cursor() as cursor:
            cursor.execute(
                "UPDATE celery_pglock_periods SET task_id = task_id "
                "WHERE classid = %s AND objid = %s",
                rows[0],
            )
        pruning.start()
        pruning.join(timeout=10)
        assert done, "the prune waited for the locked row"
        assert [7200, None] == ages(connection, rows)
    finally:
        holder.rollback()
        holder.close()
        if pruning.is_alive():
            pruning.join(timeout=10)
    try:
        periods.prune(engine, 3600)
    finally:
        engine.dispose()
    assert [None, None] == ages(connection, rows)
