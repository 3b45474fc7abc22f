"""The ``pglock`` command for incidents: who holds what, a call's key, a health check, SQL.

Two entry points share these verbs:

- ``celery -A proj pglock <verb>``: a Celery sub-command (``celery.commands`` entry
  point), using the project's app for its settings and task names;
- ``celery-pglock [--app proj] [--database-url URL] <verb>`` (or ``python -m
  celery_pglock``): the same, for a DBA without the project's code; the URL falls back to
  ``CELERY_PGLOCK_DATABASE_URL``.

Every database URL it prints is masked. Exit status: 0 fine, 1 a check failed, 2 a usage
or connection error.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
from typing import TYPE_CHECKING, Any

import click

from celery_pglock import (
    _checks,
    _driver_errors,
    _holder,
    _sql_admin,
    config,
    db,
    exceptions,
)

if TYPE_CHECKING:
    import sqlalchemy as sa

CLI_APPLICATION_NAME = "celery-pglock cli"


@dataclasses.dataclass
class Target:
    """What a verb works on: the app (if any) and the lock database URL."""

    app: Any
    url: str | None

    def conf(self) -> dict[str, Any]:
        if self.app is None:
            return {}
        return {k: v for k, v in self.app.conf.items() if k.startswith("pglock_")}

    def require_url(self) -> str:
        if self.url:
            return self.url
        raise click.UsageError(
            "No lock database: pass --database-url, set app.conf.pglock_database_url "
            f"in the app, or set {config.DATABASE_URL_ENV}."
        )

    def engine(self, *, timeout: int = 5) -> sa.Engine:
        """A lock engine without a pool (each connect is a new session), labelled as us."""
        from sqlalchemy.pool import NullPool

        conf = self.conf()
        options = dict(conf.get("pglock_engine_options") or {})
        connect_args = dict(options.pop("connect_args", {}))
        connect_args.update(
            application_name=CLI_APPLICATION_NAME, connect_timeout=timeout
        )
        options.update(poolclass=NullPool, connect_args=connect_args)
        conf["pglock_engine_options"] = options
        return db.create_engine(self.require_url(), conf)

    def lock_prefix(self) -> str:
        return str(
            self.conf().get("pglock_application_name") or db.DEFAULT_APPLICATION_NAME
        )

    def singleton_tasks(self) -> list[Any]:
        if self.app is None:
            return []
        from celery_pglock.task import SingletonTask

        return [t for t in self.app.tasks.values() if isinstance(t, SingletonTask)]


def _resolve_url(app: Any, given: str | None) -> str | None:
    if given:
        return given
    if app is not None and app.conf.get(config.DATABASE_URL_SETTING):
        return str(app.conf[config.DATABASE_URL_SETTING])
    return os.environ.get(config.DATABASE_URL_ENV) or None


def _build(*, standalone: bool) -> click.Group:
    @click.group(
        name="celery-pglock" if standalone else "pglock",
        help="Inspect celery-pglock advisory locks: locks, key, check, sql.",
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
    for command in (locks, key, check, sql):
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


# -- locks ------------------------------------------------------------------------------


@click.command(help="Every advisory lock held or awaited in the lock database.")
@click.option("--json", "as_json", is_flag=True, help="One JSON document on stdout.")
@click.pass_obj
def locks(target: Target, as_json: bool) -> None:
    engine = target.engine()
    try:
        with (
            _driver_errors.wrap_db_errors("read pg_locks", engine),
            engine.connect() as connection,
        ):
            rows = connection.exec_driver_sql(_sql_admin.LOCKS).mappings().all()
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
            _holder.parse_application_name(application_name) if ours else (None, None)
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


# -- key --------------------------------------------------------------------------------


@click.command(help="The advisory key a call of TASK would lock (no database needed).")
@click.argument("task_name", metavar="TASK")
@click.option(
    "--args",
    "args_json",
    default="[]",
    metavar="JSON",
    help="Positional arguments, e.g. '[7]'.",
)
@click.option(
    "--kwargs",
    "kwargs_json",
    default="{}",
    metavar="JSON",
    help="Keyword arguments, e.g. '{\"tenant_id\": 7}'.",
)
@click.option("--json", "as_json", is_flag=True, help="One JSON document on stdout.")
@click.pass_obj
def key(
    target: Target, task_name: str, args_json: str, kwargs_json: str, as_json: bool
) -> None:
    if target.app is None:
        raise click.UsageError(
            "`key` needs the app: celery -A proj pglock key ..., or --app."
        )
    task = target.app.tasks.get(task_name)
    if task is None or task not in target.singleton_tasks():
        known = ", ".join(sorted(t.name for t in target.singleton_tasks())) or "none"
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
        lock_key = task.lock_key_for(*args, **kwargs)
    except exceptions.PgLockError as error:
        raise click.ClickException(str(error)) from None
    click.echo(
        json.dumps(key_forms(task, lock_key), indent=2)
        if as_json
        else _key_text(key_forms(task, lock_key))
    )


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
    findings = _checks.run_checks(target, processes=processes, scope=scope)
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
        _sql_admin.uninstall_sql(schema)
        if uninstall
        else _sql_admin.install_sql(schema)
    )
    if not apply_:
        click.echo(text)
        return
    engine = target.engine()
    try:
        with (
            _driver_errors.wrap_db_errors("install the SQL functions", engine),
            engine.begin() as connection,
        ):
            connection.exec_driver_sql(text)
    except exceptions.DatabaseError as error:
        raise click.ClickException(str(error)) from None
    finally:
        engine.dispose()
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
        with _driver_errors.wrap_db_errors(action, engine):
            # Autocommit: the SQL carries its own BEGIN/COMMIT.
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
