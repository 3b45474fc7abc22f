"""The Celery app of the chaos run (tests/chaos/run.py): loss_app's, plus one task.

It reuses tests.acceptance.loss_app as it is: locks on a PRIVATE PostgreSQL
(``PGLOCK_TEST_LOCK_DATABASE_URL``), which the chaos restarts and whose backends it
terminates; the overlap recorder and the ``lock_lost`` events on the shared test
database, which the chaos never touches. Added here: redeliveries (``acks_late`` with
``reject_on_worker_lost``, and a short Redis visibility timeout so that a killed worker's
reserved messages come back within the run), the policy on loss from the environment,
and ``lock_release_failed`` recorded next to ``lock_lost`` (a body shorter than the watch
interval learns of its loss only at release).
"""

from __future__ import annotations

import os
import time
from typing import Any

from celery_pglock import DatabaseError, SingletonTask, signals

# Re-exported: the chaos run reaches both through this module, imported once its
# environment is set.
from tests.acceptance import loss_app as loss_app
from tests.acceptance.app import recorder as recorder

ON_LOST_ENV = "PGLOCK_TEST_ON_LOST"
#: Seconds before Redis hands an unacknowledged message to another worker: longer than
#: any body plus its wait in the prefetch buffer, short enough for a bounded run.
VISIBILITY_TIMEOUT = 15
#: The body refreshes its interval's end this often: a killed body leaves "last seen
#: alive", at most about twice this short (OverlapRecorder.heartbeat; the acceptance
#: app's wait_gate does the same).
HEARTBEAT = 0.2
#: The cause recorded for a loss learnt at release (lock_release_failed).
RELEASE_FAILED = "release failed: "

app = loss_app.app
app.conf.update(
    pglock_on_lost=os.environ.get(ON_LOST_ENV, "signal"),
    broker_transport_options={
        "visibility_timeout": VISIBILITY_TIMEOUT,
        "unacked_restore_interval": 1,
        "unacked_restore_throttle": 1,
    },
)


def _record_release_failed(
    sender: Any = None,
    task_id: str | None = None,
    exception: BaseException | None = None,
    **_: Any,
) -> None:
    loss_app._record_lost(
        sender=sender,
        task_id=task_id,
        task_name=getattr(sender, "name", None),
        cause=f"{RELEASE_FAILED}{type(exception).__name__}",
    )


signals.lock_release_failed.connect(_record_release_failed, weak=False)


@app.task(
    base=SingletonTask,
    bind=True,
    name="chaos.work",
    lock_args=("run", "key"),
    acks_late=True,
    reject_on_worker_lost=True,
    # A lock database restart at acquire is retried (a restart is over in seconds).
    autoretry_for=(DatabaseError,),
    retry_backoff=1,
    retry_jitter=False,
    max_retries=5,
)
def work(self: Any, run: str, key: str, seconds: float) -> str:
    """Hold ``key``'s lock for ``seconds``, recording the interval with a heartbeat."""
    with recorder.record(run, key, self.request.id) as row_id:
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            recorder.heartbeat(row_id)
            time.sleep(min(left, HEARTBEAT))
    return "ran"


#: lock_enqueue_lost_after of the enqueue phase's tasks: the bound it waits out at the end.
ENQUEUE_LOST_AFTER = 6.0


def _enqueued(self: Any, run: str, key: str, seconds: float) -> str:
    # Keyed by task too: the two tasks' locks of one key name are different locks.
    with recorder.record(run, f"{self.name}/{key}", self.request.id) as row_id:
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            recorder.heartbeat(row_id)
            time.sleep(min(left, HEARTBEAT))
    return "ran"


until_finished = app.task(
    base=SingletonTask,
    bind=True,
    name="chaos.until_finished",
    lock_args=("run", "key"),
    lock_enqueue="until_finished",
    lock_enqueue_lost_after=ENQUEUE_LOST_AFTER,
    acks_late=True,
    reject_on_worker_lost=True,
    autoretry_for=(DatabaseError,),
    max_retries=5,
)(_enqueued)
until_started = app.task(
    base=SingletonTask,
    bind=True,
    name="chaos.until_started",
    lock_args=("run", "key"),
    lock_enqueue="until_started",
    lock_enqueue_lost_after=ENQUEUE_LOST_AFTER,
    lock_retry_delay=0.5,
    max_retries=50,
)(_enqueued)


#: The flow phase (tests/chaos/flow_phase.py): a group of GROUP_LIMIT runs at most, one per
#: key; a rate of RATE[0] starts per RATE[1] seconds per key.
GROUP_LIMIT = 2
RATE = (2, 2.0)


def _heartbeating(
    run: str, keys: tuple[str, ...], task_id: str, seconds: float
) -> None:
    """Record an interval per key in ``keys``, each refreshed as the body runs."""
    rows = [
        recorder.begin(run if n == 0 else f"{run}-group", key, task_id)
        for n, key in enumerate(keys)
    ]
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        for row_id in rows:
            recorder.heartbeat(row_id)
        time.sleep(min(left, HEARTBEAT))
    for row_id in rows:
        recorder.end(row_id)


@app.task(
    base=SingletonTask,
    bind=True,
    name="chaos.grouped",
    lock_args=("run", "key"),
    lock_group="chaos",
    lock_group_limit=GROUP_LIMIT,
    lock_on_busy="retry",
    lock_retry_delay=0.2,
    max_retries=None,
    acks_late=True,
    reject_on_worker_lost=True,
)
def grouped(self: Any, run: str, key: str, seconds: float) -> str:
    """One run per key and GROUP_LIMIT in the group (recorded under ``<run>-group``)."""
    _heartbeating(run, (key, "group"), self.request.id, seconds)
    return "ran"


@app.task(
    base=SingletonTask,
    bind=True,
    name="chaos.rated",
    lock_args=("run", "key"),
    lock_rate=RATE,
    lock_on_busy="retry",
    max_retries=None,
    acks_late=True,
    reject_on_worker_lost=True,
)
def rated(self: Any, run: str, key: str, seconds: float) -> str:
    """At most RATE[0] starts of a key per RATE[1] seconds; re-queued until a start frees."""
    _heartbeating(run, (key,), self.request.id, seconds)
    return "ran"


#: The latest-wins phase (tests/chaos/latest_phase.py).
latest = app.task(
    base=SingletonTask,
    bind=True,
    name="chaos.latest",
    lock_args=("run", "key"),
    lock_enqueue="until_started",
    lock_enqueue_on_duplicate="replace",
    lock_enqueue_lost_after=ENQUEUE_LOST_AFTER,
    lock_wait_timeout=3,
    lock_retry_delay=0.2,
    max_retries=None,
    acks_late=True,
    reject_on_worker_lost=True,
)(_enqueued)
#: The same phase's debounced task: a short quiet time and longest wait, so that bursts
#: end and hop within the phase.
debounced = app.task(
    base=SingletonTask,
    bind=True,
    name="chaos.debounced",
    lock_args=("run", "key"),
    lock_enqueue="until_started",
    lock_debounce=0.3,
    lock_debounce_max=1.0,
    lock_enqueue_lost_after=ENQUEUE_LOST_AFTER,
    lock_wait_timeout=3,
    lock_retry_delay=0.2,
    max_retries=None,
    acks_late=True,
    reject_on_worker_lost=True,
)(_enqueued)
