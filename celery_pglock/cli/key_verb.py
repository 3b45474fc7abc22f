"""``pglock key``, as its help says, in every form. Manual: docs/operations/cli.md."""

from __future__ import annotations

import json
from typing import Any

import click

from celery_pglock import keys
from celery_pglock.cli import shared


@click.command(help="The advisory key a call of TASK would lock (no database needed).")
@click.argument("task_name", metavar="TASK")
@shared.ARGS
@shared.KWARGS
@click.option("--json", "as_json", is_flag=True, help="One JSON document on stdout.")
@click.pass_obj
def key(
    target: shared.Target,
    task_name: str,
    args_json: str,
    kwargs_json: str,
    as_json: bool,
) -> None:
    task, lock_key, limit = shared.key_of_call(
        target, task_name, args_json, kwargs_json, verb="key"
    )
    namespace = task.lock_config.namespace
    classid, objid, objsubid = lock_key.pg_locks_ids
    forms: dict[str, Any] = {
        "task": task.name,
        "lock_name": lock_key.name,
        "namespace": namespace,
        "key": str(lock_key),
        "ids": list(lock_key.ids),
        "pg_locks": {"classid": classid, "objid": objid, "objsubid": objsubid},
        "key_text": lock_key.text,
        "find_sql": (
            "SELECT l.pid, l.granted, a.application_name FROM pg_locks l "
            "LEFT JOIN pg_stat_activity a ON a.pid = l.pid WHERE l.locktype = 'advisory' "
            f"AND l.classid = {classid} AND l.objid = {objid} AND l.objsubid = {objsubid};"
        ),
        "key_sql": None,
        # lock_limit: slot i's key (0: the key itself), docs/reference/keys.md (Slots).
        "slots": list(map(str, keys.slot_keys(lock_key, limit))),
    }
    if lock_key.text is not None:
        material = json.dumps(json.loads(lock_key.text)[3], ensure_ascii=False)
        literals = (
            "'" + text.replace("'", "''") + "'"
            for text in (namespace, lock_key.name, material)
        )
        forms["key_sql"] = f"SELECT celery_pglock_key({', '.join(literals)});"
    if as_json:
        click.echo(json.dumps(forms, indent=2))
        return
    lines = [
        f"task:       {task.name}",
        f"lock name:  {lock_key.name}",
        f"namespace:  {namespace}",
        f"key:        {lock_key}  {'(bigint)' if len(lock_key.ids) == 1 else '(int, int)'}",
        f"pg_locks:   classid={classid} objid={objid} objsubid={objsubid}",
    ]
    if lock_key.text is not None:
        lines.append(f"key text:   {lock_key.text}")
    if len(forms["slots"]) > 1:
        slots = "  ".join(f"{i}={slot}" for i, slot in enumerate(forms["slots"]))
        lines.append(f"slots:      {slots}  (lock_limit, bigint)")
    lines.append(f"find it:    {forms['find_sql']}")
    if forms["key_sql"]:
        lines.append(f"in SQL:     {forms['key_sql']}  -- after `pglock sql --apply`")
    click.echo("\n".join(lines))
