"""Worker signal hooks: start-up checks, release safety nets. Why: docs/design.md."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from celery import signals as celery_signals

from celery_pglock import config, exceptions, metrics
from celery_pglock.db import driver_errors, engines, server_probe
from celery_pglock.lock import sessions
from celery_pglock.metrics import server as metrics_server
from celery_pglock.task import (
    enqueue,
    queued_writes,
    replacing_sweep,
    runs,
    singleton_task,
)

if TYPE_CHECKING:
    import threading

logger = logging.getLogger(__name__)

#: What serving /metrics at worker_init did, logged by _report_at_ready().
_metrics_outcome: metrics_server.Server | exceptions.ConfigurationError | None = None


def _receivers() -> dict[str, Any]:
    return {
        "worker_init": _check_worker_config,
        "worker_ready": _report_at_ready,
        "task_postrun": singleton_task.after_task,
        "worker_process_shutdown": _release_everything,
        "worker_shutdown": _release_everything,
        "task_revoked": enqueue.on_revoked,
        "task_rejected": enqueue.on_rejected,
        "task_unknown": enqueue.on_rejected,
    }


def connect() -> None:
    """Connect the receivers (idempotent: Celery connects a ``dispatch_uid`` once)."""
    for name, receiver in _receivers().items():
        getattr(celery_signals, name).connect(
            receiver, weak=False, dispatch_uid=f"celery_pglock.{name}"
        )


def disconnect() -> None:
    """Disconnect them (benchmarks/hot_path.py measures a worker without them)."""
    for name in _receivers():
        getattr(celery_signals, name).disconnect(dispatch_uid=f"celery_pglock.{name}")


def check_app(app: Any) -> None:
    """Check the lock settings of an app with SingletonTasks (ConfigurationError)."""
    if not singleton_tasks(app):
        return
    config.check_unknown_settings(app.conf)
    engines.check_url(config.database_url(app.conf))
    config.on_misconfigured_database(app.conf)
    metrics.from_conf(app.conf)


def check_lock_server(app: Any) -> None:
    """ConfigurationError on what docs/design.md (worker_init) lists; probed with a
    temporary engine: the worker's own are made after the fork."""
    scopes: dict[config.LockScope, list[str]] = {}
    for task in sorted(singleton_tasks(app), key=lambda task: str(task.name)):
        scopes.setdefault(task.lock_config.scope, []).append(task.name)
    if not scopes:
        return
    try:
        facts = server_probe.probe(config.database_url(app.conf), app.conf)
    except exceptions.DatabaseError as error:
        # An outage may end: reported at worker_ready (docs/design.md, worker hooks).
        if driver_errors.misconfiguration(error.__cause__) is None or _runs_anyway(app):
            return
        setting = config.ON_MISCONFIGURED_DATABASE_SETTING
        raise exceptions.ConfigurationError(
            f"The lock database refused this worker at start: {' '.join(str(error).split())} "
            f"The worker stops ({setting}='stop', the default) rather than start and "
            "fail every SingletonTask: fix what this names, then start it again, or set "
            f"{setting}='run' to start anyway."
        ) from error
    for scope, names in scopes.items():
        message = facts.refusal(scope)
        if message is not None:
            raise exceptions.ConfigurationError(
                f"{message} (tasks with lock_scope={scope.value!r}: {', '.join(names)})"
            )


def _report_at_ready(sender: Any = None, **_: Any) -> None:
    """Log the lock configuration or an ERROR; never raises (docs/design.md). Starts the
    latest-wins sweep (after the pool has forked its children)."""
    global _sweeping
    app: Any = getattr(sender, "app", None)
    tasks = singleton_tasks(app) if app is not None else []
    if not tasks:
        return
    if _sweeping is None:
        _sweeping = replacing_sweep.start(app)
    url: str | None = None  # no URL configured: the error below says so
    try:
        url = engines.mask_url(config.database_url(app.conf))
        version = engines.probe(app.conf)
    except exceptions.PgLockError as error:
        reason = " ".join(str(error).split())
        if driver_errors.misconfiguration(error.__cause__) is not None:
            # Its text gives the fix; "check that PostgreSQL runs" would mislead here.
            logger.error(
                "celery-pglock: the lock database refused this worker at start: %s "
                "Until that is fixed, every SingletonTask fails at once with "
                "DatabaseError (no retry).%s",
                reason,
                f" The worker runs as {config.ON_MISCONFIGURED_DATABASE_SETTING}='run' "
                "asks."
                if _runs_anyway(app)
                else "",
                extra={"action": "lock_database_misconfigured", "database": url},
            )
        else:
            logger.error(
                "celery-pglock: the lock database is unreachable at worker start: %s "
                "SingletonTasks cannot take their locks, and fail with DatabaseError, "
                "until it answers. Check that PostgreSQL runs and accepts connections "
                "from this host, and the URL in app.conf.%s or %s.",
                reason,
                config.DATABASE_URL_SETTING,
                config.DATABASE_URL_ENV,
                extra={"action": "lock_database_unreachable", "database": url},
            )
    else:
        settings = {
            name: app.conf.get(name)
            for name in config.KNOWN_SETTINGS
            if name != config.DATABASE_URL_SETTING and app.conf.get(name) is not None
        }
        options = settings.get("pglock_engine_options")
        if options is not None:  # may carry credentials: names only
            settings["pglock_engine_options"] = sorted(options)
        described = ", ".join(f"{name}={value!r}" for name, value in settings.items())
        logger.info(
            "celery-pglock: lock database %s (PostgreSQL %s), %d SingletonTasks, settings %s",
            url,
            version,
            len(tasks),
            described or "default",
            extra={"action": "lock_config", "database": url},
        )
    outcome = _metrics_outcome
    if isinstance(outcome, exceptions.ConfigurationError):
        logger.error(
            "celery-pglock: %s", outcome, extra={"action": "lock_metrics_failed"}
        )
    elif outcome is not None:
        logger.info(
            "celery-pglock: serving /metrics on port %d (prometheus_client "
            "multiprocess directory %s)",
            outcome.httpd.server_port,
            outcome.directory,
            extra={"action": "lock_metrics_serving"},
        )


def _runs_anyway(app: Any) -> bool:
    """pglock_on_misconfigured_database='run': a refusing database does not stop it."""
    run = config.OnMisconfiguredDatabase.RUN
    return config.on_misconfigured_database(app.conf) is run


def singleton_tasks(app: Any) -> list[Any]:
    return [
        task
        for task in app.tasks.values()
        if isinstance(task, singleton_task.SingletonTask)
    ]


def _check_worker_config(sender: Any = None, **_: Any) -> None:
    app = getattr(sender, "app", None)
    if app is None:
        return
    try:
        check_app(app)
        check_lock_server(app)  # standby, pooling mode against the tasks' scopes
    except exceptions.ConfigurationError as error:
        # Said once at exit: with no logging set up yet, a log record would print twice.
        raise SystemExit(f"celery-pglock: {error}") from error
    # Before the pool forks; logged at worker_ready; a failure never stops the worker.
    global _metrics_outcome
    if tasks := singleton_tasks(app):
        try:
            _metrics_outcome = metrics_server.serve(
                app.conf,
                [(task.name, task.lock_config.on_busy.value) for task in tasks],
            )
        except exceptions.ConfigurationError as error:
            _metrics_outcome = error


_sweeping: threading.Event | None = None  #: Set to stop this process's sweep.


def _release_everything(**_: Any) -> None:
    if _sweeping is not None:
        _sweeping.set()
    # A prefork child ends in os._exit, which runs no atexit hook: drain here.
    queued_writes.drain_writers()
    for lock in runs.held_locks():
        if lock.owned():
            runs.release_leftover(lock, "worker shutdown")
    sessions.close_all()
    engines.dispose_all()
    metrics_server.stop()  # the main process's /metrics endpoint; no-op in children
