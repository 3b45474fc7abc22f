"""A session keeps a prepared statement's generic plan. One made while a library table was
nearly empty must still find a key through the table's index once the table is large:
a sequential scan there costs every send the whole table (sql_text.PLAN_GUARD)."""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING, Any

import pytest
from sqlalchemy.engine import make_url

from celery_pglock import keys
from celery_pglock.db import engines, sql_text
from celery_pglock.lock import rider
from celery_pglock.task import queued
from celery_pglock.testing import _support

if TYPE_CHECKING:
    from collections.abc import Iterator


@pytest.fixture
def fresh_url(database_url: str) -> Iterator[str]:
    """A database of this test's own: its table's statistics are the test's."""
    name = f"plans_{uuid.uuid4().hex[:8]}"
    admin = _support.connect(database_url, application_name="plan guard test")
    try:
        with admin.cursor() as cursor:
            cursor.execute(f'CREATE DATABASE "{name}"')
        yield make_url(database_url).set(database=name).render_as_string(False)
    finally:
        with admin.cursor() as cursor:
            cursor.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.close()


def claim(engine: Any, key: keys.LockKey, task_id: str) -> tuple[Any, ...]:
    return queued.claim(
        engine,
        key=key,
        task_id=task_id,
        task_name="plans.t",
        mode=queued.UNTIL_FINISHED,
        stale=600.0,
        bound=5.0,
        first=(queued.FIRST_NAME, queued.FIRST),  # a send's first statement
    )


def first_params(key: keys.LockKey, task_id: str) -> dict[str, Any]:
    """queued.FIRST's params for a send of ``key``."""
    classid, objid, objsubid = key.pg_locks_ids
    return {
        "c": classid,
        "o": objid,
        "s": objsubid,
        "id": task_id,
        "name": "plans.t",
        "run": 1,
        "mode": queued.UNTIL_FINISHED,
        "stale": 600.0,
    }


def test_a_plan_made_on_a_nearly_empty_table_still_uses_its_index(
    fresh_url: str,
) -> None:
    engine = engines.create_engine(fresh_url)
    try:
        key = keys.make_key("plans", "plans.t", "hot")
        assert claim(engine, key, "owner")[0] == "new"
        with engines.autocommit_cursor(engine, 5.0) as cursor:
            cursor.execute("VACUUM ANALYZE celery_pglock_queued")  # one row, one page
        for number in range(8):  # past the five custom plans: the generic one is kept
            assert claim(engine, key, f"duplicate-{number}")[:2] == ("queued", "owner")
        with engines.autocommit_cursor(engine, 5.0) as cursor:
            cursor.execute(
                "INSERT INTO celery_pglock_queued (classid, objid, objsubid, task_id, "
                "task_name, run_objid, mode, stale_at) SELECT 1, n, 1, 'filler-' || n, "
                "'plans.t', n, 'until_finished', now() + interval '1 hour' "
                "FROM generate_series(1, 5000) AS n"
            )

        def explain(cursor: Any) -> str:
            execute = sql_text.prepared(
                cursor.connection, cursor, queued.FIRST_NAME, queued.FIRST
            )
            text, rest = sql_text.inline(execute, first_params(key, "probe"))
            assert text.startswith(sql_text.PLAN_GUARD)
            # Without the guard: the plan the session kept, as it is.
            cursor.execute("EXPLAIN " + text.removeprefix(sql_text.PLAN_GUARD), rest)
            return "\n".join(row[0] for row in cursor.fetchall())

        plan = engines.on_kept(engine, 5.0, explain)
        assert "Seq Scan on celery_pglock_queued" not in plan, plan
        assert "Index Scan using celery_pglock_queued_pkey" in plan, plan
    finally:
        engine.dispose()


def test_only_statements_on_the_library_tables_are_guarded(database_url: str) -> None:
    engine = engines.create_engine(database_url)
    lock = sql_text.TRY_LOCK_SESSION[1]
    riding = rider.riding(lock, queued.ON_START_STARTED)
    try:
        with engines.autocommit_cursor(engine, 5.0) as cursor:
            dbapi = cursor.connection
            bare = sql_text.prepared(dbapi, cursor, sql_text.name_for(lock), lock)
            ridden = sql_text.prepared(dbapi, cursor, sql_text.name_for(riding), riding)
    finally:
        engine.dispose()
    assert not bare.startswith(sql_text.PLAN_GUARD)  # the run lock's own: no table
    assert ridden.startswith(sql_text.PLAN_GUARD)


@pytest.mark.parametrize("in_transaction", [False, True])
def test_the_guard_never_outlasts_its_statement(
    database_url: str, in_transaction: bool
) -> None:
    """In a transaction block (lock_scope='transaction') SET LOCAL would last through
    the task's own queries on the lock's connection: there the statement goes bare."""
    engine = engines.create_engine(database_url)
    raw = engine.raw_connection()
    try:
        dbapi = raw.dbapi_connection
        dbapi.autocommit = not in_transaction
        cursor = dbapi.cursor()
        key = keys.make_key("plans", "plans.t", uuid.uuid4().hex)
        execute = sql_text.prepared(dbapi, cursor, queued.FIRST_NAME, queued.FIRST)
        sql_text.run(cursor, *sql_text.inline(execute, first_params(key, "t1")))
        # The statement's row, not the guard's (psycopg 3 reads the first result).
        assert cursor.fetchone() == ("new", "t1")
        cursor.execute("SELECT current_setting('enable_seqscan')")
        assert cursor.fetchone() == ("on",)
        cursor.execute(
            "DELETE FROM celery_pglock_queued WHERE (classid, objid, objsubid) = "
            "(%s::oid, %s::oid, %s::smallint)",
            key.pg_locks_ids,
        )
        if in_transaction:
            dbapi.commit()
    finally:
        raw.close()
        engine.dispose()
