"""The per-tenant export of the article this library grew from (docs/design.md, "The
article"): a session lock around work with side effects.

``build_tenant_export(tenant_id)`` builds a file, "uploads" it (writes it under
EXPORT_DIR, standing in for object storage) and records it in ``tenant_exports``. That
spans a file write, an upload and a commit of its own, so it cannot live in one
transaction: it runs under a *session* lock (the default scope), one per tenant, on a
connection that the library pins from acquire to release.

The lock only stops two exports of one tenant from running *at the same time*. A worker
that dies after the upload and before the INSERT leaves an object without a record, and
the lock is gone with its session, so a later run repeats the work. Two things make that
repeat harmless (locks reduce concurrency, constraints preserve correctness):

- a deterministic object name, ``tenant-<id>-<date>.<fmt>``, written atomically, so a
  repeated upload replaces the same object instead of adding a second one;
- ``INSERT ... ON CONFLICT DO NOTHING`` on a primary key, so a repeated record is a no-op.

From the repository root (``celery[redis]``: Celery's Redis transport, for the default
broker)::

    pip install . 'celery[redis]'
    export CELERY_PGLOCK_DATABASE_URL=postgresql+psycopg2://postgres:postgres@localhost:5432/postgres
    python -m examples.tenant_export          # create the table
    celery -A examples.tenant_export worker --loglevel INFO
    python -c "from examples.tenant_export import build_tenant_export as t; [t.delay(7) for _ in range(5)]; t.delay(8)"

Tenant 8 runs beside tenant 7, but no two runs of tenant 7 overlap: a duplicate that
starts while one runs is skipped (``LockSkipped``), and one that starts later rewrites the same object and
records nothing new (its result says ``"recorded": false``). Environment: CELERY_PGLOCK_DATABASE_URL (the lock database, and where
``tenant_exports`` lives), CELERY_PGLOCK_BROKER_URL (default redis://localhost:6379/0),
CELERY_PGLOCK_RESULT_BACKEND (default: the broker), EXPORT_DIR (default
``<temp dir>/celery-pglock-exports``) and EXAMPLE_TABLE_SUFFIX (see examples.settlement).
"""

from __future__ import annotations

import datetime
import json
import os
import re
import tempfile
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from celery import Celery

from celery_pglock import SingletonTask

BROKER_URL = os.environ.get("CELERY_PGLOCK_BROKER_URL", "redis://localhost:6379/0")
#: A fixed directory, not a fresh mkdtemp(): every worker process must write to the same
#: place, or a repeated export would not find (and replace) the object of the first.
EXPORT_DIR = Path(
    os.environ.get("EXPORT_DIR")
    or Path(tempfile.gettempdir()) / "celery-pglock-exports"
)
FORMATS = ("csv", "json")

_SUFFIX = os.environ.get("EXAMPLE_TABLE_SUFFIX", "")
if not re.fullmatch(r"[a-z0-9_]{0,30}", _SUFFIX):
    raise ValueError(f"EXAMPLE_TABLE_SUFFIX must match [a-z0-9_]*; got {_SUFFIX!r}.")
EXPORTS = f"tenant_exports{_SUFFIX}"

app = Celery(
    "tenant_export",
    broker=BROKER_URL,
    backend=os.environ.get("CELERY_PGLOCK_RESULT_BACKEND") or BROKER_URL,
)
app.conf.update(
    # pglock_database_url is not set: the library reads CELERY_PGLOCK_DATABASE_URL.
    broker_connection_retry_on_startup=True,
    worker_prefetch_multiplier=1,
)


@app.task(
    base=SingletonTask,
    # An explicit name: the lock key is hashed from it, so it must not depend on how the
    # module was imported (renaming a task changes its key).
    name="tenant_export.build_tenant_export",
    lock_args=("tenant_id",),  # one lock per tenant; fmt is not part of the key
    # lock_on_busy: "skip" (the default) suits a scheduled export, since the next tick
    # will come anyway. For an export a user asked for, re-queue it instead, so that the
    # request is not dropped while a scheduled run of the same tenant holds the lock:
    #     lock_on_busy="retry", lock_retry_delay=30,
)
def build_tenant_export(tenant_id: int, fmt: str = "csv") -> dict[str, Any]:
    """Export one tenant's data to ``EXPORT_DIR`` and record it; safe to repeat."""
    if fmt not in FORMATS:
        raise ValueError(f"fmt must be one of {', '.join(FORMATS)}; got {fmt!r}.")
    today = datetime.datetime.now(datetime.timezone.utc).date()
    # Deterministic: a retry of today's export of this tenant names the same object.
    object_name = f"tenant-{int(tenant_id)}-{today.isoformat()}.{fmt}"
    _upload(object_name, _export_file(tenant_id, fmt))
    return {
        "status": "completed",
        "object_name": object_name,
        "recorded": _record(tenant_id, object_name),
    }


def _export_file(tenant_id: int, fmt: str) -> bytes:
    """The tenant's export (stand-in data: a real job would query the tenant's rows)."""
    rows = [
        {"tenant_id": tenant_id, "invoice": f"INV-{tenant_id}-{n}", "amount": 10 * n}
        for n in range(1, 4)
    ]
    if fmt == "json":
        return json.dumps(rows, indent=2).encode()
    lines = ["tenant_id,invoice,amount"]
    lines += [f"{row['tenant_id']},{row['invoice']},{row['amount']}" for row in rows]
    return ("\n".join(lines) + "\n").encode()


def _upload(object_name: str, content: bytes) -> None:
    """Put the object under its name, atomically: readers see the old or the new one.

    Writing to a temporary name and renaming stands in for an object store's PUT (S3
    replaces an object of the same key whole); a crash mid-write leaves only a stray
    temporary file, never a half-written export under the final name.
    """
    EXPORT_DIR.mkdir(parents=True, exist_ok=True)
    handle, partial = tempfile.mkstemp(dir=EXPORT_DIR, prefix=f".{object_name}.")
    try:
        with os.fdopen(handle, "wb") as file:
            file.write(content)
        os.replace(partial, EXPORT_DIR / object_name)
    except BaseException:
        Path(partial).unlink(missing_ok=True)
        raise


def _record(tenant_id: int, object_name: str) -> bool:
    """Record the export once; False if an earlier (crashed or repeated) run did."""
    # Our own engine, not the lock's connection: in session scope that connection is
    # pinned to the lock and is not for application work.
    with _engine().begin() as connection:
        inserted = connection.execute(
            sa.text(
                f"INSERT INTO {EXPORTS} (object_name, tenant_id) "
                "VALUES (:object_name, :tenant_id) ON CONFLICT DO NOTHING"
            ),
            {"object_name": object_name, "tenant_id": tenant_id},
        ).rowcount
    return bool(inserted)


_engines: dict[int, sa.Engine] = {}


def _engine() -> sa.Engine:
    """This process's engine for the app's own data, created on first use.

    Keyed by pid: a prefork child must never use a pool (and its sockets) inherited from
    the parent, so each child makes its own.
    """
    engine = _engines.get(os.getpid())
    if engine is None:
        url = os.environ.get("CELERY_PGLOCK_DATABASE_URL")
        if not url:
            raise RuntimeError("Set CELERY_PGLOCK_DATABASE_URL to a PostgreSQL URL.")
        engine = _engines[os.getpid()] = sa.create_engine(url, pool_size=2)
    return engine


def setup_schema(database_url: str | None = None) -> None:
    """Create ``tenant_exports`` if it does not exist.

    Args:
        database_url: SQLAlchemy URL; by default CELERY_PGLOCK_DATABASE_URL.
    """
    engine = sa.create_engine(database_url) if database_url else _engine()
    try:
        with engine.begin() as connection:
            # The primary key is the durable idempotency key: one record per object.
            connection.execute(
                sa.text(
                    f"""
                    CREATE TABLE IF NOT EXISTS {EXPORTS} (
                        object_name text PRIMARY KEY,
                        tenant_id bigint NOT NULL,
                        created_at timestamptz NOT NULL DEFAULT now()
                    )
                    """
                )
            )
    finally:
        if database_url:
            engine.dispose()


if __name__ == "__main__":
    setup_schema()
    print(f"{EXPORTS} is ready; exports go to {EXPORT_DIR}.")
