"""The Celery app of the demo (``examples/demo.py``): one per-tenant singleton task.

Its body holds the tenant's lock for a moment and records when it started and ended
(PostgreSQL's clock, through :class:`celery_pglock.testing.OverlapRecorder`), so the demo
can prove afterwards that no two runs of one tenant overlapped, across processes.

Configured by the environment that demo.py gives its workers, through the variables that
Celery and celery-pglock read by themselves: CELERY_BROKER_URL, CELERY_RESULT_BACKEND and
CELERY_PGLOCK_DATABASE_URL; and PGLOCK_DEMO_RUN, a fresh id per demo run. The run id
names the queue and the lock namespace, so demos sharing a broker or database never see
each other's tasks or locks.
"""

from __future__ import annotations

import os
import time

from celery import Celery

from celery_pglock import SingletonTask, config
from celery_pglock.testing import OverlapRecorder

#: Where the recorded intervals go (in the lock database).
INTERVALS_TABLE = "pglock_demo_intervals"

#: The recorder writes to the lock database; celery-pglock finds it in the same variable.
DATABASE_URL = os.environ[config.DATABASE_URL_ENV]
RUN = os.environ.get("PGLOCK_DEMO_RUN", "manual")
QUEUE = f"pglock-demo-{RUN}"

# No broker or backend here: Celery reads CELERY_BROKER_URL and CELERY_RESULT_BACKEND.
app = Celery("demo")
app.conf.update(
    pglock_namespace=f"demo-{RUN}",
    task_default_queue=QUEUE,
    # One message at a time per process: duplicates spread over every process instead
    # of queueing behind the one that holds the lock.
    worker_prefetch_multiplier=1,
    result_expires=3600,
    broker_connection_retry_on_startup=True,
)

recorder = OverlapRecorder(DATABASE_URL, table=INTERVALS_TABLE)


@app.task(
    base=SingletonTask,
    bind=True,
    name="demo.build_tenant_export",
    lock_args=("tenant_id",),
)
def build_tenant_export(self: SingletonTask, tenant_id: int, hold: float = 0.3) -> int:
    """Hold tenant ``tenant_id``'s lock for ``hold`` seconds, recording the interval."""
    with recorder.record(RUN, f"tenant-{tenant_id}", self.request.id):
        time.sleep(hold)
    return tenant_id
