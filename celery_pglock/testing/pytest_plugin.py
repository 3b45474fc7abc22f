"""pytest plugin: test your own singleton tasks against a real lock database and workers.

Registered as the ``celery_pglock`` plugin through the ``pytest11`` entry point;
``pip install 'celery-pglock[pytest]'`` brings what its fixtures need. docs/testing.md
is the user guide.

Hazard: the entry point is registered whenever celery-pglock is installed, with or
without the extra, so this module is loaded into every pytest run of that environment.
It must stay inert: it defines fixtures and no hook, imports nothing itself at load
time but pytest (Python does import its parent packages, which start nothing), and starts
services only when a test asks for a fixture that needs them.
Every fixture name starts with ``pglock_`` so that none can shadow Celery's
``celery_*`` fixtures or a project's own. ``-p no:celery_pglock`` disables it.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import sys
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import pytest

if TYPE_CHECKING:
    from collections.abc import Iterable, Iterator, Mapping, Sequence

    import celery
    import celery.result

    import celery_pglock
    from celery_pglock.testing import (
        Interval,
        Overlap,
        OverlapRecorder,
        Services,
        WorkerProcess,
    )

#: Table, in the lock database, where workers record task-body intervals.
INTERVALS_TABLE = "pglock_pytest_intervals"
#: How pglock_worker tells its workers (the _pytest_worker module) what to run: the
#: user's app as ``celery -A`` takes it, a JSON object of Celery settings applied over
#: the app's own, and the recorder's database URL, table and run id.
APP_ENV = "CELERY_PGLOCK_PYTEST_APP"
CONFIG_ENV = "CELERY_PGLOCK_PYTEST_CONFIG"
RECORD_URL_ENV = "CELERY_PGLOCK_PYTEST_RECORD_URL"
RECORD_TABLE_ENV = "CELERY_PGLOCK_PYTEST_RECORD_TABLE"
RECORD_RUN_ENV = "CELERY_PGLOCK_PYTEST_RECORD_RUN"
#: Celery's own environment overrides of a setting, which win over every app's conf.
CELERY_OVERRIDE_ENV = {
    "CELERY_BROKER_URL": "broker_url",
    "CELERY_BROKER_READ_URL": "broker_url",
    "CELERY_BROKER_WRITE_URL": "broker_url",
    "CELERY_RESULT_BACKEND": "result_backend",
}
#: The ``-A`` module of those workers.
WORKER_APP = "celery_pglock.testing._pytest_worker"


class WorkerFactory(Protocol):
    """The type of the ``pglock_worker`` fixture: starts a ``celery worker`` subprocess."""

    def __call__(
        self,
        *,
        concurrency: int = 2,
        pool: str = "prefork",
        queues: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        timeout: float = 60.0,
    ) -> WorkerProcess: ...


class FinalStates(Protocol):
    """The type of the ``pglock_final_states`` fixture."""

    def __call__(
        self,
        results: Iterable[celery.result.AsyncResult[Any]],
        *,
        timeout: float = 30.0,
    ) -> list[str]: ...


class OverlapCheck:
    """The task-body intervals that this test's workers recorded, and their overlaps.

    Every body of a SingletonTask run by a ``pglock_worker`` worker, or by this process
    after :meth:`record`, is recorded, keyed by its lock key, with start and end taken
    from PostgreSQL's clock: two runs under one key that overlap in time are an
    exclusion failure.
    """

    def __init__(self, recorder: OverlapRecorder, run: str) -> None:
        self.recorder = recorder
        self.run = run  #: This test's run id: its rows in the intervals table.
        self._wrapped: list[tuple[celery_pglock.SingletonTask, Any]] = []

    def record(self, app: celery.Celery) -> list[str]:
        """Record the SingletonTask bodies that this process runs, until the test ends.

        For Celery's in-process workers (``celery_worker``, ``celery_session_worker``),
        which run ``app``'s task objects in threads of the test process. Call it once the
        tasks are registered (after the worker fixture, which imports
        ``celery_includes``); ``pglock_worker`` workers record theirs without it.

        Returns:
            The names of the tasks now recorded.
        """
        import celery_pglock

        done = {id(task) for task, _ in self._wrapped}
        for task in app.tasks.values():
            if isinstance(task, celery_pglock.SingletonTask) and id(task) not in done:
                self._wrapped.append((task, task.__dict__.get("run", _UNSET)))
                task.run = record_bodies(task, self.recorder, self.run)  # type: ignore[method-assign]  # this task object only
        return sorted(task.name for task, _ in self._wrapped)

    def _restore(self) -> None:
        for task, previous in reversed(self._wrapped):
            if previous is _UNSET:
                del task.run  # the class's run shows again
            else:
                task.run = previous
        self._wrapped.clear()

    def intervals(self) -> list[Interval]:
        """Every recorded body of this test, in start order."""
        return self.recorder.intervals(self.run)

    def overlaps(self) -> list[Overlap]:
        """Every pair of finished bodies of one lock key that ran at the same time."""
        return self.recorder.overlaps(self.run)

    def assert_no_overlap(self, *, min_intervals: int = 2) -> list[Interval]:
        """Fail unless at least ``min_intervals`` bodies ran, all ended, none overlapped.

        The minimum is there because a check over fewer than two bodies proves nothing:
        a worker that ran nothing would pass it.

        Returns:
            The recorded intervals, for further assertions.
        """
        __tracebackhide__ = True
        intervals = self.intervals()
        if len(intervals) < min_intervals:
            raise AssertionError(
                f"Only {len(intervals)} task bodies were recorded, fewer than "
                f"min_intervals={min_intervals}: an overlap check over them proves "
                "nothing. Did the worker consume your tasks (its queue, its app)?"
            )
        running = [interval for interval in intervals if interval.ended_at is None]
        if running:
            raise AssertionError(
                f"{len(running)} task bodies have not ended (still running, or their "
                "worker was killed); wait for the tasks to end before checking: "
                + ", ".join(f"{i.task_id} (key {i.key!r})" for i in running)
            )
        overlaps = self.overlaps()
        if overlaps:
            raise AssertionError(
                f"{len(overlaps)} overlapping runs of one lock key:\n"
                + "\n".join(f"  {overlap}" for overlap in overlaps)
            )
        return intervals


# -- services ---------------------------------------------------------------------------


@pytest.fixture(scope="session")
def pglock_services() -> Iterator[Services]:
    """PostgreSQL, broker and result backend for the session, stopped at its end.

    Those named by CELERY_PGLOCK_TEST_DATABASE_URL, CELERY_PGLOCK_TEST_BROKER_URL and
    CELERY_PGLOCK_TEST_RESULT_BACKEND; an embedded PostgreSQL and Redis for the rest.
    """
    from celery_pglock import testing

    services = testing.start_services()
    try:
        yield services
    finally:
        services.stop()


@pytest.fixture(scope="session")
def pglock_database_url(pglock_services: Services) -> str:
    """SQLAlchemy URL of the lock database."""
    return pglock_services.database_url


@pytest.fixture(scope="session")
def pglock_celery_config(pglock_services: Services) -> dict[str, Any]:
    """Celery settings pointing an app at the session's services.

    Also a queue of the session's own, so that messages left on a shared broker by an
    earlier run are never consumed. Usable as Celery's ``celery_config``.
    """
    return {
        "broker_url": pglock_services.broker_url,
        "result_backend": pglock_services.result_backend_url,
        "pglock_database_url": pglock_services.database_url,
        "task_default_queue": f"pglock-pytest-{uuid.uuid4().hex[:8]}",
        "broker_connection_retry_on_startup": True,
    }


# -- your app and its workers -----------------------------------------------------------


@pytest.fixture(scope="session")
def pglock_app_name() -> str:
    """Your Celery app as ``celery -A`` takes it; override this fixture to name it."""
    pytest.fail(
        "The pglock_app_name fixture names your Celery app, as `celery -A` takes it; "
        "override it in your conftest.py:\n\n"
        "    @pytest.fixture(scope='session')\n"
        "    def pglock_app_name() -> str:\n"
        "        return 'myproject.celery_app'\n",
        pytrace=False,
    )


@pytest.fixture(scope="session")
def pglock_app(
    pglock_app_name: str, pglock_celery_config: dict[str, Any]
) -> Iterator[celery.Celery]:
    """Your app (``pglock_app_name``), reconfigured with ``pglock_celery_config``.

    Request it before your tests first use the app: a broker connection made before
    would stay pointed at the app's own broker.
    """
    from celery.app.utils import find_app

    app: celery.Celery = find_app(pglock_app_name)
    app.conf.update(pglock_celery_config)
    with pytest.MonkeyPatch.context() as patch:
        # Celery reads these variables before any setting of any app (``celery
        # --broker`` sets them): one inherited from the user's shell would send the
        # tests' tasks to another broker than the workers'. Workers inherit them.
        for variable, setting in CELERY_OVERRIDE_ENV.items():
            if pglock_celery_config.get(setting):
                patch.setenv(variable, str(pglock_celery_config[setting]))
        yield app


@pytest.fixture
def pglock_overlap(pglock_database_url: str) -> Iterator[OverlapCheck]:
    """The task-body intervals recorded by this test's ``pglock_worker`` workers, and by
    Celery's in-process worker after ``pglock_overlap.record(app)``.
    """
    from celery_pglock import testing

    recorder = testing.OverlapRecorder(pglock_database_url, table=INTERVALS_TABLE)
    recorder.setup()
    check = OverlapCheck(recorder, uuid.uuid4().hex[:12])
    try:
        yield check
    finally:
        check._restore()
        recorder.close()


@pytest.fixture
def pglock_worker(
    pglock_app_name: str,
    pglock_app: celery.Celery,
    pglock_services: Services,
    pglock_celery_config: dict[str, Any],
    pglock_overlap: OverlapCheck,
    tmp_path: Path,
) -> Iterator[WorkerFactory]:
    """Start real ``celery worker`` subprocesses of your app; stopped after the test.

    Each call starts one worker (``concurrency`` pool processes) and waits until it is
    ready. Workers run ``pglock_app`` with ``pglock_celery_config`` and record every
    SingletonTask body for ``pglock_overlap``. Their logs are printed at teardown, which
    pytest shows for a failed test.
    """
    from celery_pglock import testing
    from celery_pglock.testing import _support

    del pglock_app  # requested so that the test process uses the workers' settings
    workers: list[WorkerProcess] = []
    base_env = {
        **pglock_services.env(),
        APP_ENV: pglock_app_name,
        CONFIG_ENV: _to_json(pglock_celery_config),
        RECORD_URL_ENV: pglock_services.database_url,
        RECORD_TABLE_ENV: INTERVALS_TABLE,
        RECORD_RUN_ENV: pglock_overlap.run,
        "PYTHONPATH": _pythonpath(),
    }

    def start(
        *,
        concurrency: int = 2,
        pool: str = "prefork",
        queues: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        timeout: float = 60.0,
    ) -> WorkerProcess:
        worker = testing.WorkerProcess(
            WORKER_APP,
            env={**base_env, **(env or {})},
            pool=pool,
            concurrency=concurrency,
            queues=queues,
            log_path=tmp_path / f"pglock-worker-{len(workers) + 1}.log",
        )
        workers.append(worker)
        return worker.start(timeout)

    yield start
    errors: list[Exception] = []
    for worker in reversed(workers):
        try:
            worker.stop(timeout=15)
        except Exception as exc:  # stop the others anyway
            errors.append(exc)
        with contextlib.suppress(testing.ServiceError):  # never started: no log
            print(_support.with_log(f"worker {worker.hostname}", worker.log_path))
    if errors:
        raise errors[0]


@pytest.fixture
def pglock_final_states() -> FinalStates:
    """Wait until results have ended and return their outcomes: a skipped run is
    ``"SKIPPED"`` whatever ``lock_skip_result`` stored (a FAILURE with LockSkipped or a
    SUCCESS skip record), anything else its Celery state.
    """
    from celery import states

    import celery_pglock

    ended = {*states.READY_STATES, celery_pglock.SKIPPED}  # outcome() says SKIPPED

    def outcome(result: celery.result.AsyncResult[Any]) -> str:
        state = result.state
        if state in states.READY_STATES and celery_pglock.skip_info(result.result):
            return celery_pglock.SKIPPED
        return state

    def wait(
        results: Iterable[celery.result.AsyncResult[Any]], *, timeout: float = 30.0
    ) -> list[str]:
        __tracebackhide__ = True
        pending = list(results)
        deadline = time.monotonic() + timeout
        while True:
            current: list[str] = [outcome(result) for result in pending]
            if all(state in ended for state in current):
                return current
            if time.monotonic() >= deadline:
                pytest.fail(
                    f"Tasks had not ended after {timeout:g} s; states: {current}",
                    pytrace=False,
                )
            time.sleep(0.05)

    return wait


def record_bodies(
    task: celery_pglock.SingletonTask, recorder: OverlapRecorder, run: str
) -> Any:
    """``task.run`` wrapped to record its interval under ``run``, keyed by its lock.

    The key is the lock's name and advisory key (``pg_locks``' identity), never the key
    text, which holds argument values. Why ``run`` and not the lock_* signals: the body
    is called after the lock was granted and before it is released, while the outcome
    signals are sent after the release, so only the body's interval proves exclusion.
    """
    import celery_pglock

    body = task.run

    @functools.wraps(body)
    def run_recorded(*args: Any, **kwargs: Any) -> Any:
        try:
            lock_key = celery_pglock.current_lock().key
        except celery_pglock.PgLockError:  # run() called outside __call__: no lock
            return body(*args, **kwargs)
        with recorder.record(run, f"{lock_key.name} {lock_key}", task.request.id):
            return body(*args, **kwargs)

    return run_recorded


#: What OverlapCheck puts back when a task had no ``run`` of its own instance.
_UNSET = object()


def _to_json(settings: Mapping[str, Any]) -> str:
    try:
        return json.dumps(dict(settings))
    except TypeError as exc:
        raise TypeError(
            f"pglock_celery_config must hold JSON values only, to reach the worker "
            f"subprocesses: {exc}."
        ) from exc


def _pythonpath() -> str:
    """PYTHONPATH for workers: what the tests can import, the workers can import.

    That is the test process's sys.path outside the Python installation (pytest's
    rootdir and conftest directories, a src/ layout), then any PYTHONPATH already set.
    """
    installation = {Path(p).resolve() for p in (sys.prefix, sys.base_prefix)}
    entries = [
        entry
        for entry in sys.path
        if entry
        and not any(
            root == Path(entry).resolve() or root in Path(entry).resolve().parents
            for root in installation
        )
    ]
    entries.append(os.getcwd())
    inherited = os.environ.get("PYTHONPATH")
    if inherited:
        entries.append(inherited)
    return os.pathsep.join(dict.fromkeys(entries))
