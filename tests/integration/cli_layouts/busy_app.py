"""An app whose SingletonTasks run another busy policy than they set in some cases:
``pglock check`` must say which and why."""

from __future__ import annotations

from celery import Celery

from celery_pglock import SingletonTask

app = Celery("busy_layout", broker="memory://", set_as_current=False)


@app.task(base=SingletonTask, shared=False, lock_enqueue="until_started")
def follow_up():
    return "followed"


@app.task(base=SingletonTask, shared=False, lock_on_busy="retry")
def retried():
    return "retried"


@app.task(base=SingletonTask, shared=False, lock_on_busy="wait")
def waited():
    return "waited"


@app.task(base=SingletonTask, shared=False, lock_shadow=True)
def shadowed():
    return "shadowed"
