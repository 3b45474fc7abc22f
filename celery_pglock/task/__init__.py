"""The Celery task and its hooks: ``SingletonTask``, what a busy run becomes, outcomes.

Layer 5 of docs/design.md. May import every layer below (bottom, ``db``, ``lock``,
``watch``) and ``metrics``; never ``cli`` or ``fencing``.
"""

from __future__ import annotations

from celery_pglock.task import worker_hooks
from celery_pglock.task.singleton_task import SingletonTask

# Celery's signals are global: the receivers are connected once, at import, and do
# nothing for an app without SingletonTasks.
worker_hooks.connect()

__all__ = ["SingletonTask"]
