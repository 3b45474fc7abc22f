"""Security against real PostgreSQL: a least-privilege role works in both scopes, and
neither a password nor an argument value reaches a log, an exception chain, a stored
result or ``application_name``.
"""

from __future__ import annotations

import logging
import traceback
import uuid

import psycopg2
import pytest
import sqlalchemy as sa
from celery import Celery

from celery_pglock import (
    AdvisoryLock,
    DatabaseError,
    LockScope,
    SingletonTask,
    current_lock,
    keys,
)
from celery_pglock.db import engines

MARKER = "LeakMe"


def everything_said(caplog, error: BaseException | None = None) -> str:
    """Log records (message and formatted exception) plus an error's whole chain."""
    parts = [record.getMessage() for record in caplog.records]
    parts += [
        "".join(traceback.format_exception(*record.exc_info))
        for record in caplog.records
        if record.exc_info
    ]
    if error is not None:
        parts.append("".join(traceback.format_exception(error)))
    return "\n".join(parts)


# -- least privilege ------------------------------------------------------------------------


@pytest.fixture
def least_privilege_url(database_url):
    """A role with LOGIN and CONNECT only (no table, schema or function grants of its
    own), with a password in its URL; dropped after the test."""
    role = f"pglock_lp_{uuid.uuid4().hex[:10]}"
    admin = sa.make_url(database_url)
    password = f"{MARKER}-{uuid.uuid4().hex[:6]}"
    conn = psycopg2.connect(
        host=admin.host,
        port=admin.port or 5432,
        user=admin.username,
        password=admin.password,
        dbname=admin.database,
        application_name="celery_pglock tests admin",
    )
    conn.autocommit = True
    quoted = f'"{role}"'
    with conn.cursor() as cursor:
        cursor.execute(f"CREATE ROLE {quoted} LOGIN PASSWORD %s", (password,))
        cursor.execute(f'GRANT CONNECT ON DATABASE "{admin.database}" TO {quoted}')
    url = admin.set(username=role, password=password).render_as_string(
        hide_password=False
    )
    try:
        yield url
    finally:
        engines.dispose_all()
        with conn.cursor() as cursor:
            cursor.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = %s",
                (role,),
            )
            cursor.execute(
                f'REVOKE CONNECT ON DATABASE "{admin.database}" FROM {quoted}'
            )
            cursor.execute(f"DROP ROLE {quoted}")
        conn.close()


@pytest.mark.parametrize("scope", [LockScope.SESSION, LockScope.TRANSACTION])
def test_least_privilege_role_locks_in_both_scopes(
    least_privilege_url, namespace, scope, caplog
):
    """acquire / locked / release as a role with no privileges beyond LOGIN and CONNECT."""
    caplog.set_level(logging.DEBUG, logger="celery_pglock")
    engine = engines.create_engine(least_privilege_url)
    try:
        key = keys.make_key(namespace, "lp", {"tenant": 7})
        holder = AdvisoryLock(engine=engine, key=key, scope=scope)
        rival = AdvisoryLock(engine=engine, key=key, scope=scope)
        assert holder.acquire()
        assert holder.locked()
        assert not rival.acquire()
        assert not rival.acquire(timeout=0.2)  # the bounded wait (lock_timeout) too
        holder.release()
        assert not holder.locked()
        assert rival.acquire()
        rival.release()
        with engine.connect() as connection:
            assert connection.exec_driver_sql("SELECT current_user").scalar() == (
                sa.make_url(least_privilege_url).username
            )
    finally:
        engine.dispose()
    assert MARKER not in everything_said(caplog)


def test_least_privilege_role_runs_a_singleton_task(
    least_privilege_url, broker_url, result_backend_url, namespace, caplog
):
    """A SingletonTask run (apply: the worker's tracer, in-process) as that role, with
    DEBUG logging on: it runs locked, and no log line shows the password."""
    caplog.set_level(logging.DEBUG, logger="celery_pglock")
    app = Celery(
        "lp", broker=broker_url, backend=result_backend_url, set_as_current=False
    )
    app.conf.pglock_database_url = least_privilege_url
    app.conf.pglock_namespace = namespace
    seen = {}

    @app.task(base=SingletonTask, name="lp.export", lock_args=("tenant",), shared=False)
    def export(tenant):
        lock = current_lock()
        seen["owned"] = lock.owned()
        seen["locked"] = lock.locked()
        return tenant

    app.finalize(auto=True)
    try:
        result = app.tasks["lp.export"].apply(args=(7,))
        assert 7 == result.get()
    finally:
        app.close()
    assert {"owned": True, "locked": True} == seen
    said = everything_said(caplog)
    assert "lp.export" in said  # DEBUG lines were written...
    assert MARKER not in said  # ...without the password


# -- passwords in failed connections ----------------------------------------------------------


@pytest.mark.parametrize(
    "url",
    [
        # an unescaped "@": libpq is handed host "ssLeakMe@127.0.0.1" and echoes it
        f"postgresql+psycopg2://app:p@ss{MARKER}@127.0.0.1:5432/test",
        # a refused port, with the password in the userinfo and in the query
        f"postgresql+psycopg2://app:{MARKER}@127.0.0.1:1/test",
        f"postgresql+psycopg2://app@127.0.0.1:1/test?password={MARKER}",
    ],
)
def test_failed_connections_never_show_the_password(url, caplog):
    """A real failed connection through an engine the caller made (so check_url never
    saw the URL): the DatabaseError, its whole cause chain and every log line are clean."""
    caplog.set_level(logging.DEBUG, logger="celery_pglock")
    engine = sa.create_engine(url, connect_args={"connect_timeout": 5})
    try:
        lock = AdvisoryLock(engine=engine, key=keys.make_key("n", "t", 1))
        with pytest.raises(DatabaseError) as acquiring:
            lock.acquire()
        with pytest.raises(DatabaseError) as reading:
            lock.locked()
    finally:
        engine.dispose()
    for caught in (acquiring, reading):
        said = everything_said(caplog, caught.value)
        assert "Could not" in said
        assert MARKER.lower() not in said.lower(), said


def test_singleton_task_failure_stores_no_password(
    broker_url, result_backend_url, namespace
):
    """A task whose lock database refuses connections fails with a DatabaseError; the
    stored result and traceback hold no password."""
    app = Celery(
        "down", broker=broker_url, backend=result_backend_url, set_as_current=False
    )
    app.conf.pglock_database_url = (
        f"postgresql+psycopg2://app:{MARKER}@127.0.0.1:1/test?connect_timeout=5"
    )
    app.conf.pglock_namespace = namespace

    @app.task(base=SingletonTask, name="down.export", shared=False)
    def export():
        return "ran"

    app.finalize(auto=True)
    try:
        result = app.tasks["down.export"].apply()
    finally:
        engines.dispose_all()
        app.close()
    assert isinstance(result.result, DatabaseError)
    assert MARKER not in str(result.result)
    assert MARKER not in (result.traceback or "")


# -- argument values in application_name ------------------------------------------------------


def test_application_name_shows_key_ids_not_argument_values(
    app_for_names, session_mode
):
    """While a body runs, pg_stat_activity shows the task name (and, on a per-lock
    connection, the lock's ids), never the argument."""
    _, task = app_for_names
    secret = f"{MARKER}@example.com"
    names = task.apply(args=(secret,)).get()
    assert any("names.by_email" in name for name in names), names
    if session_mode == "per_lock":  # a process's lock session names no key
        expected = str(task.lock_key_for(secret))
        assert any(expected in name for name in names), names
    assert not any(MARKER in name for name in names), names


@pytest.fixture
def app_for_names(
    database_url, broker_url, result_backend_url, namespace, session_mode
):
    app = Celery(
        "names", broker=broker_url, backend=result_backend_url, set_as_current=False
    )
    app.conf.pglock_database_url = database_url
    app.conf.pglock_namespace = namespace

    @app.task(
        base=SingletonTask, name="names.by_email", lock_args=("email",), shared=False
    )
    def by_email(email):
        with engines.engine_for(app.conf).connect() as connection:
            return list(
                connection.exec_driver_sql(
                    "SELECT application_name FROM pg_stat_activity "
                    "WHERE application_name LIKE %s",
                    (f"{engines.DEFAULT_APPLICATION_NAME} {engines.process_tag()}%",),
                ).scalars()
            )

    app.finalize(auto=True)
    yield app, app.tasks["names.by_email"]
    app.close()


def test_testing_services_error_shows_no_password():
    """celery_pglock.testing's "set but not reachable" error (pytest prints it) is clean."""
    from celery_pglock.testing import ServiceError, services

    url = f"postgresql+psycopg2://app:p@ss{MARKER}@127.0.0.1:5432/test"
    with pytest.raises(ServiceError) as caught:
        services._check_configured(
            "CELERY_PGLOCK_TEST_DATABASE_URL", url, services.wait_for_postgres, 1.0
        )
    said = "".join(traceback.format_exception(caught.value))
    assert "not reachable" in said
    assert MARKER not in said


# -- arguments are freed with the run --------------------------------------------------------


class Payload:
    """A stand-in for a big argument; weakly referenceable, so the test can see it go."""


def test_a_runs_arguments_are_freed_when_it_ends_without_waiting_for_gc(
    database_url, broker_url, result_backend_url, namespace
):
    """The request <-> execution link is broken at task_postrun: otherwise the cycle kept
    every call's arguments (a 5 MB string each) alive until a garbage collection, and a
    pool child's heap grew by about 100 MiB over 20 such calls (glibc keeps the memory)."""
    import gc
    import weakref

    app = Celery(
        "freed", broker=broker_url, backend=result_backend_url, set_as_current=False
    )
    app.conf.pglock_database_url = database_url
    app.conf.pglock_namespace = namespace

    @app.task(
        base=SingletonTask, name="freed.export", lock_args=("tenant",), shared=False
    )
    def export(tenant, payload):
        return tenant

    app.finalize(auto=True)
    payload = Payload()
    gone = weakref.ref(payload)
    gc.collect()
    gc.disable()
    try:
        assert 7 == app.tasks["freed.export"].apply(args=(7, payload)).get()
        del payload
        assert gone() is None
    finally:
        gc.enable()
        app.close()
