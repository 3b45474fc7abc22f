"""``pglock locks``: every advisory lock held or awaited, holders and waiters named.
Manual (the columns): docs/operations/cli.md."""

from __future__ import annotations

import datetime
import json
from typing import TYPE_CHECKING, Any

import click

from celery_pglock import keys
from celery_pglock.cli import queued_verb
from celery_pglock.db import engines
from celery_pglock.lock import holder_lookup

if TYPE_CHECKING:
    from collections.abc import Mapping

    import sqlalchemy as sa

    from celery_pglock.cli import Target

#: The key as LockKey.__str__ writes it; "since" as cli.md defines it, unless the holder's
#: application_name shows it (read()); no run locks.
LOCKS = f"""
SELECT CASE WHEN l.objsubid = 1 THEN ((l.classid::bigint << 32) | l.objid::bigint)::text
       ELSE l.classid::bigint::bit(32)::int || ',' || l.objid::bigint::bit(32)::int
       END AS key,
  l.pid AS backend_pid, l.granted, l.mode, a.application_name,
  host(a.client_addr) AS client_addr, a.state,
  CASE WHEN l.granted THEN COALESCE(a.xact_start, a.state_change, a.backend_start)
       ELSE l.waitstart END AS since,
  now() AS now
FROM pg_locks l LEFT JOIN pg_stat_activity a ON a.pid = l.pid
WHERE l.locktype = 'advisory' AND l.pid <> pg_backend_pid()
  AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
  AND NOT (l.objsubid = 2 AND l.classid = {keys.RUN_NAMESPACE})
ORDER BY key, l.granted DESC, since
"""


@click.command(help="Every advisory lock held or awaited in the lock database.")
@click.option("--json", "as_json", is_flag=True, help="One JSON document on stdout.")
@click.pass_obj
def locks(target: Target, as_json: bool) -> None:
    with target.database("read pg_locks") as engine:
        entries = read(target, engine)
        queued = queued_verb.read(engine)
    if as_json:
        click.echo(json.dumps(entries, indent=2, default=str))
        return
    footer = f"{len(queued)} queued key(s): see `pglock queued`." if queued else ""
    if not entries:
        click.echo("No advisory locks are held or awaited in this database.")
        if footer:
            click.echo(footer)
        return
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
            holder_name(entry, "-"),
            str(entry["backend_pid"] or "-"),
            entry["since"] or "-",
            queued_verb.duration(entry["held_seconds"]),
            ", ".join(
                f"{holder_name(w)} (backend {w['backend_pid']}, {queued_verb.duration(w['waiting_seconds'])})"
                for w in entry["waiters"]
            )
            or "-",
        ]
        for entry in entries
    ]
    if not any(entry["slot"] for entry in entries):  # only lock_limit tasks have slots
        for row in [header, *table]:
            del row[2]
    widths = [max(map(len, column)) for column in zip(header, *table, strict=True)]
    for row in [header, *table]:
        click.echo("  ".join(map(str.ljust, row, widths)).rstrip())
    if footer:
        click.echo(footer)


def read(target: Target, engine: sa.Engine) -> list[dict[str, Any]]:
    """By key: the holder with human names, and who waits."""
    with engine.connect() as connection:
        rows = connection.exec_driver_sql(LOCKS).mappings().all()
    prefix = (
        target.conf().get("pglock_application_name") or engines.DEFAULT_APPLICATION_NAME
    ) + " "
    singletons = target.singleton_tasks
    #: key -> task, lock, slot "i/N", the key slot i belongs to (slot 0's)
    fixed: dict[str, tuple[str, str, str | None, str | None]] = {}
    for task in singletons:
        options = task.lock_config
        if options.fixed_key is not None:
            slots = keys.slot_keys(options.fixed_key, options.limit)
            for slot, key in enumerate(slots):
                of = f"{slot}/{options.limit}" if options.limit > 1 else None
                base = str(slots[0]) if slot else None
                fixed[str(key)] = (task.name, options.name, of, base)

    def full_name(task: str | None) -> str | None:
        # application_name keeps only the tail of a long name ("~app.tasks.x").
        if task and task.startswith("~"):
            matches = [t.name for t in singletons if t.name.endswith(task[1:])]
            if len(matches) == 1:
                return str(matches[0])
        return task

    by_key: dict[str, dict[str, Any]] = {}
    for row in rows:
        name = row["application_name"] or None
        ours = bool(name and name.startswith(prefix))
        process, task = (
            holder_lookup.parse_application_name(name) if ours else (None, None)
        )
        since = row["since"]
        if row["granted"] and ours and (second := holder_lookup.held_since(name)):
            since = datetime.datetime.fromtimestamp(second, tz=row["now"].tzinfo)
        seconds = None if since is None else (row["now"] - since).total_seconds()
        session = {
            "backend_pid": row["backend_pid"],
            "holder": process,
            "task": full_name(task),
            "application_name": name,
            "client_addr": row["client_addr"],
            "celery_pglock": ours,
            "since": None if since is None else since.isoformat(timespec="seconds"),
        }
        entry = by_key.setdefault(
            row["key"],
            {
                "key": row["key"],
                "lock_name": None,
                "slot": None,
                "slot_of": None,
                "waiters": [],
                "held_seconds": None,
                **dict.fromkeys(session),
                "celery_pglock": False,
            },
        )
        if not row["granted"]:
            entry["waiters"].append({**session, "waiting_seconds": seconds})
            continue
        entry.update(session, held_seconds=seconds)
        if row["key"] in fixed:  # a key independent of arguments names its task
            entry["task"], entry["lock_name"], entry["slot"], entry["slot_of"] = fixed[
                row["key"]
            ]
    _name_argument_slots(by_key, singletons)
    return list(by_key.values())


def _name_argument_slots(by_key: dict[str, dict[str, Any]], singletons: Any) -> None:
    """The slots of per-argument lock_limit keys: slot i > 0 is derived from slot 0's key
    (keys.slot_keys) and cannot be turned back, so it is named when slot 0 is held too;
    else "?/N", from the task its holder shows."""
    limited = {
        task.name: task.lock_config
        for task in singletons
        if task.lock_config.limit > 1 and task.lock_config.fixed_key is None
    }
    for entry in list(by_key.values()):
        options = limited.get(entry["task"] or "")
        if options is None or entry["slot"] or "," in entry["key"]:
            continue
        base = keys.LockKey(name=options.name, ids=(int(entry["key"]),))
        for slot, key in enumerate(keys.slot_keys(base, options.limit)[1:], start=1):
            held = by_key.get(str(key))
            if held is not None and held["backend_pid"] is not None:
                held["slot"] = f"{slot}/{options.limit}"
                held["slot_of"], held["lock_name"] = entry["key"], options.name
                held["task"] = entry["task"]
                entry["slot"], entry["lock_name"] = f"0/{options.limit}", options.name
    for entry in by_key.values():
        options = limited.get(entry["task"] or "")
        if options is not None and not entry["slot"]:
            entry["slot"] = f"?/{options.limit}"


def holder_name(session: Mapping[str, Any], unknown: str = "?") -> str:
    return str(session["holder"] or session["application_name"] or unknown)
