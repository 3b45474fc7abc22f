"""The per-task key memo is bounded in bytes: big arguments are keyed, never kept."""

from __future__ import annotations

import gc
import tracemalloc

import pytest
from celery import Celery

from celery_pglock import SingletonTask, keys
from celery_pglock.keys import lock_keys


@pytest.fixture
def task():
    app = Celery("cache", broker="memory://", set_as_current=False)
    app.conf.pglock_database_url = "postgresql+psycopg2://u@db.invalid/app"

    @app.task(
        base=SingletonTask, name="cache.export", lock_args=("tenant",), shared=False
    )
    def export(tenant):
        return tenant

    app.finalize(auto=True)
    return app.tasks["cache.export"]


def memo(task):
    return task._binding().keys.memo.cache_info()


@pytest.mark.parametrize(
    "value", [7, -(2**63), 2**64 - 1, True, None, "x" * lock_keys.MEMO_MAX_CHARS]
)
def test_small_scalars_are_memoised(task, value):
    first = task.lock_key_for(value)
    assert first is task.lock_key_for(value)
    assert 1 == memo(task).currsize


@pytest.mark.parametrize(
    "value", [2**64, -(2**63) - 1, "x" * (lock_keys.MEMO_MAX_CHARS + 1), 1.5, [1]]
)
def test_big_or_non_scalar_arguments_are_not_memoised(task, value):
    assert task.lock_key_for(value) == task.lock_key_for(value)
    assert 0 == memo(task).currsize


def test_twenty_5_mb_arguments_leave_nothing_behind(task):
    """What a worker child saw grow by 190 MiB before the fix: now nothing is kept, and
    keying a 5 MB argument makes no copy of it."""
    task.lock_key_for("warm-up")
    gc.collect()
    tracemalloc.start()
    try:
        before, _ = tracemalloc.get_traced_memory()
        extra = 0
        for index in range(20):
            argument = f"{index:04d}" + "x" * 4_999_996
            tracemalloc.reset_peak()
            holding, _ = tracemalloc.get_traced_memory()
            task.lock_key_for(argument)
            extra = max(extra, tracemalloc.get_traced_memory()[1] - holding)
            del argument
        gc.collect()
        after, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert after - before < 100_000
    assert extra < 1_000_000


def test_memoised_and_fresh_keys_agree(task):
    value = "t" * lock_keys.MEMO_MAX_CHARS
    memoised = task.lock_key_for(value)
    assert keys.make_key("default", "cache.export", {"tenant": value}) == memoised
