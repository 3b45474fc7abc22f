"""``pglock queued`` (and ``clear``), as their help says; docs/operations/cli.md."""

from __future__ import annotations

import json

import click

from celery_pglock.cli import shared
from celery_pglock.db import engines
from celery_pglock.task import queued as queued_rows


@click.group(
    invoke_without_command=True,
    help="Keys held for a queued or running lock_enqueue message (oldest first).",
)
@click.option("--json", "as_json", is_flag=True, help="One JSON document on stdout.")
@click.option("--task", "task_name", metavar="NAME", help="Only this task's keys.")
@click.pass_context
def queued(ctx: click.Context, as_json: bool, task_name: str | None) -> None:
    if ctx.invoked_subcommand is not None:
        return
    target: shared.Target = ctx.obj
    with target.database("read the queued keys") as engine:
        rows = queued_rows.summary(engine)
    rows = [r for r in rows or () if task_name in (None, r["task_name"])]
    if as_json:
        click.echo(json.dumps(rows, indent=2, default=str))
        return
    if not rows:
        click.echo("No keys are held for queued messages.")
        return
    header = ("KEY", "TASK", "TASK ID", "MODE", "STATE", "AGE", "STALE IN")
    table = [
        (
            row["key"],
            row["task_name"],
            row["task_id"],
            row["mode"],
            row["state"]
            + (f" ({row['application_name']})" if row["application_name"] else "")
            # Latest wins: the task id is the latest send, in the carrier's row.
            + (f", carried by {row['carrier']}" if row["carrier"] else "")
            # lock_debounce: when the latest send may start.
            + (
                f", due in {shared.duration(row['due_in_seconds'])}"
                if (row["due_in_seconds"] or 0) > 0
                else ""
            ),
            shared.duration(row["age_seconds"]),
            "-"
            if row["state"] in ("running", "stale")
            else shared.duration(row["stale_in_seconds"]),
        )
        for row in rows
    ]
    shared.echo_table([header, *table])


@queued.command(help="Free queued keys: by task id, by --key, --stale ones or --all.")
@click.argument("task_ids", nargs=-1)
@click.option(
    "--key", "key_text", metavar="KEY", help="The key as `pglock queued` shows it."
)
@click.option(
    "--stale", is_flag=True, help="Every key past its bound with no live run."
)
@click.option(
    "--all", "everything", is_flag=True, help="Every key (after `celery purge`)."
)
@click.pass_obj
def clear(
    target: shared.Target,
    task_ids: tuple[str, ...],
    key_text: str | None,
    stale: bool,
    everything: bool,
) -> None:
    if sum(map(bool, (task_ids, key_text, stale, everything))) != 1:
        raise click.UsageError(
            "Give task ids, or exactly one of --key, --stale, --all."
        )
    with target.database("clear queued keys") as engine:
        rows = queued_rows.summary(engine) or []
        if task_ids:
            chosen = [r for r in rows if {r["task_id"], r["carrier"]} & set(task_ids)]
        elif key_text:
            chosen = [r for r in rows if r["key"] == key_text.strip()]
        elif stale:
            chosen = [r for r in rows if r["state"] == "stale"]
        else:
            chosen = rows
        running = [r for r in chosen if r["state"] == "running"]
        ids = [i for r in chosen for i in (r["task_id"], r["carrier"]) if i]
        freed = 0
        if ids:  # none, or no table (lock_enqueue never ran here): nothing to free
            with engines.autocommit_cursor(engine) as cursor:
                cursor.execute(queued_rows.CLEAR_BY_TASK_ID, (ids, ids))
                freed = cursor.rowcount
    click.echo(f"Freed {freed} queued key(s).")
    for row in running:
        click.echo(
            f"Note: {row['task_id']} is still running; its run lock keeps its runs "
            "single, but its key now accepts a new message."
        )
