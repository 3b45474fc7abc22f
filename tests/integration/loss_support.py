"""Helpers of the lock-loss tests (test_lock_loss*.py)."""

from __future__ import annotations

import re
import time

import psycopg2
import pytest
from celery import Celery


def dsn(url: str) -> str:
    """A libpq URL for psycopg2.connect(): no SQLAlchemy driver name."""
    return re.sub(r"^postgresql\+\w+://", "postgresql://", url)


def make_app(url, broker_url, result_backend_url, namespace, **conf):
    app = Celery(
        "loss", broker=broker_url, backend=result_backend_url, set_as_current=False
    )
    app.conf.pglock_database_url = url
    app.conf.pglock_namespace = namespace
    app.conf.update(conf)
    return app


def wait_for(predicate, timeout, what):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.02)


def terminate_backend(url: str, pid: int) -> None:
    with psycopg2.connect(dsn(url)) as connection, connection.cursor() as cursor:
        cursor.execute("SELECT pg_terminate_backend(%s)", (pid,))
    connection.close()


def holder_pid(url: str, key) -> int:
    with psycopg2.connect(dsn(url)) as connection, connection.cursor() as cursor:
        cursor.execute(
            "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted "
            "AND classid = %s::oid AND objid = %s::oid AND objsubid = %s::int2",
            key.pg_locks_ids,
        )
        (pid,) = cursor.fetchone()
    connection.close()
    return pid
