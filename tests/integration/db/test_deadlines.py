"""deadlines: a round trip's bound shuts its socket down only while its statement is under
way, never once its block has ended (even if the block's exit never ran)."""

from __future__ import annotations

import time

import psycopg2
import pytest

from celery_pglock.db import deadlines
from celery_pglock.testing import _support


@pytest.fixture
def connection(database_url):
    connection = _support.connect(database_url, application_name="deadlines test")
    connection.autocommit = True
    yield connection
    connection.close()


def _one(connection, statement):
    with connection.cursor() as cursor:
        cursor.execute(statement)
        return cursor.fetchone()


def test_a_bound_whose_exit_never_ran_leaves_its_connection_alone(connection):
    """A soft time limit landing on entering Bound.__exit__ leaves the bound watched and
    armed. Before, the reaper shut the socket down at its deadline: the connection, back
    in the pool by then (or its fd reused by another), failed its next statement."""
    bound = deadlines.bounded(connection, 0.2)
    bound.__enter__()  # and no __exit__
    assert (1,) == _one(connection, "SELECT 1")
    time.sleep(0.2 + 3 * deadlines.TICK)
    assert (2,) == _one(connection, "SELECT 2")
    assert not bound.fired


def test_a_bound_still_ends_a_statement_under_way(connection):
    started = time.monotonic()
    with (
        pytest.raises(psycopg2.OperationalError),
        deadlines.bounded(connection, 0.2) as bound,
    ):
        _one(connection, "SELECT pg_sleep(3)")
    assert bound.fired
    assert time.monotonic() - started < 0.2 + 2 * deadlines.TICK + 0.5
