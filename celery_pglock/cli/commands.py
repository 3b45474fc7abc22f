"""The ``pglock`` command for incidents: who holds what, a call's key, releasing a stuck
lock, a health check, SQL.

Two entry points share these verbs:

- ``celery -A proj pglock <verb>``: a Celery sub-command (``celery.commands`` entry
  point), using the project's app for its settings and task names;
- ``celery-pglock [--app proj] [--database-url URL] <verb>`` (or ``python -m
  celery_pglock``): the same, for a DBA without the project's code; the URL falls back to
  ``CELERY_PGLOCK_DATABASE_URL``.

Every database URL it prints is masked. Exit status (docs/operations/cli.md): 0 done, 1
a ``check`` FAIL or a database error, 2 a usage error.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import click

from celery_pglock import config, exceptions
from celery_pglock.cli import (
    admin_sql,
    check_verb,
    key_verb,
    locks_verb,
    release_verb,
)
from celery_pglock.cli.target import Target
from celery_pglock.db import driver_errors


def _resolve_url(app: Any, given: str | None) -> str | None:
    if given:
        return given
    if app is not None and app.conf.get(config.DATABASE_URL_SETTING):
        return str(app.conf[config.DATABASE_URL_SETTING])
    return os.environ.get(config.DATABASE_URL_ENV) or None


def _build(*, standalone: bool) -> click.Group:
    @click.group(
        name="celery-pglock" if standalone else "pglock",
        help="Inspect celery-pglock advisory locks: locks, key, release, check, sql.",
    )
    @click.option(
        "--database-url",
        metavar="URL",
        help="Lock database (default: the app's pglock_database_url, then "
        f"${config.DATABASE_URL_ENV}).",
    )
    @click.pass_context
    def group(ctx: click.Context, /, database_url: str | None, **kwargs: Any) -> None:
        if standalone:
            app = _load_app(kwargs.get("app_path"))
        else:
            from celery.bin.base import CLIContext

            parent = ctx.find_object(CLIContext)
            app = parent.app if parent is not None else None
        ctx.obj = Target(app=app, url=_resolve_url(app, database_url))

    if standalone:
        group = click.option(
            "-A",
            "--app",
            "app_path",
            metavar="APP",
            help="The Celery app (module or module:attribute), for task names and settings.",
        )(group)
    for command in (locks_verb.locks, key_verb.key, release_verb.release, check, sql):
        group.add_command(command)
    return group


def _load_app(path: str | None) -> Any:
    if not path:
        return None
    from celery.app.utils import find_app

    try:
        return find_app(path)
    except Exception as exc:
        raise click.UsageError(f"Cannot load the app {path!r}: {exc}") from exc


# -- check ------------------------------------------------------------------------------


@click.command(
    help="Check configuration, connectivity, privileges, standby, pooler and capacity."
)
@click.option(
    "--processes",
    type=click.IntRange(min=1),
    help="Worker processes (or threads) that run locked tasks at once, across all hosts (default: the app's worker_concurrency, or this host's CPU count).",
)
@click.option(
    "--scope",
    type=click.Choice(["session", "transaction"]),
    help="Lock scope to judge the pooler for (default: the scopes the app's tasks use, else session).",
)
@click.option("--json", "as_json", is_flag=True, help="One JSON document on stdout.")
@click.pass_obj
def check(
    target: Target, processes: int | None, scope: str | None, as_json: bool
) -> None:
    findings = check_verb.run_checks(target, processes=processes, scope=scope)
    if as_json:
        click.echo(json.dumps([dataclasses.asdict(f) for f in findings], indent=2))
    else:
        for finding in findings:
            click.echo(f"{finding.status:<4}  {finding.name:<13} {finding.detail}")
            if finding.fix:
                click.echo(f"{'':<19} fix: {finding.fix}")
    if any(f.status == "FAIL" for f in findings):
        raise SystemExit(1)


# -- sql --------------------------------------------------------------------------------


@click.command(
    help="Print (or --apply) the SQL key function celery_pglock_key() and the view "
    "celery_pglock_locks; with --fencing, the fencing-token table instead."
)
@click.option("--apply", "apply_", is_flag=True, help="Run it on the lock database.")
@click.option("--uninstall", is_flag=True, help="The DROP statements instead.")
@click.option(
    "--schema", default="public", show_default=True, help="Schema to create them in."
)
@click.option(
    "--fencing",
    is_flag=True,
    help="The table and sequence of lock_fencing (run as their owner; see the GRANTs printed).",
)
@click.pass_obj
def sql(
    target: Target, apply_: bool, uninstall: bool, schema: str, fencing: bool
) -> None:
    if fencing:
        _fencing_sql(target, apply_=apply_, uninstall=uninstall, schema=schema)
        return
    text = (
        admin_sql.uninstall_sql(schema) if uninstall else admin_sql.install_sql(schema)
    )
    if not apply_:
        click.echo(text)
        return
    _apply(target, text, "install the SQL functions")
    done = "Dropped" if uninstall else "Created"
    click.echo(
        f"{done} {schema}.celery_pglock_key(), {schema}.celery_pglock_canonical() and the view {schema}.celery_pglock_locks."
    )


def _fencing_sql(target: Target, *, apply_: bool, uninstall: bool, schema: str) -> None:
    from celery_pglock import fencing

    text = fencing.drop_sql(schema) if uninstall else fencing.create_sql(schema)
    if not apply_:
        click.echo(text)
        if not uninstall:
            grants = fencing.grant_sql("<lock role>", schema).strip().splitlines()
            click.echo("-- A lock role without CREATE needs:")
            click.echo("\n".join(f"-- {line}" for line in grants))
        return
    _apply(target, text, "set up the fencing table")
    done = "Dropped" if uninstall else "Created (if missing)"
    click.echo(
        f"{done} {schema}.celery_pglock_fencing and {schema}.celery_pglock_fencing_token_seq."
    )


def _apply(target: Target, text: str, action: str) -> None:
    engine = target.engine()
    try:
        with driver_errors.wrap_db_errors(action, engine):
            # Autocommit: the text goes as one simple query, which PostgreSQL runs as one
            # transaction unless it has its own BEGIN/COMMIT (the fencing SQL does).
            connection: Any = engine.raw_connection()
            try:
                connection.dbapi_connection.autocommit = True
                with connection.cursor() as cursor:
                    cursor.execute(text)
            finally:
                connection.close()
    except exceptions.DatabaseError as error:
        raise click.ClickException(str(error)) from None
    finally:
        engine.dispose()


#: ``celery -A proj pglock ...`` (registered under the ``celery.commands`` entry point).
celery_command = _build(standalone=False)
#: ``celery-pglock ...`` and ``python -m celery_pglock``.
standalone_command = _build(standalone=True)


def main(argv: list[str] | None = None) -> int:
    """Run the standalone command; returns its exit status."""
    # click's standalone mode ends with SystemExit; turn it into the return value.
    try:
        standalone_command.main(
            args=argv, prog_name="celery-pglock", standalone_mode=True
        )
    except SystemExit as stop:
        code: object = stop.code
        return code if isinstance(code, int) else (0 if code is None else 1)
