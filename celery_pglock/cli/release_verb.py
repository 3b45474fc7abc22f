"""``pglock release``: end the session holding a stuck lock, so PostgreSQL frees it.

An advisory lock belongs to a database session; nothing but that session can release
it. So ``release`` shows the holder, asks, and ends the holder's session with
``pg_terminate_backend()``, only if that very session still holds the key (one
statement). The holder's lock watcher then finds its lock lost and reports
``lock_lost`` (and ends the body under ``lock_on_lost="terminate"``); the run ends
FAILURE with ``LockLostError``. Ending the session also frees every other lock it held:
a process's lock session may hold several (threads, gevent), and the command says so.

Who ran it, against what and when is printed and logged (``action="lock_released_by_operator"``,
logger ``celery_pglock.cli.release_verb``); PostgreSQL's own log shows the termination too.
"""

from __future__ import annotations

import datetime
import getpass
import logging
import socket
from typing import TYPE_CHECKING, Any

import click

from celery_pglock import exceptions, keys
from celery_pglock.cli import admin_sql, key_verb, locks_verb
from celery_pglock.db import driver_errors

if TYPE_CHECKING:
    from celery_pglock.cli.target import Target

logger = logging.getLogger(__name__)

#: Ends the session ``pid`` if it still holds the key (classid, objid, objsubid) here.
TERMINATE = """
SELECT pg_terminate_backend(l.pid)
FROM pg_locks l
WHERE l.locktype = 'advisory' AND l.granted AND l.pid = %s
  AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
  AND l.classid = %s AND l.objid = %s AND l.objsubid = %s
"""


@click.command(
    help="End the session that holds a lock (TASK with --args/--kwargs, or --key), "
    "after showing it and asking; PostgreSQL then frees the lock and the holder "
    "reports it lost."
)
@click.argument("task_name", metavar="[TASK]", required=False)
@key_verb.with_call_options
@click.option(
    "--key",
    "key_text",
    metavar="KEY",
    help="The key as `pglock locks` shows it: a bigint, or 'int,int'.",
)
@click.option("--yes", is_flag=True, help="Do not ask (scripts).")
@click.pass_obj
def release(
    target: Target,
    task_name: str | None,
    args_json: str,
    kwargs_json: str,
    key_text: str | None,
    yes: bool,
) -> None:
    if (task_name is None) == (key_text is None):
        raise click.UsageError("Name the lock: a TASK (with --args/--kwargs) or --key.")
    if task_name is not None:
        _, lock_key = key_verb.key_of_call(
            target, task_name, args_json, kwargs_json, verb="release"
        )
    else:
        lock_key = _parse_key(str(key_text))
    engine = target.engine()
    try:
        with (
            driver_errors.wrap_db_errors("read pg_locks", engine),
            engine.connect() as connection,
        ):
            rows = connection.exec_driver_sql(admin_sql.LOCKS).mappings().all()
        entries = locks_verb.describe_locks([dict(row) for row in rows], target)
        holder = next(
            (e for e in entries if e["key"] == str(lock_key) and e["backend_pid"]),
            None,
        )
        if holder is None:
            raise click.ClickException(f"No session holds the lock {lock_key}.")
        click.echo(_describe(lock_key, holder))
        others = [
            e["key"]
            for e in entries
            if e["backend_pid"] == holder["backend_pid"] and e is not holder
        ]
        if others:
            click.echo(
                f"also held:  {', '.join(others)} (the same session: freed too, and "
                "reported lost by their runs)"
            )
        if not yes:
            click.confirm(
                "End that session? Its locks are freed and the run holding this one "
                "fails with LockLostError",
                abort=True,
            )
        classid, objid, objsubid = lock_key.pg_locks_ids
        with (
            driver_errors.wrap_db_errors("end the holder's session", engine),
            engine.connect() as connection,
        ):
            ended = connection.exec_driver_sql(
                TERMINATE, (holder["backend_pid"], classid, objid, objsubid)
            ).scalar()
            connection.commit()
    except exceptions.DatabaseError as error:
        raise click.ClickException(str(error)) from None
    finally:
        engine.dispose()
    if not ended:
        raise click.ClickException(
            f"Backend {holder['backend_pid']} no longer holds the lock {lock_key} "
            "(released meanwhile, or ended); nothing was done."
        )
    who = f"{getpass.getuser()}@{socket.gethostname()}"
    when = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    holder_name = holder["holder"] or holder["application_name"] or "?"
    logger.warning(
        "celery-pglock: %s ended backend %s (%s), holder of lock %s (task %s), at %s",
        who,
        holder["backend_pid"],
        holder_name,
        lock_key,
        holder["task"] or "-",
        when,
        extra={
            "action": "lock_released_by_operator",
            "lock_key": str(lock_key),
            "backend_pid": holder["backend_pid"],
            "operator": who,
        },
    )
    click.echo(
        f"Ended backend {holder['backend_pid']} ({holder_name}) at {when}, as {who}: "
        f"PostgreSQL freed lock {lock_key}. The holder reports it lost (lock_lost) "
        "within its lock_watch_interval."
    )


def _parse_key(text: str) -> keys.LockKey:
    try:
        parts = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise click.UsageError(
            f"--key {text!r} is not a key: a bigint, or two ints 'namespace,resource'."
        ) from None
    value: Any = parts[0] if len(parts) == 1 else parts
    try:
        return keys.explicit_key("--key", value, where="--key")
    except exceptions.ConfigurationError as error:
        raise click.UsageError(str(error)) from None


def _describe(lock_key: keys.LockKey, holder: dict[str, Any]) -> str:
    lines = [
        f"lock:      {lock_key}"
        + (f"  ({holder['lock_name']})" if holder["lock_name"] else ""),
        f"held by:   {holder['holder'] or holder['application_name'] or '?'}"
        + (f", task {holder['task']}" if holder["task"] else "")
        + f" (backend {holder['backend_pid']}"
        + (f", from {holder['client_addr']}" if holder["client_addr"] else "")
        + ")",
        f"since:     {holder['since'] or '?'}",
    ]
    if holder["waiters"]:
        lines.append(f"waiting:   {len(holder['waiters'])} session(s)")
    if not holder["celery_pglock"]:
        lines.append("note:      not a celery-pglock session")
    return "\n".join(lines)
