"""``pglock key``: the advisory key a call of a task would lock, in every form.

No database needed: the key is computed as the worker computes it
(``SingletonTask.lock_key_for``), with the SQL that finds it in ``pg_locks``.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any, TypeVar

import click

from celery_pglock import exceptions

if TYPE_CHECKING:
    from celery_pglock.cli.target import Target


F = TypeVar("F", bound=Any)

#: --args and --kwargs: a call of a task, as JSON (``key`` and ``release``).
call_options = [
    click.option(
        "--args",
        "args_json",
        default="[]",
        metavar="JSON",
        help="Positional arguments, e.g. '[7]'.",
    ),
    click.option(
        "--kwargs",
        "kwargs_json",
        default="{}",
        metavar="JSON",
        help="Keyword arguments, e.g. '{\"tenant_id\": 7}'.",
    ),
]


def with_call_options(command: F) -> F:
    """Add --args and --kwargs to a click command."""
    for option in reversed(call_options):
        command = option(command)
    return command


@click.command(help="The advisory key a call of TASK would lock (no database needed).")
@click.argument("task_name", metavar="TASK")
@with_call_options
@click.option("--json", "as_json", is_flag=True, help="One JSON document on stdout.")
@click.pass_obj
def key(
    target: Target, task_name: str, args_json: str, kwargs_json: str, as_json: bool
) -> None:
    task, lock_key = key_of_call(target, task_name, args_json, kwargs_json, verb="key")
    click.echo(
        json.dumps(key_forms(task, lock_key), indent=2)
        if as_json
        else _key_text(key_forms(task, lock_key))
    )


def key_of_call(
    target: Target, task_name: str, args_json: str, kwargs_json: str, *, verb: str
) -> tuple[Any, Any]:
    """The SingletonTask ``task_name`` of the app and the key of a call with these JSON
    arguments, as the worker computes it (``SingletonTask.lock_key_for``)."""
    if target.app is None:
        raise click.UsageError(
            f"`{verb}` TASK needs the app: celery -A proj pglock {verb} ..., or --app."
        )
    singletons = target.singleton_tasks()  # imports the task modules first
    task = target.tasks().get(task_name)
    if task is None or task not in singletons:
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


def key_forms(task: Any, lock_key: Any) -> dict[str, Any]:
    """Every form of ``lock_key``: as the worker computes it (SingletonTask.lock_key_for)."""
    classid, objid, objsubid = lock_key.pg_locks_ids
    forms: dict[str, Any] = {
        "task": task.name,
        "lock_name": lock_key.name,
        "namespace": task.lock_config.namespace,
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
    }
    if lock_key.text is not None:
        material = json.loads(lock_key.text)[3]
        forms["key_sql"] = (
            f"SELECT celery_pglock_key({_literal(task.lock_config.namespace)}, "
            f"{_literal(lock_key.name)}, {_literal(json.dumps(material, ensure_ascii=False))});"
        )
    return forms


def _literal(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def _key_text(forms: dict[str, Any]) -> str:
    lines = [
        f"task:       {forms['task']}",
        f"lock name:  {forms['lock_name']}",
        f"namespace:  {forms['namespace']}",
        f"key:        {forms['key']}"
        + ("  (bigint)" if len(forms["ids"]) == 1 else "  (int, int)"),
        "pg_locks:   classid={classid} objid={objid} objsubid={objsubid}".format(
            **forms["pg_locks"]
        ),
    ]
    if forms["key_text"] is not None:
        lines.append(f"key text:   {forms['key_text']}")
    lines.append(f"find it:    {forms['find_sql']}")
    if forms["key_sql"]:
        lines.append(f"in SQL:     {forms['key_sql']}  -- after `pglock sql --apply`")
    return "\n".join(lines)
