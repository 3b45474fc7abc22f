"""The two supported drivers, psycopg2 and psycopg (3): URLs, and what their errors mean.
No I/O: the errors are built as the drivers build them, without a server.
"""

from __future__ import annotations

import psycopg
import psycopg2
import pytest
import sqlalchemy as sa

from celery_pglock import ConfigurationError, _driver_errors, db
from celery_pglock.testing import ServiceError, _support


class _Psycopg2LockNotAvailable(psycopg2.OperationalError):
    """A psycopg2 error as the server's answer makes it (pgcode is read-only there)."""

    pgcode = "55P03"


@pytest.mark.parametrize(
    ("url", "driver"),
    [
        ("postgresql+psycopg2://u@h/db", "psycopg2"),
        ("postgresql+psycopg://u@h/db", "psycopg"),
        ("postgresql://u@h/db", "psycopg2"),
        ("postgres://u@h/db", "psycopg2"),
    ],
)
def test_both_drivers_are_accepted_and_no_driver_means_psycopg2(url, driver):
    assert driver == db.check_url(url).get_driver_name()


def test_an_unsupported_driver_is_refused_naming_the_setting_and_both_drivers():
    with pytest.raises(ConfigurationError) as caught:
        db.check_url("postgresql+asyncpg://app:s3cret@h/db")
    message = str(caught.value)
    assert "pglock_database_url" in message
    assert "postgresql+psycopg2://" in message
    assert "postgresql+psycopg://" in message
    assert "s3cret" not in message


@pytest.mark.parametrize(
    "error",
    [_Psycopg2LockNotAvailable("lock timeout"), psycopg.errors.LockNotAvailable()],
    ids=["psycopg2 pgcode", "psycopg sqlstate"],
)
def test_sqlstate_reads_either_drivers_attribute(error):
    assert "55P03" == _driver_errors.sqlstate(error)
    wrapped = sa.exc.OperationalError("SELECT 1", {}, error)
    assert "55P03" == _driver_errors.sqlstate(wrapped)


@pytest.mark.parametrize("module", [psycopg2, psycopg], ids=["psycopg2", "psycopg"])
def test_a_lost_connection_is_a_disconnect_and_a_lock_timeout_is_not(module):
    lost = module.OperationalError("server closed the connection unexpectedly")
    assert _driver_errors.is_disconnect(lost)
    assert _driver_errors.is_transient(lost)
    assert _driver_errors.misconfiguration(lost) is None
    assert None is _driver_errors.sqlstate(lost)
    timed_out = (
        psycopg.errors.LockNotAvailable()
        if module is psycopg
        else _Psycopg2LockNotAvailable("lock timeout")
    )
    assert not _driver_errors.is_disconnect(timed_out)


def test_a_terminated_backend_is_a_disconnect_on_psycopg():
    assert _driver_errors.is_disconnect(psycopg.errors.AdminShutdown())


@pytest.mark.parametrize("module", [psycopg2, psycopg], ids=["psycopg2", "psycopg"])
def test_a_refused_login_is_a_misconfiguration_on_either_driver(module):
    refused = module.OperationalError(
        'connection failed: connection to server at "127.0.0.1", port 5432 failed: '
        'FATAL:  password authentication failed for user "app"'
    )
    problem = _driver_errors.misconfiguration(refused)
    assert problem is not None
    assert "password authentication failed" == problem.cause
    assert not _driver_errors.is_transient(refused)


def test_a_late_answer_raises_the_connections_own_drivers_error():
    """_deadline raises the OperationalError of the connection's driver: the lock paths'
    driver-error handling (and SQLAlchemy's) must recognise it."""
    connection = object.__new__(
        psycopg.Connection
    )  # no socket: a class is all it reads
    assert psycopg.OperationalError is _driver_errors.operational_error(connection)
    connection2 = psycopg2.extensions.connection.__new__(psycopg2.extensions.connection)
    assert psycopg2.OperationalError is _driver_errors.operational_error(connection2)


def test_the_test_driver_variable_picks_the_embedded_urls_driver(monkeypatch):
    monkeypatch.setenv(_support.DRIVER_ENV, "psycopg")
    assert "psycopg" == _support.driver()
    assert "postgresql+psycopg://u@h:1/db" == _support.with_driver(
        "postgresql+psycopg2://u@h:1/db", _support.driver()
    )
    assert "postgresql+psycopg://u@h:1/db" == _support.with_driver(
        "postgresql://u@h:1/db", "psycopg"
    )
    monkeypatch.setenv(_support.DRIVER_ENV, "asyncpg")
    with pytest.raises(ServiceError, match="CELERY_PGLOCK_TEST_DRIVER must be one of"):
        _support.driver()
