"""The ``pglock`` command, as ``celery -A proj pglock`` and ``celery-pglock``; may import
every layer. Manual: docs/operations/cli.md."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
from typing import TYPE_CHECKING, Any

import click
from celery.app.utils import find_app
from celery.bin.base import CLIContext
from sqlalchemy.pool import NullPool

from celery_pglock import config, exceptions
from celery_pglock.cli import (
    check_verb,
    key_verb,
    locks_verb,
    periods_verb,
    queued_verb,
    release_verb,
    sql_verb,
)
from celery_pglock.db import driver_errors, engines
from celery_pglock.task import worker_hooks

if TYPE_CHECKING:
    from collections.abc import Iterator

    import sqlalchemy as sa

__all__ = ["Target", "celery_command", "main", "standalone_command"]

CLI_APPLICATION_NAME = "celery-pglock cli"


@dataclasses.dataclass
class Target:
    app: Any
    url: str | None

    def require_url(self) -> str:
        if self.url:
            return self.url
        raise click.UsageError(
            "No lock database: pass --database-url, set app.conf.pglock_database_url "
            f"in the app, or set {config.DATABASE_URL_ENV}."
        )

    def conf(self) -> dict[str, Any]:
        items = self.app.conf.items() if self.app is not None else ()
        return {k: v for k, v in items if k.startswith("pglock_")}

    @contextlib.contextmanager
    def database(self, action: str) -> Iterator[sa.Engine]:
        """A database error ends the verb (exit status 1)."""
        engine = self.engine()
        try:
            with driver_errors.wrap_db_errors(action, engine):
                yield engine
        except exceptions.DatabaseError as error:
            raise click.ClickException(str(error)) from None
        finally:
            engine.dispose()

    def engine(self) -> sa.Engine:
        """Without a pool: each connect is a new session."""
        conf = self.conf()
        options = dict(conf.get("pglock_engine_options") or {})
        connect_args = dict(options.pop("connect_args", {}))
        connect_args.update(application_name=CLI_APPLICATION_NAME, connect_timeout=5)
        options.update(poolclass=NullPool, connect_args=connect_args)
        conf["pglock_engine_options"] = options
        return engines.create_engine(self.require_url(), conf)

    @functools.cached_property
    def singleton_tasks(self) -> list[Any]:
        """After importing the task modules as a worker would."""
        if self.app is None:
            return []
        try:
            self.app.loader.import_default_modules()
        except Exception as exc:
            raise click.UsageError(
                f"Cannot import the task modules of the app {self.app.main!r} "
                f"(its include/imports settings and autodiscover_tasks): "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        return worker_hooks.singleton_tasks(self.app)


def _build(*, standalone: bool) -> click.Group:
    @click.group(
        name="celery-pglock" if standalone else "pglock",
        help="Inspect celery-pglock advisory locks: locks, queued, periods, key, release, "
        "check, sql.",
        commands=[
            locks_verb.locks,
            queued_verb.queued,
            periods_verb.periods,
            key_verb.key,
            release_verb.release,
            check_verb.check,
            sql_verb.sql,
        ],
    )
    @click.option(
        "--database-url",
        metavar="URL",
        help="Lock database (default: the app's pglock_database_url, then "
        f"${config.DATABASE_URL_ENV}).",
    )
    @click.pass_context
    def group(ctx: click.Context, /, database_url: str | None, **kwargs: Any) -> None:
        app = None if standalone else getattr(ctx.find_object(CLIContext), "app", None)
        if standalone and kwargs.get("app_path"):
            try:
                app = find_app(kwargs["app_path"])
            except Exception as exc:
                raise click.UsageError(
                    f"Cannot load the app {kwargs['app_path']!r}: {exc}"
                ) from exc
        if not database_url and app is not None:
            database_url = app.conf.get(config.DATABASE_URL_SETTING)
        url = database_url or os.environ.get(config.DATABASE_URL_ENV)
        ctx.obj = Target(app=app, url=str(url) if url else None)

    if standalone:
        group = click.option(
            "-A",
            "--app",
            "app_path",
            metavar="APP",
            help="The Celery app (module or module:attribute), for task names and settings.",
        )(group)
    return group


#: Registered under the ``celery.commands`` entry point.
celery_command = _build(standalone=False)
standalone_command = _build(standalone=True)


def main(argv: list[str] | None = None) -> int:
    try:
        standalone_command.main(
            args=argv, prog_name="celery-pglock", standalone_mode=True
        )
    except SystemExit as stop:  # how click's standalone mode ends
        code: object = stop.code
        return code if isinstance(code, int) else (0 if code is None else 1)
