"""The ``-A`` module of the pytest plugin's workers: the user's app, pointed at the test
services, with every SingletonTask body recorded for the overlap check.

``celery -A celery_pglock.testing._pytest_worker worker`` imports the user's app (named by
``pytest_plugin.APP_ENV``, resolved the way ``celery -A`` resolves it), applies the test
session's settings (``pytest_plugin.CONFIG_ENV``, JSON) over whatever the app configured for itself, and
exposes it as ``app``. Only worker subprocesses started by the plugin import this module.

Every SingletonTask's body (``run``) is wrapped by ``pytest_plugin.record_bodies``, which
says why the body and not the lock_* signals.

Hazard: the settings are applied right after the user's module is imported. An app that
loads its configuration later (in a signal handler, say) would override them.
"""

from __future__ import annotations

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


@signals.worker_init.connect(weak=False)
def _record_bodies(**_: Any) -> None:
    # worker_init comes after the app's modules were imported and before the pool
    # forks, so every pool child inherits the wrapped tasks.
    for task in app.tasks.values():
        if isinstance(task, celery_pglock.SingletonTask):
            task.run = plugin.record_bodies(task, recorder, RUN)  # type: ignore[method-assign]  # per instance, on purpose
