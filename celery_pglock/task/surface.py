"""What the task layer's helpers may touch of a SingletonTask (its one implementation),
typed, and nothing private."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import sqlalchemy as sa

    from celery_pglock import config, keys


class LockedTask(Protocol):
    # Read-only here: the helpers read Celery's task attributes, never set them.
    @property
    def name(self) -> str: ...
    @property
    def request(self) -> Any: ...  # Celery's request Context
    @property
    def max_retries(self) -> int | None: ...
    @property
    def default_retry_delay(self) -> float: ...
    @property
    def acks_late(self) -> bool: ...
    @property
    def expires(self) -> Any: ...
    @property
    def ignore_result(self) -> bool: ...
    @property
    def backend(self) -> Any: ...  # Celery's result backend
    @property
    def serializer(self) -> str: ...

    @property
    def lock_config(self) -> config.LockConfig: ...

    def lock_key_for(self, *args: Any, **kwargs: Any) -> keys.LockKey: ...

    def locks_engine(self) -> sa.Engine: ...

    def retry(self, *args: Any, **kwargs: Any) -> Any: ...

    def AsyncResult(self, task_id: str, **kwargs: Any) -> Any: ...  # noqa: N802 - Celery's
