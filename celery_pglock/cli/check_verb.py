"""``pglock check``: what must hold for locks to mean anything, each with its fix.

Configuration, connectivity, server version, standby, role privileges, a connection pooler
in the way (see ``server_probe.py``) and ``max_connections`` against the lock sessions the
workers will open. Each check yields a :class:`Finding`; any FAIL makes the command exit 1.
"""

from __future__ import annotations

import dataclasses
import os
from typing import TYPE_CHECKING

import click

from celery_pglock import config, exceptions
from celery_pglock.cli import admin_sql
from celery_pglock.db import engines, server_probe

if TYPE_CHECKING:
    import sqlalchemy as sa

    from celery_pglock.cli.target import Target


@dataclasses.dataclass
class Finding:
    status: str  # OK, WARN or FAIL
    name: str
    detail: str
    fix: str | None = None


def run_checks(
    target: Target, *, processes: int | None = None, scope: str | None = None
) -> list[Finding]:
    """Every check, in order; stops after the first one the rest depend on."""
    findings: list[Finding] = []
    setting = f"app.conf.{config.DATABASE_URL_SETTING} (or ${config.DATABASE_URL_ENV})"
    scopes = {scope} if scope else set()
    try:
        if target.app is not None:
            config.check_unknown_settings(target.app.conf)
            for task in target.singleton_tasks():
                scopes.add(task.lock_config.scope.value)
        url = target.require_url()
        parsed = engines.check_url(url)
    except (exceptions.ConfigurationError, click.UsageError) as error:
        return [
            Finding(
                "FAIL",
                "configuration",
                str(error).strip(),
                "set the lock database URL and options as the message says",
            )
        ]
    scopes = scopes or {"session"}
    tasks = len(target.singleton_tasks())
    findings.append(
        Finding(
            "OK",
            "configuration",
            f"{engines.mask_url(parsed)}"
            + (
                f"; {tasks} SingletonTask(s), scope {', '.join(sorted(scopes))}"
                if target.app is not None
                else ""
            ),
        )
    )
    if target.app is not None and not tasks:
        # An app with no SingletonTask locks nothing: most likely its task modules are
        # not where the worker looks, or the tasks lack base=SingletonTask.
        findings.append(
            Finding(
                "FAIL",
                "tasks",
                f"the app {target.app.main!r} has no SingletonTask, after importing its "
                "task modules as a worker does (include=, imports, autodiscover_tasks)",
                "give the tasks to lock base=SingletonTask, and list their modules in "
                "Celery(include=[...]) or app.autodiscover_tasks()",
            )
        )

    engine = target.engine()
    try:
        try:
            with engine.connect() as connection:
                facts = connection.exec_driver_sql(admin_sql.SERVER_FACTS).one()
        except Exception as exc:
            text = (
                str(getattr(exc, "orig", exc)).strip().splitlines()[0]
                if str(exc)
                else type(exc).__name__
            )
            name = "connectivity"
            fix = f"check host, port, database and credentials in {setting}, and that the server accepts this host"
            if "startup parameter" in text and "options" in text:
                # The library drops its own keepalive options where they are refused.
                fix = "a pooler (PgBouncer) refuses the options startup parameter set in pglock_engine_options['connect_args']: remove it, or connect to PostgreSQL directly"
            elif _statement_pooling(engine):
                name = "pooler"
                text = "statement pooling: multi-statement transactions are refused, and both lock scopes need them"
                fix = "use a URL that reaches PostgreSQL directly, or a pool in session mode (transaction mode for lock_scope='transaction' only)"
            findings.append(
                Finding(
                    "FAIL",
                    name,
                    f"{'cannot connect to ' if name == 'connectivity' else ''}"
                    f"{engines.mask_url(parsed)}: {text}",
                    fix,
                )
            )
            return findings
        (
            version_num,
            version,
            standby,
            max_connections,
            reserved,
            in_use,
            _server_port,  # unused: server_probe.probe tells a proxy by the client port
            role,
            try_ok,
            xact_ok,
        ) = facts
        findings.append(
            Finding("OK", "connectivity", f"PostgreSQL {version} as {role}")
        )
        findings.append(
            Finding("OK", "server", f"version {version}")
            if version_num >= 140000
            else Finding(
                "WARN",
                "server",
                f"version {version}: celery-pglock supports PostgreSQL >= 14 (`pglock "
                "locks` reads pg_locks.waitstart; the SQL key function needs >= 11)",
                "upgrade PostgreSQL (13 is end-of-life)",
            )
        )
        findings.append(
            Finding(
                "FAIL",
                "standby",
                "the server is a standby (pg_is_in_recovery() is true): advisory locks are not replicated, so a lock taken here excludes nobody on the primary",
                f"point {setting} at the primary",
            )
            if standby
            else Finding("OK", "standby", "a primary (not in recovery)")
        )
        findings.append(
            Finding(
                "OK",
                "privileges",
                "may call pg_try_advisory_lock and pg_try_advisory_xact_lock",
            )
            if try_ok and xact_ok
            else Finding(
                "FAIL",
                "privileges",
                f"role {role} may not execute the advisory lock functions",
                f"GRANT EXECUTE ON FUNCTION pg_try_advisory_lock(bigint), pg_try_advisory_xact_lock(bigint), pg_advisory_unlock(bigint) TO {role}",
            )
        )
        findings.append(_pooler_finding(engine, scopes))
        findings.append(
            _capacity_finding(
                target,
                processes,
                _connections_per_process(target, scopes),
                max_connections,
                reserved,
                in_use,
            )
        )
    finally:
        engine.dispose()
    return findings


def _statement_pooling(engine: sa.Engine) -> bool:
    """Is a statement pooler the reason SQLAlchemy could not connect? (Its first
    connection opens a transaction, which statement pooling answers by closing it; the
    probe's autocommit connections get through.)"""
    try:
        return server_probe.probe(engine).pooling is server_probe.Pooling.STATEMENT
    except exceptions.PgLockError:
        return False


def _pooler_finding(engine: sa.Engine, scopes: set[str]) -> Finding:
    try:
        facts = server_probe.probe(engine)
    except exceptions.PgLockError as exc:
        return Finding("WARN", "pooler", f"could not probe for a pooler: {exc}".strip())
    direct = "or a URL that reaches PostgreSQL directly (or through session pooling)"
    if facts.pooling is server_probe.Pooling.STATEMENT:
        return Finding(
            "FAIL",
            "pooler",
            f"statement pooling ({facts.evidence}): multi-statement transactions are refused, and both lock scopes need them",
            f"use a URL that reaches PostgreSQL directly, or a pool in session (or, with lock_scope='transaction', transaction) mode; {direct}",
        )
    if facts.pooling is server_probe.Pooling.TRANSACTION:
        if "session" in scopes:
            return Finding(
                "FAIL",
                "pooler",
                f"transaction pooling ({facts.evidence}); session-scope locks would be shared with other clients",
                f"set lock_scope='transaction' (app.conf.pglock_scope), {direct}",
            )
        return Finding(
            "OK",
            "pooler",
            f"transaction pooling ({facts.evidence}): fine for lock_scope='transaction' only",
        )
    if facts.proxied:
        return Finding(
            "OK",
            "pooler",
            "a proxy in session mode: the server sees another client port than ours, "
            f"and {facts.evidence}",
        )
    return Finding("OK", "pooler", f"no pooler or proxy detected ({facts.evidence})")


def _connections_per_process(target: Target, scopes: set[str]) -> tuple[int, str]:
    """Lock connections one worker process holds while its bodies run, and why.

    Measured in real workers (tests/acceptance/test_sessions.py): a process whose locks
    all live on its lock session holds 1 (the lock watcher checks them there). A lock
    on a pooled connection of its own (transaction scope, whose connection the body
    uses; a bounded wait) is checked by the watcher on
    a connection of its own: 2.
    """
    pooled: list[str] = []
    if "transaction" in scopes:
        pooled.append("transaction scope")
    if any(
        task.lock_config.on_busy is config.OnBusy.WAIT
        for task in target.singleton_tasks()
    ):
        pooled.append("lock_on_busy='wait'")
    if pooled:
        return (
            2,
            f"a pooled lock connection and the lock watcher's, for {', '.join(pooled)}",
        )
    return 1, "its lock session, which the lock watcher checks too"


def _capacity_finding(
    target: Target,
    processes: int | None,
    per_process: tuple[int, str],
    max_connections: int,
    reserved: int,
    in_use: int,
) -> Finding:
    if processes is None:
        configured = (
            target.app.conf.get("worker_concurrency")
            if target.app is not None
            else None
        )
        processes = int(configured or os.cpu_count() or 1)
    available = max_connections - reserved - in_use
    count, why = per_process
    needed = processes * count
    detail = (
        f"{needed} lock connection(s) needed at most ({processes} process(es) x {count}: "
        f"{why}); max_connections={max_connections}, {reserved} reserved, {in_use} in use, "
        f"{available} free"
    )
    fix = "raise max_connections, lower worker concurrency, or pool lock sessions through PgBouncer in session mode"
    if needed > available:
        return Finding("FAIL", "capacity", detail, fix)
    if needed > 0.8 * available:
        return Finding("WARN", "capacity", detail + " (over 80% of what is free)", fix)
    return Finding("OK", "capacity", detail)
