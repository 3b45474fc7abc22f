"""``pglock locks``, as its help says. The columns: docs/operations/cli.md."""

from __future__ import annotations

import json

import click

from celery_pglock.cli import shared
from celery_pglock.task import queued as queued_rows


@click.command(help="Every advisory lock held or awaited in the lock database.")
@click.option("--json", "as_json", is_flag=True, help="One JSON document on stdout.")
@click.pass_obj
def locks(target: shared.Target, as_json: bool) -> None:
    with target.database("read pg_locks") as engine:
        entries = shared.read_locks(target, engine)
        queued = queued_rows.summary(engine)
    if as_json:
        click.echo(json.dumps(entries, indent=2, default=str))
        return
    if not entries:
        click.echo("No advisory locks are held or awaited in this database.")
    else:
        header = ["KEY", "LOCK", "SLOT", "TASK", "HOLDER", "BACKEND", "SINCE", "HELD"]
        header.append("WAITING")
        table = [
            [
                entry["key"],
                entry["lock_name"]
                or ("-" if entry["celery_pglock"] else "(not celery-pglock)"),
                (entry["slot"] or "-")
                + (f" of {entry['slot_of']}" if entry["slot_of"] else ""),
                entry["task"] or "-",
                shared.holder_name(entry, "-"),
                str(entry["backend_pid"] or "-"),
                entry["since"] or "-",
                shared.duration(entry["held_seconds"]),
                ", ".join(
                    f"{shared.holder_name(w)} (backend {w['backend_pid']}, {shared.duration(w['waiting_seconds'])})"
                    for w in entry["waiters"]
                )
                or "-",
            ]
            for entry in entries
        ]
        if not any(entry["slot"] for entry in entries):  # only lock_limit tasks
            for row in [header, *table]:
                del row[2]
        shared.echo_table([header, *table])
    if queued:
        click.echo(f"{len(queued)} queued key(s): see `pglock queued`.")
