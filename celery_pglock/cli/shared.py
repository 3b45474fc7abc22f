"""What the verbs share, so that none imports another (its parts: docs/design.md)."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import functools
import json
from typing import TYPE_CHECKING, Any

import click
from sqlalchemy.pool import NullPool

from celery_pglock import config, exceptions, keys
from celery_pglock.db import driver_errors, engines
from celery_pglock.lock import holder_lookup
from celery_pglock.task import bindings, groups, worker_hooks

if TYPE_CHECKING:
    from collections.abc import Iterator, Mapping, Sequence

    import sqlalchemy as sa


@dataclasses.dataclass
class Target:
    app: Any
    url: str | None

    def require_url(self) -> str:
        if self.url:
            return self.url
        raise click.UsageError(
            "No lock database: pass --database-url, set app.conf.pglock_database_url "
            f"in the app, or set {config.DATABASE_URL_ENV}."
        )

    def conf(self) -> dict[str, Any]:
        items = self.app.conf.items() if self.app is not None else ()
        return {k: v for k, v in items if k.startswith("pglock_")}

    @contextlib.contextmanager
    def database(self, action: str) -> Iterator[sa.Engine]:
        """A database error ends the verb (exit status 1)."""
        engine = self.engine()
        try:
            with driver_errors.wrap_db_errors(action, engine):
                yield engine
        except exceptions.DatabaseError as error:
            raise click.ClickException(str(error)) from None
        finally:
            engine.dispose()

    def engine(self) -> sa.Engine:
        """Without a pool: each connect is a new session."""
        conf = self.conf()
        options = dict(conf.get("pglock_engine_options") or {})
        connect_args = dict(options.pop("connect_args", {}))
        connect_args.update(application_name="celery-pglock cli", connect_timeout=5)
        options.update(poolclass=NullPool, connect_args=connect_args)
        conf["pglock_engine_options"] = options
        try:
            return engines.create_engine(self.require_url(), conf)
        except exceptions.ConfigurationError as error:  # a bad URL: masked, exit 2
            raise click.UsageError(str(error)) from None

    @functools.cached_property
    def singleton_tasks(self) -> list[Any]:
        """After importing the task modules as a worker would."""
        if self.app is None:
            return []
        try:
            self.app.loader.import_default_modules()
        except Exception as exc:
            raise click.UsageError(
                f"Cannot import the task modules of the app {self.app.main!r} "
                f"(its include/imports settings and autodiscover_tasks): "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        return worker_hooks.singleton_tasks(self.app)


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


def key_of_call(
    target: Target, task_name: str, args_json: str, kwargs_json: str, *, verb: str
) -> tuple[Any, keys.LockKey, int]:
    """The task, the key a call of it locks and that key's limit (lock_limit_for)."""
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
        lock_key = task.lock_key_for(*args, **kwargs)  # first: its error names the args
        return task, lock_key, bindings.limit_of(task, task.lock_config, args, kwargs)
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


#: Keys as LockKey.__str__ writes them, no run locks; SINCE: docs/operations/cli.md (or the
#: holder's application_name, read_locks()). Also the view `pglock sql` installs.
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


def read_locks(target: Target, engine: sa.Engine) -> list[dict[str, Any]]:
    """By key: the holder with human names, and who waits."""
    with engine.connect() as connection:
        rows = connection.exec_driver_sql(LOCKS).mappings().all()
    prefix = (
        target.conf().get("pglock_application_name") or engines.DEFAULT_APPLICATION_NAME
    ) + " "
    singletons = target.singleton_tasks
    #: key -> task (None: a group's, shared), lock, slot "i/N", slot 0's key
    fixed: dict[str, tuple[str | None, str, str | None, str | None]] = {}
    for task in singletons:
        options = task.lock_config
        if options.group is not None:
            group = groups.group_key(options.namespace, options.group)
            limit = options.group_limit
            for slot, key in enumerate(keys.slot_keys(group, limit)):
                first = str(group) if slot else None
                fixed[str(key)] = (
                    None,
                    f"group {options.group}",
                    f"{slot}/{limit}",
                    first,
                )
        if options.fixed_key is not None:
            per_key = bindings.per_key_limit(task)
            count, shown = (keys.SLOT_MAX, "*") if per_key else (options.limit, None)
            slots = keys.slot_keys(options.fixed_key, count)
            for slot, key in enumerate(slots):
                of = f"{slot}/{shown or count}" if count > 1 else None
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
            task, entry["lock_name"], entry["slot"], entry["slot_of"] = fixed[
                row["key"]
            ]
            entry["task"] = task or entry["task"]
    _name_argument_slots(by_key, singletons)
    return list(by_key.values())


def _name_argument_slots(by_key: dict[str, dict[str, Any]], singletons: Any) -> None:
    """Per-argument lock_limit slots: slot i > 0 cannot be turned back into slot 0's key,
    so it is named only when slot 0 is held too; else "?/N" (docs/operations/cli.md)."""
    # Task name -> (options, slots to look for, N as shown: "*" is lock_limit_for's own).
    limited = {
        task.name: (options, keys.SLOT_MAX, "*")
        if bindings.per_key_limit(task)
        else (options, options.limit, str(options.limit))
        for task in singletons
        if ((options := task.lock_config).limit > 1 or bindings.per_key_limit(task))
        and options.fixed_key is None
    }
    for entry in list(by_key.values()):
        found = limited.get(entry["task"] or "")
        if found is None or entry["slot"] or "," in entry["key"]:
            continue
        options, count, of = found
        base = keys.LockKey(name=options.name, ids=(int(entry["key"]),))
        for slot, key in enumerate(keys.slot_keys(base, count)[1:], start=1):
            held = by_key.get(str(key))
            if held is not None and held["backend_pid"] is not None:
                held["slot"] = f"{slot}/{of}"
                held["slot_of"], held["lock_name"] = entry["key"], options.name
                held["task"] = entry["task"]
                entry["slot"], entry["lock_name"] = f"0/{of}", options.name
    for entry in by_key.values():
        found = limited.get(entry["task"] or "")
        if found is not None and not entry["slot"]:
            entry["slot"] = f"?/{found[2]}"


def holder_name(session: Mapping[str, Any], unknown: str = "?") -> str:
    return str(session["holder"] or session["application_name"] or unknown)


def duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 60:
        return f"{seconds:.1f}s"
    if seconds < 3600:
        return f"{int(seconds // 60)}m{int(seconds % 60):02d}s"
    return f"{int(seconds // 3600)}h{int(seconds % 3600 // 60):02d}m"


def echo_table(rows: Sequence[Sequence[str]]) -> None:
    """The header and rows, each column as wide as its widest cell."""
    widths = [max(map(len, column)) for column in zip(*rows, strict=True)]
    for row in rows:
        click.echo("  ".join(map(str.ljust, row, widths)).rstrip())
