"""``Celery(include=[...])``: the app module does not import its task module."""

from __future__ import annotations

from celery import Celery

app = Celery(
    "include_layout",
    broker="memory://",
    include=["tests.integration.cli_layouts.include_tasks"],
)
