"""Every Celery behaviour celery-pglock relies on that is not Celery's public API: one
function (or constant) each, named for its assumption, its docstring saying where Celery does it and the
releases it was checked on. Nothing else in the package touches these internals.

Hazard: a Celery release may change any of them without notice. Each one is tested
against the installed Celery by tests/unit/test_celery_compat.py, which CI runs on the
oldest Celery claimed (``scripts/matrix.sh oldest``: 5.3.0) and the newest
(``scripts/test.sh``): a release that breaks one fails there, under its name. The list,
and why each is relied on: docs/design.md (Celery's internals).

It sits at the bottom (it imports Celery and nothing of the package) because
``config.py`` reads the settings' namespace too; the task layer, ``cli/`` and
``contrib/django/`` call it for the rest."""

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
    """The namespace prefix of ``app.conf``'s setting names (``"CELERY_"`` after
    ``config_from_object(..., namespace="CELERY")``), or ``""``.

    Assumes ``Settings.prefix`` (``celery/app/utils.py``), which is not documented, and
    is set once the settings are read (before, it may be None): the caller lists the
    settings first. Checked on Celery 5.3.0 and 5.7.0.
    """
    return str(getattr(conf, "prefix", None) or "")


def load_app(path: str) -> Any:
    """The app ``path`` names (``module`` or ``module:attribute``), as ``celery -A`` finds it.

    Assumes ``celery.app.utils.find_app``, which Celery's own ``-A`` uses and does not
    document. Checked on Celery 5.3.0 and 5.7.0.
    """
    return find_app(path)


def command_app(ctx: click.Context) -> Any:
    """The app of ``celery -A proj pglock``, from the click context, or None.

    Assumes Celery's command group leaves a ``celery.bin.base.CLIContext`` with the
    loaded ``app`` as the context object of its subcommands (``celery/bin/celery.py``),
    not documented for plugins. Checked on Celery 5.3.0 and 5.7.0.
    """
    from celery.bin.base import CLIContext  # here: only the command needs celery.bin

    return getattr(ctx.find_object(CLIContext), "app", None)


def task_registry(app: celery.Celery) -> dict[str, Any]:
    """The app's task registry, without finalizing the app.

    Assumes ``Celery._tasks`` (``celery/app/base.py``): ``app.tasks`` would finalize the
    app, which an app with ``autofinalize=False`` refuses while its tasks are being
    bound. Checked on Celery 5.3.0 and 5.7.0.
    """
    registry: dict[str, Any] = getattr(app, "_tasks", None) or {}
    return registry


def run_parameters(cls: type) -> list[inspect.Parameter]:
    """The parameters a call of the task class ``cls`` takes (its ``run`` without ``self``).

    Assumes ``@app.task`` stores a plain function as a ``staticmethod`` ``run`` on the
    class it builds, and a ``bind=True`` function as a plain one, whose first parameter
    is the task (``Celery._task_from_fun``, ``celery/app/base.py``). Checked on Celery
    5.3.0 and 5.7.0.
    """
    run = inspect.getattr_static(cls, "run")
    if isinstance(run, staticmethod):  # @app.task without bind=True
        return list(inspect.signature(run.__func__).parameters.values())
    return list(inspect.signature(run).parameters.values())[1:]  # bind=True, a class


#: A custom ``__call__`` run by Celery's tracer may call ``task.run`` itself; a direct
#: call goes through ``Task.__call__``, which pushes a request. Assumes that the tracer
#: (a worker's, and ``Task.apply``'s) calls a task whose class overrides ``__call__``
#: after pushing the task and the message's request (``called_directly=False``), and keeps
#: that request pushed until ``task_postrun`` has run (``build_tracer``,
#: ``celery/app/trace.py``). ``Task.__call__`` would push a request of its own, ~35 us:
#: an empty one on Celery 5.3.0, where ``run()`` would lose the message's id, a copy of
#: the current one on 5.7.0. A constant, not a function: it is read on every run.
#: Checked on Celery 5.3.0 and 5.7.0.
TRACER_KEEPS_REQUEST = True


def drop_continuations(request: Any) -> None:
    """Keep the link callbacks and the rest of a chain from receiving this run's result.

    Assumes the tracer reads them from the request the task sees
    (``task.request.callbacks``, ``request.chain``) after the body returns, and sends
    nothing when they are None (``build_tracer``, ``celery/app/trace.py``). Checked on
    Celery 5.3.0 and 5.7.0.
    """
    request.callbacks = None
    request.chain = None


def redelivered(request: Any) -> bool:
    """Whether the broker delivered this run's message before (a worker died holding it).

    Assumes the worker's request copies the transport's ``redelivered`` flag into
    ``request.delivery_info`` (``celery/worker/request.py``); kombu's Redis transport
    sets it on a restored message. Checked on Celery 5.3.0 and 5.7.0.
    """
    return bool((request.delivery_info or {}).get("redelivered"))


def is_retry_send(options: Mapping[str, Any]) -> bool:
    """Whether an ``apply_async`` with these options is ``Task.retry()`` re-sending a run.

    Assumes ``retry()`` publishes through ``signature_from_request`` with
    ``retries=n + 1`` (n >= 0) among the options, and that a first send has none
    (``celery/app/task.py``). Checked on Celery 5.3.0 and 5.7.0.
    """
    return bool(options.get("retries"))


def retry_publishes(task: celery.Task[Any, Any], max_retries: int | None) -> bool:
    """Whether ``task.retry(max_retries=max_retries)`` would publish (retries left).

    Assumes ``retry()``'s own check: it raises instead of publishing once
    ``request.retries + 1`` exceeds the limit, the call's or else ``task.max_retries``,
    and None is unlimited (``celery/app/task.py``). Checked on Celery 5.3.0 and 5.7.0.
    """
    limit = task.max_retries if max_retries is None else max_retries
    return limit is None or task.request.retries + 1 <= limit


def autoretries(task: celery.Task[Any, Any], error: BaseException) -> bool:
    """Whether the task's ``autoretry_for`` (less its ``dont_autoretry_for``) covers ``error``.

    Part of the copy of Celery's autoretry (``add_autoretry_behaviour``,
    ``celery/app/autoretry.py``), which wraps ``run()`` and so never sees an error of
    the lock, taken in ``__call__`` before it. Assumes ``@app.task``'s options are
    attributes of the task, as that wrapper reads them. Checked on Celery 5.3.0 and 5.7.0.
    """
    return isinstance(
        error, tuple(getattr(task, "autoretry_for", ()))
    ) and not isinstance(error, tuple(getattr(task, "dont_autoretry_for", ())))


def autoretry_options(task: celery.Task[Any, Any]) -> dict[str, Any]:
    """The keyword arguments Celery's autoretry passes to ``task.retry()`` for this
    attempt: ``retry_kwargs``, with the ``retry_backoff`` countdown.

    The rest of the copy of ``add_autoretry_behaviour`` (``celery/app/autoretry.py``):
    same attributes, same defaults (``retry_backoff_max`` 600, ``retry_jitter`` True),
    same ``get_exponential_backoff_interval`` call. Checked on Celery 5.3.0 and 5.7.0.
    """
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
    """Drop the limit a ``task.retry(max_retries=n)`` left on the task object.

    Assumes ``retry()`` stores ``n`` as ``task.override_max_retries`` for later runs of
    the task in the process, and that only autoretry's wrapper deletes it after its
    retry (``celery/app/task.py``, ``celery/app/autoretry.py``); the copy above does as
    it does. Checked on Celery 5.3.0 and 5.7.0.
    """
    vars(task).pop(MAX_RETRIES_OVERRIDE, None)
