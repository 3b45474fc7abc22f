"""What a ``pglock`` verb works on: the app (if any) and the lock database URL."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import click

from celery_pglock import config
from celery_pglock.db import engines

if TYPE_CHECKING:
    import sqlalchemy as sa

CLI_APPLICATION_NAME = "celery-pglock cli"


@dataclasses.dataclass
class Target:
    """What a verb works on: the app (if any) and the lock database URL."""

    app: Any
    url: str | None
    _tasks_loaded: bool = dataclasses.field(default=False, repr=False)

    def conf(self) -> dict[str, Any]:
        if self.app is None:
            return {}
        return {k: v for k, v in self.app.conf.items() if k.startswith("pglock_")}

    def require_url(self) -> str:
        if self.url:
            return self.url
        raise click.UsageError(
            "No lock database: pass --database-url, set app.conf.pglock_database_url "
            f"in the app, or set {config.DATABASE_URL_ENV}."
        )

    def engine(self, *, timeout: int = 5) -> sa.Engine:
        """A lock engine without a pool (each connect is a new session), labelled as us."""
        from sqlalchemy.pool import NullPool

        conf = self.conf()
        options = dict(conf.get("pglock_engine_options") or {})
        connect_args = dict(options.pop("connect_args", {}))
        connect_args.update(
            application_name=CLI_APPLICATION_NAME, connect_timeout=timeout
        )
        options.update(poolclass=NullPool, connect_args=connect_args)
        conf["pglock_engine_options"] = options
        return engines.create_engine(self.require_url(), conf)

    def lock_prefix(self) -> str:
        return str(
            self.conf().get("pglock_application_name")
            or engines.DEFAULT_APPLICATION_NAME
        )

    def tasks(self) -> dict[str, Any]:
        """The app's task registry once its task modules are imported as a worker would."""
        if self.app is None:
            return {}
        if not self._tasks_loaded:
            self._tasks_loaded = True
            _import_task_modules(self.app)
        return dict(self.app.tasks)

    def singleton_tasks(self) -> list[Any]:
        from celery_pglock.task import SingletonTask

        return [t for t in self.tasks().values() if isinstance(t, SingletonTask)]


def _import_task_modules(app: Any) -> None:
    """Import the app's task modules the way ``celery worker`` does at start.

    ``-A proj`` imports only the app's module; tasks listed in ``Celery(include=...)`` or
    ``imports``, or found by ``app.autodiscover_tasks()`` (Django's layout, which also
    needs ``django.setup()``: Celery's Django fix-up runs it on the same signal), are
    imported by the loader when a worker starts (``loader.init_worker``), as ``celery
    report`` does too. Without it a verb would see none of them.
    """
    try:
        app.loader.import_default_modules()
    except Exception as exc:
        raise click.UsageError(
            f"Cannot import the task modules of the app {app.main!r} "
            f"(its include/imports settings and autodiscover_tasks): "
            f"{type(exc).__name__}: {exc}"
        ) from exc
