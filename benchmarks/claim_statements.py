"""What a lock_enqueue send's statement costs PostgreSQL: the lean FIRST against CLAIM.

    .venv/bin/python benchmarks/claim_statements.py [--sends N] [--reps R]

Each form is sent N times on one connection, as the library sends it (prepared, its
params written by sql_text.inline), for new keys and for duplicates of one fresh row; the
CPU of that backend is read with psutil (10 ms ticks) and the client's with
``time.thread_time``. The forms are interleaved over R repetitions. The rows are deleted
at the end. Services as in compare.py (:func:`celery_pglock.testing.start_services`).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
import uuid
from collections.abc import Callable, Collection, Iterator
from typing import TYPE_CHECKING, Any

import psutil

from celery_pglock import keys
from celery_pglock.db import engines, sql_text
from celery_pglock.task import queued
from celery_pglock.testing import start_services

if TYPE_CHECKING:
    from celery_pglock.db.own_tables import OwnTable

FORMS = {
    "CLAIM": (queued.CLAIM_NAME, queued.CLAIM),
    "FIRST": (queued.FIRST_NAME, queued.FIRST),
}
TASK_NAME = "bench.claim_statements"


Send = Callable[[str, dict[str, Any]], None]
#: The key's material -> the params of one send.
Params = Callable[[str], dict[str, Any]]


def measure(
    send: Send,
    backend: psutil.Process,
    forms: Collection[str],
    cases: Collection[str],
    params: Params,
    sends: int,
    reps: int,
) -> dict[str, list[tuple[float, float]]]:
    """(server, client) µs per send of each "form, case", the forms interleaved. The
    case "new key" sends a key of its own each time; any other, the key named by it."""
    results: dict[str, list[tuple[float, float]]] = {}
    for rep in range(reps):
        for case in cases:
            for form in forms:
                values = [
                    params(f"{form}-{rep}-{i}" if case == "new key" else case)
                    for i in range(sends)
                ]
                send(form, values[0])  # prepared before the timing
                server0, client0 = backend.cpu_times(), time.thread_time()
                for one in values:
                    send(form, one)
                server1, client1 = backend.cpu_times(), time.thread_time()
                server = (server1.user + server1.system) - (
                    server0.user + server0.system
                )
                results.setdefault(f"{form}, {case}", []).append(
                    (server * 1e6 / sends, (client1 - client0) * 1e6 / sends)
                )
    return results


def report(
    results: dict[str, list[tuple[float, float]]], sends: int, reps: int
) -> None:
    print(f"{sends} sends x {reps} interleaved repetitions; µs per send")
    width = max(len(label) for label in results)
    print(
        f"{'statement':<{width}} {'server mean':>11} {'median':>7} {'client mean':>11}"
    )
    for label, samples in results.items():
        server = [s for s, _ in samples]
        client = [c for _, c in samples]
        print(
            f"{label:<{width}} {statistics.mean(server):>11.1f} "
            f"{statistics.median(server):>7.1f} {statistics.mean(client):>11.1f}"
        )


def arguments(description: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--sends", type=int, default=4000)
    parser.add_argument("--reps", type=int, default=5)
    return parser.parse_args()


@contextlib.contextmanager
def connection(table: OwnTable) -> Iterator[tuple[Any, Any, psutil.Process]]:
    """An autocommit DBAPI connection to the services' database, with ``table`` made:
    (connection, its cursor, its backend's process)."""
    with start_services() as services:
        engine = engines.create_engine(services.database_url)
        table.ensure(engine, 5.0)
        dbapi: Any = engine.raw_connection().dbapi_connection
        dbapi.autocommit = True
        cursor = dbapi.cursor()
        cursor.execute(sql_text.BACKEND_PID)
        try:
            yield dbapi, cursor, psutil.Process(cursor.fetchone()[0])
        finally:
            dbapi.close()
            engine.dispose()


def main() -> int:
    args = arguments(__doc__.split("\n", 1)[0])
    run = uuid.uuid4().hex[:8]
    with connection(queued.TABLE) as (dbapi, cursor, backend):

        def params(material: str) -> dict[str, Any]:
            task_id = str(uuid.uuid4())
            key = keys.make_key("bench-claim", run, material)
            return {
                **queued._row_params(key, task_id),
                "name": TASK_NAME,
                "run": keys.run_key(task_id).ids[-1],
                "mode": queued.UNTIL_FINISHED,
                "stale": 600.0,
                "force": False,
            }

        def send(form: str, values: dict[str, Any]) -> None:
            execute = sql_text.prepared(dbapi, cursor, *FORMS[form])
            cursor.execute(*sql_text.inline(execute, values))
            cursor.fetchone()

        send("CLAIM", params("duplicate"))  # the duplicates' row
        results = measure(
            send,
            backend,
            FORMS,
            ("new key", "duplicate"),
            params,
            args.sends,
            args.reps,
        )
        cursor.execute(
            "DELETE FROM celery_pglock_queued WHERE task_name = %s", (TASK_NAME,)
        )
    report(results, args.sends, args.reps)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
