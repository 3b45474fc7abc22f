"""Driver errors at the lock database boundary: translated once, then classified.

Every SQLAlchemy or driver (psycopg2, psycopg 3) error a lock path meets leaves it as
:class:`~celery_pglock.exceptions.DatabaseError` (:func:`wrap_db_errors`), with secrets
scrubbed from the whole chain. The classifiers below decide what an error means for the
locks: a dead session held nothing any more (:func:`is_dead_session`), a transient
error is worth a re-queue (:func:`is_transient`), and a misconfiguration (a wrong
password, a missing database or role, a TLS setting the server refuses) is not worth one
(:func:`misconfiguration`). They look at the driver's own error (``__cause__``); only the
last also reads its text, because libpq reports a refused login without a SQLSTATE.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
import sys
from typing import TYPE_CHECKING, Any

from sqlalchemy import exc as sa_exc

from celery_pglock import exceptions
from celery_pglock.db import redact

if TYPE_CHECKING:
    from collections.abc import Iterator

    import sqlalchemy as sa


@contextlib.contextmanager
def wrap_db_errors(
    action: str, engine: sa.Engine | None = None, *, connecting: bool = False
) -> Iterator[None]:
    """Translate SQLAlchemy/driver errors into :class:`DatabaseError` at one boundary.

    ``connecting=True`` around the opening of a lock connection (a pool checkout): its
    failure (refused, too many clients, authentication, a timeout) then never counts as
    a dead session (:func:`is_dead_session`), whatever the driver's error looks like.
    """
    try:
        yield
    except exceptions.PgLockError:
        raise
    except Exception as exc:
        if not isinstance(exc, (sa_exc.SQLAlchemyError, OSError, *_driver_error())):
            raise
        where = f" on {redact.mask_url(engine.url)}" if engine is not None else ""
        # libpq echoes connection options (a host name holding half a password, a DSN
        # fragment) in its messages; scrub the whole chain, which tracebacks print.
        redact.scrub_exception(
            exc, redact.secrets_of(engine.url) if engine is not None else ()
        )
        message = f"Could not {action}{where}: {str(exc).strip()}"
        problem = misconfiguration(exc)
        if problem is not None:
            message += f" -- {problem}"
        error = exceptions.DatabaseError(message)
        if connecting:
            setattr(error, _CONNECT_FAILED, True)
        raise error from exc


#: Set on a DatabaseError raised while opening a lock connection (see wrap_db_errors).
_CONNECT_FAILED = "_pglock_connect_failed"


def is_dead_session(error: exceptions.DatabaseError) -> bool:
    """True if ``error`` says an established lock session died under a statement (server
    restart, failover, terminated backend, cut link): it held nothing any more, and a
    fresh connection may well work. False for a failure to connect (refused, too many
    clients), which is no dead session: there was none.

    Decided by where the error arose, not by its shape: psycopg2 raises a dead
    session found at a transaction's BEGIN without a cursor, like a failed connect, and
    psycopg 3 any dead session without a server result.
    """
    return not getattr(error, _CONNECT_FAILED, False) and is_disconnect(error.__cause__)


#: The supported drivers' modules (db.SUPPORTED_DRIVERS), by import name.
DRIVER_MODULES = ("psycopg2", "psycopg")


def _errors(name: str) -> tuple[type[Exception], ...]:
    """The DBAPI error class ``name`` of every supported driver imported so far.

    A driver's error can only exist once its module is imported, so neither is imported
    here: import stays cheap, and psycopg 3 need not be installed.
    """
    return tuple(
        getattr(module, name)
        for module in map(sys.modules.get, DRIVER_MODULES)
        if module is not None
    )


def _driver_error() -> tuple[type[Exception], ...]:
    return _errors("Error")


def errors_named(name: str) -> tuple[type[Exception], ...]:
    """The DBAPI error class ``name`` (``"OperationalError"``) of every supported driver
    imported so far (see :func:`_errors`)."""
    return _errors(name)


def operational_error(dbapi_connection: Any) -> type[Exception]:
    """The OperationalError class of the driver ``dbapi_connection`` belongs to (found
    through its classes: a ``connection_factory`` subclass lives in the user's module)."""
    for cls in type(dbapi_connection).__mro__:
        package = cls.__module__.partition(".")[0]
        if package in DRIVER_MODULES:
            error: type[Exception] = sys.modules[package].OperationalError
            return error
    raise TypeError(f"not a connection of a supported driver: {type(dbapi_connection)}")


def _from_statement(original: BaseException) -> bool:
    """Did the driver attach a statement's cursor (psycopg2) or a server result
    (psycopg 3) to ``original``? Then it is no failure to connect."""
    return (
        getattr(original, "cursor", None) is not None
        or getattr(original, "pgresult", None) is not None
    )


def is_disconnect(exc: BaseException | None) -> bool:
    """True if ``exc`` means the session is gone (so it holds no lock any more)."""
    original = getattr(exc, "orig", exc)
    # psycopg2: "connection already closed" (psycopg 3 says it as an OperationalError).
    if isinstance(original, _errors("InterfaceError")):
        return True
    if not isinstance(original, _errors("OperationalError")):
        return False
    code = sqlstate(original)
    # No SQLSTATE: the socket died. 08xxx: connection exceptions. 57P0x: the server is
    # shutting down or terminated this backend (admin shutdown, crash, restart).
    return code is None or code.startswith(("08", "57P0"))


def is_connect_failure(exc: BaseException | None) -> bool:
    """True if ``exc`` looks like a failure to open a new connection (refused, unknown
    host, authentication, too many clients).

    psycopg2 attaches the cursor to the errors a statement raises (psycopg 3 the
    server's result), and an OperationalError without one usually comes from connecting:
    but a dead session found at the implicit BEGIN of a transaction has none either (on
    psycopg 3 no dead session has). Good enough to call an error transient (both are);
    to tell a dead session from a failed connect, the lock paths use
    :func:`is_dead_session`, which knows where the error arose.
    """
    original = getattr(exc, "orig", exc)
    return isinstance(original, _errors("OperationalError")) and not _from_statement(
        original
    )


def is_transient(exc: BaseException | None) -> bool:
    """True if ``exc`` says the database is unavailable for now, not that we are wrong:
    a failed connect, a dead session, or insufficient resources (SQLSTATE 53xxx, such as
    ``too_many_connections``). Never for a :func:`misconfiguration`: waiting does not
    fix a wrong password."""
    if exc is None or misconfiguration(exc) is not None:
        return False
    return (
        is_connect_failure(exc)
        or is_disconnect(exc)
        or (sqlstate(exc) or "").startswith("53")
    )


def sqlstate(exc: BaseException) -> str | None:
    """The SQLSTATE of a driver error (or one wrapped by SQLAlchemy), if any: psycopg2
    calls it ``pgcode``, psycopg 3 ``sqlstate``."""
    original = getattr(exc, "orig", exc)
    code = getattr(original, "pgcode", None) or getattr(original, "sqlstate", None)
    return code if isinstance(code, str) else None


@dataclasses.dataclass(frozen=True)
class Misconfiguration:
    """A connection refused for a reason that waiting does not fix."""

    sqlstate: str | None  #: The SQLSTATE the server sends (None: found by the client).
    cause: str  #: What is wrong, in a few words.
    advice: str  #: What to change.

    def __str__(self) -> str:
        code = f" (SQLSTATE {self.sqlstate})" if self.sqlstate else ""
        return (
            f"a configuration error, not an outage, so it is not retried: "
            f"{self.cause}{code}. {self.advice}"
        )


_URL = "the lock database URL (app.conf.pglock_database_url or $CELERY_PGLOCK_DATABASE_URL)"
_AUTHENTICATION = Misconfiguration(
    "28P01",
    "password authentication failed",
    f"Check the user name and password in {_URL}; PostgreSQL says the same when "
    "the role does not exist.",
)
_NO_DATABASE = Misconfiguration(
    "3D000",
    "the database does not exist",
    f"Fix the database name in {_URL}, or create the database.",
)
#: What a connect failure's text says, as libpq and the server word it in English. Neither
#: driver gives a SQLSTATE for a refused connect (libpq reports it before any result), so the
#: text is all there is. A server whose lc_messages is not English words these in its
#: language: unmatched, such an error is taken for an outage and retried, as before.
_RULES: tuple[tuple[re.Pattern[str], Misconfiguration], ...] = tuple(
    (re.compile(pattern), problem)
    for pattern, problem in (
        (r"password authentication failed|no password supplied", _AUTHENTICATION),
        (
            r'role "[^"]*" does not exist',
            Misconfiguration(
                "28000",
                "the role does not exist",
                f"Fix the user name in {_URL}, or create the role.",
            ),
        ),
        (
            r"is not permitted to log in",
            Misconfiguration(
                "28000",
                "the role may not log in",
                "ALTER ROLE ... LOGIN, or use a role that may.",
            ),
        ),
        (
            r"no pg_hba\.conf entry|pg_hba\.conf rejects",
            Misconfiguration(
                "28000",
                "pg_hba.conf admits no such connection (this host, user, database and TLS mode)",
                "Add a pg_hba.conf line for it on the server, or connect as it expects "
                "(sslmode in the URL's query).",
            ),
        ),
        (r'database "[^"]*" does not exist', _NO_DATABASE),
        (
            r"permission denied for database",
            Misconfiguration(
                "42501",
                "the role may not connect to this database",
                "GRANT CONNECT ON DATABASE ... TO the role.",
            ),
        ),
        (
            r"authentication failed|authentication method \d+ not supported",
            Misconfiguration(
                "28000",
                "authentication failed",
                f"Check the credentials in {_URL} and the method pg_hba.conf asks for.",
            ),
        ),
        (
            # Not "SSL SYSCALL error", "SSL connection has been closed unexpectedly" or
            # a bad record MAC: those are a cut or garbled link, an outage.
            r"SSL was required|does not support SSL|sslmode|certificate|private key|"
            r"unknown ca|unsupported protocol|wrong version number|"
            r"no protocols available|GSSAPI encryption required",
            Misconfiguration(
                None,
                "the TLS (SSL) settings do not work with this server",
                "Check sslmode, sslrootcert, sslcert and sslkey in the URL's query (or "
                "pglock_engine_options['connect_args']) against the server's ssl setting.",
            ),
        ),
        (
            r"invalid connection option|invalid \w+ value|invalid integer value|"
            r"invalid port number",
            Misconfiguration(
                None,
                "a connection option is invalid",
                "Fix the option in the URL's query or pglock_engine_options['connect_args'].",
            ),
        ),
    )
)


def misconfiguration(exc: BaseException | None) -> Misconfiguration | None:
    """What is misconfigured if ``exc`` is a connection the server (or libpq) refused for
    a reason that waiting does not fix: SQLSTATE class 28 (invalid authorization), 3D000
    (invalid catalog name), a role that does not exist or may not log in, pg_hba.conf, a
    TLS setting, an invalid connection option. None for anything else (an outage, a
    statement's error)."""
    original = getattr(exc, "orig", exc)
    if not isinstance(original, _driver_error()):
        return None
    code = sqlstate(original)
    if code is not None:
        if not code.startswith("28") and code != "3D000":
            return None  # a statement's error, or an outage the server names (57P03)
        text = str(original)
        for pattern, problem in _RULES:
            if problem.sqlstate == code and pattern.search(text):
                return problem
        if code == _NO_DATABASE.sqlstate:
            return _NO_DATABASE
        return Misconfiguration(
            code, "the server refused the login", f"Check the role and {_URL}."
        )
    if not isinstance(
        original, _errors("OperationalError") + _errors("ProgrammingError")
    ):
        return None
    if _from_statement(original):
        return None  # a statement's error: no connect failure
    text = str(original)
    for pattern, problem in _RULES:
        if pattern.search(text):
            return problem
    return None
