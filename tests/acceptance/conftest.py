"""Fixtures for acceptance tests: the acceptance app and real worker processes.

Workers are started once per module (starting a prefork worker takes seconds) and shared
by its tests; tests stay independent because each one uses its own ``run`` id, which is
part of every lock key and of every recorded interval.
"""

from __future__ import annotations

import importlib
import os
import time
import uuid
from typing import TYPE_CHECKING, Any

import pytest

from celery_pglock.testing import OverlapRecorder, WorkerProcess

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

QUEUE = f"pglock-acceptance-{uuid.uuid4().hex[:8]}"
NAMESPACE = f"acceptance-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="session")
def acceptance_env(services) -> dict[str, str]:
    """Environment for the acceptance app, in this process and in its workers."""
    from tests.conftest import REPO_ROOT

    env = {
        **services.env(),
        "PGLOCK_TEST_QUEUE": QUEUE,
        "PGLOCK_TEST_NAMESPACE": NAMESPACE,
        "PYTHONPATH": os.pathsep.join(
            filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])
        ),
    }
    os.environ.update(env)
    return env


@pytest.fixture(scope="session")
def acceptance(acceptance_env):
    """The tests.acceptance.app module, imported with the session's services."""
    module = importlib.import_module("tests.acceptance.app")
    module.setup_gates()
    module.recorder.setup()
    return module


@pytest.fixture(scope="module")
def start_workers(
    acceptance_env, tmp_path_factory
) -> Iterator[Callable[..., list[WorkerProcess]]]:
    """Start N real worker processes for this module; all are stopped at module end."""
    started: list[WorkerProcess] = []
    log_dir = tmp_path_factory.mktemp("workers")

    def start(
        count: int = 2,
        *,
        env: dict[str, str] | None = None,
        app: str = "tests.acceptance.app",
        **options: Any,
    ) -> list[WorkerProcess]:
        options.setdefault("concurrency", 2)
        workers = [
            WorkerProcess(
                app,
                env={**acceptance_env, **(env or {})},
                log_path=log_dir / f"worker-{len(started) + index}.log",
                **options,
            )
            for index in range(count)
        ]
        started.extend(workers)
        for worker in workers:
            worker.start(timeout=90)
        return workers

    yield start
    for worker in reversed(started):
        worker.stop(timeout=20)


@pytest.fixture(scope="module")
def enqueue_app(acceptance: Any) -> Any:
    """The lock_enqueue tasks' module (tests/acceptance/enqueue_app.py), imported once the
    acceptance environment is set."""
    import tests.acceptance.enqueue_app as module

    return module


@pytest.fixture
def run() -> str:
    """A fresh run id: the lock keys and recorded intervals of this test only."""
    return uuid.uuid4().hex[:12]


def wait_until(predicate: Callable[[], Any], *, timeout: float, what: str) -> Any:
    """Poll ``predicate`` until it returns a truthy value; fail naming ``what``."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"Timed out after {timeout:g}s waiting for {what}")
        time.sleep(0.05)


def states(results) -> list[str]:
    return [result.state for result in results]


def skipped(result) -> bool:
    """Did this run end as a skip (the default lock_skip_result='failure')?"""
    from celery_pglock import LockSkipped

    return result.state == "FAILURE" and isinstance(result.result, LockSkipped)


def outcomes(results) -> list[str]:
    """Each run's outcome: SUCCESS, "skipped", or its state (FAILURE, PENDING, ...)."""
    return ["skipped" if skipped(result) else result.state for result in results]


@pytest.fixture
def recorder(acceptance) -> OverlapRecorder:
    return acceptance.recorder


@pytest.fixture
def outage_workers(acceptance_env, private_postgres, tmp_path):
    """Start N workers (-c 2 each) of tests.acceptance.outage_app, whose lock database is
    ``private_postgres`` (the test stops and starts it); returns the app's module."""
    import tests.acceptance.outage_app as outage_app

    env = {
        **acceptance_env,
        outage_app.LOCK_DB_ENV: private_postgres.url(),
        outage_app.QUEUE_ENV: f"pglock-outage-{uuid.uuid4().hex[:8]}",
    }
    # The module read its settings when first imported: set them here, for this test.
    outage_app.app.conf.pglock_database_url = env[outage_app.LOCK_DB_ENV]
    outage_app.app.conf.task_default_queue = env[outage_app.QUEUE_ENV]
    started: list[WorkerProcess] = []

    def start(count: int) -> Any:
        for index in range(count):
            worker = WorkerProcess(
                "tests.acceptance.outage_app",
                env=env,
                concurrency=2,
                queues=[env[outage_app.QUEUE_ENV]],
                log_path=tmp_path / f"outage-worker-{index}.log",
            )
            started.append(worker)
            worker.start(timeout=90)
        return outage_app

    yield start
    for worker in started:
        worker.stop(timeout=20)
