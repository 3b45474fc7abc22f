"""An app with tasks but no SingletonTask: ``pglock check`` must not call it OK."""

from __future__ import annotations

from celery import Celery

app = Celery("plain_layout", broker="memory://")


@app.task
def ping():
    return "pong"
