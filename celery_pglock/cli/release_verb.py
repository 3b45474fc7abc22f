"""``pglock release``, as its help says; the holder then: docs/operations/cli.md."""

from __future__ import annotations

import datetime
import getpass
import logging
import socket

import click

from celery_pglock.cli import shared
from celery_pglock.db import driver_errors

logger = logging.getLogger(__name__)

EXIT_WAIT = 10  #: Seconds to wait for the ended session to exit (its locks go with it).
#: Only if ``pid`` still holds the key; waits (PostgreSQL 14+): False if it had not exited.
TERMINATE = f"""
SELECT pg_terminate_backend(l.pid, {EXIT_WAIT * 1000})
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
@shared.ARGS
@shared.KWARGS
@click.option(
    "--key",
    "key_text",
    metavar="KEY",
    help="The key as `pglock locks` shows it: a bigint, or 'int,int'.",
)
@click.option("--yes", is_flag=True, help="Do not ask (scripts).")
@click.pass_obj
def release(
    target: shared.Target,
    task_name: str | None,
    args_json: str,
    kwargs_json: str,
    key_text: str | None,
    yes: bool,
) -> None:
    if (task_name is None) == (key_text is None):
        raise click.UsageError("Name the lock: a TASK (with --args/--kwargs) or --key.")
    if task_name is not None:
        _, lock_key, _ = shared.key_of_call(
            target, task_name, args_json, kwargs_json, verb="release"
        )
    else:
        lock_key = shared.parse_key(str(key_text))
    with target.database("read pg_locks") as engine:
        entries = shared.read_locks(target, engine)
        holder = next(
            (e for e in entries if e["key"] == str(lock_key) and e["backend_pid"]),
            None,
        )
        if holder is None:
            raise click.ClickException(f"No session holds the lock {lock_key}.")
        pid, task = holder["backend_pid"], holder["task"]
        name = shared.holder_name(holder)
        lines = [
            f"lock:      {lock_key}"
            + (f"  ({holder['lock_name']})" if holder["lock_name"] else ""),
            f"held by:   {name}"
            + (f", task {task}" if task else "")
            + f" (backend {pid}"
            + (f", from {holder['client_addr']}" if holder["client_addr"] else "")
            + ")",
            f"since:     {holder['since'] or '?'}",
        ]
        if holder["waiters"]:
            lines.append(f"waiting:   {len(holder['waiters'])} session(s)")
        if not holder["celery_pglock"]:
            lines.append("note:      not a celery-pglock session")
        click.echo("\n".join(lines))
        others = [
            e["key"] for e in entries if e["backend_pid"] == pid and e is not holder
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
        with (
            driver_errors.wrap_db_errors("end the holder's session", engine),
            engine.connect() as connection,
        ):
            ended = connection.exec_driver_sql(
                TERMINATE, (pid, *lock_key.pg_locks_ids)
            ).scalar()
            connection.commit()
    if ended is None:
        raise click.ClickException(
            f"Backend {pid} no longer holds the lock {lock_key} "
            "(released meanwhile, or ended); nothing was done."
        )
    if not ended:
        raise click.ClickException(
            f"Backend {pid} was told to end but had not exited after {EXIT_WAIT} s: "
            f"PostgreSQL frees lock {lock_key} when it does (see `pglock locks`)."
        )
    who = f"{getpass.getuser()}@{socket.gethostname()}"
    when = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    logger.warning(
        "celery-pglock: %s ended backend %s (%s), holder of lock %s (task %s), at %s",
        who,
        pid,
        name,
        lock_key,
        task or "-",
        when,
        extra={
            "action": "lock_released_by_operator",
            "lock_key": str(lock_key),
            "backend_pid": pid,
            "operator": who,
        },
    )
    click.echo(
        f"Ended backend {pid} ({name}) at {when}, as {who}: PostgreSQL freed lock "
        f"{lock_key}. The holder reports it lost (lock_lost) within its "
        "lock_watch_interval."
    )
