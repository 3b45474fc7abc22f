"""A user's test of a singleton task, written with the celery-pglock pytest plugin only.

It sends duplicate exports of two tenants to a real prefork worker and checks what the
task promises: no two exports of one tenant ever ran at the same time (from PostgreSQL's
clock, across the worker's processes), each tenant was exported, and the export was
recorded once however many duplicates ran.
"""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING

import sqlalchemy as sa

from celery_pglock import SKIPPED
from examples import tenant_export

if TYPE_CHECKING:
    from pathlib import Path

    from celery_pglock.testing.pytest_plugin import (
        FinalStates,
        OverlapCheck,
        WorkerFactory,
    )

DUPLICATES = 6


def test_one_export_per_tenant_at_a_time(
    pglock_database_url: str,
    pglock_worker: WorkerFactory,
    pglock_final_states: FinalStates,
    pglock_overlap: OverlapCheck,
    tmp_path: Path,
) -> None:
    """Duplicates of one tenant never overlap; each tenant is exported and recorded once."""
    tenant_export.setup_schema(pglock_database_url)
    pglock_worker(concurrency=4, env={"EXPORT_DIR": str(tmp_path)})
    # Tenants of this run only: a rerun on a shared database starts from no record.
    tenants = [uuid.uuid4().int % 10**9 for _ in range(2)]

    results = [
        tenant_export.build_tenant_export.delay(tenant)
        for _ in range(DUPLICATES)
        for tenant in tenants
    ]
    states = pglock_final_states(results, timeout=60)

    assert set(states) <= {"SUCCESS", SKIPPED}
    pglock_overlap.assert_no_overlap(min_intervals=len(tenants))
    done = [result.get() for result in results if result.state == "SUCCESS"]
    for tenant in tenants:
        runs = [
            export for export in done if f"tenant-{tenant}-" in export["object_name"]
        ]
        assert runs, f"tenant {tenant} was never exported"
        assert 1 == sum(export["recorded"] for export in runs)
        assert 1 == len(list(tmp_path.glob(f"tenant-{tenant}-*.csv")))
    _forget(pglock_database_url, tenants)


def _forget(database_url: str, tenants: list[int]) -> None:
    """Delete this run's records (the table stays, as the example's setup left it)."""
    engine = sa.create_engine(database_url, poolclass=sa.NullPool)
    try:
        with engine.begin() as connection:
            connection.execute(
                sa.text(
                    f"DELETE FROM {tenant_export.EXPORTS} WHERE tenant_id = ANY(:tenants)"
                ),
                {"tenants": tenants},
            )
    finally:
        engine.dispose()
