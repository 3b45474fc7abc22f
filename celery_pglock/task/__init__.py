"""The Celery task layer: ``SingletonTask`` and its hooks. Why: docs/design.md."""

from __future__ import annotations

from celery_pglock.task import worker_hooks
from celery_pglock.task.singleton_task import SingletonTask

worker_hooks.connect()  # at import: docs/design.md (Worker signal hooks)

__all__ = ["SingletonTask"]
