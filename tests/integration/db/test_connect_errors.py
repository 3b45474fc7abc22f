"""A connection the server refuses for a reason waiting does not fix is a configuration
error: never transient (no re-queue), and its message names the cause and the fix.

Against a private PostgreSQL that asks for passwords (``password_postgres``): the
texts are libpq's and the server's own, which psycopg2 hands over without a SQLSTATE.
"""

from __future__ import annotations

import pytest
import sqlalchemy as sa

from celery_pglock import AdvisoryLock, DatabaseError, keys
from celery_pglock.db import driver_errors, engines
from celery_pglock.testing import _support
from tests.conftest import GHOST_ROLE, PASSWORD_ROLE, ROLE_PASSWORD

WRONG_PASSWORD = "wrong-pw-never-logged"


def _url(server, *, user, password=None, database="postgres", query=""):
    secret = f":{password}" if password else ""
    return (
        f"postgresql+{_support.driver()}://{user}{secret}@{_support.HOST}:{server.port}/{database}"
        + (f"?{query}" if query else "")
    )


def _refusal(url):
    with pytest.raises(DatabaseError) as caught:
        engines.probe({"pglock_database_url": url})
    return caught.value


@pytest.mark.parametrize(
    ("who", "sqlstate", "cause", "advice"),
    [
        (
            {"user": PASSWORD_ROLE, "password": WRONG_PASSWORD},
            "28P01",
            "password authentication failed",
            "Check the user name and password",
        ),
        (
            {"user": PASSWORD_ROLE},
            "28P01",
            "password authentication failed",
            "password",
        ),
        (
            {"user": GHOST_ROLE},
            "28000",
            "the role does not exist",
            "Fix the user name",
        ),
        (
            {"user": PASSWORD_ROLE, "password": ROLE_PASSWORD, "database": "nope"},
            "3D000",
            "the database does not exist",
            "Fix the database name",
        ),
        (
            {"user": "postgres", "query": "sslmode=require"},
            None,
            "TLS (SSL) settings",
            "sslmode",
        ),
        ({"user": "postgres", "query": "sslmode=bogus"}, None, "TLS (SSL)", "sslmode"),
    ],
    ids=["password", "no-password", "role", "database", "tls-required", "sslmode"],
)
def test_a_refused_login_is_a_configuration_error(
    password_postgres, who, sqlstate, cause, advice
):
    error = _refusal(_url(password_postgres, **who))
    message = str(error)
    assert not driver_errors.is_transient(error.__cause__)
    assert not driver_errors.is_transient(error.__cause__)
    problem = driver_errors.misconfiguration(error.__cause__)
    assert problem is not None
    assert sqlstate == problem.sqlstate
    assert "not an outage, so it is not retried" in message
    assert cause in message
    assert advice in message
    if sqlstate:
        assert f"(SQLSTATE {sqlstate})" in message
    assert WRONG_PASSWORD not in message
    assert ROLE_PASSWORD not in message


def test_the_right_password_gets_in(password_postgres):
    url = _url(password_postgres, user=PASSWORD_ROLE, password=ROLE_PASSWORD)
    assert engines.probe({"pglock_database_url": url})


def test_an_outage_stays_transient():
    """Nothing listens: an outage, retried as before, with no misconfiguration named."""
    url = f"postgresql+{_support.driver()}://app:x@{_support.HOST}:{_support.free_port()}/locks"
    error = _refusal(url)
    assert driver_errors.is_transient(error.__cause__)
    assert None is driver_errors.misconfiguration(error.__cause__)
    assert "not retried" not in str(error)


def test_a_lock_acquire_names_the_cause(password_postgres):
    """The path a task takes: acquiring through a lock engine."""
    url = _url(password_postgres, user=PASSWORD_ROLE, password=WRONG_PASSWORD)
    engine = engines.create_engine(url, {})
    try:
        lock = AdvisoryLock(engine=engine, key=keys.make_key("connect-errors", "x"))
        with pytest.raises(DatabaseError, match=r"SQLSTATE 28P01") as caught:
            lock.acquire()
        assert not driver_errors.is_transient(caught.value.__cause__)
    finally:
        engine.dispose()


def test_a_statement_error_is_no_misconfiguration(password_postgres):
    """A SQLSTATE of a statement (here 42501, as a connect refusal could also be) is
    left alone: only a refused connection is a misconfiguration."""
    engine = sa.create_engine(password_postgres.url())
    try:
        with engine.connect() as connection, pytest.raises(sa.exc.DBAPIError) as caught:
            connection.exec_driver_sql('SELECT * FROM "database ""x"" does not exist"')
    finally:
        engine.dispose()
    assert None is driver_errors.misconfiguration(caught.value)


@pytest.mark.parametrize("driver", ["psycopg2", "psycopg"])
def test_a_refused_connect_carries_no_sqlstate_on_either_driver(
    password_postgres, driver
):
    """Why misconfiguration() reads a refused connect by its text alone: neither driver
    gives it a SQLSTATE, not even psycopg 3 (3D000 here is the rule's, for the message)."""
    url = _url(
        password_postgres, user=PASSWORD_ROLE, password=ROLE_PASSWORD, database="nope"
    )
    error = _refusal(url.replace(f"+{_support.driver()}://", f"+{driver}://"))
    assert None is driver_errors.sqlstate(error.__cause__)
    problem = driver_errors.misconfiguration(error.__cause__)
    assert problem is not None
    assert "3D000" == problem.sqlstate
