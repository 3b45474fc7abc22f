"""What a SingletonTask class is bound to, once, when Celery binds it to its app (its
options, key binder and lock engine), and the checks that refuse a bad binding."""

from __future__ import annotations

import dataclasses
import inspect
import os
from typing import TYPE_CHECKING, Any

from celery_pglock import celery_compat, config, exceptions, keys, metrics
from celery_pglock.db import engines
from celery_pglock.task import groups, history

if TYPE_CHECKING:
    from collections.abc import Set as AbstractSet

    import celery
    import sqlalchemy as sa

    from celery_pglock.config import LockConfig
    from celery_pglock.keys import CallKeys


@dataclasses.dataclass(slots=True)
class Binding:
    config: LockConfig
    conf: Any
    keys: CallKeys
    custom_key: bool  #: A subclass overrides lock_key_for.
    custom_limit: bool = False  #: A subclass overrides lock_limit_for.
    engine_of_pid: tuple[int, sa.Engine] | None = None

    def engine(self) -> sa.Engine:
        cached = self.engine_of_pid
        if cached is not None and cached[0] == os.getpid():
            return cached[1]
        engine = engines.engine_for(self.conf)
        self.engine_of_pid = (os.getpid(), engine)
        return engine


def bind(
    cls: Any,
    app: celery.Celery,
    *,
    custom_key: bool,
    reserved: AbstractSet[str],
    custom_limit: bool = False,
) -> Binding:
    """``cls``'s binding to ``app``; a bad option or signature raises ConfigurationError."""
    try:
        parameters = celery_compat.run_parameters(cls)
    except (TypeError, ValueError) as exc:
        raise exceptions.ConfigurationError(
            f"Task {cls.name!r}: cannot read its signature ({exc})."
        ) from exc
    # Set lock_* and peer options, unwrapped (``reserved``: the class's own ``lock_*``
    # members that are not options); config.resolve() refuses the peers'.
    attributes: dict[str, Any] = {}
    for klass in reversed(cls.__mro__):
        for name in vars(klass):
            if (
                name.startswith("lock_")
                and (name in config.TASK_OPTIONS or name not in reserved)
            ) or name in config.PEER_OPTIONS:
                value = inspect.getattr_static(cls, name)
                if isinstance(value, staticmethod):
                    value = value.__func__
                if value is not None:
                    attributes[name] = value
                else:
                    attributes.pop(name, None)
    options = config.resolve(
        task_name=cls.name, attributes=attributes, conf=app.conf, parameters=parameters
    )
    call_keys = keys.CallKeys(
        options.task_name,
        options.namespace,
        options.name,
        parameters,
        options.lock_args,
        options.fixed_key,
    )
    if custom_limit:
        _refuse_per_key_limits(options)
    return Binding(options, app.conf, call_keys, custom_key, custom_limit)


def _refuse_per_key_limits(options: LockConfig) -> None:
    """lock_limit_for may give any key several slots: refuse what lock_limit > 1 refuses."""
    clash: str | None = None
    if options.fencing:
        clash = "lock_fencing=True (on the task or app.conf.pglock_fencing)"
    if options.enqueue is not None:
        clash = f"lock_enqueue={options.enqueue.value!r}"
    if clash is not None:
        raise exceptions.ConfigurationError(
            f"Task {options.task_name!r} overrides lock_limit_for, which may give a key "
            f"several slots, and has {clash}, which needs one run per key "
            "(docs/guide/limits.md): drop one of them."
        )


def per_key_limit(task: Any) -> bool:
    """``task`` (a SingletonTask) overrides lock_limit_for."""
    binding = type(task)._pglock
    return isinstance(binding, Binding) and binding.custom_limit


def limit_of(task: Any, options: LockConfig, args: Any, kwargs: Any) -> int:
    """The key's limit from the task's lock_limit_for, or ConfigurationError: a bad
    answer never runs the body without its lock."""
    limit = task.lock_limit_for(*args, **kwargs)
    if type(limit) is not int or not 1 <= limit <= keys.SLOT_MAX:
        raise exceptions.ConfigurationError(
            f"Task {options.task_name!r}: lock_limit_for returned {limit!r}; expected an "
            f"int from 1 to {keys.SLOT_MAX} (runs of the call's key at once)."
        )
    return limit


def settle(name: str, binding: Binding, app: celery.Celery) -> None:
    """Once bound: refuse what clashes with the app's other tasks, and set up what the
    app's settings ask of this process (metrics, pglock_history)."""
    refuse_a_shared_queue(name, binding, app)
    groups.refuse_another_limit(name, binding.config, app)
    metrics.configure(app.conf)
    history.configure(app.conf)


def refuse_a_shared_queue(name: str, binding: Binding, app: celery.Celery) -> None:
    """Refuse two lock_enqueue tasks sharing one key's queued row (ConfigurationError)."""
    queue = _queue_of(binding)
    if queue is None:
        return
    mine = binding.config
    for other in list(celery_compat.task_registry(app).values()):
        theirs = getattr(type(other), "_pglock", None)
        if (
            isinstance(theirs, Binding)
            and other.name != name
            and _queue_of(theirs) == queue
        ):
            raise exceptions.ConfigurationError(
                f"Tasks {other.name!r} and {name!r} both use lock_enqueue on lock "
                f"{mine.name!r} (namespace {mine.namespace!r}): a send of one would "
                "return the other's queued message, and its own work would never run. "
                "Give each task its own lock_name, or set lock_enqueue on one of them "
                "only (docs/guide/enqueue.md)."
            )


def _queue_of(binding: Binding) -> tuple[Any, ...] | None:
    """Where a lock_enqueue task's rows are keyed; None without, or with custom keys."""
    options = binding.config
    if options.enqueue is None or binding.custom_key:
        return None
    return options.namespace, options.name, options.fixed_key
