"""The Celery app of the lock-loss acceptance tests (tests/acceptance/test_lock_loss.py).

Its locks live on a PRIVATE PostgreSQL (``PGLOCK_TEST_LOCK_DATABASE_URL``) whose backends
the tests terminate; the overlap recorder, the gates and the ``lock_lost`` events live on
the shared test database, which the tests never disturb.
"""

from __future__ import annotations

import gc
import os
import signal
import sys
import time
from typing import Any

import billiard
from celery import Celery

from celery_pglock import SingletonTask, current_lock, signals
from celery_pglock.testing import BROKER_URL_ENV, RESULT_BACKEND_ENV, _support
from tests.acceptance.app import database_url, recorder, wait_gate

LOCK_DATABASE_ENV = "PGLOCK_TEST_LOCK_DATABASE_URL"
LOST_TABLE = "pglock_test_lost"

app = Celery(
    "loss",
    broker=os.environ[BROKER_URL_ENV],
    backend=os.environ.get(RESULT_BACKEND_ENV) or os.environ[BROKER_URL_ENV],
)
app.conf.update(
    pglock_database_url=os.environ[LOCK_DATABASE_ENV],
    pglock_namespace=os.environ.get("PGLOCK_TEST_NAMESPACE", "loss"),
    pglock_watch_interval=0.5,
    pglock_db_timeout=float(os.environ.get("PGLOCK_TEST_DB_TIMEOUT", "5")),
    task_default_queue=os.environ.get("PGLOCK_TEST_QUEUE", "pglock-loss"),
    worker_prefetch_multiplier=1,
    result_expires=3600,
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=False,
)

_events: dict[int, object] = {}


def _events_cursor():  # one autocommit connection per process
    connection = _events.get(os.getpid())
    if connection is None:
        connection = _support.connect(database_url, application_name="loss events")
        connection.autocommit = True  # type: ignore[attr-defined]
        _events[os.getpid()] = connection
    return connection.cursor()  # type: ignore[attr-defined]


def setup_events() -> None:
    with _events_cursor() as cursor:
        cursor.execute(
            f"CREATE TABLE IF NOT EXISTS {LOST_TABLE} (task_id text, task_name text, "
            "cause text, pid int, at timestamptz DEFAULT clock_timestamp())"
        )
        cursor.execute(
            f"CREATE TABLE IF NOT EXISTS {NOTES_TABLE} (task_id text, note text)"
        )


def lost_events(task_id: str) -> list[tuple]:
    with _events_cursor() as cursor:
        cursor.execute(
            f"SELECT task_name, cause, pid, at FROM {LOST_TABLE} WHERE task_id = %s",
            (task_id,),
        )
        return cursor.fetchall()


def _record_lost(
    sender: Any = None,
    task_id: str | None = None,
    task_name: str | None = None,
    cause: str | None = None,
    **_: Any,
) -> None:
    # Sent from the lock watcher thread of the process that ran the task.
    with _events_cursor() as cursor:
        cursor.execute(
            f"INSERT INTO {LOST_TABLE} (task_id, task_name, cause, pid) "
            "VALUES (%s, %s, %s, %s)",
            (task_id, task_name, cause, os.getpid()),
        )


signals.lock_lost.connect(_record_lost, weak=False)


@app.task(base=SingletonTask, bind=True, lock_args=("run",), lock_on_lost="signal")
def hold(self, run: str, gate: str) -> str:
    """Hold the lock until the gate opens; a lost lock is reported, the body goes on."""
    with recorder.record(run, "hold", self.request.id) as row_id:
        wait_gate(gate, row_id)
    return "finished"


@app.task(base=SingletonTask, bind=True, lock_args=("run",), lock_on_lost="terminate")
def hold_gate_terminate(self, run: str, gate: str) -> str:
    """Hold until the gate opens, lock_on_lost='terminate' (a gevent body goes on)."""
    with recorder.record(run, "hold", self.request.id) as row_id:
        wait_gate(gate, row_id)
    return "finished"


@app.task(base=SingletonTask, bind=True, lock_args=("run",), lock_on_lost="terminate")
def hold_terminate(self, run: str, chunk: float) -> str:
    """Sleep up to 60 s in ``chunk``-second sleeps (one sleep when chunk=60)."""
    with recorder.record(run, "hold", self.request.id):
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            time.sleep(chunk)
    return "slept"


@app.task(base=SingletonTask, bind=True, lock_args=("run",))
def hold_default(self, run: str, seconds: float, chunk: float) -> str:
    """No lock option of its own (the app sets only the watch interval and the check
    timeout): sleep ``seconds`` in ``chunk``-second sleeps."""
    with recorder.record(run, "hold", self.request.id):
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            time.sleep(chunk)
    return "slept"


NOTES_TABLE = "pglock_test_notes"


def note(task_id: str, text: str) -> None:
    with _events_cursor() as cursor:
        cursor.execute(f"INSERT INTO {NOTES_TABLE} VALUES (%s, %s)", (task_id, text))


def notes(task_id: str) -> list[str]:
    with _events_cursor() as cursor:
        cursor.execute(f"SELECT note FROM {NOTES_TABLE} WHERE task_id = %s", (task_id,))
        return [row[0] for row in cursor.fetchall()]


def _child(how: str) -> None:
    """What the forked child does to end (see test_lock_loss.py)."""
    gc.collect()  # whatever the child dropped is finalised now
    if how.endswith("raise"):
        raise RuntimeError("the child raises")
    if how.endswith("sys.exit"):
        sys.exit(3)
    if how.endswith("os._exit"):
        os._exit(0)
    # "return"


class _ForkingTask(SingletonTask):
    """Ends a forked copy of the run as soon as Celery's tracer is done with it.

    A child that raises out of the body unwinds the task's frames (SingletonTask's
    release path: the hazard under test), then Celery's tracer; this stops it there,
    before it reports to the pool as if it were the pool process. Results are not
    stored (``ignore_result``), so the copy cannot overwrite the parent's either.
    """

    def on_failure(self, *args: object, **kwargs: object) -> None:
        if os.getpid() != _owner.get(self.request.id):
            os._exit(0)

    def after_return(self, *args: object, **kwargs: object) -> None:
        if os.getpid() != _owner.get(self.request.id):
            os._exit(0)


_owner: dict[str, int] = {}


@app.task(
    base=_ForkingTask,
    bind=True,
    lock_args=("run",),
    lock_name="loss.shared",
    ignore_result=True,
)
def forks(self, run: str, how: str, gate: str) -> None:
    """Fork inside the body; the child ends as ``how`` says; then hold until the gate.

    ``os.fork-*``: a child of os.fork (``raise`` unwinds the task's frames; ``gc`` drops
    the inherited lock connection and collects it). ``mp-*``: a multiprocessing child (billiard's
    fork start method) running :func:`_child`. Notes ``held=<bool>`` once the child
    has exited, as the parent sees its lock then.
    """
    _owner[self.request.id] = os.getpid()
    lock = current_lock()
    with recorder.record(run, "forks", self.request.id) as row_id:
        if how.startswith("mp-"):
            # billiard: Celery's multiprocessing fork, which (unlike the standard
            # library's) lets a pool process start children.
            process = billiard.get_context("fork").Process(target=_child, args=(how,))
            process.start()
            process.join(30)
        else:
            pid = os.fork()
            if pid == 0:
                signal.alarm(10)  # whatever happens, the copy does not live on
                if how == "os.fork-gc":
                    lock._hold = None  # drop the inherited connection
                    gc.collect()
                if how == "os.fork-return":
                    return  # through SingletonTask's frames, as the parent would
                _child(how)  # os.fork-raise unwinds the task's frames from here
                os._exit(0)
            os.waitpid(pid, 0)
        note(self.request.id, f"held={lock.locked() and not lock.lost}")
        wait_gate(gate, row_id)


@app.task(base=SingletonTask, bind=True, lock_args=("run",), lock_name="loss.shared")
def duplicate(self, run: str) -> str:
    """Shares forks' lock: skipped while the parent holds it."""
    with recorder.record(run, "forks", self.request.id):
        pass
    return "ran"
