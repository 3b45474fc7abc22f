"""Celery-style signals, one per lock outcome, all sent from ``task/outcomes.py``.
Their arguments, and why receivers must stay cheap: docs/reference/signals.md."""

from __future__ import annotations

from celery.utils.dispatch import Signal

lock_acquired = Signal(name="lock_acquired")  #: The body is about to run locked.
lock_skipped = Signal(name="lock_skipped")  #: The body did not run: the lock was held.
lock_completed = Signal(name="lock_completed")  #: The body returned.
lock_failed = Signal(name="lock_failed")  #: The body raised.
#: Releasing went wrong; the connection was closed, so the lock is free.
lock_release_failed = Signal(name="lock_release_failed")
lock_lost = Signal(name="lock_lost")  #: The lock was lost while the body ran.
#: A lock_enqueue send: published, or returned as a duplicate of a queued message.
lock_enqueued = Signal(name="lock_enqueued")
