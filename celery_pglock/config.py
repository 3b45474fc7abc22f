"""Task options and app settings: resolved once when a task is bound, frozen, validated.

Resolution order for every option: the task's own attribute (decorator keyword or class
attribute), then ``app.conf.pglock_<option>``, then the default. Bad values raise
:class:`~celery_pglock.exceptions.ConfigurationError` naming the task, the option and what
was expected. Unknown ``lock_*`` task attributes and ``pglock_*`` settings are errors too,
so a typo can never silently run a task without the lock it was meant to have.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import inspect
import os
from typing import TYPE_CHECKING, Any

from celery_pglock import exceptions, keys

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping, Sequence

#: Environment variable read when ``app.conf.pglock_database_url`` is not set.
DATABASE_URL_ENV = "CELERY_PGLOCK_DATABASE_URL"
DATABASE_URL_SETTING = "pglock_database_url"


class OnBusy(str, enum.Enum):
    """What a SingletonTask does when its lock is already held."""

    SKIP = "skip"  #: Do not run the body; the result state is SKIPPED.
    RAISE = "raise"  #: Raise LockBusy; the task fails.
    RETRY = "retry"  #: Re-queue with Celery's retry after lock_retry_delay seconds.
    WAIT = "wait"  #: Block at most lock_wait_timeout seconds, then raise LockBusy.


class LockScope(str, enum.Enum):
    """How long a SingletonTask's lock lives."""

    #: pg_try_advisory_lock on a pinned connection, released when the task ends.
    SESSION = "session"
    #: pg_try_advisory_xact_lock in one transaction that the body can use; commit releases.
    TRANSACTION = "transaction"


class SessionMode(str, enum.Enum):
    """Which PostgreSQL session carries a process's session-scope locks."""

    #: One long-lived session per worker process carries all of its session-scope
    #: try-locks, with exclusion per key inside the process. The default for every pool.
    PER_PROCESS = "per_process"
    #: A pooled connection per held lock (transaction scope and bounded waits always
    #: work this way, whatever the setting).
    PER_LOCK = "per_lock"


SESSION_MODE_SETTING = "pglock_session_mode"

#: Task attribute -> app setting for the options that have an app-wide default.
APP_SETTINGS = {
    "lock_namespace": "pglock_namespace",
    "lock_on_busy": "pglock_on_busy",
    "lock_scope": "pglock_scope",
    "lock_retry_delay": "pglock_retry_delay",
    "lock_wait_timeout": "pglock_wait_timeout",
}
#: Options that only make sense per task.
TASK_ONLY_OPTIONS = ("lock_args", "lock_key", "lock_id", "lock_name")
TASK_OPTIONS = (*TASK_ONLY_OPTIONS, *APP_SETTINGS)
#: Settings read by the connection layer (db.py), listed here so typos are caught.
DATABASE_SETTINGS = (
    DATABASE_URL_SETTING,
    "pglock_engine_options",
    "pglock_application_name",
    "pglock_server_keepalives",
    SESSION_MODE_SETTING,
)
KNOWN_SETTINGS = (*APP_SETTINGS.values(), *DATABASE_SETTINGS)

DEFAULT_NAMESPACE = "default"
DEFAULT_RETRY_DELAY = 30.0
DEFAULT_WAIT_TIMEOUT = 10.0


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class LockConfig:
    """The resolved locking options of one task."""

    task_name: str  #: The Celery task name, for messages.
    name: str  #: The lock name hashed into the key: lock_name or the task name.
    namespace: str = DEFAULT_NAMESPACE  #: Mixed into every key.
    on_busy: OnBusy = OnBusy.SKIP  #: What to do when the lock is held.
    scope: LockScope = LockScope.SESSION  #: Session or transaction lifetime.
    retry_delay: float = DEFAULT_RETRY_DELAY  #: Seconds before a RETRY re-run.
    wait_timeout: float = (
        DEFAULT_WAIT_TIMEOUT  #: Seconds a WAIT may block (server-side).
    )
    lock_args: tuple[str, ...] = ()  #: Parameter names whose values form the key.
    lock_key: Callable[..., object] | None = None  #: Custom key-material function.
    fixed_key: keys.LockKey | None = None  #: The key when it never varies per call.


def _fail(
    task_name: str, option: str, value: object, expected: str
) -> exceptions.ConfigurationError:
    return exceptions.ConfigurationError(
        f"Task {task_name!r}: {option}={value!r} is invalid; expected {expected}."
    )


def _choice(
    task_name: str, option: str, value: object, enum_cls: type[enum.Enum]
) -> Any:
    try:
        return enum_cls(value)
    except ValueError:
        allowed = ", ".join(repr(member.value) for member in enum_cls)
        raise _fail(task_name, option, value, f"one of {allowed}") from None


def _seconds(task_name: str, option: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise _fail(task_name, option, value, "a positive number of seconds")
    if value == float("inf"):
        raise _fail(
            task_name,
            option,
            value,
            "a finite number of seconds (waits are always bounded)",
        )
    return float(value)


def check_unknown_settings(conf: Mapping[str, Any]) -> None:
    """Refuse ``pglock_*`` settings we do not know, with a did-you-mean hint."""
    for setting in conf:
        if (
            isinstance(setting, str)
            and setting.lower().startswith("pglock_")
            and setting not in KNOWN_SETTINGS
        ):
            hint = difflib.get_close_matches(setting, KNOWN_SETTINGS, n=1)
            raise exceptions.ConfigurationError(
                f"Unknown setting {setting!r}"
                + (f"; did you mean {hint[0]!r}?" if hint else ".")
                + f" Known settings: {', '.join(KNOWN_SETTINGS)}."
            )


def task_parameters(
    run: Callable[..., object], *, drop_self: bool
) -> list[inspect.Parameter]:
    """The parameters a caller passes to the task (``self`` removed for bound tasks)."""
    parameters = list(inspect.signature(run).parameters.values())
    return parameters[1:] if drop_self else parameters


def resolve(
    *,
    task_name: str,
    attributes: Mapping[str, Any],
    conf: Mapping[str, Any],
    parameters: Sequence[inspect.Parameter],
) -> LockConfig:
    """Resolve one task's options: task attribute > ``app.conf.pglock_*`` > default.

    Args:
        task_name: The Celery task name.
        attributes: The task's ``lock_*`` attributes that are not None.
        conf: The app configuration.
        parameters: The task's call parameters, to check ``lock_args`` against.

    Raises:
        ConfigurationError: naming the task, the option and what was expected.
    """
    for attribute in attributes:
        if attribute not in TASK_OPTIONS:
            hint = difflib.get_close_matches(attribute, TASK_OPTIONS, n=1)
            raise exceptions.ConfigurationError(
                f"Task {task_name!r}: unknown option {attribute!r}"
                + (f"; did you mean {hint[0]!r}?" if hint else ".")
                + f" Known options: {', '.join(TASK_OPTIONS)}."
            )
    check_unknown_settings(conf)

    def option(name: str, default: object) -> tuple[str, object]:
        """(how to name the option in an error, its value): task > app.conf > default."""
        if name in attributes:
            return name, attributes[name]
        setting = APP_SETTINGS.get(name)
        if setting is not None and conf.get(setting) is not None:
            return f"{name} (from app.conf.{setting})", conf[setting]
        return name, default

    source, namespace = option("lock_namespace", DEFAULT_NAMESPACE)
    if not isinstance(namespace, str) or not namespace:
        raise _fail(task_name, source, namespace, "a non-empty string")
    lock_name = attributes.get("lock_name", task_name)
    if not isinstance(lock_name, str) or not lock_name:
        raise _fail(task_name, "lock_name", lock_name, "a non-empty string")

    on_busy = _choice(task_name, *option("lock_on_busy", OnBusy.SKIP), OnBusy)
    scope = _choice(task_name, *option("lock_scope", LockScope.SESSION), LockScope)
    retry_delay = _seconds(task_name, *option("lock_retry_delay", DEFAULT_RETRY_DELAY))
    wait_timeout = _seconds(
        task_name, *option("lock_wait_timeout", DEFAULT_WAIT_TIMEOUT)
    )

    given = [
        name for name in ("lock_args", "lock_key", "lock_id") if name in attributes
    ]
    if len(given) > 1:
        raise exceptions.ConfigurationError(
            f"Task {task_name!r}: set only one of lock_args, lock_key and lock_id "
            f"(got {' and '.join(given)}); each one defines the whole key."
        )

    lock_args = _lock_args(task_name, attributes.get("lock_args", ()), parameters)
    lock_key = attributes.get("lock_key")
    if lock_key is not None and not callable(lock_key):
        raise _fail(
            task_name, "lock_key", lock_key, "a callable taking the task's arguments"
        )

    fixed_key: keys.LockKey | None = None
    if "lock_id" in attributes:
        fixed_key = keys.explicit_key(
            lock_name, attributes["lock_id"], where=f"Task {task_name!r}: lock_id"
        )
    elif not lock_args and lock_key is None:
        fixed_key = keys.make_key(namespace, lock_name)

    return LockConfig(
        task_name=task_name,
        name=lock_name,
        namespace=namespace,
        on_busy=on_busy,
        scope=scope,
        retry_delay=retry_delay,
        wait_timeout=wait_timeout,
        lock_args=lock_args,
        lock_key=lock_key,
        fixed_key=fixed_key,
    )


def _lock_args(
    task_name: str, value: object, parameters: Sequence[inspect.Parameter]
) -> tuple[str, ...]:
    names: tuple[object, ...]
    if isinstance(value, str):
        names = (value,)
    elif isinstance(value, (list, tuple)):
        names = tuple(value)
    else:
        raise _fail(
            task_name,
            "lock_args",
            value,
            "a parameter name or a tuple of parameter names",
        )
    by_name = {parameter.name: parameter for parameter in parameters}
    for name in names:
        parameter = by_name.get(name) if isinstance(name, str) else None
        if parameter is None:
            raise _fail(
                task_name,
                "lock_args",
                value,
                f"names of the task's parameters ({', '.join(by_name) or 'it takes none'}); "
                f"{name!r} is not one of them",
            )
        if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            raise _fail(
                task_name,
                "lock_args",
                value,
                f"named parameters; {name!r} is a *args/**kwargs catch-all, use lock_key instead",
            )
    if len(set(names)) != len(names):
        raise _fail(task_name, "lock_args", value, "each parameter name at most once")
    return tuple(str(name) for name in names)


def session_mode(conf: Mapping[str, Any]) -> SessionMode:
    """``app.conf.pglock_session_mode`` (default ``per_process``), validated.

    Raises:
        ConfigurationError: not one of the modes.
    """
    value = conf.get(SESSION_MODE_SETTING)
    if value is None:
        return SessionMode.PER_PROCESS
    try:
        return SessionMode(value)
    except ValueError:
        allowed = ", ".join(repr(member.value) for member in SessionMode)
        raise exceptions.ConfigurationError(
            f"{SESSION_MODE_SETTING}={value!r} is invalid; expected one of {allowed}."
        ) from None


def database_url(conf: Mapping[str, Any]) -> str:
    """The lock database URL: ``app.conf.pglock_database_url``, else the environment.

    Raises:
        ConfigurationError: neither is set.
    """
    url = conf.get(DATABASE_URL_SETTING) or os.environ.get(DATABASE_URL_ENV)
    if not url:
        raise exceptions.ConfigurationError(
            "No lock database configured: set app.conf.pglock_database_url or the "
            f"{DATABASE_URL_ENV} environment variable to a PostgreSQL URL such as "
            "postgresql+psycopg2://user:password@host/dbname."
        )
    return str(url)
