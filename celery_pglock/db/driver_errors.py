"""Driver errors translated once into a scrubbed DatabaseError, then classified by cause.
Why: docs/operations/failure-modes.md ("Lock database unavailable")."""

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
    """Into DatabaseError; with ``connecting=True`` never taken for a dead session."""
    try:
        yield
    except exceptions.PgLockError:
        raise
    except Exception as exc:
        if not isinstance(
            exc, (sa_exc.SQLAlchemyError, OSError, *errors_named("Error"))
        ):
            raise
        where = f" on {redact.mask_url(engine.url)}" if engine is not None else ""
        # libpq echoes connection options (half a password as a host name): scrub the chain.
        redact.scrub_exception(
            exc, redact.secrets_of(engine.url) if engine is not None else ()
        )
        message = f"Could not {action}{where}: {str(exc).strip()}"
        if (problem := misconfiguration(exc)) is not None:
            message += f" -- {problem}"
        error = exceptions.DatabaseError(message)
        error.pglock_connect_failed = connecting  # type: ignore[attr-defined]
        raise error from exc


def is_dead_session(error: exceptions.DatabaseError) -> bool:
    """An established session died (holds nothing now). By where, not shape: a failed
    connect looks the same on psycopg 3 and at psycopg2's BEGIN."""
    connect_failed = getattr(error, "pglock_connect_failed", False)
    return not connect_failed and is_disconnect(error.__cause__)


DRIVER_MODULES = ("psycopg2", "psycopg")  #: The supported drivers, by import name.


def errors_named(*names: str) -> tuple[type[Exception], ...]:
    """Of every driver imported so far (none imported here: psycopg 3 is optional)."""
    return tuple(
        getattr(module, name)
        for module in map(sys.modules.get, DRIVER_MODULES)
        if module is not None
        for name in names
    )


def operational_error(dbapi_connection: Any) -> type[Exception]:
    # Through the MRO: a ``connection_factory`` subclass lives in the user's module.
    for cls in type(dbapi_connection).__mro__:
        package = cls.__module__.partition(".")[0]
        if package in DRIVER_MODULES:
            error: type[Exception] = sys.modules[package].OperationalError
            return error
    raise TypeError(f"not a connection of a supported driver: {type(dbapi_connection)}")


def _from_statement(original: BaseException) -> bool:
    # psycopg2 attaches the statement's cursor, psycopg 3 the server's result.
    return any(getattr(original, n, None) is not None for n in ("cursor", "pgresult"))


def is_disconnect(exc: BaseException | None) -> bool:
    original = getattr(exc, "orig", exc)
    # psycopg2's "connection already closed" (an OperationalError on psycopg 3).
    if isinstance(original, errors_named("InterfaceError")):
        return True
    if not isinstance(original, errors_named("OperationalError")):
        return False
    code = sqlstate(original)
    # None: the socket died; 08: connection exception; 57P0x: shutdown, terminated backend.
    return code is None or code.startswith(("08", "57P0"))


def is_transient(exc: BaseException | None) -> bool:
    """Unavailable for now: a failed connect, a dead session, SQLSTATE class 53 (too many
    connections); never a misconfiguration."""
    if exc is None or misconfiguration(exc) is not None:
        return False
    original = getattr(exc, "orig", exc)
    return (
        (
            isinstance(original, errors_named("OperationalError"))
            and not _from_statement(original)
        )
        or is_disconnect(exc)
        or (sqlstate(exc) or "").startswith("53")
    )


def sqlstate(exc: BaseException) -> str | None:
    original = getattr(exc, "orig", exc)
    code = getattr(original, "pgcode", None) or getattr(original, "sqlstate", None)
    return code if isinstance(code, str) else None


@dataclasses.dataclass(frozen=True)
class Misconfiguration:
    """A connection refused for a reason that waiting does not fix."""

    #: Searched in a refused connect's English text: other lc_messages read as an outage.
    pattern: str = dataclasses.field(repr=False, compare=False)
    sqlstate: str | None  #: None: found by the client.
    cause: str
    advice: str

    def __str__(self) -> str:
        code = f" (SQLSTATE {self.sqlstate})" if self.sqlstate else ""
        return (
            f"a configuration error, not an outage, so it is not retried: "
            f"{self.cause}{code}. {self.advice}"
        )


_URL = "the lock database URL (app.conf.pglock_database_url or $CELERY_PGLOCK_DATABASE_URL)"
_CONNECT_ARGS = "pglock_engine_options['connect_args']"
_RULES = (
    Misconfiguration(
        r"password authentication failed|no password supplied",
        "28P01",
        "password authentication failed",
        f"Check the user name and password in {_URL}; PostgreSQL says the same "
        "when the role does not exist.",
    ),
    Misconfiguration(
        r'role "[^"]*" does not exist',
        "28000",
        "the role does not exist",
        f"Fix the user name in {_URL}, or create the role.",
    ),
    Misconfiguration(
        r"is not permitted to log in",
        "28000",
        "the role may not log in",
        "ALTER ROLE ... LOGIN, or use a role that may.",
    ),
    Misconfiguration(
        r"no pg_hba\.conf entry|pg_hba\.conf rejects",
        "28000",
        "pg_hba.conf admits no such connection (this host, user, database and TLS mode)",
        "Add a pg_hba.conf line for it on the server, or connect as it expects "
        "(sslmode in the URL's query).",
    ),
    Misconfiguration(
        r'database "[^"]*" does not exist',
        "3D000",
        "the database does not exist",
        f"Fix the database name in {_URL}, or create the database.",
    ),
    Misconfiguration(
        r"permission denied for database",
        "42501",
        "the role may not connect to this database",
        "GRANT CONNECT ON DATABASE ... TO the role.",
    ),
    Misconfiguration(
        r"authentication failed|authentication method \d+ not supported",
        "28000",
        "authentication failed",
        f"Check the credentials in {_URL} and the method pg_hba.conf asks for.",
    ),
    Misconfiguration(
        # Not "SSL SYSCALL error", "closed unexpectedly", bad record MAC: outages.
        r"SSL was required|does not support SSL|sslmode|certificate|private key|"
        r"unknown ca|unsupported protocol|wrong version number|"
        r"no protocols available|GSSAPI encryption required",
        None,
        "the TLS (SSL) settings do not work with this server",
        f"Check sslmode, sslrootcert, sslcert and sslkey in the URL's query (or "
        f"{_CONNECT_ARGS}) against the server's ssl setting.",
    ),
    Misconfiguration(
        r"invalid connection option|invalid \w+ value|invalid integer value|"
        r"invalid port number",
        None,
        "a connection option is invalid",
        f"Fix the option in the URL's query or {_CONNECT_ARGS}.",
    ),
)


def misconfiguration(exc: BaseException | None) -> Misconfiguration | None:
    """A refused connect's login, database, pg_hba.conf, TLS or option problem, else None."""
    original = getattr(exc, "orig", exc)
    # A refused connect has no SQLSTATE (the rules' codes are for the message).
    if (
        not isinstance(original, errors_named("OperationalError", "ProgrammingError"))
        or sqlstate(original) is not None
        or _from_statement(original)
    ):
        return None
    text = str(original)
    return next((rule for rule in _RULES if re.search(rule.pattern, text)), None)
