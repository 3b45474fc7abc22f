"""``pglock key``: a call's advisory key in every form, as the worker computes it; and how
a verb names a lock (a call, or ``--key``). Manual: docs/operations/cli.md."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import click

from celery_pglock import exceptions, keys

if TYPE_CHECKING:
    from celery_pglock.cli import Target

#: A call of a task, as JSON (``key`` and ``release``).
ARGS = click.option(
    "--args",
    "args_json",
    default="[]",
    metavar="JSON",
    help="Positional arguments, e.g. '[7]'.",
)
KWARGS = click.option(
    "--kwargs",
    "kwargs_json",
    default="{}",
    metavar="JSON",
    help="Keyword arguments, e.g. '{\"tenant_id\": 7}'.",
)


@click.command(help="The advisory key a call of TASK would lock (no database needed).")
@click.argument("task_name", metavar="TASK")
@ARGS
@KWARGS
@click.option("--json", "as_json", is_flag=True, help="One JSON document on stdout.")
@click.pass_obj
def key(
    target: Target, task_name: str, args_json: str, kwargs_json: str, as_json: bool
) -> None:
    task, lock_key = key_of_call(target, task_name, args_json, kwargs_json, verb="key")
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
        "slots": [
            str(slot) for slot in keys.slot_keys(lock_key, task.lock_config.limit)
        ],
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


def key_of_call(
    target: Target, task_name: str, args_json: str, kwargs_json: str, *, verb: str
) -> tuple[Any, keys.LockKey]:
    if target.app is None:
        raise click.UsageError(
            f"`{verb}` TASK needs the app: celery -A proj pglock {verb} ..., or --app."
        )
    singletons = target.singleton_tasks
    task = next((t for t in singletons if t.name == task_name), None)
    if task is None:
        known = ", ".join(sorted(t.name for t in singletons)) or "none"
        raise click.UsageError(
            f"{task_name!r} is not a SingletonTask of this app (SingletonTasks: {known})."
        )
    try:
        args = json.loads(args_json)
        kwargs = json.loads(kwargs_json)
    except json.JSONDecodeError as exc:
        raise click.UsageError(f"--args/--kwargs must be JSON: {exc}") from None
    if not isinstance(args, list) or not isinstance(kwargs, dict):
        raise click.UsageError(
            "--args must be a JSON array and --kwargs a JSON object."
        )
    try:
        return task, task.lock_key_for(*args, **kwargs)
    except exceptions.PgLockError as error:
        raise click.ClickException(str(error)) from None


def parse_key(text: str) -> keys.LockKey:
    try:
        parts = tuple(int(part) for part in text.split(","))
        return keys.explicit_key(
            "--key", parts[0] if len(parts) == 1 else parts, where="--key"
        )
    except exceptions.ConfigurationError as error:  # a ValueError too: first
        raise click.UsageError(str(error)) from None
    except ValueError:
        raise click.UsageError(
            f"--key {text!r} is not a key: a bigint, or two ints 'namespace,resource'."
        ) from None
