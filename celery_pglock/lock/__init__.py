"""The lock layer: ``AdvisoryLock`` and its sessions, knowing nothing of Celery.
What it may import: docs/design.md (Layers)."""

from __future__ import annotations

from celery_pglock.lock.advisory import AdvisoryLock

__all__ = ["AdvisoryLock"]
