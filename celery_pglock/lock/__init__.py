"""AdvisoryLock and its sessions; no Celery. Imports allowed: docs/design.md (Layers)."""

from __future__ import annotations

from celery_pglock.lock.advisory import AdvisoryLock

__all__ = ["AdvisoryLock"]
