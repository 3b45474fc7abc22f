"""A minimal Celery app for WorkerProcess's own tests: one plain task, no locks.

The broker and result backend come from the environment that ``worker_factory`` (or
``Services.env()``) gives the worker process.
"""

from __future__ import annotations

import os

from celery import Celery

from celery_pglock.testing import BROKER_URL_ENV, RESULT_BACKEND_ENV

broker_url = os.environ[BROKER_URL_ENV]
app = Celery(
    "trivial_app",
    broker=broker_url,
    backend=os.environ.get(RESULT_BACKEND_ENV) or broker_url,
)


@app.task(name="trivial.add")
def add(x: int, y: int) -> int:
    """Return ``x + y``."""
    return x + y
