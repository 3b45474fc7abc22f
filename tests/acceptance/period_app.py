"""A lock_period task and its beat schedule, for tests/acceptance/test_period.py.

A module of its own (the worker and both beats run ``-A tests.acceptance.period_app``),
so the shared acceptance app stays as it is. Beat imports this module, so it publishes
through the task class. Each body records, in one statement, its start on PostgreSQL's
clock beside the period's row as the body sees it.
"""

from __future__ import annotations

import os

from celery_pglock import SingletonTask, current_lock
from tests.acceptance.app import _gate_cursor, app

__all__ = ["app", "ticked"]

RUN_ENV = "PGLOCK_TEST_PERIOD_RUN"
PERIOD = 5.0
STARTS_TABLE = "pglock_test_period_starts"

app.conf.beat_schedule = {
    "tick": {
        "task": "tests.acceptance.period_app.ticked",
        "schedule": 1.0,
        "args": (os.environ.get(RUN_ENV, "no-run"),),
    }
}


def setup() -> None:
    with _gate_cursor() as cursor:
        cursor.execute(
            f"CREATE TABLE IF NOT EXISTS {STARTS_TABLE} (run text, task_id text, "
            "body_at timestamptz, period_at timestamptz, period_task text)"
        )


@app.task(
    base=SingletonTask, bind=True, shared=False, lock_args=("run",), lock_period=PERIOD
)
def ticked(self, run: str) -> str:
    """Record this body's start and the period row it started under."""
    with _gate_cursor() as cursor:
        cursor.execute(
            f"INSERT INTO {STARTS_TABLE} SELECT %s, %s, clock_timestamp(), "
            "p.started_at, p.task_id FROM (SELECT 1) one LEFT JOIN celery_pglock_periods p "
            "ON (p.classid, p.objid, p.objsubid) = (%s, %s, %s)",
            (run, self.request.id, *current_lock().key.pg_locks_ids),
        )
    return run
