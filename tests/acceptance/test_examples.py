"""The examples work as documented: the demo, the daily settlement and the tenant export.

Each test runs the example's real code in real ``celery worker`` processes (or, for the
demo, runs ``examples/demo.py`` itself) against the session's services. Tables get a
per-test suffix (EXAMPLE_TABLE_SUFFIX) and are dropped afterwards, exports go to the
test's tmp_path, and each test consumes a queue of its own, so reruns and other suites
sharing the database and broker start clean.
"""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
import uuid
from typing import TYPE_CHECKING, Any

import pytest
import sqlalchemy as sa

from celery_pglock import config
from celery_pglock.testing import BROKER_URL_ENV, DATABASE_URL_ENV
from tests.conftest import REPO_ROOT

from .conftest import outcomes, wait_until

if TYPE_CHECKING:
    from collections.abc import Iterator
    from pathlib import Path
    from types import ModuleType

    from celery_pglock.testing import Services

pytestmark = pytest.mark.timeout(60)

ENDED = ("SUCCESS", "skipped", "FAILURE")
#: The demo's table rows: label, sent, ran, skipped, failed, overlaps.
TENANT_ROW = re.compile(r"^\s*tenant (\d+)" + r"\s+(\d+)" * 5 + r"\s*$", re.M)
TOTAL_ROW = re.compile(r"^\s*total" + r"\s+(\d+)" * 5 + r"\s*$", re.M)
DEMO_PASSWORD = "not-to-be-printed"


@pytest.fixture(scope="module")
def example_env(services: Services) -> dict[str, str]:
    """The variables the examples read, pointing at the session's services."""
    return {
        "CELERY_PGLOCK_DATABASE_URL": services.database_url,
        "CELERY_PGLOCK_BROKER_URL": services.broker_url,
        "CELERY_PGLOCK_RESULT_BACKEND": services.result_backend_url,
    }


@pytest.fixture
def suffix(example_env: dict[str, str]) -> Iterator[str]:
    """A table-name suffix of this test's own; its tables are dropped afterwards."""
    value = f"_t{uuid.uuid4().hex[:8]}"
    yield value
    engine = sa.create_engine(example_env["CELERY_PGLOCK_DATABASE_URL"])
    try:
        with engine.begin() as connection:
            for table in ("settlements", "settlement_runs", "tenant_exports"):
                connection.execute(sa.text(f"DROP TABLE IF EXISTS {table}{value}"))
    finally:
        engine.dispose()


@pytest.fixture
def database(example_env: dict[str, str]) -> Iterator[sa.Engine]:
    """An engine on the test database, for seeding and checking the examples' tables."""
    engine = sa.create_engine(
        example_env["CELERY_PGLOCK_DATABASE_URL"], poolclass=sa.NullPool
    )
    yield engine
    engine.dispose()


def _import_example(name: str, env: dict[str, str]) -> ModuleType:
    """Import ``examples.<name>`` configured by ``env``, which is then removed again."""
    with pytest.MonkeyPatch.context() as patch:
        for variable, value in env.items():
            patch.setenv(variable, value)
        module = importlib.import_module(f"examples.{name}")
    # Imported once per session: make sure it talks to this session's broker.
    assert env["CELERY_PGLOCK_BROKER_URL"] == module.app.conf.broker_url
    return module


def _run_module(module: str, *args: str, env: dict[str, str]) -> None:
    """Run ``python -m <module>`` from the repository root, as its docstring says."""
    subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=REPO_ROOT,
        env={**os.environ, **env},
        check=True,
        timeout=30,
        capture_output=True,
    )


def _wait_ended(results: list[Any], timeout: float = 30) -> list[str]:
    # Each run's outcome: SUCCESS, "skipped" (FAILURE with LockSkipped) or FAILURE.
    wait_until(
        lambda: all(result.ready() for result in results),
        timeout=timeout,
        what="every task to end",
    )
    return outcomes(results)


def test_demo_reports_no_overlaps(services: Services) -> None:
    """examples/demo.py exits 0; its table shows 60 sent, no overlap, ran + skipped = sent.

    The demo takes its services from the bootstrap's variables, like the test suite; the
    URL carries a password (ignored by trust authentication) that must never be printed.
    A developer's CELERY_PGLOCK_DATABASE_URL (a real lock database, say) is not touched.
    """
    url = sa.make_url(services.database_url).set(password=DEMO_PASSWORD)
    env = {
        **os.environ,
        DATABASE_URL_ENV: url.render_as_string(hide_password=False),
        BROKER_URL_ENV: services.broker_url,
        config.DATABASE_URL_ENV: "postgresql+psycopg2://app@127.0.0.1:1/production",
    }
    demo = subprocess.Popen(
        [sys.executable, "examples/demo.py", "--timeout", "45"],
        cwd=REPO_ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        output, _ = demo.communicate(timeout=55)
    except subprocess.TimeoutExpired:
        # SIGTERM, not the SIGKILL of subprocess.run: the demo then stops its workers.
        demo.terminate()
        output, _ = demo.communicate(timeout=30)
        pytest.fail(f"examples/demo.py did not finish within 55 s:\n{output}")
    assert 0 == demo.returncode, output
    assert DEMO_PASSWORD not in output
    assert "pg_locks" in output
    tenants = TENANT_ROW.findall(output)
    assert 3 == len(tenants), output
    for _, sent, ran, skipped, failed, overlaps in tenants:
        assert (20, 0, 0) == (int(sent), int(failed), int(overlaps)), output
        assert int(sent) == int(ran) + int(skipped)
        assert int(ran) >= 1
    total = TOTAL_ROW.search(output)
    assert total is not None, output
    sent, ran, skipped, failed, overlaps = map(int, total.groups())
    assert (60, 0, 0) == (sent, failed, overlaps), output
    assert sent == ran + skipped


def test_settlement_settles_every_row_exactly_once(
    worker_factory: Any,
    example_env: dict[str, str],
    suffix: str,
    database: sa.Engine,
) -> None:
    """Duplicates of daily_settlement sent at once: one run at a time, each row settled once.

    Then, as in the article's psql test, a session holding (42, 1001) makes every run skip.
    """
    env = {**example_env, "EXAMPLE_TABLE_SUFFIX": suffix}
    settlement = _import_example("settlement", env)
    _run_module("examples.settlement", "300", env=env)
    queue = f"pglock-examples-{uuid.uuid4().hex[:8]}"
    for _ in range(2):
        worker_factory("examples.settlement", env=env, queues=[queue], concurrency=2)

    with database.connect().execution_options(isolation_level="AUTOCOMMIT") as holder:
        # The key is a fixed number, not namespaced per test: serialise with other test
        # sessions on this database that run this test at the same time.
        holder.execute(sa.text("SET lock_timeout = '40s'"))
        holder.execute(
            sa.text("SELECT pg_advisory_lock(hashtext('celery_pglock test_examples'))")
        )

        results = [
            settlement.daily_settlement.apply_async(queue=queue) for _ in range(8)
        ]
        outcome = _wait_ended(results)
        ran = [
            result
            for result, state in zip(results, outcome, strict=True)
            if state == "SUCCESS"
        ]
        assert len(results) == len(ran) + outcome.count("skipped"), outcome
        assert ran
        assert 300 == sum(result.result for result in ran)

        with database.connect() as connection:
            rows = connection.execute(
                sa.text(
                    f"SELECT status, processed_by, count(*) FROM settlements{suffix} "
                    "GROUP BY status, processed_by"
                )
            ).all()
            runs = connection.execute(
                sa.text(f"SELECT task_id, settled FROM settlement_runs{suffix}")
            ).all()
            overlapping = connection.execute(
                sa.text(
                    f"SELECT count(*) FROM settlement_runs{suffix} a "
                    f"JOIN settlement_runs{suffix} b ON a.id < b.id "
                    "AND a.started_at < b.finished_at AND b.started_at < a.finished_at"
                )
            ).scalar_one()
        assert {"processed"} == {status for status, _, _ in rows}
        ran_ids = {result.id for result in ran}
        assert {task_id for _, task_id, _ in rows} <= ran_ids
        assert ran_ids == {task_id for task_id, _ in runs}
        assert 300 == sum(settled for _, settled in runs)
        assert 0 == overlapping

        # The article's concurrency test: while another session holds (42, 1001), every
        # run is skipped, and the key it reports is that pair.
        assert holder.execute(sa.text("SELECT pg_try_advisory_lock(42, 1001)")).scalar()
        try:
            blocked = [
                settlement.daily_settlement.apply_async(queue=queue) for _ in range(3)
            ]
            assert ["skipped"] * 3 == _wait_ended(blocked)
        finally:
            holder.execute(sa.text("SELECT pg_advisory_unlock(42, 1001)"))
        assert "42,1001" == blocked[0].result.key


def test_tenant_export_writes_one_file_and_one_row_per_tenant(
    worker_factory: Any,
    example_env: dict[str, str],
    suffix: str,
    database: sa.Engine,
    tmp_path: Path,
) -> None:
    """Two tenants in parallel plus duplicates of one: one object and one record each.

    A later repeat of a finished export (a retry after a crash, say) converges on the
    same object and records nothing new.
    """
    export_dir = tmp_path / "exports"
    env = {**example_env, "EXAMPLE_TABLE_SUFFIX": suffix, "EXPORT_DIR": str(export_dir)}
    tenant_export = _import_example("tenant_export", env)
    _run_module("examples.tenant_export", env=env)
    queue = f"pglock-examples-{uuid.uuid4().hex[:8]}"
    for _ in range(2):
        worker_factory("examples.tenant_export", env=env, queues=[queue])

    # Tenant ids of this test only: the key is the task name plus the tenant id.
    busy, other = (int(uuid.uuid4().int % 10**9) for _ in range(2))
    task = tenant_export.build_tenant_export
    sends = [busy, other, *[busy] * 6]
    results = [task.apply_async((tenant,), queue=queue) for tenant in sends]
    outcome = _wait_ended(results)
    assert len(results) == outcome.count("SUCCESS") + outcome.count("skipped"), outcome
    done = [
        (tenant, result.result)
        for tenant, result, state in zip(sends, results, outcome, strict=True)
        if state == "SUCCESS"
    ]
    assert {busy, other} == {tenant for tenant, _ in done}
    names = {tenant: value["object_name"] for tenant, value in done}
    # Deterministic names.
    assert all(names[tenant] == value["object_name"] for tenant, value in done)
    for tenant in (busy, other):
        assert re.fullmatch(rf"tenant-{tenant}-\d{{4}}-\d\d-\d\d\.csv", names[tenant])
        assert 1 == sum(value["recorded"] for t, value in done if t == tenant)

    repeat = task.apply_async((busy,), queue=queue)
    assert ["SUCCESS"] == _wait_ended([repeat])
    assert {"status": "completed", "object_name": names[busy], "recorded": False} == (
        repeat.result
    )

    assert sorted(names.values()) == sorted(path.name for path in export_dir.iterdir())
    with database.connect() as connection:
        recorded = connection.execute(
            sa.text(
                f"SELECT tenant_id, object_name FROM tenant_exports{suffix} ORDER BY 1"
            )
        ).all()
    assert sorted(names.items()) == [tuple(row) for row in recorded]
    # The header plus three invoices.
    assert 4 == len((export_dir / names[busy]).read_text().splitlines())
