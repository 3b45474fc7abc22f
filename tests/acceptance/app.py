"""The Celery app that acceptance tests run in real ``celery worker`` processes.

Every protected body records its start/end instants (PostgreSQL's clock) through the
overlap detector, so a test can prove that no two runs of one key overlapped, across
processes. ``run`` (a per-test id) is part of every key, so tests never share locks.

Bodies wait on *gates* (rows in a table) rather than fixed sleeps where a test needs a
run to stay inside its lock: the test opens the gate when it has checked what it wanted.
"""

from __future__ import annotations

import os
import signal
import time

from celery import Celery

from celery_pglock import SingletonTask, current_lock
from celery_pglock.testing import (
    BROKER_URL_ENV,
    DATABASE_URL_ENV,
    RESULT_BACKEND_ENV,
    OverlapRecorder,
    _support,
    strategies,
)

QUEUE_ENV = "PGLOCK_TEST_QUEUE"
NAMESPACE_ENV = "PGLOCK_TEST_NAMESPACE"
GATES_TABLE = "pglock_test_gates"
#: A gate that is never opened ends its wait after this long, so no test can hang a worker.
GATE_TIMEOUT = 60.0

database_url = os.environ[DATABASE_URL_ENV]
# PGLOCK_TEST_SESSION_MODE=per_lock: run a worker in the other lock-session strategy.
strategies.use_per_lock_sessions(
    os.environ.get("PGLOCK_TEST_SESSION_MODE") == "per_lock"
)
broker_url = os.environ[BROKER_URL_ENV]

app = Celery(
    "acceptance",
    broker=broker_url,
    backend=os.environ.get(RESULT_BACKEND_ENV) or broker_url,
)
app.conf.update(
    # PGLOCK_TEST_NO_DB_URL: a test checks that a worker without a lock database refuses to start.
    pglock_database_url=None
    if os.environ.get("PGLOCK_TEST_NO_DB_URL")
    else database_url,
    pglock_namespace=os.environ.get(NAMESPACE_ENV, "acceptance"),
    task_default_queue=os.environ.get(QUEUE_ENV, "pglock-acceptance"),
    worker_prefetch_multiplier=1,
    result_expires=3600,
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=False,
    # PGLOCK_TEST_METRICS_PORT: a worker serving /metrics (tests/acceptance/test_metrics.py).
    pglock_metrics_port=int(os.environ["PGLOCK_TEST_METRICS_PORT"])
    if os.environ.get("PGLOCK_TEST_METRICS_PORT")
    else None,
    # PGLOCK_TEST_HISTORY: a worker keeping pglock_history (tests/acceptance/test_why.py).
    pglock_history=3600 if os.environ.get("PGLOCK_TEST_HISTORY") else None,
)

recorder = OverlapRecorder(database_url)
_gate_connection: dict[int, object] = {}


def _gate_cursor():  # one autocommit connection per process, re-made after fork
    connection = _gate_connection.get(os.getpid())
    if connection is None:
        connection = _support.connect(database_url, application_name="acceptance gates")
        connection.autocommit = True
        _gate_connection[os.getpid()] = connection
    return connection.cursor()


def setup_gates() -> None:
    with _gate_cursor() as cursor:
        cursor.execute(
            f"CREATE TABLE IF NOT EXISTS {GATES_TABLE} (name text PRIMARY KEY)"
        )


def open_gate(name: str) -> None:
    with _gate_cursor() as cursor:
        cursor.execute(
            f"INSERT INTO {GATES_TABLE} VALUES (%s) ON CONFLICT DO NOTHING", (name,)
        )


def wait_gate(name: str, row_id: int) -> None:
    """Block until the gate opens, refreshing the interval's end as a heartbeat.

    The heartbeat makes ``ended_at`` "last seen alive", so even a run that is killed
    while waiting leaves a (slightly short) interval for the overlap check.
    """
    deadline = time.monotonic() + GATE_TIMEOUT
    while time.monotonic() < deadline:
        recorder.heartbeat(row_id)
        with _gate_cursor() as cursor:
            cursor.execute(f"SELECT 1 FROM {GATES_TABLE} WHERE name = %s", (name,))
            if cursor.fetchone():
                return
        time.sleep(0.02)


def _body(task, run: str, key: str, hold: float, gate: str | None) -> str:
    with recorder.record(run, key, task.request.id) as row_id:
        if gate:
            wait_gate(gate, row_id)
        if hold:
            time.sleep(hold)
    return key


@app.task(base=SingletonTask, bind=True, lock_args=("run", "key"))
def protected(
    self, run: str, key: str, hold: float = 0.0, gate: str | None = None
) -> str:
    """Skip when busy (the default policy)."""
    return _body(self, run, key, hold, gate)


@app.task(
    base=SingletonTask,
    bind=True,
    lock_args=("run", "key"),
    lock_on_busy="wait",
    lock_wait_timeout=30,
)
def waiter(self, run: str, key: str, hold: float = 0.0, gate: str | None = None) -> str:
    """Wait (bounded) when busy."""
    return _body(self, run, key, hold, gate)


@app.task(
    base=SingletonTask,
    bind=True,
    lock_args=("run", "key"),
    lock_on_busy="retry",
    lock_retry_delay=0.3,
    max_retries=100,
)
def retrier(
    self, run: str, key: str, hold: float = 0.0, gate: str | None = None
) -> str:
    """Re-queue through Celery's retry when busy."""
    return _body(self, run, key, hold, gate)


@app.task(base=SingletonTask, bind=True, lock_args=("run", "key"), lock_on_busy="raise")
def raiser(self, run: str, key: str, hold: float = 0.0, gate: str | None = None) -> str:
    """Fail with LockBusy when busy."""
    return _body(self, run, key, hold, gate)


@app.task(
    base=SingletonTask,
    bind=True,
    shared=False,  # this app only: an app-wide pglock_fencing in another test must not meet it
    lock_args=("run", "key"),
    lock_limit=3,
    lock_on_busy="retry",
    lock_retry_delay=0.2,
    max_retries=200,
)
def limited(
    self, run: str, key: str, hold: float = 0.0, gate: str | None = None
) -> str:
    """At most three runs of a key at once; re-queued while all three slots are taken."""
    return _body(self, run, key, hold, gate)


#: The group of ``grouped``: at most two of its runs at once, whatever their keys.
GROUP_LIMIT = 2


@app.task(
    base=SingletonTask,
    bind=True,
    shared=False,
    lock_args=("run", "key"),
    lock_group="acceptance-exports",
    lock_group_limit=GROUP_LIMIT,
    lock_on_busy="retry",
    lock_retry_delay=0.2,
    max_retries=400,
)
def grouped(
    self, run: str, key: str, hold: float = 0.0, gate: str | None = None
) -> str:
    """One run per key and two in the group at once (recorded as key "group" too);
    re-queued while busy."""
    with recorder.record(run, "group", self.request.id):
        return _body(self, run, key, hold, gate)


@app.task(base=SingletonTask, bind=True, lock_args=("run",), max_retries=3)
def retries_once(self, run: str) -> int:
    """Call self.retry() on the first attempt; the retry must run and take the lock again."""
    with recorder.record(run, "retries_once", self.request.id):
        if self.request.retries == 0:
            raise self.retry(countdown=0)
    return self.request.retries


@app.task(base=SingletonTask, bind=True, lock_args=("run",), time_limit=2)
def overruns(self, run: str, gate: str) -> str:
    """Wait on a gate past its hard time limit: the pool kills the child mid-task."""
    with recorder.record(run, "overruns", self.request.id) as row_id:
        wait_gate(gate, row_id)
    return "finished"


@app.task(
    base=SingletonTask, bind=True, lock_args=("run", "key"), lock_scope="transaction"
)
def protected_in_transaction(
    self, run: str, key: str, hold: float = 0.0, gate: str | None = None
) -> str:
    """protected, in transaction scope."""
    return _body(self, run, key, hold, gate)


@app.task(base=SingletonTask, bind=True, lock_args=("run",), lock_scope="transaction")
def writes_in_lock(self, run: str, fail: bool = False) -> int:
    """Insert a row through the lock's transaction; raise afterwards when asked."""
    connection = current_lock().connection
    connection.exec_driver_sql(
        "CREATE TABLE IF NOT EXISTS pglock_test_writes (run text, task_id text)"
    )
    connection.exec_driver_sql(
        "INSERT INTO pglock_test_writes VALUES (%s, %s)", (run, self.request.id)
    )
    if fail:
        raise RuntimeError("fail after writing")
    return 1


@app.task(bind=True)
def after(self, previous: str, run: str) -> str:
    """A plain follow-up task for chain tests: records that it ran."""
    with recorder.record(run, "after", self.request.id):
        pass
    return previous


@app.task(base=SingletonTask, bind=True, lock_args=("run",), max_retries=3)
def retry_later(self, run: str) -> str:
    """self.retry(throw=False), then keep working under the lock for a while.

    The retry must not be delivered while this attempt still holds the lock (it would
    be skipped and lost): it is published only after the release.
    """
    with recorder.record(run, "retry_later", self.request.id):
        if self.request.retries == 0:
            self.retry(countdown=0, throw=False)
            time.sleep(0.5)
            return "first"
    return "second"


@app.task(base=SingletonTask, bind=True, lock_args=("run",), max_retries=3)
def retries_then_dies(self, run: str) -> int:
    """self.retry(throw=False), then the pool child is SIGKILLed while it still holds the
    lock: the retry must run anyway (it was published by self.retry())."""
    with recorder.record(run, "retries_then_dies", self.request.id):
        if self.request.retries == 0:
            self.retry(countdown=0, throw=False)
            os.kill(os.getpid(), signal.SIGKILL)
    return self.request.retries


@app.task(base=SingletonTask, bind=True, lock_args=("run",), soft_time_limit=1)
def soft_limited(self, run: str, gate: str) -> str:
    """Wait on a gate past its soft time limit: SoftTimeLimitExceeded unwinds the body."""
    with recorder.record(run, "soft_limited", self.request.id) as row_id:
        wait_gate(gate, row_id)
    return "finished"


@app.task(
    base=SingletonTask, bind=True, lock_args=("run", "key"), lock_skip_result="success"
)
def protected_success(
    self, run: str, key: str, hold: float = 0.0, gate: str | None = None
) -> str:
    """Skip when busy, ending as SUCCESS with a skip record."""
    return _body(self, run, key, hold, gate)


@app.task(bind=True, lock_args=("run", "key"), base=SingletonTask, lock_shadow=True)
def shadowed(
    self, run: str, key: str, hold: float = 0.0, gate: str | None = None
) -> str:
    """Shadow mode: the lock is tried and reported, the body always runs."""
    return _body(self, run, key, hold, gate)


@app.task
def collect(results: list[object]) -> int:
    """A chord callback: how many header results it received."""
    return len(results)
