"""Worker signal hooks: configuration checks at start, and the lock-release safety nets.

Connected once per process, when ``celery_pglock.task`` is imported (celery signals are
global, and the receivers work for any app). None of these is the normal release path:
``SingletonTask.__call__`` releases in its own ``finally``. They catch what that cannot:

- ``task_postrun``: if the execution that just ended still holds its lock (a bug or an
  unexpected exit path), it is released. The lock is found on the tracer's request, i.e.
  per execution and per thread, never by task id: two executions can share an id (a
  redelivery, an explicit task_id, a retry attempt) and must not release each other's
  lock. Releasing is idempotent. It is also where a run that published a retry
  releases its lock: the first moment after Celery stored the attempt's RETRY state.
  Last, it cuts the request <-> execution link, so that the request (and the call's
  arguments) is freed now rather than at the next garbage collection.
- ``task_revoked`` needs no hook: a task revoked before it starts holds nothing, and
  ``terminate=True`` kills the prefork child, whose session end frees the lock. (The
  signal fires in the worker's main process, and can fire twice, celery#3805.)
- ``worker_process_shutdown`` / ``worker_shutdown``: anything still held is released and
  every lock connection (the process's lock session included) closed, so a stopping
  worker frees its locks before it exits.
- ``worker_init``: a missing or invalid database URL, or an unknown ``pglock_*`` setting,
  stops the worker at start with a message naming the setting and the environment
  variable, instead of failing every locked task later. (It exits: Celery logs and
  swallows ordinary exceptions raised by signal receivers.) So does a lock database that
  is a standby, or a pooler that breaks a task's lock scope (``check_lock_server``;
  an unreachable database is left to ``worker_ready``). It also starts the
  /metrics endpoint when ``pglock_metrics_port`` is set: in the main process, before the
  pool forks, so children inherit its multiprocess directory. Worker shutdown stops it.
- ``worker_ready``: connects once to the lock database and logs the lock configuration
  (``lock_config``), or an ERROR naming the masked URL and what to check: what the
  server refused when it is a misconfiguration (``lock_database_misconfigured``: a
  wrong password, a missing database; tasks then fail at once), else that it did not
  answer (``lock_database_unreachable``). Not from ``worker_init``: Celery configures logging
  after that signal, so records sent there are lost. An unreachable database does not
  stop the worker: it may be a moment's outage (a failover, a deploy in the wrong
  order), other tasks of the worker may not need it, and a supervisor restarting a
  refusing worker in a loop helps no one; every SingletonTask then fails with
  DatabaseError until the database answers, as it would after a later outage.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from celery import signals as celery_signals

from celery_pglock import config, exceptions, metrics
from celery_pglock.db import driver_errors, engines, server_probe
from celery_pglock.lock import sessions
from celery_pglock.task import context, metrics_endpoint, singleton_task

logger = logging.getLogger(__name__)

_SHUTDOWN_SIGNALS = {
    "worker_process_shutdown": celery_signals.worker_process_shutdown,
    "worker_shutdown": celery_signals.worker_shutdown,
}
_connected = False
_connect_guard = threading.Lock()
#: What start_metrics() did, for report_lock_database() to log once logging is set up.
_metrics_outcome: metrics_endpoint.Server | exceptions.ConfigurationError | None = None


def connect() -> None:
    """Connect the receivers (idempotent)."""
    global _connected
    with _connect_guard:
        if _connected:
            return
        celery_signals.worker_init.connect(
            _check_worker_config, weak=False, dispatch_uid="celery_pglock.worker_init"
        )
        celery_signals.worker_ready.connect(
            _report_at_ready, weak=False, dispatch_uid="celery_pglock.worker_ready"
        )
        celery_signals.task_postrun.connect(
            singleton_task.after_task,
            weak=False,
            dispatch_uid="celery_pglock.task_postrun",
        )
        for name, signal in _SHUTDOWN_SIGNALS.items():
            signal.connect(
                _release_everything, weak=False, dispatch_uid=f"celery_pglock.{name}"
            )
        _connected = True


def disconnect() -> None:
    """Disconnect the receivers (tests; a worker never needs this)."""
    global _connected
    with _connect_guard:
        celery_signals.worker_init.disconnect(dispatch_uid="celery_pglock.worker_init")
        celery_signals.worker_ready.disconnect(
            dispatch_uid="celery_pglock.worker_ready"
        )
        celery_signals.task_postrun.disconnect(
            dispatch_uid="celery_pglock.task_postrun"
        )
        for name, signal in _SHUTDOWN_SIGNALS.items():
            signal.disconnect(dispatch_uid=f"celery_pglock.{name}")
        _connected = False


def check_app(app: Any) -> None:
    """Check the lock settings of ``app`` if it has SingletonTasks.

    Raises:
        ConfigurationError: naming the setting (and environment variable) at fault.
    """
    if not _singleton_tasks(app):
        return
    config.check_unknown_settings(app.conf)
    engines.check_url(config.database_url(app.conf))
    metrics.from_conf(app.conf)


def check_lock_server(app: Any) -> None:
    """Worker start: refuse a lock database that no SingletonTask of ``app`` can use.

    Probes with a temporary engine (the worker's own engines are made after the fork).
    An unreachable database does not stop the worker: each process checks again at its
    first lock.

    Raises:
        ConfigurationError: a standby, or a pooling mode that breaks the scope of some
            tasks; the message names them and the fix.
    """
    scopes: dict[config.LockScope, list[str]] = {}
    for task in sorted(_singleton_tasks(app), key=lambda task: str(task.name)):
        scopes.setdefault(task.lock_config.scope, []).append(task.name)
    if not scopes:
        return
    url = config.database_url(app.conf)
    try:
        facts = server_probe.probe(url, app.conf)
    except exceptions.DatabaseError:
        # Reported at worker_ready (logging is not set up yet in worker_init); each
        # process probes again at its first lock.
        return
    for scope, names in scopes.items():
        message = facts.refusal(scope)
        if message is not None:
            raise exceptions.ConfigurationError(
                f"{message} (tasks with lock_scope={scope.value!r}: {', '.join(names)})"
            )


def report_lock_database(app: Any) -> None:
    """Connect once to the lock database of ``app``; log the configuration or an ERROR.

    Does nothing for an app without SingletonTasks. Never raises: see the module
    docstring for why an unreachable database does not stop the worker.
    """
    tasks = _singleton_tasks(app)
    if not tasks:
        return
    try:
        url = engines.mask_url(config.database_url(app.conf))
        version = engines.probe(app.conf)
    except exceptions.PgLockError as error:
        if driver_errors.misconfiguration(error.__cause__) is not None:
            # The error's text ends with the cause and its fix; "check that PostgreSQL
            # runs" would send the operator the wrong way.
            logger.error(
                "celery-pglock: the lock database refused this worker at start: %s "
                "Until that is fixed, every SingletonTask fails at once with "
                "DatabaseError (no retry).",
                " ".join(str(error).split()),
                extra={"action": "lock_database_misconfigured", "database": url},
            )
        else:
            logger.error(
                "celery-pglock: the lock database is unreachable at worker start: %s "
                "SingletonTasks cannot take their locks, and fail with DatabaseError, "
                "until it answers. Check that PostgreSQL runs and accepts connections "
                "from this host, and the URL in app.conf.%s or %s.",
                " ".join(str(error).split()),
                config.DATABASE_URL_SETTING,
                config.DATABASE_URL_ENV,
                extra={"action": "lock_database_unreachable", "database": url},
            )
        _report_metrics()
        return
    settings = {
        name: app.conf.get(name)
        for name in config.KNOWN_SETTINGS
        if name != config.DATABASE_URL_SETTING and app.conf.get(name) is not None
    }
    if "pglock_engine_options" in settings:  # may carry credentials: names only
        settings["pglock_engine_options"] = sorted(settings["pglock_engine_options"])
    described = ", ".join(f"{name}={value!r}" for name, value in settings.items())
    logger.info(
        "celery-pglock: lock database %s (PostgreSQL %s), %d SingletonTasks, settings %s",
        url,
        version,
        len(tasks),
        described or "default",
        extra={"action": "lock_config", "database": url},
    )
    _report_metrics()


def start_metrics(app: Any) -> None:
    """Serve /metrics when ``pglock_metrics_port`` is set (worker_init: before the fork).

    The outcome is logged at worker_ready by :func:`report_lock_database`, once logging is
    configured. A failure is not worth refusing to run the tasks for: it is reported, and
    the worker goes on without metrics.
    """
    global _metrics_outcome
    tasks = _singleton_tasks(app)
    if not tasks:
        return
    try:
        _metrics_outcome = metrics_endpoint.serve(
            app.conf, [(task.name, task.lock_config.on_busy.value) for task in tasks]
        )
    except exceptions.ConfigurationError as error:
        _metrics_outcome = error


def _report_metrics() -> None:
    outcome = _metrics_outcome
    if isinstance(outcome, exceptions.ConfigurationError):
        logger.error(
            "celery-pglock: %s", outcome, extra={"action": "lock_metrics_failed"}
        )
    elif outcome is not None:
        logger.info(
            "celery-pglock: serving /metrics on port %d (prometheus_client "
            "multiprocess directory %s)",
            outcome.port,
            outcome.directory,
            extra={"action": "lock_metrics_serving"},
        )


def _singleton_tasks(app: Any) -> list[Any]:
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
        # Said once, by the interpreter on stderr as the worker exits: a log record here
        # would reach Python's last-resort handler (Celery has not set up logging yet),
        # which prints it to stderr as well, so every message appeared twice.
        raise SystemExit(f"celery-pglock: {error}") from error
    start_metrics(app)


def _report_at_ready(sender: Any = None, **_: Any) -> None:
    app = getattr(sender, "app", None)
    if app is not None:
        report_lock_database(app)


def _release_everything(**_: Any) -> None:
    for lock in context.all_held():
        if lock.owned():
            singleton_task.release_leftover(lock, "worker shutdown")
    sessions.close_all()
    engines.dispose_all()
    metrics_endpoint.stop()  # the main process's /metrics endpoint; no-op in children
