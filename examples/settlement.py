"""The daily settlement of the article this library grew from (docs/design.md, "The
article"): one transaction, ``pg_try_advisory_xact_lock``.

Every pending row of ``settlements`` is locked ``FOR UPDATE``, marked processed, and the
run is written to ``settlement_runs``, all in the one transaction that also holds the
advisory lock (42, 1001). Committing releases the lock; an error rolls the work back and
releases it too, so the lock cannot leak.

The beat schedule sends the task every 10 s. Run two beats (two replicas of a deployment,
say) and every tick is sent twice, yet the two runs never overlap. A copy that starts
while the other holds the lock is skipped (``LockSkipped``) without touching a row; a copy that
starts after the other committed finds no pending row and settles 0. The lock keeps the
work from running twice at once; the ``pending -> processed`` transition is what keeps a
row from being settled twice. From the repository root (``celery[redis]``: Celery's Redis
transport, for the broker)::

    pip install . 'celery[redis]'
    export CELERY_PGLOCK_DATABASE_URL=postgresql+psycopg2://postgres:postgres@localhost:5432/postgres
    export CELERY_PGLOCK_BROKER_URL=redis://localhost:6379/0   # the default
    python -m examples.settlement 5          # create the tables, add 5 pending rows
    celery -A examples.settlement worker --loglevel INFO
    celery -A examples.settlement beat -s /tmp/beat-a.db    # in another terminal
    celery -A examples.settlement beat -s /tmp/beat-b.db    # and a second beat

(Each beat needs its own schedule file, ``-s``.) Per tick, the worker log shows one run
that settled the pending rows, and a second one that was skipped ("raised expected:
LockSkipped(... is held by <host>:<pid> ...)") or settled 0, depending on how close together the two beats sent.

Environment: CELERY_PGLOCK_DATABASE_URL names the lock database, which is also where the
tables live (transaction scope works on the lock's own connection, so they must share a
database); CELERY_PGLOCK_BROKER_URL the broker; CELERY_PGLOCK_RESULT_BACKEND the result
backend (default: the broker). EXAMPLE_TABLE_SUFFIX is appended to the table names, so
that tests and several copies of the example can share one database; EXAMPLE_QUEUE
(default ``celery``) and SETTLEMENT_EVERY (seconds between ticks, default 10) let them
share a broker and wait less. PGLOCK_METRICS_PORT (and PGLOCK_METRICS_ADDRESS) serve
/metrics, as docker-compose.yml does: it runs this example with a worker, a beat, Flower,
Prometheus and Grafana.
"""

from __future__ import annotations

import os
import re
import sys

import sqlalchemy as sa
from celery import Celery

from celery_pglock import SingletonTask, current_lock

BROKER_URL = os.environ.get("CELERY_PGLOCK_BROKER_URL", "redis://localhost:6379/0")
#: The article's numeric registry: namespace 42 is "background jobs", 1001 "daily
#: settlement". Explicit numbers (not a hashed name) let psql and other services take
#: the very same lock: ``SELECT pg_try_advisory_xact_lock(42, 1001)``.
BACKGROUND_JOBS, DAILY_SETTLEMENT = 42, 1001

_SUFFIX = os.environ.get("EXAMPLE_TABLE_SUFFIX", "")
if not re.fullmatch(r"[a-z0-9_]{0,30}", _SUFFIX):
    raise ValueError(f"EXAMPLE_TABLE_SUFFIX must match [a-z0-9_]*; got {_SUFFIX!r}.")
SETTLEMENTS = f"settlements{_SUFFIX}"
RUNS = f"settlement_runs{_SUFFIX}"

app = Celery(
    "settlement",
    broker=BROKER_URL,
    backend=os.environ.get("CELERY_PGLOCK_RESULT_BACKEND") or BROKER_URL,
)
app.conf.update(
    # pglock_database_url is not set: the library reads CELERY_PGLOCK_DATABASE_URL.
    broker_connection_retry_on_startup=True,
    worker_prefetch_multiplier=1,
    task_default_queue=os.environ.get("EXAMPLE_QUEUE") or "celery",
    beat_schedule={
        # Every 10 s so that you can watch it; a real daily job would use
        # celery.schedules.crontab(hour=2, minute=0).
        "daily-settlement": {
            "task": "settlement.daily_settlement",
            "schedule": float(os.environ.get("SETTLEMENT_EVERY") or 10),
        },
    },
    # /metrics for Prometheus when PGLOCK_METRICS_PORT is set (docker-compose.yml does).
    pglock_metrics_port=int(os.environ["PGLOCK_METRICS_PORT"])
    if os.environ.get("PGLOCK_METRICS_PORT")
    else None,
    pglock_metrics_address=os.environ.get("PGLOCK_METRICS_ADDRESS") or None,
)


@app.task(
    base=SingletonTask,
    # An explicit name: beat_schedule refers to it, whichever way the module is imported.
    name="settlement.daily_settlement",
    lock_scope="transaction",
    lock_id=(BACKGROUND_JOBS, DAILY_SETTLEMENT),
)
def daily_settlement() -> int:
    """Settle every pending row; return how many. Skipped while another run holds (42, 1001)."""
    # The lock's own transaction: what we write here commits together with the release
    # when we return, and rolls back with it if we raise. Never commit it ourselves.
    connection = current_lock().connection
    started_at = connection.execute(sa.text("SELECT clock_timestamp()")).scalar_one()
    # FOR UPDATE although we hold the advisory lock: the lock is only advisory, and a
    # code path that forgot it (an admin script, an API handler) must still not settle
    # a row that we are settling. Row locks are enforced by PostgreSQL for everyone.
    pending = (
        connection.execute(
            sa.text(
                f"SELECT id FROM {SETTLEMENTS} WHERE status = 'pending' "
                "ORDER BY id FOR UPDATE"
            )
        )
        .scalars()
        .all()
    )
    if pending:
        connection.execute(
            sa.text(
                f"UPDATE {SETTLEMENTS} SET status = 'processed', "
                "processed_at = now(), processed_by = :task_id WHERE id = ANY(:ids)"
            ),
            {"task_id": daily_settlement.request.id, "ids": list(pending)},
        )
    # The article: record outcomes, with their duration. Written in the same transaction,
    # so a run that rolls back leaves no record of having settled anything.
    connection.execute(
        sa.text(
            f"INSERT INTO {RUNS} (task_id, started_at, finished_at, settled) "
            "VALUES (:task_id, :started_at, clock_timestamp(), :settled)"
        ),
        {
            "task_id": daily_settlement.request.id,
            "started_at": started_at,
            "settled": len(pending),
        },
    )
    return len(pending)


def _database_url(database_url: str | None) -> str:
    url = database_url or os.environ.get("CELERY_PGLOCK_DATABASE_URL")
    if not url:
        raise RuntimeError("Set CELERY_PGLOCK_DATABASE_URL to a PostgreSQL URL.")
    return url


def setup_schema(database_url: str | None = None) -> None:
    """Create the example's tables if they do not exist.

    Args:
        database_url: SQLAlchemy URL; by default CELERY_PGLOCK_DATABASE_URL.
    """
    engine = sa.create_engine(_database_url(database_url))
    try:
        with engine.begin() as connection:
            connection.execute(
                sa.text(
                    f"""
                    CREATE TABLE IF NOT EXISTS {SETTLEMENTS} (
                        id bigserial PRIMARY KEY,
                        account_id int NOT NULL,
                        amount numeric(12, 2) NOT NULL,
                        status text NOT NULL DEFAULT 'pending'
                            CHECK (status IN ('pending', 'processed')),
                        processed_at timestamptz,
                        processed_by text
                    )
                    """
                )
            )
            connection.execute(
                sa.text(
                    f"""
                    CREATE TABLE IF NOT EXISTS {RUNS} (
                        id bigserial PRIMARY KEY,
                        task_id text,
                        started_at timestamptz NOT NULL,
                        finished_at timestamptz NOT NULL,
                        settled int NOT NULL
                    )
                    """
                )
            )
    finally:
        engine.dispose()


def add_pending(count: int, database_url: str | None = None) -> None:
    """Insert ``count`` pending settlements (accounts 1..10, amounts 1.00, 2.00, ...)."""
    engine = sa.create_engine(_database_url(database_url))
    try:
        with engine.begin() as connection:
            connection.execute(
                sa.text(
                    f"INSERT INTO {SETTLEMENTS} (account_id, amount) "
                    "SELECT 1 + n % 10, n FROM generate_series(1, :count) AS n"
                ),
                {"count": count},
            )
    finally:
        engine.dispose()


if __name__ == "__main__":
    rows = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    setup_schema()
    add_pending(rows)
    print(f"{SETTLEMENTS}: added {rows} pending rows.")
