"""Celery-style signals, one per lock outcome, all sent from ``task/outcomes.py``.

Their arguments, and why receivers must stay cheap: docs/reference/signals.md.
"""

from __future__ import annotations

from celery.utils.dispatch import Signal

#: The body is about to run under the lock.
lock_acquired = Signal(name="lock_acquired")
#: The body did not run: the lock was held (``action``, ``holder``, ``shadow``).
lock_skipped = Signal(name="lock_skipped")
lock_completed = Signal(name="lock_completed")  #: The body returned (``held_seconds``).
#: The body raised (``held_seconds``, ``state``, ``exception``).
lock_failed = Signal(name="lock_failed")
#: Releasing went wrong (``exception``); the connection was closed, so the lock is free.
lock_release_failed = Signal(name="lock_release_failed")
#: The lock was found lost while the body ran (``cause``); sent from the watcher thread.
lock_lost = Signal(name="lock_lost")

__all__ = [
    "lock_acquired",
    "lock_completed",
    "lock_failed",
    "lock_lost",
    "lock_release_failed",
    "lock_skipped",
]
