"""The ``pglock`` command, as ``celery -A proj pglock`` and ``celery-pglock``; may import
every layer. Manual: docs/operations/cli.md."""

from __future__ import annotations

import os
from typing import Any

import click

from celery_pglock import celery_compat, config
from celery_pglock.cli import (
    check_verb,
    key_verb,
    locks_verb,
    periods_verb,
    queued_verb,
    release_verb,
    shared,
    sql_verb,
    why_verb,
)

__all__ = ["celery_command", "main", "standalone_command"]


def _build(*, standalone: bool) -> click.Group:
    @click.group(
        name="celery-pglock" if standalone else "pglock",
        help="Inspect celery-pglock advisory locks: locks, queued, periods, key, release, "
        "check, sql, why.",
        commands=[
            locks_verb.locks,
            queued_verb.queued,
            periods_verb.periods,
            key_verb.key,
            release_verb.release,
            check_verb.check,
            sql_verb.sql,
            why_verb.why,
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
        app = None if standalone else celery_compat.command_app(ctx)
        if standalone and kwargs.get("app_path"):
            try:
                app = celery_compat.load_app(kwargs["app_path"])
            except Exception as exc:
                raise click.UsageError(
                    f"Cannot load the app {kwargs['app_path']!r}: {exc}"
                ) from exc
        if not database_url and app is not None:
            database_url = app.conf.get(config.DATABASE_URL_SETTING)
        url = database_url or os.environ.get(config.DATABASE_URL_ENV)
        ctx.obj = shared.Target(app=app, url=str(url) if url else None)

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
        standalone_command.main(args=argv, prog_name="celery-pglock")
    except SystemExit as stop:  # how click's standalone mode ends
        code = stop.code
        return code if isinstance(code, int) else (0 if code is None else 1)
