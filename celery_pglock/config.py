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

    SKIP = "skip"  #: Do not run the body; the run ends as lock_skip_result says.
    RAISE = "raise"  #: Raise LockBusy; the task fails.
    RETRY = "retry"  #: Re-queue with Celery's retry after lock_retry_delay seconds.
    WAIT = "wait"  #: Block at most lock_wait_timeout seconds, then raise LockBusy.


class OnError(str, enum.Enum):
    """What a SingletonTask does when the lock database fails at acquire.

    The body never runs without its lock, whatever the choice.
    """

    #: Outages are transient: re-queue with Celery's retry, backing off (bounded by
    #: lock_error_retries), then fail with DatabaseError. The default.
    RETRY = "retry"
    RAISE = "raise"  #: Fail at once with DatabaseError.


class SkipResult(str, enum.Enum):
    """How a run skipped by ``lock_on_busy='skip'`` ends for its caller and for monitors.

    See docs/guide/skipped-results.md for the effect on chains, groups and chords.
    """

    #: FAILURE with ``LockSkipped`` (listed in the task's ``throws``): ready at once,
    #: ``get()`` raises it, a task-failed event, chains and chords end. The default.
    FAILURE = "failure"
    #: SUCCESS with a skip record (a dict) as the value: ready at once, ``get()`` returns
    #: it, a task-succeeded event; link callbacks and the rest of a chain do not run.
    SUCCESS = "success"
    #: The state SKIPPED (not a Celery ready state: ``get()`` waits until its timeout, no
    #: terminal event). What celery-pglock did before 0.2.
    SKIPPED = "skipped"


class OnLost(str, enum.Enum):
    """What a SingletonTask does when its lock is lost while the body runs.

    Either way the loss is reported (``lock_lost`` signal, ERROR log, metric),
    ``current_lock().lost`` becomes True and the run ends FAILURE with LockLostError.
    See docs/operations/lock-loss.md.
    """

    SIGNAL = "signal"  #: Report it; the body goes on until it checks ensure_held().
    #: Report it and end the body with LockLostError where the pool allows it
    #: (prefork/solo: a signal to the main thread; threads: an asynchronous exception;
    #: gevent/eventlet cannot, and act as SIGNAL). The default: the duplicate that took
    #: the freed lock then overlaps the body for no longer than the detection.
    TERMINATE = "terminate"


class LockScope(str, enum.Enum):
    """How long a SingletonTask's lock lives."""

    #: pg_try_advisory_lock on a pinned connection, released when the task ends.
    SESSION = "session"
    #: pg_try_advisory_xact_lock in one transaction that the body can use; commit releases.
    TRANSACTION = "transaction"


#: Settings that were removed -> what to do instead (the unknown-setting check says it).
REMOVED_SETTINGS = {
    "pglock_session_mode": "session-scope try-locks always use the process's lock "
    "session, bounded waits and transaction scope a pooled connection per lock; delete "
    "the setting (see the changelog, and docs/design.md for the sessions)",
}

#: Task attribute -> app setting for the options that have an app-wide default.
APP_SETTINGS = {
    "lock_namespace": "pglock_namespace",
    "lock_on_busy": "pglock_on_busy",
    "lock_scope": "pglock_scope",
    "lock_retry_delay": "pglock_retry_delay",
    "lock_wait_timeout": "pglock_wait_timeout",
    "lock_skip_result": "pglock_skip_result",
    "lock_shadow": "pglock_shadow",
    "lock_on_error": "pglock_on_error",
    "lock_error_retries": "pglock_error_retries",
    "lock_error_backoff": "pglock_error_backoff",
    "lock_on_lost": "pglock_on_lost",
    "lock_watch_interval": "pglock_watch_interval",
    "lock_check_timeout": "pglock_check_timeout",
    "lock_fencing": "pglock_fencing",
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
)
#: Settings read by the metrics layer (metrics.py), validated by metrics.from_conf().
METRICS_SETTINGS = ("pglock_metrics", "pglock_metrics_port", "pglock_metrics_address")
KNOWN_SETTINGS = (*APP_SETTINGS.values(), *DATABASE_SETTINGS, *METRICS_SETTINGS)

DEFAULT_NAMESPACE = "default"
DEFAULT_RETRY_DELAY = 30.0
DEFAULT_WAIT_TIMEOUT = 10.0
DEFAULT_ERROR_RETRIES = 5
DEFAULT_ERROR_BACKOFF = 2.0
#: The longest countdown of a lock_on_error='retry' re-run, whatever the backoff.
MAX_ERROR_COUNTDOWN = 300.0
#: Seconds between two checks that a running body's lock is still held (0: never check).
DEFAULT_WATCH_INTERVAL = 1.0
#: Longest a lock check, or a release, may wait on the lock database.
DEFAULT_CHECK_TIMEOUT = 5.0
#: The soonest PostgreSQL may free the lock of a client cut off, with the server
#: keepalives of db.SERVER_KEEPALIVE_OPTIONS (idle 30 s, then 3 probes 10 s apart): if the
#: link breaks just before a scheduled probe, the 3 unanswered probes end the session
#: 3 x 10 s later. (Just after an answered probe it takes 30 + 3 x 10 = 60 s.)
SERVER_KEEPALIVE_DEADLINE = 10.0 * 3
#: Room kept under that deadline for ending the body once a loss is detected.
LOSS_MARGIN = 5.0


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class LockConfig:
    """The resolved locking options of one task."""

    task_name: str  #: The Celery task name, for messages.
    name: str  #: The lock name hashed into the key: lock_name or the task name.
    namespace: str = DEFAULT_NAMESPACE  #: Mixed into every key.
    on_busy: OnBusy = OnBusy.SKIP  #: What to do when the lock is held.
    scope: LockScope = LockScope.SESSION  #: Session or transaction lifetime.
    retry_delay: float = DEFAULT_RETRY_DELAY  #: Seconds before a RETRY re-run.
    #: Seconds a WAIT may block (server-side).
    wait_timeout: float = DEFAULT_WAIT_TIMEOUT
    #: How a skipped run ends (on_busy=skip only).
    skip_result: SkipResult = SkipResult.FAILURE
    #: Shadow mode: try the lock and report every outcome, but always run the body.
    shadow: bool = False
    #: What to do when the lock database fails at acquire.
    on_error: OnError = OnError.RETRY
    #: How many times a run is re-queued for database errors before it fails.
    error_retries: int = DEFAULT_ERROR_RETRIES
    #: Seconds before the first such re-run; doubled each time, at most 300 s.
    error_backoff: float = DEFAULT_ERROR_BACKOFF
    #: What to do when the lock is lost while the body runs.
    on_lost: OnLost = OnLost.TERMINATE
    #: Seconds between checks that the lock is still held while the body runs; 0
    #: turns the checks off (no loss detection).
    watch_interval: float = DEFAULT_WATCH_INTERVAL
    #: Longest a check or a release may wait on the lock database.
    check_timeout: float = DEFAULT_CHECK_TIMEOUT
    #: Issue a fencing token to each acquisition (docs/guide/fencing.md).
    fencing: bool = False
    lock_args: tuple[str, ...] = ()  #: Parameter names whose values form the key.
    lock_key: Callable[..., object] | None = None  #: Custom key-material function.
    fixed_key: keys.LockKey | None = None  #: The key when it never varies per call.


def check_unknown_settings(conf: Mapping[str, Any]) -> None:
    """Refuse ``pglock_*`` settings we do not know, with a did-you-mean hint.

    Settings loaded with a namespace (Django's ``config_from_object(...,
    namespace="CELERY")``) are checked under their own spelling, ``CELERY_PGLOCK_*``.
    """
    # Celery keeps a namespace's keys as given (CELERY_PGLOCK_ON_BUSY) and finds them
    # for conf.get("pglock_on_busy") through its prefix: check them under that name.
    # Listed first: a configuration not yet read (Celery's PendingConfiguration, as
    # from celery.current_app) reads itself then, and only then knows its prefix.
    settings = list(conf)
    prefix = getattr(conf, "prefix", None) or ""
    for setting in settings:
        spelled = setting
        if prefix and setting.upper().startswith(prefix.upper()):
            setting = setting[len(prefix) :].lower()
        if setting in REMOVED_SETTINGS:
            raise exceptions.ConfigurationError(
                f"The setting {spelled!r} was removed: {REMOVED_SETTINGS[setting]}."
            )
        if setting.lower().startswith("pglock_") and setting not in KNOWN_SETTINGS:
            hint = difflib.get_close_matches(setting, KNOWN_SETTINGS, n=1)
            known = KNOWN_SETTINGS
            if spelled != setting:  # show names the way this configuration writes them
                hint = [f"{prefix}{name}".upper() for name in hint]
                known = tuple(f"{prefix}{name}".upper() for name in known)
            raise exceptions.ConfigurationError(
                f"Unknown setting {spelled!r}"
                + (f"; did you mean {hint[0]!r}?" if hint else ".")
                + f" Known settings: {', '.join(known)}."
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
        if attribute in PEER_OPTIONS:
            raise peer_refusal(task_name, attribute, attributes[attribute])
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

    skip_result = _choice(
        task_name, *option("lock_skip_result", SkipResult.FAILURE), SkipResult
    )
    source, shadow = option("lock_shadow", False)
    if not isinstance(shadow, bool):
        raise _fail(task_name, source, shadow, "True or False")
    if shadow and scope is LockScope.TRANSACTION:
        raise _fail(
            task_name,
            source,
            shadow,
            "False with lock_scope='transaction' (a shadowed run that finds the lock "
            "busy has no lock transaction to lend its body). Set lock_shadow=False on "
            "this task to keep it out of shadow mode (an app-wide pglock_shadow then "
            "applies to the other tasks), or shadow it with lock_scope='session' first",
        )

    on_error = _choice(task_name, *option("lock_on_error", OnError.RETRY), OnError)
    source, error_retries = option("lock_error_retries", DEFAULT_ERROR_RETRIES)
    if (
        isinstance(error_retries, bool)
        or not isinstance(error_retries, int)
        or error_retries < 0
    ):
        raise _fail(task_name, source, error_retries, "a whole number >= 0")
    error_backoff = _seconds(
        task_name, *option("lock_error_backoff", DEFAULT_ERROR_BACKOFF)
    )

    on_lost = _choice(task_name, *option("lock_on_lost", OnLost.TERMINATE), OnLost)
    interval_source, interval_value = option(
        "lock_watch_interval", DEFAULT_WATCH_INTERVAL
    )
    watch_interval = (
        0.0  # 0 turns the checks off
        if type(interval_value) in (int, float) and interval_value == 0
        else _seconds(task_name, interval_source, interval_value)
    )
    timeout_source, check_timeout = option("lock_check_timeout", DEFAULT_CHECK_TIMEOUT)
    check_timeout = _seconds(task_name, timeout_source, check_timeout)
    if (
        watch_interval
        and conf.get("pglock_server_keepalives", True)
        and watch_interval + check_timeout + LOSS_MARGIN > SERVER_KEEPALIVE_DEADLINE
    ):
        # A holder cut off from the server must learn it before the server frees the
        # lock through its keepalives; see docs/operations/lock-loss.md.
        raise exceptions.ConfigurationError(
            f"Task {task_name!r}: {interval_source}={watch_interval!r} plus "
            f"{timeout_source}={check_timeout!r} is too long: a holder cut off from the "
            f"server would learn it after up to {watch_interval + check_timeout:g}s, "
            f"but the server may free its lock {SERVER_KEEPALIVE_DEADLINE:g}s after the "
            "link breaks (keepalives). Expected lock_watch_interval + lock_check_timeout <= "
            f"{SERVER_KEEPALIVE_DEADLINE - LOSS_MARGIN:g}."
        )
    source, fencing = option("lock_fencing", False)
    if not isinstance(fencing, bool):
        raise _fail(task_name, source, fencing, "True or False")

    given = [
        name for name in ("lock_args", "lock_key", "lock_id") if name in attributes
    ]
    if len(given) > 1:
        raise exceptions.ConfigurationError(
            f"Task {task_name!r}: set only one of lock_args, lock_key and lock_id "
            f"(got {' and '.join(given)}); each one defines the whole key."
        )

    lock_args = _valid_lock_args(task_name, attributes.get("lock_args", ()), parameters)
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
        skip_result=skip_result,
        shadow=shadow,
        on_error=on_error,
        error_retries=error_retries,
        error_backoff=error_backoff,
        on_lost=on_lost,
        watch_interval=watch_interval,
        check_timeout=check_timeout,
        fencing=fencing,
        lock_args=lock_args,
        lock_key=lock_key,
        fixed_key=fixed_key,
    )


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


# -- checks of one option's value (each error names the task, the option and what was
# expected: ``Task 'x': lock_retry_delay=-1 is invalid; expected a positive number``) --


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


def _valid_lock_args(
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


# -- the per-task options of the Redis-based peers, refused with their replacement
# (docs/migration.md) --


#: Per-task option names of the Redis-based peers, refused on a SingletonTask. Left in
#: place after a migration they would do nothing, and a task keyed per tenant through them
#: would silently run with one lock for all tenants. Each maps to the library it comes from.
#: App-wide ``singleton_*``/``ONCE`` settings are not refused: during a migration the peer
#: may still run other tasks of the same app.
PEER_OPTIONS = {
    "once": "celery-once",
    "unique_on": "celery-singleton",
    "raise_on_duplicate": "celery-singleton",
    "lock_expiry": "celery-singleton",
    "heimdall": "celery-heimdall",
}
#: What to do with a TTL option (lock_expiry, once's timeout, heimdall's unique_timeout).
_NO_EXPIRY = (
    "remove it: the lock ends with the run, or with its database session when a worker "
    "dies, so there is no expiry to choose"
)


def peer_refusal(
    task_name: str, option: str, value: object
) -> exceptions.ConfigurationError:
    """The error for a peer library's option, naming what to write instead."""
    return exceptions.ConfigurationError(
        f"Task {task_name!r}: {option!r} is a {PEER_OPTIONS[option]} option, which "
        "SingletonTask does not read (left in place, the task would run with one lock "
        f"for all argument values); {_equivalent(option, value)}. See the migration "
        "guide (docs/migration.md)."
    )


def _equivalent(option: str, value: object) -> str:
    def names(given: object) -> str:
        listed = [given] if isinstance(given, str) else given
        if isinstance(listed, (list, tuple)) and listed:
            return f"lock_args={tuple(listed)!r}"
        if isinstance(listed, (list, tuple)):
            return "no lock_args (one lock per task)"
        # celery-once without 'keys' locked on every argument
        return "lock_args naming every parameter"

    if option == "unique_on":
        return f"use {names(value)}"
    if option == "raise_on_duplicate":
        return "use lock_on_busy='raise', or leave the default lock_on_busy='skip'"
    if option == "lock_expiry":
        return _NO_EXPIRY
    if option == "once":
        keys_given = value.get("keys") if isinstance(value, dict) else None
        return (
            f"use {names(keys_given)} for its 'keys', lock_on_busy for 'graceful' "
            "('skip', the default, or 'raise'), and for 'timeout', " + _NO_EXPIRY
        )
    return (  # heimdall
        "use lock_args or lock_key for its 'key', lock_on_busy='raise' for "
        f"'unique_raises', and for 'unique_timeout', {_NO_EXPIRY}"
    )
