"""What sql_text.PLAN_GUARD buys and costs: a duplicate lock_enqueue send (queued.FIRST) on
sessions whose generic plan was made while the table held one row, or once it held many.

    .venv/bin/python benchmarks/plan_guard.py [--rows N] [--sends S] [--reps R]

Four sessions send the same duplicate: the library's form (guarded) and the same EXECUTE
without the guard, each with its plan made on the nearly empty table (one row, after
VACUUM ANALYZE) or after N more rows were inserted. Backend CPU per send is read from
psutil (10 ms ticks), the sessions interleaved over R repetitions. It runs in a database of
its own, dropped at the end, on the services of compare.py (start_services).
"""

from __future__ import annotations

import argparse
import statistics
import uuid
from typing import Any

import psutil
from sqlalchemy.engine import make_url

from celery_pglock.db import engines, sql_text
from celery_pglock.task import queued
from celery_pglock.testing import _support, start_services

FEW_SENDS = 200  #: For the bare session planned on one row: each of its sends is slow.


def params(objid: int, task_id: str) -> dict[str, Any]:
    """queued.FIRST's params for a send of key (1, ``objid``, 1)."""
    return {
        "c": 1,
        "o": objid,
        "s": 1,
        "id": task_id,
        "name": "bench.plan_guard",
        "run": 1,
        "mode": queued.UNTIL_FINISHED,
        "stale": 600.0,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=20_000)
    parser.add_argument("--sends", type=int, default=3_000)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    with start_services() as services:
        name = f"plan_guard_{uuid.uuid4().hex[:8]}"
        admin = _support.connect(services.database_url, application_name="plan guard")
        with admin.cursor() as cursor:
            cursor.execute(f'CREATE DATABASE "{name}"')
        url = make_url(services.database_url).set(database=name)
        engine = engines.create_engine(url.render_as_string(False))
        try:
            print(run(engine, args.rows, args.sends, args.reps))
        finally:
            engine.dispose()
            with admin.cursor() as cursor:
                cursor.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
            admin.close()
    return 0


def run(engine: Any, rows: int, sends: int, reps: int) -> str:
    queued.TABLE.ensure(engine, 10.0)
    sessions: dict[str, tuple[Any, str, psutil.Process]] = {}
    # Each session its own connection, out of the pool till the end.
    held: list[Any] = []

    def connection() -> Any:
        held.append(engine.raw_connection())
        dbapi = held[-1].dbapi_connection
        dbapi.autocommit = True
        return dbapi

    def session(label: str, guarded: bool) -> None:
        dbapi = connection()
        cursor = dbapi.cursor()
        execute = sql_text.prepared(dbapi, cursor, queued.FIRST_NAME, queued.FIRST)
        if not guarded:
            execute = execute.removeprefix(sql_text.PLAN_GUARD)
        for number in range(10):  # past the five custom plans: the generic one is kept
            send(cursor, execute, f"warm-{number}")
        cursor.execute(sql_text.BACKEND_PID)
        sessions[label] = (cursor, execute, psutil.Process(cursor.fetchone()[0]))

    def send(cursor: Any, execute: str, task_id: str, objid: int = 0) -> None:
        sql_text.run(cursor, *sql_text.inline(execute, params(objid, task_id)))

    first_cursor = connection().cursor()
    first = sql_text.prepared(
        first_cursor.connection, first_cursor, queued.FIRST_NAME, queued.FIRST
    )
    send(first_cursor, first, "owner")  # the duplicate's row
    first_cursor.execute("VACUUM ANALYZE celery_pglock_queued")
    session("guarded, planned on 1 row", True)
    session("bare, planned on 1 row", False)
    for number in range(1, rows + 1):
        send(first_cursor, first, f"filler-{number}", objid=number)
    session(f"guarded, planned on {rows:,} rows", True)
    session(f"bare, planned on {rows:,} rows", False)
    cpu: dict[str, list[float]] = {label: [] for label in sessions}
    for rep in range(reps):
        for label, (cursor, execute, backend) in sessions.items():
            count = FEW_SENDS if label == "bare, planned on 1 row" else sends
            before = sum(backend.cpu_times()[:2])
            for number in range(count):
                send(cursor, execute, f"dup-{rep}-{number}")
            cpu[label].append((sum(backend.cpu_times()[:2]) - before) * 1e6 / count)
    for pooled in held:
        pooled.close()
    lines = [
        f"backend CPU per duplicate send, table of {rows + 1:,} rows, median of {reps}",
        *(f"  {label:<34} {statistics.median(v):8.1f} µs" for label, v in cpu.items()),
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
