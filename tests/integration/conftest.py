"""Fixtures shared by the SingletonTask and lock-loss tests of this directory.

``app`` (test_task*.py): an app per test, in both session modes; test_fencing.py has
an app fixture of its own. ``events``: the celery_pglock signals a test sent.
``lost_events`` (test_lock_loss*.py): the lock_lost signals.
"""

from __future__ import annotations

import pytest
from celery import Celery

from celery_pglock import signals
from tests.integration.task_support import close_app


@pytest.fixture
def app(database_url, broker_url, result_backend_url, namespace, session_mode):
    app = Celery(
        "it", broker=broker_url, backend=result_backend_url, set_as_current=False
    )
    app.conf.pglock_database_url = database_url
    app.conf.pglock_namespace = namespace
    yield app
    close_app(app)


@pytest.fixture
def events():
    """Every celery_pglock signal sent during the test, as (signal name, kwargs)."""
    seen = []
    receivers = []
    for name in (
        "lock_acquired",
        "lock_skipped",
        "lock_completed",
        "lock_failed",
        "lock_release_failed",
    ):

        def receiver(sender=None, signal=None, _name=name, **kwargs):
            seen.append((_name, kwargs))

        getattr(signals, name).connect(receiver, weak=False)
        receivers.append((getattr(signals, name), receiver))
    yield seen
    for signal, receiver in receivers:
        signal.disconnect(receiver)


@pytest.fixture
def lost_events():
    """Every lock_lost signal sent during the test (its kwargs)."""
    seen: list[dict] = []

    def receiver(sender=None, signal=None, **kwargs):
        seen.append(kwargs)

    signals.lock_lost.connect(receiver, weak=False)
    yield seen
    signals.lock_lost.disconnect(receiver)
