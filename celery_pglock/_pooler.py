"""Is a connection pooler between us and PostgreSQL, and in which mode? (``pglock check``)

Session advisory locks need one server session per client session for the lock's whole
life: a transaction- or statement-pooling proxy (PgBouncer ``pool_mode=transaction`` /
``statement``) hands the server session to other clients between transactions, so a
session lock would be held by whoever gets that server session next. Probes, in order:

1. ``inet_server_port()`` differs from the port we connected to: something (a pooler, a
   proxy, a port forward) is in the way.
2. Statement pooling refuses multi-statement transactions (``BEGIN``).
3. Two client sessions, one after the other: A takes a session lock, B asks for the same
   key inside a transaction. Directly (or through session pooling) B is refused; through
   transaction pooling B is usually given A's idle server session (PgBouncer reuses the
   most recent one), where the lock is re-entrant, so B is *granted*. A sees its own lock
   vanish from ``pg_locks`` for its backend pid if it moved, too.

Probe 3 can miss transaction pooling when the pooler gives B a fresh server session; it
never reports pooling on a direct connection.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import secrets
from typing import Any


class PoolMode(str, enum.Enum):
    """What ``pglock check`` concluded about the path to the server."""

    DIRECT = "direct"  #: No proxy seen.
    SESSION = "session"  #: A proxy, keeping one server session per client session.
    TRANSACTION = "transaction"  #: Server sessions change between transactions.
    STATEMENT = "statement"  #: Multi-statement transactions are refused.


@dataclasses.dataclass(frozen=True)
class PoolerReport:
    mode: PoolMode
    detail: str


def detect(connect: Any, url_port: int | None, server_port: int | None) -> PoolerReport:
    """Probe the path to the server; ``connect()`` opens a new autocommit DBAPI connection."""
    proxied = (
        url_port is not None and server_port is not None and url_port != server_port
    )
    key = secrets.randbits(63)
    first = connect()
    second = connect()
    try:
        with second.cursor() as cursor:
            try:
                cursor.execute("BEGIN")
                cursor.execute("SELECT 1")
                cursor.execute("COMMIT")
            except Exception as exc:
                if _refused(exc, second):
                    return PoolerReport(
                        PoolMode.STATEMENT,
                        "a multi-statement transaction was refused (PgBouncer closes the "
                        "connection on BEGIN in statement pooling)",
                    )
                raise
        with first.cursor() as cursor:
            cursor.execute("SELECT pg_try_advisory_lock(%s)", (key,))
            (taken,) = cursor.fetchone()
        with second.cursor() as cursor:
            cursor.execute("BEGIN")
            cursor.execute("SELECT pg_try_advisory_lock(%s)", (key,))
            (also_taken,) = cursor.fetchone()
            cursor.execute("SELECT pg_advisory_unlock_all()")
            cursor.execute("COMMIT")
        if taken and also_taken:
            return PoolerReport(
                PoolMode.TRANSACTION,
                "two client sessions were both granted one session advisory lock: they "
                "shared a server session (transaction pooling)",
            )
        with first.cursor() as cursor:
            cursor.execute("SELECT pg_advisory_unlock_all()")
    finally:
        for connection in (first, second):
            with contextlib.suppress(
                Exception
            ):  # a probe connection: nothing to report
                connection.close()
    if proxied:
        return PoolerReport(
            PoolMode.SESSION,
            f"connected to port {url_port} but the server listens on {server_port}: a "
            "proxy or pooler is in the way, and it kept one server session per client",
        )
    return PoolerReport(PoolMode.DIRECT, "no pooler or proxy detected")


def refuses_transactions(url: Any) -> bool:
    """Does ``url`` lead to statement pooling? (A plain libpq session, no startup options.)

    SQLAlchemy opens a transaction on its first connection, which statement pooling
    answers by closing the connection; this asks again without SQLAlchemy, so the
    refusal's own message can be seen.
    """
    import psycopg2

    kwargs = url.translate_connect_args(username="user", database="dbname")
    try:
        connection = psycopg2.connect(
            connect_timeout=5, application_name="celery-pglock cli", **kwargs
        )
    except Exception:
        return False
    try:
        connection.autocommit = True
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")  # a single statement works...
        try:
            with connection.cursor() as cursor:
                cursor.execute("BEGIN")  # ...and a transaction is refused
                cursor.execute("SELECT 1")
                cursor.execute("ROLLBACK")
        except Exception as exc:
            return _refused(exc, connection)
    except Exception:
        return False
    finally:
        with contextlib.suppress(Exception):
            connection.close()
    return False


def _refused(exc: Exception, connection: Any) -> bool:
    # PgBouncer answers BEGIN in statement pooling with an error naming the mode (newer
    # versions) or by closing the client connection (1.18 logs the reason server-side
    # only). PostgreSQL itself never does either on BEGIN.
    if "statement pooling" in str(exc).lower():
        return True
    raw = getattr(connection, "dbapi_connection", connection)
    return bool(getattr(raw, "closed", False))
