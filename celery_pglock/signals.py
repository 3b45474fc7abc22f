"""Celery-style signals for every lock outcome: connect receivers to export metrics.

Every signal is sent with ``sender`` = the task instance and these keyword arguments:

========================  ==================================================================
``task_id``               the Celery task id (None for a direct call)
``task_name``             the task name
``key``                   the :class:`~celery_pglock.keys.LockKey` (``str(key)`` is what
                          ``pg_locks`` shows; ``key.name`` is the lock name)
``wait_seconds``          time spent asking for the lock, including a bounded wait
========================  ==================================================================

Per signal, in addition:

- :data:`lock_acquired` - the body is about to run under the lock.
- :data:`lock_skipped` - the body did not run because the lock was held. ``action`` is the
  ``lock_on_busy`` policy applied (``"skip"``, ``"raise"``, ``"retry"`` or ``"wait"``, the
  last meaning a bounded wait timed out); ``holder`` is ``host:pid`` of the worker process
  holding the lock (None if unknown); ``shadow`` is True in shadow mode, where the body
  runs anyway (a would-be skip).
- :data:`lock_completed` - the body returned; ``held_seconds``, ``state`` = ``"SUCCESS"``.
- :data:`lock_failed` - the body raised; ``held_seconds``, ``state`` (``"FAILURE"``,
  ``"RETRY"``, ``"IGNORED"`` or ``"REJECTED"``) and ``exception``.
- :data:`lock_release_failed` - releasing went wrong (the unlock reported "not held", the
  database failed, or a transaction-scope lock had ended early); ``exception``. The
  connection was closed, so PostgreSQL no longer holds the lock either way.
- :data:`lock_lost` - the lock was found lost while the body ran (session ended, server
  restarted or failed over, or the lock could not be verified in time); ``cause`` says
  which, in a sentence. Sent from the lock watcher thread of the process running the
  task, within about ``lock_watch_interval`` seconds of the loss. The run then ends
  FAILURE with LockLostError. See docs/operations/lock-loss.md.

A skipped run is not a success: exporters should count ``lock_skipped`` on its own, and
repeated skips usually mean the work is slower than its schedule.

These signals, the log records and the metrics (:mod:`celery_pglock.metrics`) are all fed
from one place, ``celery_pglock.task.outcomes``, one event per outcome.

Receivers run synchronously on the task's hot path, so keep them cheap. Like all Celery
signals, an exception in a receiver is logged and swallowed; it never affects the task.
"""

from __future__ import annotations

from celery.utils.dispatch import Signal

lock_acquired = Signal(name="lock_acquired")
lock_skipped = Signal(name="lock_skipped")
lock_completed = Signal(name="lock_completed")
lock_failed = Signal(name="lock_failed")
lock_release_failed = Signal(name="lock_release_failed")
lock_lost = Signal(name="lock_lost")

__all__ = [
    "lock_acquired",
    "lock_completed",
    "lock_failed",
    "lock_lost",
    "lock_release_failed",
    "lock_skipped",
]
