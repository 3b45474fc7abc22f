"""``pglock queued``: the keys lock_enqueue holds for a queued or running message, and
``pglock queued clear``. Manual: docs/operations/cli.md."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import click

from celery_pglock import keys
from celery_pglock.db import engines
from celery_pglock.lock import queued as queued_rows

if TYPE_CHECKING:
    import sqlalchemy as sa

    from celery_pglock.cli import Target

# The key as LockKey.__str__ writes it; "running": its run lock is held by a session.
_ROWS = f"""
SELECT CASE WHEN q.objsubid = 1 THEN ((q.classid::bigint << 32) | q.objid::bigint)::text
       ELSE q.classid::bigint::bit(32)::int || ',' || q.objid::bigint::bit(32)::int
       END AS key,
  q.task_name, q.task_id,
  CASE q.mode WHEN 'f' THEN 'until_finished' ELSE 'until_started' END AS mode,
  r.pid AS run_pid, a.application_name,
  q.started_at IS NOT NULL AS started, q.stale_at < now() AS past_stale_at,
  extract(epoch FROM now() - q.published_at)::float8 AS age_seconds,
  extract(epoch FROM q.stale_at - now())::float8 AS stale_in_seconds
FROM celery_pglock_queued q
LEFT JOIN pg_locks r ON r.locktype = 'advisory' AND r.granted
  AND r.database = (SELECT oid FROM pg_database WHERE datname = current_database())
  AND r.classid = {keys.RUN_NAMESPACE} AND r.objid = q.run_objid::bit(32)::bigint::oid
  AND r.objsubid = 2
LEFT JOIN pg_stat_activity a ON a.pid = r.pid
ORDER BY q.published_at
"""


def read(engine: sa.Engine) -> list[dict[str, Any]] | None:
    """The queued keys, oldest first; None when lock_enqueue never ran here (no table)."""
    with engines.autocommit(engine) as dbapi, dbapi.cursor() as cursor:
        if not queued_rows.TABLE.present(cursor):
            return None
        cursor.execute(_ROWS)
        names = [column[0] for column in cursor.description]
        rows = [dict(zip(names, row, strict=True)) for row in cursor.fetchall()]
    for row in rows:
        if row["run_pid"] is not None:
            row["state"] = "running"
        elif row["past_stale_at"]:
            row["state"] = "stale"  # the next send of its key takes it over
        else:
            row["state"] = "started" if row["started"] else "queued"
    return rows


def duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 60:
        return f"{seconds:.1f}s"
    if seconds < 3600:
        return f"{int(seconds // 60)}m{int(seconds % 60):02d}s"
    return f"{int(seconds // 3600)}h{int(seconds % 3600 // 60):02d}m"


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
    target: Target = ctx.obj
    with target.database("read the queued keys") as engine:
        rows = read(engine)
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
            + (f" ({row['application_name']})" if row["application_name"] else ""),
            duration(row["age_seconds"]),
            "-"
            if row["state"] in ("running", "stale")
            else duration(row["stale_in_seconds"]),
        )
        for row in rows
    ]
    widths = [max(map(len, column)) for column in zip(header, *table, strict=True)]
    for line in [header, *table]:
        click.echo("  ".join(map(str.ljust, line, widths)).rstrip())


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
    target: Target,
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
        rows = read(engine) or []
        if task_ids:
            chosen = [r for r in rows if r["task_id"] in task_ids]
        elif key_text:
            chosen = [r for r in rows if r["key"] == key_text.strip()]
        elif stale:
            chosen = [r for r in rows if r["state"] == "stale"]
        else:
            chosen = rows
        running = [r for r in chosen if r["state"] == "running"]
        with engines.autocommit(engine) as dbapi, dbapi.cursor() as cursor:
            cursor.execute(
                "DELETE FROM celery_pglock_queued WHERE task_id = ANY(%s)",
                ([r["task_id"] for r in chosen],),
            )
            freed = cursor.rowcount
    click.echo(f"Freed {freed} queued key(s).")
    for row in running:
        click.echo(
            f"Note: {row['task_id']} is still running; its run lock keeps its runs "
            "single, but its key now accepts a new message."
        )
