"""An app whose SingletonTask misspells an option: ``pglock check`` must name the fix."""

from __future__ import annotations

from celery import Celery

from celery_pglock import SingletonTask

app = Celery("typo_layout", broker="memory://", set_as_current=False)


@app.task(base=SingletonTask, shared=False, lock_arg=("tenant_id",))
def export(tenant_id):
    return tenant_id
