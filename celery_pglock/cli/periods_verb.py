"""``pglock periods`` (and ``prune``), as their help says; docs/operations/cli.md."""

from __future__ import annotations

import json
import math
from typing import Any

import click

from celery_pglock.cli import shared
from celery_pglock.task import periods as period_rows

_NO_TABLE = "No lock_period table: no lock_rate or lock_period task has started on this database."


def _longest(target: shared.Target) -> tuple[float, str] | None:
    """The longest period (lock_period, or lock_rate's window) of the app's tasks, and
    whose; None without one."""
    found = [
        (rate.window, str(task.name))
        for task in target.singleton_tasks
        if (rate := task.lock_config.rate) is not None
    ]
    return max(found) if found else None


@click.group(
    invoke_without_command=True,
    help="The table of lock_rate and lock_period: its rows and their ages; `periods "
    "prune` deletes the rows whose period (lock_period, or lock_rate's window) has passed.",
)
@click.option("--json", "as_json", is_flag=True, help="One JSON document on stdout.")
@click.pass_context
def periods(ctx: click.Context, as_json: bool) -> None:
    if ctx.invoked_subcommand is not None:
        return
    target: shared.Target = ctx.obj
    longest = _longest(target)
    with target.database("read the lock_period table") as engine:
        found = period_rows.summary(engine, longest[0] if longest else None)
    document: dict[str, Any] = {
        "table": found is not None,
        "rows": found.rows if found else 0,
        "oldest_seconds": found.oldest_seconds if found else None,
        "newest_seconds": found.newest_seconds if found else None,
        "longest_period": longest[0] if longest else None,
        "longest_period_task": longest[1] if longest else None,
        "prunable": found.older if found and longest else None,
    }
    if as_json:
        click.echo(json.dumps(document, indent=2))
        return
    if found is None:
        click.echo(_NO_TABLE)
        return
    click.echo(
        f"{found.rows} row(s); oldest start {shared.duration(found.oldest_seconds)} "
        f"ago, newest {shared.duration(found.newest_seconds)} ago."
    )
    if longest is None:
        click.echo(
            "No task of this app has lock_rate or lock_period (pass --app): the rows a "
            "prune may delete are unknown."
        )
    else:
        click.echo(
            f"{found.older} row(s) past the longest period of the app's tasks "
            f"({longest[0]:g} s, {longest[1]}): `periods prune` deletes them."
        )


@periods.command(
    help="Delete the rows started longer ago than the longest period of the app's "
    "tasks (or --older-than SECONDS, never less than that period)."
)
@click.option(
    "--older-than",
    type=float,
    metavar="SECONDS",
    help="Delete rows older than this; at least the longest period of every app "
    "that shares the table (required without --app).",
)
@click.pass_obj
def prune(target: shared.Target, older_than: float | None) -> None:
    longest = _longest(target)
    if older_than is None:
        if longest is None:
            raise click.UsageError(
                "No task of the app has lock_rate or lock_period, so the period a row "
                "may outlive is unknown: pass --app (the app whose tasks use them), or "
                "--older-than SECONDS, at least the longest period of every app "
                "that shares this database."
            )
        older_than = longest[0]
    if not (math.isfinite(older_than) and older_than > 0):
        raise click.UsageError(
            f"--older-than: expected a positive number of seconds, got {older_than:g}."
        )
    if longest is not None and older_than < longest[0]:
        raise click.UsageError(
            f"--older-than {older_than:g} is shorter than the period of "
            f"{longest[1]} ({longest[0]:g} s): rows still within their period would "
            "be deleted, and those keys could start again early."
        )
    with target.database("prune the lock_period table") as engine:
        deleted = period_rows.prune(engine, older_than)
    if deleted is None:
        click.echo(_NO_TABLE)
        return
    click.echo(f"Deleted {deleted} period row(s) started over {older_than:g} s ago.")
