"""``pglock locks``: every advisory lock held or awaited, with human names.

Holders and waiters are grouped by key; celery-pglock sessions are named by the
``host:pid`` and task their ``application_name`` carries, and a key that does not
depend on arguments is named by its task.
"""

from __future__ import annotations

import datetime
import json
from typing import TYPE_CHECKING, Any

import click

from celery_pglock import exceptions
from celery_pglock.cli import admin_sql
from celery_pglock.db import driver_errors
from celery_pglock.lock import holder_lookup

if TYPE_CHECKING:
    from celery_pglock.cli.target import Target


@click.command(help="Every advisory lock held or awaited in the lock database.")
@click.option("--json", "as_json", is_flag=True, help="One JSON document on stdout.")
@click.pass_obj
def locks(target: Target, as_json: bool) -> None:
    engine = target.engine()
    try:
        with (
            driver_errors.wrap_db_errors("read pg_locks", engine),
            engine.connect() as connection,
        ):
            rows = connection.exec_driver_sql(admin_sql.LOCKS).mappings().all()
    except exceptions.DatabaseError as error:
        raise click.ClickException(str(error)) from None
    finally:
        engine.dispose()
    entries = describe_locks([dict(row) for row in rows], target)
    if as_json:
        click.echo(json.dumps(entries, indent=2, default=str))
        return
    if not entries:
        click.echo("No advisory locks are held or awaited in this database.")
        return
    header = ("KEY", "LOCK", "TASK", "HOLDER", "BACKEND", "SINCE", "HELD", "WAITING")
    table = [
        (
            entry["key"],
            entry["lock_name"]
            or ("-" if entry["celery_pglock"] else "(not celery-pglock)"),
            entry["task"] or "-",
            entry["holder"] or entry["application_name"] or "-",
            str(entry["backend_pid"] or "-"),
            entry["since"] or "-",
            _duration(entry["held_seconds"]),
            ", ".join(
                f"{w['holder'] or w['application_name'] or '?'} (backend {w['backend_pid']}, {_duration(w['waiting_seconds'])})"
                for w in entry["waiters"]
            )
            or "-",
        )
        for entry in entries
    ]
    widths = [
        max(len(str(row[i])) for row in [header, *table]) for i in range(len(header))
    ]
    for row in [header, *table]:
        click.echo(
            "  ".join(
                str(cell).ljust(width) for cell, width in zip(row, widths, strict=True)
            ).rstrip()
        )


def describe_locks(rows: list[dict[str, Any]], target: Target) -> list[dict[str, Any]]:
    """Group pg_locks rows by key: the holder with human names, and who waits."""
    prefix = target.lock_prefix() + " "
    fixed = {
        str(task.lock_config.fixed_key): (task.name, task.lock_config.name)
        for task in target.singleton_tasks()
        if task.lock_config.fixed_key is not None
    }
    names: list[str] = [str(task.name) for task in target.singleton_tasks()]

    def full_name(task: str | None) -> str | None:
        # application_name keeps only the tail of a long task name ("~app.tasks.x").
        if task and task.startswith("~"):
            matches = [name for name in names if name.endswith(task[1:])]
            if len(matches) == 1:
                return matches[0]
        return task

    by_key: dict[str, dict[str, Any]] = {}
    for row in rows:
        application_name = row.get("application_name") or None
        ours = bool(application_name and application_name.startswith(prefix))
        process, task = (
            holder_lookup.parse_application_name(application_name)
            if ours
            else (None, None)
        )
        seconds = (
            (row["now"] - row["since"]).total_seconds()
            if row.get("since") is not None
            else None
        )
        session = {
            "backend_pid": row["backend_pid"],
            "holder": process,
            "task": full_name(task),
            "application_name": application_name,
            "client_addr": row.get("client_addr"),
            "celery_pglock": ours,
            "since": _iso(row.get("since")),
        }
        entry = by_key.setdefault(
            row["key"],
            {
                "key": row["key"],
                "lock_name": None,
                "waiters": [],
                "held_seconds": None,
                "backend_pid": None,
                "holder": None,
                "task": None,
                "application_name": None,
                "client_addr": None,
                "celery_pglock": False,
                "since": None,
            },
        )
        if row["granted"]:
            entry.update(session, held_seconds=seconds)
            known = fixed.get(row["key"])
            # Only keys that do not depend on arguments can be named from the key alone.
            if known is not None:  # the full task name (application_name may cut it)
                entry["task"] = known[0]
                entry["lock_name"] = known[1]
        else:
            entry["waiters"].append({**session, "waiting_seconds": seconds})
    return list(by_key.values())


def _iso(value: Any) -> str | None:
    if isinstance(value, datetime.datetime):
        return value.isoformat(timespec="seconds")
    return None if value is None else str(value)


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 60:
        return f"{seconds:.1f}s"
    if seconds < 3600:
        return f"{int(seconds // 60)}m{int(seconds % 60):02d}s"
    return f"{int(seconds // 3600)}h{int(seconds % 3600 // 60):02d}m"
