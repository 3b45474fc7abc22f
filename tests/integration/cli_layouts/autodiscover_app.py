"""``app.autodiscover_tasks(packages)``: finds ``<package>.tasks`` when a worker starts
(lazily, on Celery's import_modules signal), as Django projects do with no arguments."""

from __future__ import annotations

from celery import Celery

app = Celery("autodiscover_layout", broker="memory://")
app.autodiscover_tasks(packages=["tests.integration.cli_layouts.billing"])
