"""What one queued key costs PostgreSQL, per table design (issue 35): WAL-logged and
UNLOGGED, with its statements prepared (as the library sends them) and unprepared.

    .venv/bin/python benchmarks/queued_table.py [--keys N] [--reps R]

One key's life is the floor of lock_enqueue's design: the row inserted at publish, a
try-lock before the body, the row deleted by the statement that unlocks after it, the
writes committed asynchronously. Sent on one connection, key after key, and measured on
the server: the CPU of that backend (psutil, 10 ms ticks; N keys per figure), of the other
PostgreSQL processes (the WAL writer, the checkpointer), and the WAL bytes written. The
designs are interleaved over R repetitions; medians. The two tables are the benchmark's
own (``bench_floor_queued*``) and their rows are deleted as the keys end.
"""

from __future__ import annotations

import argparse
import statistics
import uuid
from typing import Any

import psutil

from celery_pglock.testing import _support, start_services

TABLES = {"WAL-logged": "bench_floor_queued", "UNLOGGED": "bench_floor_queued_unlogged"}
_CREATE = """
CREATE TABLE IF NOT EXISTS bench_floor_queued (k text PRIMARY KEY, task_id text NOT NULL,
  started_at timestamptz);
CREATE UNLOGGED TABLE IF NOT EXISTS bench_floor_queued_unlogged (k text PRIMARY KEY,
  task_id text NOT NULL, started_at timestamptz);
"""
_ASYNC = "s AS MATERIALIZED (SELECT set_config('synchronous_commit', 'off', true))"
PUBLISH = (
    "WITH i AS (INSERT INTO {table} (k, task_id) VALUES ($1, $2) ON CONFLICT DO NOTHING "
    f"RETURNING task_id), {_ASYNC} SELECT task_id FROM i, s"
)
START = "SELECT pg_try_advisory_lock(hashtext($1))"
END = (
    f"WITH d AS (DELETE FROM {{table}} WHERE k = $1 RETURNING 1), {_ASYNC} "
    "SELECT pg_advisory_unlock(hashtext($1)) FROM s"
)


def postgres_cpu(backend: int) -> tuple[float, float]:
    """CPU seconds of ``backend`` and of every other postgres process on this host."""
    mine = others = 0.0
    for process in psutil.process_iter(["name"]):
        try:
            if not (process.info["name"] or "").startswith("postgres"):
                continue
            seconds = sum(process.cpu_times()[:2])
        except psutil.Error:
            continue
        if process.pid == backend:
            mine += seconds
        else:
            others += seconds
    return mine, others


class Design:
    """One table's key life, its statements prepared or sent as text."""

    def __init__(self, cursor: Any, label: str, table: str, prepared: bool) -> None:
        self.cursor = cursor
        self.label = f"{label}, {'prepared' if prepared else 'unprepared'}"
        #: Each statement: the text sent, and how many times it passes the key.
        self.sends: dict[str, tuple[str, int]] = {}
        for kind, text in (("publish", PUBLISH), ("start", START), ("end", END)):
            text = text.format(table=table)
            if prepared:
                distinct = 2 if "$2" in text else 1
                name = f"{kind}_{table}"
                cursor.execute(
                    f"PREPARE {name} ({', '.join(['text'] * distinct)}) AS {text}"
                )
                self.sends[kind] = (
                    f"EXECUTE {name} ({', '.join(['%s'] * distinct)})",
                    distinct,
                )
            else:
                self.sends[kind] = (
                    text.replace("$1", "%s").replace("$2", "%s"),
                    text.count("$"),
                )

    def measure(self, backend: int, count: int) -> tuple[float, float, float]:
        """``count`` new keys, published first, then each started and ended: per key, the
        CPU µs of ``backend`` and of the other postgres processes, and the WAL bytes."""
        keys = [uuid.uuid4().hex for _ in range(count)]
        self.cursor.execute("SELECT pg_current_wal_insert_lsn()")
        lsn = self.cursor.fetchone()[0]
        mine, others = postgres_cpu(backend)
        for phase in (("publish",), ("start", "end")):
            for key in keys:
                for kind in phase:
                    text, params = self.sends[kind]
                    self.cursor.execute(text, (key,) * params)
                    self.cursor.fetchone()
        mine_after, others_after = postgres_cpu(backend)
        self.cursor.execute(
            "SELECT pg_wal_lsn_diff(pg_current_wal_insert_lsn(), %s)", (lsn,)
        )
        wal = float(self.cursor.fetchone()[0])
        return (
            (mine_after - mine) * 1e6 / count,
            (others_after - others) * 1e6 / count,
            wal / count,
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keys", type=int, default=4000, help="keys per figure")
    parser.add_argument("--reps", type=int, default=7, help="interleaved repetitions")
    args = parser.parse_args()
    with start_services() as services:
        connection = _support.connect(
            services.database_url, application_name="bench queued"
        )
        try:
            with connection.cursor() as cursor:
                cursor.execute(_CREATE)
                cursor.execute("SELECT pg_backend_pid()")
                backend = cursor.fetchone()[0]
                designs = [
                    Design(cursor, label, table, prepared)
                    for label, table in TABLES.items()
                    for prepared in (False, True)
                ]
                figures: dict[str, list[tuple[float, float, float]]] = {
                    d.label: [] for d in designs
                }
                for _ in range(args.reps):
                    for design in designs:
                        figures[design.label].append(design.measure(backend, args.keys))
        finally:
            connection.close()
    print(
        "| table, statements | backend CPU µs/key | other PostgreSQL CPU µs/key | WAL bytes/key |"
    )
    print("|---|---:|---:|---:|")
    for label, rows in figures.items():
        cpu, other, wal = (statistics.median(r[i] for r in rows) for i in range(3))
        print(f"| {label} | {cpu:.0f} | {other:.0f} | {wal:.0f} |")
    print(
        f"\n`benchmarks/queued_table.py --keys {args.keys} --reps {args.reps}`; medians."
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
