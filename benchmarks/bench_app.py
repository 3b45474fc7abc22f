"""The Celery app that ``benchmarks/run.py`` runs in real ``celery worker`` subprocesses.

Tasks (all bodies trivial, so that what is measured is the per-task machinery):

- ``bench.plain(i)``: a plain Celery task, the baseline.
- ``bench.locked_per_arg(i)``: SingletonTask, ``lock_args=("i",)``, session scope. Called
  with distinct ``i``, so no two runs contend: pure lock overhead (the 0.95x target).
- ``bench.locked_fixed()``: SingletonTask with one key for the task: every run contends;
  the loser of a race is skipped (FAILURE with LockSkipped in Celery's trace).
- ``bench.locked_xact(i)``: like ``locked_per_arg`` in transaction scope.
- ``bench.plain_results(i)`` / ``bench.locked_results(i)``: the plain and per-argument
  tasks with their results stored in the result backend.
- ``bench.plain_ignore(i)``: a plain task that raises ``Ignore``: what Celery itself
  charges for the way a SingletonTask skip ends.

Everything is configured from the environment (see the ``*_ENV`` names below), because
run.py starts a fresh worker for every measurement. With ``BENCH_PLAIN_ONLY=1`` this
module never imports celery_pglock, so the baseline is a worker of plain Celery: no
SQLAlchemy in memory and none of celery_pglock's signal receivers on the task path.

Measurement hooks: ``task_prerun``/``task_postrun`` receivers write one fixed-size record
per task (start, end, outcome) to a per-process file in ``BENCH_RECORD_DIR``; one
``os.write`` of 24 bytes, a few microseconds, the same for every variant. The records are
taken *outside* SingletonTask.__call__, so lock acquire and release are inside the
measured interval. Each task process opens its lock connection(s) before its first task
and then writes a ``<pid>.warm`` marker there, which run.py waits for, so connecting is
not measured. ``BENCH_PROFILE_DIR`` runs each prefork pool child under cProfile and
dumps its stats there at child shutdown.

Hazard: the per-task INFO lines ("Received task", "Task ... succeeded") are silenced
(``BENCH_TASK_LOGS=1`` keeps them). They cost more than the lock does, equally for every
variant, and would only dilute the ratios.
"""

from __future__ import annotations

import contextlib
import cProfile
import logging
import os
import struct
import threading
import time
from typing import Any

from celery import Celery, signals
from celery.exceptions import Ignore

BROKER_URL_ENV = "BENCH_BROKER_URL"
RESULT_BACKEND_ENV = "BENCH_RESULT_BACKEND"
DATABASE_URL_ENV = "BENCH_DATABASE_URL"
NAMESPACE_ENV = "BENCH_NAMESPACE"
QUEUE_ENV = "BENCH_QUEUE"
RECORD_DIR_ENV = "BENCH_RECORD_DIR"
PROFILE_DIR_ENV = "BENCH_PROFILE_DIR"
PLAIN_ONLY_ENV = "BENCH_PLAIN_ONLY"
TASK_LOGS_ENV = "BENCH_TASK_LOGS"
#: The worker's --pool, so that the warm-up runs in the process that runs the tasks.
POOL_ENV = "BENCH_POOL"
#: Pool connections each process opens before the first task (threads pool: one per
#: thread), so that connecting is not part of the measurement.
WARM_CONNECTIONS_ENV = "BENCH_WARM_CONNECTIONS"

#: One record per task: start and end (time.monotonic_ns, system-wide on Linux) and the
#: outcome code.
RECORD = struct.Struct("<qqq")
OUTCOME_SUCCESS, OUTCOME_IGNORED, OUTCOME_OTHER = 0, 1, 2
#: Suffix of the marker file each task process writes in BENCH_RECORD_DIR once warm.
WARM_SUFFIX = ".warm"
#: Application name prefix of the benchmark's lock sessions in pg_stat_activity.
APPLICATION_NAME = "pglock-bench"

PLAIN = "bench.plain"
PLAIN_RESULTS = "bench.plain_results"
PLAIN_IGNORE = "bench.plain_ignore"
LOCKED_PER_ARG = "bench.locked_per_arg"
LOCKED_FIXED = "bench.locked_fixed"
LOCKED_XACT = "bench.locked_xact"
LOCKED_RESULTS = "bench.locked_results"

_broker_url = os.environ.get(BROKER_URL_ENV, "memory://")
_plain_only = os.environ.get(PLAIN_ONLY_ENV) == "1"

app = Celery("bench", broker=_broker_url, backend=os.environ.get(RESULT_BACKEND_ENV))
app.conf.update(
    task_default_queue=os.environ.get(QUEUE_ENV, "pglock-bench"),
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=False,
    result_expires=600,  # a shared Redis must not keep the benchmark's results for a day
)
if not _plain_only:
    app.conf.update(
        pglock_database_url=os.environ.get(DATABASE_URL_ENV),
        pglock_namespace=os.environ.get(NAMESPACE_ENV, "bench"),
        pglock_application_name=APPLICATION_NAME,
    )


@app.task(name=PLAIN, ignore_result=True)
def plain(i: int) -> int:
    return i


@app.task(name=PLAIN_RESULTS, ignore_result=False)
def plain_results(i: int) -> int:
    return i


@app.task(name=PLAIN_IGNORE, ignore_result=True)
def plain_ignore(i: int) -> int:
    # What Celery itself charges for a run that ends in Ignore (a SingletonTask skip).
    raise Ignore(f"plain_ignore({i})")


if not _plain_only:
    from celery_pglock import SingletonTask

    @app.task(
        name=LOCKED_PER_ARG, base=SingletonTask, lock_args=("i",), ignore_result=True
    )
    def locked_per_arg(i: int) -> int:
        return i

    @app.task(name=LOCKED_FIXED, base=SingletonTask, ignore_result=True)
    def locked_fixed() -> int:
        return 0

    @app.task(
        name=LOCKED_XACT,
        base=SingletonTask,
        lock_args=("i",),
        lock_scope="transaction",
        ignore_result=True,
    )
    def locked_xact(i: int) -> int:
        return i

    @app.task(
        name=LOCKED_RESULTS, base=SingletonTask, lock_args=("i",), ignore_result=False
    )
    def locked_results(i: int) -> int:
        return i


# -- measurement hooks -------------------------------------------------------------------

_record_dir = os.environ.get(RECORD_DIR_ENV)
_starts: dict[str, int] = {}
_fd: tuple[int, int] | None = None  # (pid, file descriptor), re-opened after fork
_fd_guard = threading.Lock()


def _record_fd() -> int:
    global _fd
    pid = os.getpid()
    current = _fd
    if current is not None and current[0] == pid:
        return current[1]
    with _fd_guard:
        if _fd is None or _fd[0] != pid:
            path = os.path.join(str(_record_dir), f"{pid}.rec")
            _fd = (pid, os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644))
        return _fd[1]


def _on_prerun(task_id: str | None = None, **_: Any) -> None:
    if task_id is not None:
        _starts[task_id] = time.monotonic_ns()


def _on_postrun(
    task_id: str | None = None,
    state: str | None = None,
    retval: Any = None,
    **_: Any,
) -> None:
    end = time.monotonic_ns()
    start = _starts.pop(task_id, end) if task_id is not None else end
    # A skip: FAILURE with LockSkipped (the default lock_skip_result), IGNORED before.
    # By name: this module must not import celery_pglock (see the module docstring).
    skipped = state == "IGNORED" or type(retval).__name__ == "LockSkipped"
    outcome = (
        OUTCOME_SUCCESS
        if state == "SUCCESS"
        else OUTCOME_IGNORED
        if skipped
        else OUTCOME_OTHER
    )
    # O_APPEND + one write of 24 bytes: atomic, so threads of one process may share it.
    os.write(_record_fd(), RECORD.pack(start, end, outcome))


if _record_dir:
    signals.task_prerun.connect(_on_prerun, weak=False)
    signals.task_postrun.connect(_on_postrun, weak=False)


def _quiet_task_logs(**_: Any) -> None:
    # Celery decides per tracer (built in each pool child after logging is set up)
    # whether to log every task at INFO; raise these loggers above INFO before that.
    for name in ("celery.app.trace", "celery.worker.strategy", "celery.worker.request"):
        logging.getLogger(name).setLevel(logging.WARNING)


if os.environ.get(TASK_LOGS_ENV) != "1":
    _quiet_task_logs()
    signals.after_setup_logger.connect(_quiet_task_logs, weak=False)
    signals.after_setup_task_logger.connect(_quiet_task_logs, weak=False)


def _warm_up(connections: int) -> None:
    """Open ``connections`` lock connections at once and pool them (no lock taken)."""
    if _plain_only or connections < 1:
        return
    from celery_pglock import db

    engine = db.engine_for(app.conf)
    opened = [engine.raw_connection() for _ in range(connections)]
    for connection in opened:
        connection.close()


def _mark_warm() -> None:
    """Tell run.py that this task process is warm (it waits for one file per process)."""
    if _record_dir:
        path = os.path.join(_record_dir, f"{os.getpid()}{WARM_SUFFIX}")
        with open(path, "w", encoding="ascii") as marker:
            marker.write("warm\n")


def _on_child_init(**_: Any) -> None:
    _warm_up(int(os.environ.get(WARM_CONNECTIONS_ENV, "1")))
    if os.environ.get(PROFILE_DIR_ENV):
        _profiler.enable()
    _mark_warm()


def _on_worker_ready(**_: Any) -> None:
    # threads and solo pools run tasks in the main process: warm it up there.
    if os.environ.get(POOL_ENV, "prefork") != "prefork":
        _warm_up(int(os.environ.get(WARM_CONNECTIONS_ENV, "1")))
        _mark_warm()


def _on_child_shutdown(**_: Any) -> None:
    directory = os.environ.get(PROFILE_DIR_ENV)
    if not directory:
        return
    _profiler.disable()
    with contextlib.suppress(OSError):
        _profiler.dump_stats(os.path.join(directory, f"{os.getpid()}.prof"))


_profiler = cProfile.Profile()
signals.worker_process_init.connect(_on_child_init, weak=False)
signals.worker_ready.connect(_on_worker_ready, weak=False)
signals.worker_process_shutdown.connect(_on_child_shutdown, weak=False)
