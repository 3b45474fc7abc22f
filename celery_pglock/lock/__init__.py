"""The lock and its sessions: ``AdvisoryLock`` over the session :mod:`.sessions` picks.

Layer 3 of docs/design.md. May import the bottom (``exceptions``, ``config``, ``keys``)
and ``db``; never ``watch``, ``task`` or the operator surfaces. Knows nothing of Celery.
"""

from __future__ import annotations

from celery_pglock.lock.advisory import AdvisoryLock

__all__ = ["AdvisoryLock"]
