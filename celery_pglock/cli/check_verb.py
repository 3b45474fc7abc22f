"""``pglock check``; a FAIL exits 1. Each check and its fix: docs/operations/cli.md."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import TYPE_CHECKING, Any

import click

from celery_pglock import config, exceptions
from celery_pglock.db import engines, server_probe
from celery_pglock.task import busy_policy

if TYPE_CHECKING:
    import sqlalchemy as sa

    from celery_pglock.cli import shared

SERVER_FACTS = """
SELECT current_setting('server_version_num')::int AS version_num,
  current_setting('server_version') AS version, pg_is_in_recovery() AS standby,
  current_setting('max_connections')::int AS max_connections,
  current_setting('superuser_reserved_connections')::int AS reserved,
  (SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'client backend') AS in_use,
  current_user AS role,
  has_function_privilege('pg_try_advisory_lock(bigint)', 'execute')
  AND has_function_privilege('pg_try_advisory_xact_lock(bigint)', 'execute') AS may_lock
"""

DIRECT = "or a URL that reaches PostgreSQL directly (or through session pooling)"


@dataclasses.dataclass
class Finding:
    status: str  # OK, WARN or FAIL; INFO says how a task runs, never fails
    name: str
    detail: str
    fix: str | None = None


@click.command(
    help="Check configuration, connectivity, privileges, standby, pooler and capacity."
)
@click.option(
    "--processes",
    "--concurrency",
    "processes",
    type=click.IntRange(min=1),
    help="Worker processes (or threads) that run locked tasks at once, across all hosts: the sum of the workers' -c (default: the app's worker_concurrency, else this host's CPU count).",
)
@click.option(
    "--scope",
    type=click.Choice(["session", "transaction"]),
    help="Lock scope to judge the pooler for (default: the scopes the app's tasks use, else session).",
)
@click.option("--json", "as_json", is_flag=True, help="One JSON document on stdout.")
@click.pass_obj
def check(
    target: shared.Target, processes: int | None, scope: str | None, as_json: bool
) -> None:
    findings = run_checks(target, processes=processes, scope=scope)
    if as_json:
        click.echo(json.dumps([dataclasses.asdict(f) for f in findings], indent=2))
    else:
        for finding in findings:
            click.echo(f"{finding.status:<4}  {finding.name:<13} {finding.detail}")
            if finding.fix:
                click.echo(f"{'':<19} fix: {finding.fix}")
    if any(f.status == "FAIL" for f in findings):
        raise SystemExit(1)


def run_checks(
    target: shared.Target, *, processes: int | None = None, scope: str | None = None
) -> list[Finding]:
    """In order; stops after the first one the rest depend on."""
    setting = f"app.conf.{config.DATABASE_URL_SETTING} (or ${config.DATABASE_URL_ENV})"
    app, scopes = target.app, {scope} if scope else set()
    try:
        if app is not None:
            config.check_unknown_settings(app.conf)
            scopes.update(t.lock_config.scope.value for t in target.singleton_tasks)
        masked = engines.mask_url(engines.check_url(target.require_url()))
    except (exceptions.ConfigurationError, click.UsageError) as error:
        return [Finding("FAIL", "configuration", str(error).strip(), _fix(error))]
    scopes = scopes or {"session"}
    tasks = len(target.singleton_tasks)
    summary = f"; {tasks} SingletonTask(s), scope {', '.join(sorted(scopes))}"
    findings = [
        Finding("OK", "configuration", masked + (summary if app is not None else ""))
    ]
    if app is not None and not tasks:
        findings.append(
            Finding(
                "FAIL",
                "tasks",
                f"the app {app.main!r} has no SingletonTask, after importing its "
                "task modules as a worker does (include=, imports, autodiscover_tasks)",
                "give the tasks to lock base=SingletonTask, and list their modules in "
                "Celery(include=[...]) or app.autodiscover_tasks()",
            )
        )
    findings += [
        Finding("INFO", "busy policy", f"{task.name}: {'; '.join(changes)}")
        for task in target.singleton_tasks
        if (changes := busy_policy.silent_changes(task.lock_config))
    ]
    engine = target.engine()
    try:
        try:
            with engine.connect() as connection:
                facts = connection.exec_driver_sql(SERVER_FACTS).one()
        except Exception as exc:
            text = str(getattr(exc, "orig", exc)).strip() or type(exc).__name__
            text = text.splitlines()[0]
            fix = f"check host, port, database and credentials in {setting}, and that the server accepts this host"
            if "startup parameter" in text and "options" in text:
                # Our own options are dropped where refused: these are the user's.
                fix = "a pooler (PgBouncer) refuses the options startup parameter set in pglock_engine_options['connect_args']: remove it, or connect to PostgreSQL directly"
            elif (
                isinstance(probed := _probe(engine), server_probe.ServerFacts)
                and probed.pooling is server_probe.Pooling.STATEMENT
            ):  # it refuses SQLAlchemy's first transaction; the probe's autocommit passes
                return [*findings, _pooler(probed, scopes)]
            detail = f"cannot connect to {masked}: {text}"
            return [*findings, Finding("FAIL", "connectivity", detail, fix)]
        version, role = facts.version, facts.role
        old = f"version {version}: celery-pglock supports PostgreSQL >= 14 (`pglock locks` reads pg_locks.waitstart; the SQL key function needs >= 11)"
        standby = "the server is a standby (pg_is_in_recovery() is true): advisory locks are not replicated, so a lock taken here excludes nobody on the primary"
        grant = f"GRANT EXECUTE ON FUNCTION pg_try_advisory_lock(bigint), pg_try_advisory_xact_lock(bigint), pg_advisory_unlock(bigint) TO {role}"
        may_lock = "may call pg_try_advisory_lock and pg_try_advisory_xact_lock"
        may_not = f"role {role} may not execute the advisory lock functions"
        findings += [
            Finding("OK", "connectivity", f"PostgreSQL {version} as {role}"),
            Finding("OK", "server", f"version {version}")
            if facts.version_num >= 140000
            else Finding(
                "WARN", "server", old, "upgrade PostgreSQL (13 is end-of-life)"
            ),
            Finding("FAIL", "standby", standby, f"point {setting} at the primary")
            if facts.standby
            else Finding("OK", "standby", "a primary (not in recovery)"),
            Finding("OK", "privileges", may_lock)
            if facts.may_lock
            else Finding("FAIL", "privileges", may_not, grant),
            _pooler(_probe(engine), scopes),
            _capacity(target, processes, scopes, facts),
        ]
    finally:
        engine.dispose()
    return findings


def _fix(error: Exception) -> str:
    """The fix of a configuration error: a misspelt name gets its closest valid one."""
    unknown = getattr(error, "unknown", None)
    suggestion = getattr(error, "suggestion", None)
    if unknown and suggestion:
        return f"rename {unknown!r} to {suggestion!r}, the closest valid name"
    if unknown:
        return f"remove {unknown!r}, or use one of the names the message lists"
    return "set the lock database URL and options as the message says"


def _probe(engine: sa.Engine) -> server_probe.ServerFacts | exceptions.PgLockError:
    try:
        return server_probe.probe(engine)
    except exceptions.PgLockError as exc:
        return exc


def _pooler(
    facts: server_probe.ServerFacts | exceptions.PgLockError, scopes: set[str]
) -> Finding:
    if isinstance(facts, exceptions.PgLockError):
        return Finding(
            "WARN", "pooler", f"could not probe for a pooler: {facts}".strip()
        )
    if facts.pooling is server_probe.Pooling.STATEMENT:
        detail = f"statement pooling ({facts.evidence}): multi-statement transactions are refused, and both lock scopes need them"
        fix = f"use a URL that reaches PostgreSQL directly, or a pool in session (or, with lock_scope='transaction', transaction) mode; {DIRECT}"
        return Finding("FAIL", "pooler", detail, fix)
    if facts.pooling is server_probe.Pooling.TRANSACTION and "session" in scopes:
        detail = f"transaction pooling ({facts.evidence}); session-scope locks would be shared with other clients"
        fix = f"set lock_scope='transaction' (app.conf.pglock_scope), {DIRECT}"
        return Finding("FAIL", "pooler", detail, fix)
    if facts.pooling is server_probe.Pooling.TRANSACTION:
        detail = f"transaction pooling ({facts.evidence}): fine for lock_scope='transaction' only"
    elif facts.proxied:
        detail = f"a proxy in session mode: the server sees another client port than ours, and {facts.evidence}"
    else:
        detail = f"no pooler or proxy detected ({facts.evidence})"
    return Finding("OK", "pooler", detail)


def _capacity(
    target: shared.Target, processes: int | None, scopes: set[str], facts: Any
) -> Finding:
    """Lock connections needed against free ones; per process: docs/operations/cli.md."""
    app = target.app
    configured = app.conf.get("worker_concurrency") if app is not None else None
    if processes is not None:
        source = "--processes"
    elif configured:
        processes, source = int(configured), "the app's worker_concurrency"
    else:
        # A worker's -c is on its command line, out of our sight: say what we assumed.
        processes = os.cpu_count() or 1
        source = (
            "this host's CPU count, as a worker without -c or worker_concurrency "
            "runs; pass --processes with the sum of your workers' -c"
        )
    pooled = ["transaction scope"] if "transaction" in scopes else []
    if any(t.lock_config.on_busy is config.OnBusy.WAIT for t in target.singleton_tasks):
        pooled.append("lock_on_busy='wait'")
    count, why = (
        (2, f"a pooled lock connection and the lock watcher's, for {', '.join(pooled)}")
        if pooled
        else (1, "its lock session, which the lock watcher checks too")
    )
    available = facts.max_connections - facts.reserved - facts.in_use
    needed = processes * count
    detail = (
        f"{needed} lock connection(s) needed at most ({processes} process(es), from "
        f"{source}, x {count}: {why}); max_connections={facts.max_connections}, "
        f"{facts.reserved} reserved, {facts.in_use} in use, {available} free"
    )
    fix = "raise max_connections, lower worker concurrency, or pool lock sessions through PgBouncer in session mode"
    if needed > available:
        return Finding("FAIL", "capacity", detail, fix)
    if needed > 0.8 * available:
        return Finding("WARN", "capacity", detail + " (over 80% of what is free)", fix)
    return Finding("OK", "capacity", detail)
