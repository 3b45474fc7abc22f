"""The public API used as users do, type-checked only (mypy), never run.

scripts/test.sh runs ``mypy tests/typing`` next to ``mypy`` on the package. The examples in
README.md and docs/ are type-checked and run by tests/unit/test_docs_examples.py.
"""

from __future__ import annotations

from celery import Celery

from celery_pglock import (
    SKIPPED,
    AdvisoryLock,
    LockBusy,
    LockKey,
    LockLostError,
    LockScope,
    LockSkipped,
    OnBusy,
    OnLost,
    SingletonTask,
    SkipResult,
    current_lock,
    fencing,
    metrics,
    signals,
    skip_info,
)
from celery_pglock.db.engines import create_engine

app = Celery("billing", broker="redis://localhost:6379/0")
app.conf.pglock_database_url = "postgresql+psycopg2://app@db/app"


@app.task(base=SingletonTask)
def daily_settlement() -> None: ...


@app.task(base=SingletonTask, lock_args=("tenant_id",))
def build_tenant_export(tenant_id: int, fmt: str = "csv") -> str:
    return f"{tenant_id}.{fmt}"


@app.task(base=SingletonTask, lock_scope="transaction")
def settle() -> int:
    connection = current_lock().connection
    return int(connection.exec_driver_sql("SELECT 1").scalar_one())


class Exports(SingletonTask):
    lock_args = ("tenant_id",)
    lock_on_busy = OnBusy.RETRY
    lock_scope = LockScope.SESSION


def on_skipped(sender: object, task_id: str | None, key: LockKey, **_: object) -> None:
    print(task_id, key, SKIPPED)


signals.lock_skipped.connect(on_skipped)


@app.task(base=SingletonTask, lock_on_lost=OnLost.TERMINATE, lock_watch_interval=2)
def long_sync() -> bool:
    lock = current_lock()
    try:
        lock.ensure_held()
    except LockLostError as lost:
        print(lost.key, lock.lost_cause)
    return lock.lost


def on_lost(sender: object, key: LockKey, cause: str, **_: object) -> None:
    print(key, cause)


signals.lock_lost.connect(on_lost)


def standalone() -> None:
    engine = create_engine("postgresql+psycopg2://app@db/app")
    lock = AdvisoryLock(engine=engine, key=build_tenant_export.lock_key_for(7))
    try:
        with lock:
            pass
    except LockBusy as busy:
        print(busy.key, busy.name)


class Reports(SingletonTask):
    lock_skip_result = SkipResult.SUCCESS
    lock_shadow = True


def caller() -> None:
    try:
        build_tenant_export.delay(7).get(timeout=10)
    except LockSkipped as skip:
        print(skip.holder, skip.details["key"], skip_info(skip))


class CountingMetrics:
    def acquired(self, task: str, wait_seconds: float) -> None: ...
    def skipped(self, task: str, policy: str, wait_seconds: float) -> None: ...
    def released(self, task: str, state: str, held_seconds: float) -> None: ...
    def release_failed(self, task: str) -> None: ...
    def lost(self, task: str) -> None: ...


sink: metrics.Metrics = CountingMetrics()
app.conf.pglock_metrics = sink


@app.task(base=SingletonTask, lock_args=("tenant_id",), lock_fencing=True)
def publish(tenant_id: int) -> bool:
    token: int | None = current_lock().fencing_token
    with create_engine("postgresql+psycopg2://app@db/app").begin() as connection:
        applied: bool = fencing.fenced_upsert(
            connection, "reports", key={"tenant_id": tenant_id}, values={}, token=token
        )
    return applied
