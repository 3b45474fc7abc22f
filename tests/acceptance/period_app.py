"""A lock_period task, a lock_enqueue task and their beat schedule, for
tests/acceptance/test_period.py.

A module of its own (the worker and both beats run ``-A tests.acceptance.period_app``),
so the shared acceptance app stays as it is. Beat imports this module, so it publishes
through the task class. Each body records, in one statement, its start on PostgreSQL's
clock beside the period's row as the body sees it. The lock_enqueue task records each
delivery (task_prerun: before its lock is tried) and its body's start and end.
"""

from __future__ import annotations

import os
import time

from celery import signals

from celery_pglock import SingletonTask, current_lock
from tests.acceptance.app import _gate_cursor, app

__all__ = ["app", "enqueued", "ticked"]

RUN_ENV = "PGLOCK_TEST_PERIOD_RUN"
PERIOD = 5.0
STARTS_TABLE = "pglock_test_period_starts"
ENQUEUED_TABLE = "pglock_test_enqueued_events"
ENQUEUED_BODY = 3.0  #: Seconds: several ticks of both beats fall within one run.

app.conf.beat_schedule = {
    "tick": {
        "task": "tests.acceptance.period_app.ticked",
        "schedule": 1.0,
        "args": (os.environ.get(RUN_ENV, "no-run"),),
    },
    "queued-tick": {
        "task": "tests.acceptance.period_app.enqueued",
        "schedule": 1.0,
        "args": (os.environ.get(RUN_ENV, "no-run"),),
    },
}


def setup() -> None:
    with _gate_cursor() as cursor:
        cursor.execute(
            f"CREATE TABLE IF NOT EXISTS {STARTS_TABLE} (run text, task_id text, "
            "body_at timestamptz, period_at timestamptz, period_task text)"
        )
        cursor.execute(
            f"CREATE TABLE IF NOT EXISTS {ENQUEUED_TABLE} (run text, task_id text, "
            "event text, at timestamptz)"
        )


def _record(run: str, task_id: str | None, event: str) -> None:
    with _gate_cursor() as cursor:
        cursor.execute(
            f"INSERT INTO {ENQUEUED_TABLE} VALUES (%s, %s, %s, clock_timestamp())",
            (run, task_id, event),
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


@app.task(
    base=SingletonTask,
    bind=True,
    shared=False,
    lock_args=("run",),
    lock_enqueue="until_finished",
)
def enqueued(self, run: str) -> str:
    """A body longer than a tick: both beats' ticks meanwhile publish nothing."""
    _record(run, self.request.id, "start")
    time.sleep(ENQUEUED_BODY)
    _record(run, self.request.id, "end")
    return run


@signals.task_prerun.connect(sender=enqueued, weak=False)
def _delivered(
    task_id: str | None = None, args: tuple[str] = ("?",), **_: object
) -> None:
    _record(args[0], task_id, "delivered")
