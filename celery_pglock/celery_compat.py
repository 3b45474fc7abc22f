"""Every Celery behaviour relied on that is not Celery's public API, one name each, its
docstring saying where Celery does it and the releases checked. Hazard: a Celery release
may change any without notice; tests/unit/test_celery_compat.py then fails under its name
(CI runs the oldest and newest Celery). Why each: docs/design.md ("Celery's internals")."""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any

from celery.app.utils import find_app
from celery.utils.time import get_exponential_backoff_interval

if TYPE_CHECKING:
    from collections.abc import Mapping

    import celery
    import click

#: Where ``Task.retry(max_retries=n)`` leaves ``n`` on the task object.
MAX_RETRIES_OVERRIDE = "override_max_retries"


def conf_prefix(conf: Mapping[str, Any]) -> str:
    """The namespace prefix of the settings' names (``"CELERY_"``), or ``""``: the
    undocumented ``Settings.prefix`` (celery/app/utils.py), None until the settings are
    read, so the caller lists them first. Checked on Celery 5.3.0 and 5.7.0."""
    return str(getattr(conf, "prefix", None) or "")


def load_app(path: str) -> Any:
    """The app ``path`` names, as ``celery -A`` finds it: the undocumented
    ``celery.app.utils.find_app``. Checked on Celery 5.3.0 and 5.7.0."""
    return find_app(path)


def command_app(ctx: click.Context) -> Any:
    """The app of ``celery -A proj pglock``, or None: the ``CLIContext`` Celery's group
    leaves on the click context (celery/bin/celery.py). Checked on 5.3.0 and 5.7.0."""
    from celery.bin.base import CLIContext  # here: only the command needs celery.bin

    return getattr(ctx.find_object(CLIContext), "app", None)


def task_registry(app: celery.Celery) -> dict[str, Any]:
    """The app's tasks without finalizing it (``app.tasks`` would, refused while an
    ``autofinalize=False`` app binds): ``Celery._tasks`` (celery/app/base.py). Checked
    on Celery 5.3.0 and 5.7.0."""
    registry: dict[str, Any] = getattr(app, "_tasks", None) or {}
    return registry


def run_parameters(cls: type) -> list[inspect.Parameter]:
    """A call's parameters: ``run`` is a staticmethod, or with ``bind=True`` a function
    taking the task first (``Celery._task_from_fun``, celery/app/base.py). Checked on
    Celery 5.3.0 and 5.7.0."""
    run = inspect.getattr_static(cls, "run")
    if isinstance(run, staticmethod):  # @app.task without bind=True
        return list(inspect.signature(run.__func__).parameters.values())
    return list(inspect.signature(run).parameters.values())[1:]  # bind=True, a class


#: The tracer calls a custom ``__call__`` with the message's request pushed, kept until
#: ``task_postrun`` (``build_tracer``, celery/app/trace.py); ``Task.__call__`` pushes
#: its own (~35 us; empty on 5.3.0). A constant: read on every run. Checked on Celery
#: 5.3.0 and 5.7.0.
TRACER_KEEPS_REQUEST = True


def drop_continuations(request: Any) -> None:
    """Keep link callbacks and the chain's rest from this run's result: the tracer reads
    ``request.callbacks``/``request.chain`` after the body, None sends nothing
    (``build_tracer``, celery/app/trace.py). Checked on Celery 5.3.0 and 5.7.0."""
    request.callbacks = None
    request.chain = None


def redelivered(request: Any) -> bool:
    """The broker delivered this message before: ``delivery_info["redelivered"]``
    (celery/worker/request.py). Checked on Celery 5.3.0 and 5.7.0."""
    return bool((request.delivery_info or {}).get("redelivered"))


def is_retry_send(options: Mapping[str, Any]) -> bool:
    """This ``apply_async`` is ``Task.retry()``'s: it sends ``retries=n + 1``, a first
    send none (celery/app/task.py). Checked on Celery 5.3.0 and 5.7.0."""
    return bool(options.get("retries"))


def retry_publishes(task: celery.Task[Any, Any], max_retries: int | None) -> bool:
    """``task.retry(max_retries=...)`` would publish: ``retries + 1`` within the call's
    limit, else ``task.max_retries``; None is unlimited (celery/app/task.py). Checked on
    Celery 5.3.0 and 5.7.0."""
    limit = task.max_retries if max_retries is None else max_retries
    return limit is None or task.request.retries + 1 <= limit


def autoretries(task: celery.Task[Any, Any], error: BaseException) -> bool:
    """``autoretry_for`` less ``dont_autoretry_for`` covers ``error``: part of the copy
    of ``add_autoretry_behaviour`` (celery/app/autoretry.py), which never sees a lock
    error. Checked on Celery 5.3.0 and 5.7.0."""
    return isinstance(
        error, tuple(getattr(task, "autoretry_for", ()))
    ) and not isinstance(error, tuple(getattr(task, "dont_autoretry_for", ())))


def autoretry_options(task: celery.Task[Any, Any]) -> dict[str, Any]:
    """The ``task.retry()`` kwargs autoretry passes: ``retry_kwargs`` and the backoff
    countdown, with its attributes and defaults (celery/app/autoretry.py). Checked on
    Celery 5.3.0 and 5.7.0."""
    options = dict(getattr(task, "retry_kwargs", {}))
    backoff = float(getattr(task, "retry_backoff", False))
    if backoff:
        options["countdown"] = get_exponential_backoff_interval(
            factor=int(max(1.0, backoff)),
            retries=task.request.retries,
            maximum=int(getattr(task, "retry_backoff_max", 600)),
            full_jitter=getattr(task, "retry_jitter", True),
        )
    return options


def forget_max_retries_override(task: celery.Task[Any, Any]) -> None:
    """Drop ``override_max_retries``, which ``retry(max_retries=n)`` leaves on the task
    and only autoretry's wrapper deletes (celery/app/task.py, celery/app/autoretry.py).
    Checked on Celery 5.3.0 and 5.7.0."""
    vars(task).pop(MAX_RETRIES_OVERRIDE, None)
