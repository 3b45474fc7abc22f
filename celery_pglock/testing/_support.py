"""Plumbing shared by the test services: errors, ports, log tails, deadlines, psycopg2.

Hazard: :func:`free_port` returns a port that is free *now*; another process can take it
before the server binds it. Callers that chose the port themselves retry with a new one
when the server reports "Address already in use".
"""

from __future__ import annotations

import math
import os
import socket
import time
from collections import deque
from typing import TYPE_CHECKING, Any

from sqlalchemy.engine import make_url

if TYPE_CHECKING:
    from collections.abc import Callable
    from pathlib import Path

#: Host every embedded service listens on: loopback only, never a public interface.
HOST = "127.0.0.1"


class ServiceError(RuntimeError):
    """A test service could not be started, reached or stopped."""


def free_port(host: str = HOST) -> int:
    """A TCP port that nothing listens on at the moment of the call."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


def tail(path: Path | None, lines: int = 40) -> str:
    """The last ``lines`` lines of a log file, or a note saying why there are none."""
    if path is None:
        return "<no log file>"
    try:
        with path.open(encoding="utf-8", errors="replace") as handle:
            last = deque(handle, maxlen=lines)
    except OSError as exc:
        return f"<log {path} unreadable: {exc}>"
    text = "".join(last).rstrip()
    return text or f"<log {path} is empty>"


def with_log(message: str, path: Path | None) -> str:
    """``message`` followed by the tail of the log at ``path``, for error messages."""
    return f"{message}\n--- last lines of {path} ---\n{tail(path)}"


def wait_until(
    condition: Callable[[], bool],
    *,
    timeout: float,
    interval: float = 0.05,
    give_up: Callable[[], bool] | None = None,
) -> bool:
    """Poll ``condition`` until it is true or ``timeout`` seconds pass.

    Args:
        condition: Checked first immediately, then every ``interval`` seconds.
        timeout: The deadline, in seconds from now.
        interval: Seconds between checks.
        give_up: Checked after each failed ``condition``; true stops waiting early
            (the process being waited for has exited, say).

    Returns:
        Whether ``condition`` became true before the deadline.
    """
    deadline = time.monotonic() + timeout
    while True:
        if condition():
            return True
        if (give_up is not None and give_up()) or time.monotonic() >= deadline:
            return False
        time.sleep(interval)


#: The driver of the URLs the embedded PostgreSQL hands out: ``psycopg2`` (the default)
#: or ``psycopg`` (3), as in ``postgresql+psycopg://``.
DRIVER_ENV = "CELERY_PGLOCK_TEST_DRIVER"


def driver() -> str:
    """The driver named by $CELERY_PGLOCK_TEST_DRIVER (default ``psycopg2``).

    Raises:
        ServiceError: it names a driver celery-pglock does not support.
    """
    from celery_pglock.db import engines

    name = os.environ.get(DRIVER_ENV) or "psycopg2"
    if name not in engines.SUPPORTED_DRIVERS:
        raise ServiceError(
            f"${DRIVER_ENV} must be one of {', '.join(engines.SUPPORTED_DRIVERS)}; got {name!r}."
        )
    return name


def with_driver(url: str, name: str) -> str:
    """``url`` (a PostgreSQL URL with or without a driver) with the driver ``name``."""
    scheme, separator, rest = url.partition("://")
    if not separator or scheme.partition("+")[0] not in ("postgresql", "postgres"):
        return url  # not a PostgreSQL URL: as it is (its check reports it)
    return f"postgresql+{name}://{rest}"


def connect_kwargs(url: str) -> dict[str, Any]:
    """psycopg2/libpq connection keywords for a SQLAlchemy or libpq database URL.

    ``postgresql+psycopg2://user:pw@host:port/db?sslmode=...`` becomes
    ``{"user": ..., "password": ..., "host": ..., "port": ..., "dbname": ..., "sslmode": ...}``.
    """
    parsed = make_url(url)
    kwargs: dict[str, Any] = parsed.translate_connect_args(
        username="user", database="dbname"
    )
    kwargs.update(parsed.query)
    return kwargs


def connect(url: str, *, application_name: str, connect_timeout: float = 5.0) -> Any:
    """A new psycopg2 connection in autocommit mode, outside any SQLAlchemy pool.

    Args:
        url: A ``postgresql+psycopg2://`` (or plain libpq) URL.
        application_name: Shown in pg_stat_activity. Never start it with ``pglock``: the
            test suite's leak check treats such sessions as lock connections.
        connect_timeout: Seconds libpq may spend connecting (rounded up, at least 1).
    """
    import psycopg2  # type: ignore[import-untyped, unused-ignore]  # no stubs shipped

    kwargs = {
        "connect_timeout": max(1, math.ceil(connect_timeout)),
        "application_name": application_name,
        **connect_kwargs(url),
    }
    connection = psycopg2.connect(**kwargs)
    connection.autocommit = True
    return connection


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie."""
    import psutil  # type: ignore[import-untyped, unused-ignore]  # no stubs shipped

    try:
        return bool(psutil.Process(pid).status() != psutil.STATUS_ZOMBIE)
    except psutil.Error:
        return False


def clean_env(**overrides: str) -> dict[str, str]:
    """``os.environ`` without libpq's ``PG*`` variables, plus ``overrides``.

    A developer's ``PGPORT`` or ``PGDATA`` must not steer the embedded server's tools.
    """
    env = {
        name: value for name, value in os.environ.items() if not name.startswith("PG")
    }
    env.update(overrides)
    return env
