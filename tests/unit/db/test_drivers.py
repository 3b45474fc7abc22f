"""The two supported drivers, psycopg2 and psycopg (3): URLs, and what their errors mean.
No I/O: the errors are built as the drivers build them, without a server.
"""

from __future__ import annotations

import psycopg
import psycopg2
import psycopg2.extensions
import psycopg2.extras
import pytest
import sqlalchemy as sa

from celery_pglock import ConfigurationError
from celery_pglock.db import driver_errors, engines, sql_text
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
    assert driver == engines.check_url(url).get_driver_name()


def test_an_unsupported_driver_is_refused_naming_the_setting_and_both_drivers():
    with pytest.raises(ConfigurationError) as caught:
        engines.check_url("postgresql+asyncpg://app:s3cret@h/db")
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
    assert "55P03" == driver_errors.sqlstate(error)
    wrapped = sa.exc.OperationalError("SELECT 1", {}, error)
    assert "55P03" == driver_errors.sqlstate(wrapped)


@pytest.mark.parametrize("module", [psycopg2, psycopg], ids=["psycopg2", "psycopg"])
def test_a_lost_connection_is_a_disconnect_and_a_lock_timeout_is_not(module):
    lost = module.OperationalError("server closed the connection unexpectedly")
    assert driver_errors.is_disconnect(lost)
    assert driver_errors.is_transient(lost)
    assert driver_errors.misconfiguration(lost) is None
    assert None is driver_errors.sqlstate(lost)
    timed_out = (
        psycopg.errors.LockNotAvailable()
        if module is psycopg
        else _Psycopg2LockNotAvailable("lock timeout")
    )
    assert not driver_errors.is_disconnect(timed_out)


def test_a_terminated_backend_is_a_disconnect_on_psycopg():
    assert driver_errors.is_disconnect(psycopg.errors.AdminShutdown())


@pytest.mark.parametrize("module", [psycopg2, psycopg], ids=["psycopg2", "psycopg"])
def test_a_refused_login_is_a_misconfiguration_on_either_driver(module):
    refused = module.OperationalError(
        'connection failed: connection to server at "127.0.0.1", port 5432 failed: '
        'FATAL:  password authentication failed for user "app"'
    )
    problem = driver_errors.misconfiguration(refused)
    assert problem is not None
    assert "password authentication failed" == problem.cause
    assert not driver_errors.is_transient(refused)


def test_a_late_answer_raises_the_connections_own_drivers_error():
    """_deadline raises the OperationalError of the connection's driver: the lock paths'
    driver-error handling (and SQLAlchemy's) must recognise it."""
    connection = object.__new__(
        psycopg.Connection
    )  # no socket: a class is all it reads
    assert psycopg.OperationalError is driver_errors.operational_error(connection)
    connection2 = psycopg2.extensions.connection.__new__(psycopg2.extensions.connection)
    assert psycopg2.OperationalError is driver_errors.operational_error(connection2)

    class LoggingConnection(psycopg2.extensions.connection):
        """A user's connection_factory, defined outside the driver's package."""

    connection3 = LoggingConnection.__new__(LoggingConnection)
    assert psycopg2.OperationalError is driver_errors.operational_error(connection3)


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


@pytest.mark.parametrize(
    ("installed", "expected"),
    [(None, "it is not installed"), ("3.1.6", "psycopg 3.1.6 is installed")],
)
def test_a_psycopg_url_without_a_working_psycopg_says_which_extra(
    monkeypatch, installed, expected
):
    """Before: a ModuleNotFoundError at the first lock, or (3.1.0-3.1.6) "client-side
    cursors don't support binary results" at the first connect."""

    def version(name: str) -> str:
        if installed is None:
            raise engines.importlib.metadata.PackageNotFoundError(name)
        return installed

    monkeypatch.setattr(engines.importlib.metadata, "version", version)
    with pytest.raises(ConfigurationError) as caught:
        engines.check_url("postgresql+psycopg://app:s3cret@h/db")
    message = str(caught.value)
    assert "pglock_database_url" in message
    assert expected in message
    assert "celery-pglock[psycopg]" in message
    assert "s3cret" not in message
    engines.check_url(
        "postgresql+psycopg2://app@h/db"
    )  # psycopg 3 not needed for psycopg2


@pytest.mark.parametrize("installed", ["3.1.8", "3.2", "3.3.9", "4.0.0.dev1"])
def test_a_recent_enough_psycopg_is_accepted(monkeypatch, installed):
    monkeypatch.setattr(engines.importlib.metadata, "version", lambda name: installed)
    assert (
        engines.check_url("postgresql+psycopg://u@h/db").get_driver_name() == "psycopg"
    )


@pytest.mark.parametrize(
    "url", ["postgresql+psycopg://u:pw@h/db", "postgresql://u@h/db"]
)
def test_the_watchers_connect_keeps_libpq_keywords_and_drops_the_drivers_own(url):
    """The watcher connects with psycopg2: a driver keyword there is an invalid DSN, and
    every check of the lock would then fail (the lock taken for lost)."""
    user_args = {
        "prepare_threshold": 0,  # psycopg 3's, the usual PgBouncer advice
        "autocommit": True,  # psycopg 3's
        "cursor_factory": psycopg2.extras.RealDictCursor,  # psycopg2's
        "sslmode": "prefer",  # libpq's: kept
        "target_session_attrs": "read-write",  # libpq's: kept
    }
    engine = engines.create_engine(
        url, {"pglock_engine_options": {"connect_args": user_args}}
    )
    try:
        params = engines.connect_params(engine)
    finally:
        engine.dispose()
    assert {"prepare_threshold", "autocommit", "cursor_factory", "context"}.isdisjoint(
        params
    )
    assert params["sslmode"] == "prefer"
    assert params["target_session_attrs"] == "read-write"
    assert params["keepalives"] == 1
    assert "application_name" in params
    psycopg2.extensions.parse_dsn(psycopg2.extensions.make_dsn(**params))


@pytest.mark.parametrize(
    ("module", "read"), [("psycopg", "last"), ("psycopg2", "first")]
)
def test_the_last_result_of_a_statement_string_is_read_on_psycopg_3(module, read):
    """psycopg 3 starts at a multi-statement string's first result (``nextset()`` moves
    on), psycopg2 at its last: the fencing token is the last statement's."""

    class Cursor:
        """A cursor over three results, stepping as psycopg 3's does."""

        results = ("first", "second", "last")

        def __init__(self) -> None:
            self.at = 0

        def nextset(self) -> bool | None:
            if self.at + 1 == len(self.results):
                return None
            self.at += 1
            return True

    Cursor.__module__ = f"{module}.cursor"
    cursor = Cursor()
    sql_text.to_last_result(cursor)
    assert Cursor.results[cursor.at] == read
