"""Driver errors at the lock database boundary: translated once, then classified.

Every SQLAlchemy or psycopg2 error a lock path meets leaves it as
:class:`~celery_pglock.exceptions.DatabaseError` (:func:`wrap_db_errors`), with secrets
scrubbed from the whole chain. The classifiers below decide what an error means for the
locks: a dead session held nothing any more (:func:`is_dead_session`), and a transient
error is worth a re-queue (:func:`is_transient`). They look at the driver's own error
(``__cause__``), never at message text.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

from sqlalchemy import exc as sa_exc

from celery_pglock import _redact, exceptions

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
    except (sa_exc.SQLAlchemyError, OSError, _driver_error()) as exc:
        where = f" on {_redact.mask_url(engine.url)}" if engine is not None else ""
        # libpq echoes connection options (a host name holding half a password, a DSN
        # fragment) in its messages; scrub the whole chain, which tracebacks print.
        _redact.scrub_exception(
            exc, _redact.secrets_of(engine.url) if engine is not None else ()
        )
        error = exceptions.DatabaseError(f"Could not {action}{where}: {exc}".strip())
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
    session found at a transaction's BEGIN without a cursor, like a failed connect.
    """
    return not getattr(error, _CONNECT_FAILED, False) and is_disconnect(error.__cause__)


def _driver_error() -> type[Exception]:
    import psycopg2  # the only supported driver; imported lazily to keep import cheap

    return psycopg2.Error


def is_disconnect(exc: BaseException | None) -> bool:
    """True if ``exc`` means the session is gone (so it holds no lock any more)."""
    import psycopg2  # the only supported driver; imported here to keep import cheap

    original = getattr(exc, "orig", exc)
    if isinstance(original, psycopg2.InterfaceError):  # "connection already closed"
        return True
    if not isinstance(original, psycopg2.OperationalError):
        return False
    code = sqlstate(original)
    # No SQLSTATE: the socket died. 08xxx: connection exceptions. 57P0x: the server is
    # shutting down or terminated this backend (admin shutdown, crash, restart).
    return code is None or code.startswith(("08", "57P0"))


def is_connect_failure(exc: BaseException | None) -> bool:
    """True if ``exc`` looks like a failure to open a new connection (refused, unknown
    host, authentication, too many clients).

    psycopg2 attaches the cursor to the errors a statement raises, and an
    OperationalError without one usually comes from connecting: but a dead session found
    at the implicit BEGIN of a transaction has none either. Good enough to call an error
    transient (both are); to tell a dead session from a failed connect, the lock paths
    use :func:`is_dead_session`, which knows where the error arose.
    """
    import psycopg2  # the only supported driver; imported here to keep import cheap

    original = getattr(exc, "orig", exc)
    return (
        isinstance(original, psycopg2.OperationalError)
        and getattr(original, "cursor", None) is None
    )


def is_transient(exc: BaseException | None) -> bool:
    """True if ``exc`` says the database is unavailable for now, not that we are wrong:
    a failed connect, a dead session, or insufficient resources (SQLSTATE 53xxx, such as
    ``too_many_connections``)."""
    if exc is None:
        return False
    return (
        is_connect_failure(exc)
        or is_disconnect(exc)
        or (sqlstate(exc) or "").startswith("53")
    )


def sqlstate(exc: BaseException) -> str | None:
    """The SQLSTATE of a driver error (or one wrapped by SQLAlchemy), if any."""
    original = getattr(exc, "orig", exc)
    code = getattr(original, "pgcode", None)
    return code if isinstance(code, str) else None
