"""``pglock release``: end the session holding a stuck lock, after saying whose it is.

PostgreSQL frees a session advisory lock only for its own session, or when the session
ends, so releasing another process's lock means ending its session
(``pg_terminate_backend``). Its holder then learns of the loss from its lock watcher, like
after any terminated session (``lock_lost``, and ``lock_on_lost``): docs/cli.md.
"""

from __future__ import annotations

import datetime
import getpass
import json
import logging
import socket
import time
from typing import TYPE_CHECKING, Any

import click

from celery_pglock import _cli_key, _driver_errors, _sql_admin, exceptions, keys

if TYPE_CHECKING:
    import sqlalchemy as sa

    from celery_pglock.cli import Target

logger = logging.getLogger(__name__)

#: Seconds to wait for the terminated backend to exit (and its locks to be freed).
EXIT_WAIT = 10.0


@click.command(
    help="End the session holding TASK's lock for these arguments (or --key KEY), after "
    "showing the holder and asking. Every lock on that session ends with it."
)
@click.argument("task_name", metavar="[TASK]", required=False)
@click.option("--args", "args_json", default="[]", metavar="JSON", help="As for key.")
@click.option(
    "--kwargs", "kwargs_json", default="{}", metavar="JSON", help="As for key."
)
@click.option(
    "--key",
    "key_text",
    metavar="KEY",
    help="The key as `pglock locks` shows it (BIGINT or INT,INT), instead of TASK.",
)
@click.option("--yes", is_flag=True, help="Do not ask for confirmation (scripts).")
@click.pass_obj
def release(
    target: Target,
    task_name: str | None,
    args_json: str,
    kwargs_json: str,
    key_text: str | None,
    yes: bool,
) -> None:
    lock_key, task = _lock_key(target, task_name, args_json, kwargs_json, key_text)
    engine = target.engine()
    try:
        with (
            _driver_errors.wrap_db_errors("release a lock", engine),
            engine.connect() as connection,
        ):
            _release(connection, lock_key, task, yes=yes)
    except exceptions.DatabaseError as error:
        raise click.ClickException(str(error)) from None
    finally:
        engine.dispose()


def _lock_key(
    target: Target,
    task_name: str | None,
    args_json: str,
    kwargs_json: str,
    key_text: str | None,
) -> tuple[keys.LockKey, str | None]:
    if task_name is not None and key_text is None:
        task, lock_key = _cli_key.task_key(
            target, task_name, args_json, kwargs_json, verb="release"
        )
        return lock_key, str(task.name)
    if key_text is None or task_name is not None:
        raise click.UsageError("Name either TASK (with --args/--kwargs) or --key KEY.")
    try:
        ids = tuple(int(part) for part in key_text.split(","))
    except ValueError:
        ids = ()
    low, high = -(2**63), 2**63 - 1
    if len(ids) == 1 and low <= ids[0] <= high:
        return keys.LockKey(name=key_text, ids=(ids[0],)), None
    if len(ids) == 2 and all(-(2**31) <= i < 2**31 for i in ids):
        return keys.LockKey(name=key_text, ids=(ids[0], ids[1])), None
    raise click.UsageError(
        f"--key {key_text!r} is invalid; expected a bigint or two ints as "
        "`pglock locks` shows them (e.g. 7123456789 or 42,7)."
    )


def _release(
    connection: sa.Connection, lock_key: keys.LockKey, task: str | None, *, yes: bool
) -> None:
    ids = lock_key.pg_locks_ids
    row = connection.exec_driver_sql(_sql_admin.KEY_HOLDER, ids).mappings().first()
    connection.rollback()
    what = f"lock {lock_key}" + (f" of {task}" if task else "")
    if row is None:
        click.echo(f"Nobody holds {what}: nothing to release.")
        raise SystemExit(1)
    holder = dict(row)
    click.echo(_describe(what, holder))
    if not yes and not click.confirm(
        f"End backend {holder['pid']}'s session, and with it every lock it holds?"
    ):
        raise SystemExit(1)
    ended = connection.exec_driver_sql(
        _sql_admin.TERMINATE_HOLDER, (holder["pid"], *ids)
    ).first()
    connection.commit()
    if ended is None:
        click.echo(f"Backend {holder['pid']} no longer holds {what}: nothing done.")
        raise SystemExit(1)
    if not ended[0]:
        raise click.ClickException(
            f"PostgreSQL refused to end backend {holder['pid']}: the CLI's role must be "
            "a superuser, the holder's role, or a member of pg_signal_backend."
        )
    _wait_gone(connection, holder["pid"])
    record = {
        "action": "lock_released_by_operator",
        "lock_key": str(lock_key),
        "task": task,
        "holder_pid": holder["pid"],
        "holder": holder["application_name"],
        "other_keys_ended": holder["other_keys"],
        "by": f"{getpass.getuser()}@{socket.gethostname()}",
        "at": datetime.datetime.now(datetime.timezone.utc).isoformat(),
    }
    # Who, what and when: on stdout for the operator, and to the log for the record.
    logger.warning("celery-pglock: %s", json.dumps(record), extra=record)
    click.echo(
        f"Released {what}: backend {holder['pid']} ended by {record['by']} at "
        f"{record['at']}. Its holder is told by its lock watcher (lock_lost)."
    )


def _describe(what: str, holder: dict[str, Any]) -> str:
    others = int(holder["other_keys"] or 0)
    lines = [
        f"{what} is held by backend {holder['pid']}",
        f"  application_name: {holder['application_name'] or '-'}",
        f"  client: {holder['client_addr'] or 'local socket'}, role {holder['usename']}",
        f"  since: {holder['since']}",
    ]
    if others:
        lines.append(
            f"  that session also holds {others} other advisory lock(s): ending it "
            "ends them too"
        )
    return "\n".join(lines)


def _wait_gone(connection: sa.Connection, pid: int) -> None:
    deadline = time.monotonic() + EXIT_WAIT
    while True:
        gone = connection.exec_driver_sql(_sql_admin.BACKEND_GONE, (pid,)).scalar()
        connection.rollback()
        if gone:
            return
        if time.monotonic() > deadline:
            raise click.ClickException(
                f"Backend {pid} was signalled but has not exited after {EXIT_WAIT:g}s; "
                "its locks are freed when it does."
            )
        time.sleep(0.05)
