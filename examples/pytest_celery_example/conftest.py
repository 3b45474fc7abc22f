"""A project that tests with Celery's own fixtures (``celery_config``, ``celery_session_app``,
``celery_session_worker``), here loaded by pytest-celery, and adds celery-pglock with one
fixture: ``celery_config`` built on ``pglock_celery_config``.

pytest-celery 1.x replaces ``celery_worker`` with its Docker worker; Celery's in-process
worker stays available as ``celery_session_worker``. Without pytest-celery, load Celery's
fixtures with ``pytest_plugins = ("celery.contrib.pytest",)``.
"""

from __future__ import annotations

from typing import Any

import pytest


@pytest.fixture(scope="session")
def celery_config(pglock_celery_config: dict[str, Any]) -> dict[str, Any]:
    """The lock database, broker and result backend of the session, and the project's own."""
    return {**pglock_celery_config, "task_track_started": True}


@pytest.fixture(scope="session")
def celery_includes() -> list[str]:
    return ["examples.pytest_celery_example.tasks"]


@pytest.fixture(scope="session")
def celery_worker_pool() -> str:
    """Threads, so that a duplicate can be received while the first run holds its lock."""
    return "threads"


@pytest.fixture(scope="session")
def celery_worker_parameters() -> dict[str, Any]:
    return {"concurrency": 4}
