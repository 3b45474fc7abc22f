"""What lock-loss watching adds to every SingletonTask run, in one process.

    .venv/bin/python benchmarks/lock_loss_overhead.py

Per run, the task layer calls ``loss_watcher.watch()`` before the body and ``loss_watcher.unwatch()``
after it, and the release's round trip is wrapped in ``deadlines.bounded()``. A body
shorter than ``lock_watch_interval`` never meets a check; this script times those three
calls alone (best of 5 x 100,000, microseconds per call) and prints how many checks the
watcher ran meanwhile, which must be 0. Needs PostgreSQL for one idle connection:
CELERY_PGLOCK_DATABASE_URL, else CELERY_PGLOCK_TEST_DATABASE_URL.
"""

from __future__ import annotations

import os
import time
import timeit

from celery_pglock import config, keys
from celery_pglock.db import deadlines, engines
from celery_pglock.lock import AdvisoryLock
from celery_pglock.testing import lock_state
from celery_pglock.watch import loss_watcher

CALLS = 100_000


def main() -> None:
    url = os.environ.get("CELERY_PGLOCK_DATABASE_URL") or os.environ.get(
        "CELERY_PGLOCK_TEST_DATABASE_URL"
    )
    if not url:
        raise SystemExit("set CELERY_PGLOCK_DATABASE_URL to a PostgreSQL URL")
    engine = engines.create_engine(url)
    lock = AdvisoryLock(engine=engine, key=keys.make_key("bench", "loss"))
    watched = config.LockConfig(task_name="bench", name="bench")
    unwatched = config.LockConfig(task_name="bench", name="bench", watch_interval=0.0)
    connection = engine.raw_connection()

    def run(options: config.LockConfig) -> None:
        lock.acquired_at = time.monotonic()  # a fresh run: never due for a check
        loss_watcher.watch(lock, print, options)
        loss_watcher.unwatch(lock)

    def release_bound() -> None:
        with deadlines.bounded(connection.dbapi_connection, 5.0):
            pass

    cases = {
        "watch + unwatch (lock_watch_interval=1)": lambda: run(watched),
        "watch + unwatch (lock_watch_interval=0, off)": lambda: run(unwatched),
        "bounded release wrapper": release_bound,
    }
    with lock_state.watcher_checks() as checks:
        for name, call in cases.items():
            best = min(timeit.repeat(call, number=CALLS, repeat=5)) / CALLS
            print(f"{name:48} {best * 1e6:6.2f} us")
    print(f"{'checks run by the watcher meanwhile':48} {checks():6d}")
    connection.close()
    engine.dispose()


if __name__ == "__main__":
    main()
