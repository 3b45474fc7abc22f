"""The ``-A`` module of the pytest plugin's workers: the user's app, pointed at the test
services, with every SingletonTask body recorded for the overlap check.

``celery -A celery_pglock.testing._pytest_worker worker`` imports the user's app (named by
``pytest_plugin.APP_ENV``, resolved the way ``celery -A`` resolves it), applies the test
session's settings (``pytest_plugin.CONFIG_ENV``, JSON) over whatever the app configured for itself, and
exposes it as ``app``. Only worker subprocesses started by the plugin import this module.

Why wrap ``run``: an interval must start after the lock was granted and end before it is
released, or a correct lock could show an overlap. SingletonTask calls ``self.run`` exactly
there, between acquire and release; the lock_* signals cannot be used because the
outcome signals are sent after the release.

Hazard: the settings are applied right after the user's module is imported. An app that
loads its configuration later (in a signal handler, say) would override them.
"""

from __future__ import annotations

import functools
import json
import os
from typing import Any

from celery import signals
from celery.app.utils import find_app

import celery_pglock
from celery_pglock.testing import overlap
from celery_pglock.testing import pytest_plugin as plugin

app = find_app(os.environ[plugin.APP_ENV])
app.conf.update(json.loads(os.environ[plugin.CONFIG_ENV]))
recorder = overlap.OverlapRecorder(
    os.environ[plugin.RECORD_URL_ENV], table=os.environ[plugin.RECORD_TABLE_ENV]
)
RUN = os.environ[plugin.RECORD_RUN_ENV]


def recorded(task: celery_pglock.SingletonTask) -> Any:
    """``task.run`` wrapped to record its interval, keyed by the lock it runs under.

    The key is the lock's name and advisory key (``pg_locks``' identity), never the key
    text, which holds argument values.
    """
    body = task.run

    @functools.wraps(body)
    def run(*args: Any, **kwargs: Any) -> Any:
        try:
            lock_key = celery_pglock.current_lock().key
        except celery_pglock.PgLockError:  # run() called outside __call__: no lock
            return body(*args, **kwargs)
        with recorder.record(RUN, f"{lock_key.name} {lock_key}", task.request.id):
            return body(*args, **kwargs)

    return run


@signals.worker_init.connect(weak=False)
def _record_bodies(**_: Any) -> None:
    # worker_init comes after the app's modules were imported and before the pool
    # forks, so every pool child inherits the wrapped tasks.
    for task in app.tasks.values():
        if isinstance(task, celery_pglock.SingletonTask):
            task.run = recorded(task)  # type: ignore[method-assign]  # per instance, on purpose
