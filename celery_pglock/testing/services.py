"""The one service bootstrap: PostgreSQL, a Celery broker and a result backend.

The test suite, the demo and the benchmarks all start their services here. Configured
servers win: ``CELERY_PGLOCK_TEST_DATABASE_URL``, ``CELERY_PGLOCK_TEST_BROKER_URL`` and
``CELERY_PGLOCK_TEST_RESULT_BACKEND`` name them (CI's health-checked containers, a
developer's docker compose). Whatever is not configured is started here, privately: an
:class:`EmbeddedPostgres` and an :class:`EmbeddedRedis`. So the whole suite runs on a
bare machine, and CI never silently skips a tier.

Why ``TEST`` names and not the library's own ``CELERY_PGLOCK_DATABASE_URL``: what these
services get is disposable (tests create tables, kill sessions, restart servers), and a
developer's shell may well hold the URL of a real lock database.

Hazard: a configured URL that does not answer is an error, not a reason to fall back to
an embedded server; falling back would test something other than what was asked for.
The error names the variable and shows the URL with its password masked.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from typing import TYPE_CHECKING, Any

from sqlalchemy.engine import make_url

from celery_pglock import config
from celery_pglock.db import engines, redact
from celery_pglock.testing import _support
from celery_pglock.testing._support import ServiceError
from celery_pglock.testing.postgres import EmbeddedPostgres
from celery_pglock.testing.redis import EmbeddedRedis

if TYPE_CHECKING:
    from collections.abc import Callable
    from types import TracebackType

    from typing_extensions import Self

DATABASE_URL_ENV = "CELERY_PGLOCK_TEST_DATABASE_URL"
BROKER_URL_ENV = "CELERY_PGLOCK_TEST_BROKER_URL"
RESULT_BACKEND_ENV = "CELERY_PGLOCK_TEST_RESULT_BACKEND"
REDIS_SCHEMES = ("redis", "rediss")
#: application_name of the probing sessions (deliberately not starting with "pglock").
PROBE_APPLICATION_NAME = "celery_pglock.testing probe"


@dataclasses.dataclass(kw_only=True)
class Services:
    """Where the test session's services are, and which of them it started itself."""

    database_url: str  #: SQLAlchemy URL of the lock database.
    broker_url: str  #: Celery broker URL.
    result_backend_url: str  #: Celery result backend URL.
    postgres_version: str  #: ``server_version`` of the database, such as ``"18.6"``.
    #: What start_services() started itself, of "postgres" and "redis".
    started: list[str] = dataclasses.field(default_factory=list)
    postgres: EmbeddedPostgres | None = None  #: The embedded server, if started here.
    redis: EmbeddedRedis | None = None  #: The embedded Redis, if started here.

    def env(self) -> dict[str, str]:
        """Environment variables that point a subprocess (a worker) at these services."""
        return {
            DATABASE_URL_ENV: self.database_url,
            BROKER_URL_ENV: self.broker_url,
            RESULT_BACKEND_ENV: self.result_backend_url,
            config.DATABASE_URL_ENV: self.database_url,
        }

    def describe(self) -> list[str]:
        """Two lines for humans: where PostgreSQL and the broker are, and whose they are.

        URLs are shown with their passwords masked.
        """
        postgres = (
            "embedded" if "postgres" in self.started else f"from {DATABASE_URL_ENV}"
        )
        broker = (
            "embedded Redis" if "redis" in self.started else f"from {BROKER_URL_ENV}"
        )
        return [
            f"PostgreSQL: {self.postgres_version} ({postgres}) at "
            f"{engines.mask_url(self.database_url)}",
            f"Broker:     {engines.mask_url(self.broker_url)} ({broker})",
        ]

    def stop(self) -> None:
        """Stop what :func:`start_services` started; configured services are left alone."""
        redis, self.redis = self.redis, None
        postgres, self.postgres = self.postgres, None
        try:
            if redis is not None:
                redis.stop()
        finally:
            if postgres is not None:
                postgres.cleanup()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()


def start_services(*, timeout: float = 20.0) -> Services:
    """Check the configured services and start embedded ones for the rest.

    Args:
        timeout: Seconds to wait for each configured service to answer (a container may
            still be starting), and for each embedded one to start.

    Raises:
        ServiceError: a configured URL does not answer (the message names its variable),
            or an embedded service failed to start.
    """
    postgres: EmbeddedPostgres | None = None
    redis: EmbeddedRedis | None = None
    started: list[str] = []
    with contextlib.ExitStack() as undo:  # stops what was started if a later step fails
        database_url = os.environ.get(DATABASE_URL_ENV, "")
        if database_url:
            _check_configured(
                DATABASE_URL_ENV, database_url, wait_for_postgres, timeout
            )
        else:
            postgres = EmbeddedPostgres()
            undo.callback(postgres.cleanup)
            postgres.start(timeout=max(timeout, 60.0))
            started.append("postgres")
            database_url = postgres.url()
        broker_url = os.environ.get(BROKER_URL_ENV, "")
        if broker_url:
            _check_configured(BROKER_URL_ENV, broker_url, wait_for_broker, timeout)
        else:
            redis = EmbeddedRedis()
            undo.callback(redis.stop)
            redis.start(timeout=timeout)
            started.append("redis")
            broker_url = redis.url()
        result_backend_url = os.environ.get(RESULT_BACKEND_ENV, "")
        if result_backend_url and result_backend_url != broker_url:
            _check_configured(
                RESULT_BACKEND_ENV, result_backend_url, _wait_for_backend, timeout
            )
        services = Services(
            database_url=database_url,
            broker_url=broker_url,
            result_backend_url=result_backend_url
            or default_result_backend(broker_url, database_url),
            postgres_version=server_version(database_url),
            started=started,
            postgres=postgres,
            redis=redis,
        )
        undo.pop_all()
    return services


def default_result_backend(broker_url: str, database_url: str) -> str:
    """The broker itself when it is Redis, else Celery's database backend on our database."""
    if _scheme(broker_url) in REDIS_SCHEMES:
        return broker_url
    return f"db+{database_url}"


def wait_for_postgres(url: str, timeout: float) -> None:
    """Wait until the PostgreSQL server at ``url`` accepts a connection and a query.

    Raises:
        ServiceError: it did not within ``timeout`` seconds (the last error is shown).
    """

    def probe() -> None:
        connection = _support.connect(
            url, application_name=PROBE_APPLICATION_NAME, connect_timeout=2
        )
        try:
            with connection.cursor() as cursor:
                cursor.execute("SELECT 1")
        finally:
            connection.close()

    _retry(probe, timeout, f"PostgreSQL at {engines.mask_url(url)}")


def wait_for_redis(url: str, timeout: float) -> None:
    """Wait until the Redis server at ``url`` answers PING.

    Raises:
        ServiceError: it did not within ``timeout`` seconds (the last error is shown).
    """
    import redis

    def probe() -> None:
        client: Any = redis.Redis.from_url(
            url, socket_connect_timeout=2, socket_timeout=2
        )
        try:
            client.ping()
        finally:
            client.close()

    _retry(probe, timeout, f"Redis at {engines.mask_url(url)}")


def wait_for_broker(url: str, timeout: float) -> None:
    """Wait until the Celery broker at ``url`` accepts a connection (Redis: PING).

    Raises:
        ServiceError: it did not within ``timeout`` seconds (the last error is shown).
    """
    if _scheme(url) in REDIS_SCHEMES:
        wait_for_redis(url, timeout)
        return
    import kombu

    def probe() -> None:
        with kombu.Connection(url, connect_timeout=2) as connection:
            connection.connect()

    _retry(probe, timeout, f"the broker at {engines.mask_url(url)}")


def server_version(url: str) -> str:
    """The ``server_version`` of the PostgreSQL server at ``url``, such as ``"18.6"``."""
    connection = _support.connect(url, application_name=PROBE_APPLICATION_NAME)
    try:
        with connection.cursor() as cursor:
            cursor.execute("SHOW server_version")
            (version,) = cursor.fetchone()
    finally:
        connection.close()
    # Distribution builds append their own text: "15.14 (Ubuntu 15.14-1.pgdg22.04+1)".
    return str(version).split()[0]


def _wait_for_backend(url: str, timeout: float) -> None:
    scheme = _scheme(url)
    if scheme in REDIS_SCHEMES:
        wait_for_redis(url, timeout)
    elif scheme.startswith("db+"):
        wait_for_postgres(url.removeprefix("db+"), timeout)
    # Other backends (rpc://, ...) are checked by their first use.


def _check_configured(
    variable: str, url: str, wait: Callable[[str, float], None], timeout: float
) -> None:
    try:
        wait(url, timeout)
    except ServiceError as exc:
        # A driver echoes connection options (a host holding half a password).
        redact.scrub_exception(exc, _url_secrets(url))
        raise ServiceError(
            f"{variable}={engines.mask_url(url)} is set but not reachable: {exc} "
            f"Start that service, fix the URL, or unset {variable} to use an embedded one."
        ) from exc


def _retry(probe: Callable[[], None], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            probe()
        except Exception as exc:  # any failure means "not yet"; the last one is shown
            if time.monotonic() >= deadline:
                detail = " ".join(str(exc).split()) or type(exc).__name__
                raise ServiceError(
                    f"{what} did not answer within {timeout:g} s: {detail}."
                ) from exc
            time.sleep(0.25)
        else:
            return


def _url_secrets(url: str) -> list[str]:
    try:
        return redact.secrets_of(make_url(url.removeprefix("db+")))
    except Exception:  # unparseable: the generic scrub still masks URLs and pairs
        return []


def _scheme(url: str) -> str:
    return url.partition("://")[0].lower()
