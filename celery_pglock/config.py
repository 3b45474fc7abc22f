"""Task options and app settings: resolved once when a task is bound, frozen, validated.
Each option and setting: docs/reference/options.md, docs/reference/settings.md."""

from __future__ import annotations

import dataclasses
import difflib
import enum
import os
from typing import TYPE_CHECKING, Any

from celery_pglock import exceptions, keys

if TYPE_CHECKING:
    import inspect
    from collections.abc import Callable, Mapping, Sequence

DATABASE_URL_ENV = "CELERY_PGLOCK_DATABASE_URL"
DATABASE_URL_SETTING = "pglock_database_url"


class OnBusy(str, enum.Enum):
    """What a SingletonTask does when its lock is already held."""

    SKIP = "skip"  #: Do not run the body; the run ends as lock_skip_result says.
    RAISE = "raise"  #: Raise LockBusy; the task fails.
    RETRY = "retry"  #: Re-queue with Celery's retry after lock_retry_delay seconds.
    WAIT = "wait"  #: Block at most lock_wait_timeout seconds, then raise LockBusy.


class SkipResult(str, enum.Enum):
    """How a run skipped by ``lock_on_busy='skip'`` ends (docs/guide/skipped-results.md)."""

    #: FAILURE with ``LockSkipped`` (listed in the task's ``throws``). The default.
    FAILURE = "failure"
    #: SUCCESS with a skip record (a dict); link callbacks and the rest of a chain do not run.
    SUCCESS = "success"


class OnLost(str, enum.Enum):
    """What a SingletonTask does on losing its lock mid-body (the run ends FAILURE either way)."""

    SIGNAL = "signal"  #: Report it; the body goes on until it checks ensure_held().
    #: Also end the body with LockLostError (gevent/eventlet: as SIGNAL). The default.
    TERMINATE = "terminate"


class Enqueue(str, enum.Enum):
    """How long a message keeps a key's other sends from being published (lock_enqueue)."""

    #: From publish until its run ends: a duplicate send returns the queued one's result.
    UNTIL_FINISHED = "until_finished"
    #: From publish until its run starts: one running and at most one queued per key.
    UNTIL_STARTED = "until_started"


class OnDuplicate(str, enum.Enum):
    """What a send of a key already queued returns (lock_enqueue_on_duplicate)."""

    RETURN = "return"  #: The queued message's AsyncResult (its task id). The default.
    RAISE = "raise"  #: AlreadyQueued, carrying the queued message's task id.


class OnEnqueueError(str, enum.Enum):
    """What a send does when the lock database cannot be asked (lock_enqueue_on_error)."""

    RAISE = "raise"  #: EnqueueUnavailable; nothing is published. The default.
    PUBLISH = (
        "publish"  #: Publish unchecked (WARNING, metric); the run lock still guards.
    )


class OnMisconfiguredDatabase(str, enum.Enum):
    """What a worker does when its lock database refuses it at start for a reason waiting
    does not fix (pglock_on_misconfigured_database; docs/operations/failure-modes.md)."""

    #: Exit non-zero before "ready", the refusal and its fix on stderr. The default.
    STOP = "stop"
    #: Log an ERROR and start anyway; each SingletonTask then fails at once.
    RUN = "run"


class LockScope(str, enum.Enum):
    """How long a SingletonTask's lock lives."""

    #: A session-level advisory lock (pg_advisory_lock family), released when the run ends.
    SESSION = "session"
    #: pg_try_advisory_xact_lock in one transaction that the body can use; commit releases.
    TRANSACTION = "transaction"


DEFAULT_DB_TIMEOUT = 5.0  #: lock_db_timeout / pglock_db_timeout unless set.


def is_seconds(value: object) -> bool:
    """A valid number of seconds (a positive finite int or float, not a bool)."""
    try:
        _seconds(value)
    except ValueError:
        return False
    return True


def app_seconds(conf: Mapping[str, Any], option: str) -> float:
    """The app-wide ``pglock_<option>`` in seconds, or the option's default when unset or
    invalid (a task that binds refuses an invalid one with its fix): for code with no task
    at hand, as an engine's connect or a message of a task this process does not know."""
    value: Any = conf.get(f"pglock_{option}")
    return float(value) if is_seconds(value) else float(getattr(_DEFAULTS, option))


def _seconds(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError("a positive number of seconds")
    if value == float("inf"):
        raise ValueError("a finite number of seconds (waits are always bounded)")
    return float(value)


def _choice(enum_cls: type[enum.Enum]) -> Callable[[object], Any]:
    def check(value: object) -> Any:
        try:
            return enum_cls(value)
        except ValueError:
            allowed = ", ".join(repr(member.value) for member in enum_cls)
            raise ValueError(f"one of {allowed}") from None

    return check


def _expect(test: Callable[[Any], object], expected: str) -> Callable[[object], Any]:
    def check(value: object) -> object:
        if not test(value):
            raise ValueError(expected)
        return value

    return check


_flag = _expect(lambda value: isinstance(value, bool), "True or False")
_text = _expect(lambda value: isinstance(value, str) and value, "a non-empty string")


def _skip_result(value: object) -> SkipResult:
    if value == "skipped":
        raise ValueError(
            "'failure' or 'success': 'skipped' was removed, because its SKIPPED state is "
            "not a ready state (get() waits for its timeout, monitors show STARTED for "
            "ever, a chord never completes); see docs/guide/skipped-results.md"
        )
    return _choice(SkipResult)(value)  # type: ignore[no-any-return]


def _optional(check: Callable[[object], Any]) -> Callable[[object], Any]:
    return lambda value: None if value is None else check(value)


def _interval(value: object) -> float:
    return 0.0 if type(value) in (int, float) and value == 0 else _seconds(value)


#: LockConfig field -> its check, for options set as lock_<field> or pglock_<field>.
_CHECKS: dict[str, Callable[[object], Any]] = {
    "namespace": _text,
    "on_busy": _choice(OnBusy),
    "scope": _choice(LockScope),
    "retry_delay": _seconds,
    "wait_timeout": _seconds,
    "skip_result": _skip_result,
    "shadow": _flag,
    "on_lost": _choice(OnLost),
    "watch_interval": _interval,
    "db_timeout": _seconds,
    "fencing": _flag,
    "enqueue": _optional(_choice(Enqueue)),
    "enqueue_on_duplicate": _choice(OnDuplicate),
    "enqueue_on_error": _choice(OnEnqueueError),
    "enqueue_lost_after": _seconds,
}
_AUTORETRY = (
    "a DatabaseError at acquire is retried by Celery's own options, as for the body: "
    "autoretry_for=(celery_pglock.DatabaseError,) with retry_backoff and max_retries "
    "(docs/guide/retries.md)"
)
#: Removed option names (without lock_/pglock_) -> what replaces them (docs/migration.md).
REMOVED = {
    "on_error": _AUTORETRY,
    "error_retries": _AUTORETRY,
    "error_backoff": _AUTORETRY,
    "key": "use lock_args for keys made of arguments, or override "
    "lock_key_for(*args, **kwargs) in a SingletonTask subclass (docs/guide/keys.md)",
    "session_mode": "session-scope try-locks always use the process's lock session, "
    "bounded waits and transaction scope a pooled connection per lock; delete the setting "
    "(CHANGELOG.md)",
    "check_timeout": "it is renamed lock_db_timeout (app-wide: pglock_db_timeout), as it "
    "bounds every round trip to the lock database, not only the lock check",
}

#: Soonest the server's keepalives free a cut-off client's lock; the margin kept under it.
SERVER_KEEPALIVE_DEADLINE = 10.0 * 3
LOSS_MARGIN = 5.0


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class LockConfig:
    """The resolved locking options of one task (docs/reference/options.md)."""

    task_name: str  #: The Celery task name, for messages.
    name: str  #: The lock name hashed into the key: lock_name or the task name.
    namespace: str = "default"  #: Mixed into every key.
    on_busy: OnBusy = OnBusy.SKIP  #: What to do when the lock is held.
    scope: LockScope = LockScope.SESSION  #: Session or transaction lifetime.
    retry_delay: float = 30.0  #: Seconds before a lock_on_busy='retry' re-run.
    wait_timeout: float = 10.0  #: Seconds a lock_on_busy='wait' may block.
    skip_result: SkipResult = SkipResult.FAILURE  #: How a skipped run ends.
    shadow: bool = False  #: Try the lock and report, but always run the body.
    on_lost: OnLost = OnLost.TERMINATE  #: What to do when the lock is lost.
    #: Seconds between checks that the lock is still held; 0: no loss detection.
    watch_interval: float = 1.0
    db_timeout: float = (
        DEFAULT_DB_TIMEOUT  #: Longest one round trip to the lock database may take.
    )
    fencing: bool = False  #: Issue a fencing token to each acquisition.
    enqueue: Enqueue | None = (
        None  #: Keep duplicates out of the queue (None: run lock only).
    )
    enqueue_on_duplicate: OnDuplicate = (
        OnDuplicate.RETURN
    )  #: A duplicate send's answer.
    enqueue_on_error: OnEnqueueError = (
        OnEnqueueError.RAISE
    )  #: Lock database unreachable.
    #: Seconds past its due time before a never-started message stops holding its key.
    enqueue_lost_after: float = 3600.0
    limit: int = 1  #: Runs of one key at once (lock_limit): its slots.
    period: float | None = None  #: At most one start per key per this many seconds.
    lock_args: tuple[str, ...] = ()  #: Parameter names whose values form the key.
    fixed_key: keys.LockKey | None = None  #: The key when it never varies per call.


_DEFAULTS = LockConfig(task_name="", name="")
APP_SETTINGS = {f"lock_{field}": f"pglock_{field}" for field in _CHECKS}
#: Options without an app-wide setting -> why (lock_period: per key, not per app).
PER_TASK = {"period": "a period of its own for each task that needs one"}
TASK_OPTIONS = (
    "lock_args",
    "lock_id",
    "lock_limit",
    "lock_name",
    "lock_period",
    *APP_SETTINGS,
)
# Settings read by db/ and metrics.py (which validates its own), known to catch typos.
DATABASE_SETTINGS = (
    DATABASE_URL_SETTING,
    "pglock_engine_options",
    "pglock_application_name",
    "pglock_server_keepalives",
)
METRICS_SETTINGS = ("pglock_metrics", "pglock_metrics_port", "pglock_metrics_address")
ON_MISCONFIGURED_DATABASE_SETTING = "pglock_on_misconfigured_database"
#: Settings read by the worker's start-up hooks (task/worker_hooks.py).
WORKER_SETTINGS = (ON_MISCONFIGURED_DATABASE_SETTING,)
KNOWN_SETTINGS = (
    *APP_SETTINGS.values(),
    *DATABASE_SETTINGS,
    *METRICS_SETTINGS,
    *WORKER_SETTINGS,
)


def on_misconfigured_database(conf: Mapping[str, Any]) -> OnMisconfiguredDatabase:
    """``pglock_on_misconfigured_database`` (default "stop"), or ConfigurationError."""
    setting = ON_MISCONFIGURED_DATABASE_SETTING
    value = conf.get(setting)
    if value is None:
        return OnMisconfiguredDatabase.STOP
    try:
        return _choice(OnMisconfiguredDatabase)(value)  # type: ignore[no-any-return]
    except ValueError as exc:
        raise exceptions.ConfigurationError(
            f"{setting}={value!r} is invalid; expected {exc}: 'stop' to end the worker "
            "at start when the lock database refuses it (a wrong password, a missing "
            "database), 'run' to start anyway."
        ) from None


def check_unknown_settings(conf: Mapping[str, Any]) -> None:
    """Refuse unknown or removed ``pglock_*`` settings, named as written (CELERY_PGLOCK_*)."""
    # list() first: a PendingConfiguration (celery.current_app) knows its prefix once read.
    settings = list(conf)
    prefix = getattr(conf, "prefix", None) or ""
    for spelled in settings:
        setting = spelled
        if prefix and setting.upper().startswith(prefix.upper()):
            setting = setting[len(prefix) :].lower()
        if not setting.lower().startswith("pglock_") or setting in KNOWN_SETTINGS:
            continue
        known: Sequence[str] = KNOWN_SETTINGS
        if spelled != setting:  # show names the way this configuration writes them
            known = [f"{prefix}{name}".upper() for name in known]
        raise _unknown("", "setting", spelled, known)


def _unknown(
    where: str, kind: str, spelled: str, known: Sequence[str]
) -> exceptions.ConfigurationError:
    bare = spelled.lower().split("pglock_" if kind == "setting" else "lock_", 1)[-1]
    hint: list[str] | None = None  # set for a name that never existed
    if bare in REMOVED:
        message = f"{where}{kind} {spelled!r} was removed: {REMOVED[bare]}."
    elif kind == "setting" and bare in PER_TASK:
        message = f"{spelled!r} is not a setting: set lock_{bare} on the task ({PER_TASK[bare]})."
    else:
        hint = difflib.get_close_matches(spelled, known, n=1)
        message = (
            f"{where}unknown {kind} {spelled!r}"
            + (f"; did you mean {hint[0]!r}?" if hint else ".")
            + f" Known {kind}s: {', '.join(known)}."
        )
    return exceptions.ConfigurationError(
        message[0].upper() + message[1:],
        unknown=None if hint is None else spelled,
        suggestion=hint[0] if hint else None,
    )


def resolve(
    *,
    task_name: str,
    attributes: Mapping[str, Any],
    conf: Mapping[str, Any],
    parameters: Sequence[inspect.Parameter],
) -> LockConfig:
    """One task's options: attribute, else app setting, else default (or ConfigurationError)."""
    for attribute in attributes:
        if attribute in PEER_OPTIONS:
            raise peer_refusal(task_name, attribute, attributes[attribute])
        if attribute not in TASK_OPTIONS:
            raise _unknown(f"Task {task_name!r}: ", "option", attribute, TASK_OPTIONS)
    check_unknown_settings(conf)

    values: dict[str, Any] = {}
    source: dict[str, str] = {}  # how to name each option in an error
    for field, check in _CHECKS.items():
        name, setting = f"lock_{field}", f"pglock_{field}"
        where, value = name, getattr(_DEFAULTS, field)
        if name in attributes:
            value = attributes[name]
        elif conf.get(setting) is not None:
            where, value = f"{name} (from app.conf.{setting})", conf[setting]
        source[field] = where
        try:
            values[field] = check(value)
        except ValueError as exc:
            raise _fail(task_name, where, value, str(exc)) from None
    period = attributes.get("lock_period")
    if period is not None:
        try:
            period = _seconds(period)
        except ValueError as exc:
            raise _fail(task_name, "lock_period", period, str(exc)) from None
    lock_name = attributes.get("lock_name", task_name)
    if not isinstance(lock_name, str) or not lock_name:
        raise _fail(task_name, "lock_name", lock_name, "a non-empty string")
    if values["shadow"] and values["scope"] is LockScope.TRANSACTION:
        raise _fail(
            task_name,
            source["shadow"],
            True,
            "False with lock_scope='transaction' (a shadowed busy run has no lock "
            "transaction to lend its body): set lock_shadow=False on this task, or "
            "shadow it with lock_scope='session' first",
        )
    limit = attributes.get("lock_limit", 1)
    if type(limit) is not int or not 1 <= limit <= keys.SLOT_MAX:
        expected = f"an int from 1 to {keys.SLOT_MAX} (runs of one key at once)"
        raise _fail(task_name, "lock_limit", limit, expected)
    if limit > 1 and values["fencing"]:
        raise _fail(
            task_name,
            source["fencing"],
            True,
            f"False with lock_limit={limit} (a fencing token orders the holders of one "
            "key, and lock_limit lets several hold it at once): set lock_fencing=False on "
            "this task, or lock_limit=1",
        )
    if values["enqueue"] is not None:
        if limit > 1:
            raise _fail(
                task_name,
                "lock_limit",
                limit,
                "1 with lock_enqueue (a queued row belongs to one running message; "
                "several slots of one key would share it)",
            )
        _check_enqueue(task_name, values, source, attributes, conf)
    interval, timeout = values["watch_interval"], values["db_timeout"]
    if (
        interval
        and conf.get("pglock_server_keepalives", True)
        and interval + timeout + LOSS_MARGIN > SERVER_KEEPALIVE_DEADLINE
    ):
        raise exceptions.ConfigurationError(  # docs/operations/lock-loss.md
            f"Task {task_name!r}: {source['watch_interval']}={interval!r} plus "
            f"{source['db_timeout']}={timeout!r} is too long: a holder cut off from the "
            f"server learns it after up to {interval + timeout:g}s, but the server may "
            f"free its lock {SERVER_KEEPALIVE_DEADLINE:g}s after the link breaks. "
            "Expected lock_watch_interval + lock_db_timeout <= "
            f"{SERVER_KEEPALIVE_DEADLINE - LOSS_MARGIN:g}."
        )

    if "lock_args" in attributes and "lock_id" in attributes:
        raise exceptions.ConfigurationError(
            f"Task {task_name!r}: set only one of lock_args and lock_id; each one "
            "defines the whole key."
        )
    lock_args = _valid_lock_args(task_name, attributes.get("lock_args", ()), parameters)
    fixed_key: keys.LockKey | None = None
    if "lock_id" in attributes:
        fixed_key = keys.explicit_key(
            lock_name, attributes["lock_id"], where=f"Task {task_name!r}: lock_id"
        )
    elif not lock_args:
        fixed_key = keys.make_key(values["namespace"], lock_name)
    return LockConfig(
        task_name=task_name,
        name=lock_name,
        lock_args=lock_args,
        fixed_key=fixed_key,
        limit=limit,
        period=period,
        **values,
    )


def _check_enqueue(
    task_name: str,
    values: dict[str, Any],
    source: dict[str, str],
    attributes: Mapping[str, Any],
    conf: Mapping[str, Any],
) -> None:
    where = source["enqueue"]
    if values["scope"] is LockScope.TRANSACTION:
        raise _fail(
            task_name,
            where,
            values["enqueue"].value,
            "None with lock_scope='transaction' (the queued row would change with the "
            "body's transaction, and every send of the key would wait for it): use "
            "lock_scope='session' for a task with lock_enqueue",
        )
    if values["shadow"]:
        raise _fail(
            task_name,
            source["shadow"],
            True,
            "False with lock_enqueue (a shadowed task must publish every send to "
            "report what the lock would do): set lock_shadow=False on this task, or "
            "shadow the run lock first and add lock_enqueue after",
        )
    user_set = "lock_on_busy" in attributes or conf.get("pglock_on_busy") is not None
    if values["enqueue"] is Enqueue.UNTIL_STARTED and not user_set:
        # The queued follow-up is delivered while the run holds the key: skipping it
        # would lose the change it carries (docs/guide/enqueue.md).
        values["on_busy"] = OnBusy.WAIT


def database_url(conf: Mapping[str, Any]) -> str:
    """``app.conf.pglock_database_url``, else the environment, else ConfigurationError."""
    url = conf.get(DATABASE_URL_SETTING) or os.environ.get(DATABASE_URL_ENV)
    if not url:
        raise exceptions.ConfigurationError(
            "No lock database configured: set app.conf.pglock_database_url or the "
            f"{DATABASE_URL_ENV} environment variable to a PostgreSQL URL such as "
            "postgresql+psycopg2://user:password@host/dbname."
        )
    return str(url)


def _fail(
    task_name: str, option: str, value: object, expected: str
) -> exceptions.ConfigurationError:
    return exceptions.ConfigurationError(
        f"Task {task_name!r}: {option}={value!r} is invalid; expected {expected}."
    )


def _valid_lock_args(
    task_name: str, value: object, parameters: Sequence[inspect.Parameter]
) -> tuple[str, ...]:
    names = (value,) if isinstance(value, str) else value
    if not isinstance(names, (list, tuple)):
        expected = "a parameter name or a tuple of parameter names"
        raise _fail(task_name, "lock_args", value, expected)
    by_name = {parameter.name: parameter for parameter in parameters}
    for name in names:
        parameter = by_name.get(name) if isinstance(name, str) else None
        if parameter is None:
            expected = f"names of the task's parameters ({', '.join(by_name) or 'it takes none'}); {name!r} is not one of them"
            raise _fail(task_name, "lock_args", value, expected)
        if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            expected = f"named parameters; {name!r} is a *args/**kwargs catch-all, (override lock_key_for for keys that are not plain arguments)"
            raise _fail(task_name, "lock_args", value, expected)
    if len(set(names)) != len(names):
        raise _fail(task_name, "lock_args", value, "each parameter name at most once")
    return tuple(names)


#: Peers' per-task options -> (library, what it would do left in place, what instead):
#: refused, as they would do nothing. Their app-wide settings are not: a peer may still
#: run other tasks (docs/migration.md).
_UNKEYED = (
    "its key names would not pick the lock, which follows lock_args (without them, one "
    "lock covers every argument value)"
)
PEER_OPTIONS = {
    "once": (
        "celery-once",
        f"{_UNKEYED}, and no other part of it would do anything",
        "use lock_enqueue='until_finished' with {keys} for its 'keys', "
        "lock_enqueue_on_duplicate for 'graceful' ('return', the default, or 'raise'), "
        "lock_enqueue='until_started' for 'unlock_before_run', and for 'timeout', "
        "{no_expiry}",
    ),
    "unique_on": (
        "celery-singleton",
        _UNKEYED,
        "use lock_enqueue='until_finished' with {keys}",
    ),
    "raise_on_duplicate": (
        "celery-singleton",
        "a duplicate would not raise",
        "use lock_enqueue_on_duplicate='raise' with lock_enqueue='until_finished'",
    ),
    "lock_expiry": (
        "celery-singleton",
        "it would set no expiry, and none is needed",
        "{no_expiry}",
    ),
    "heimdall": (
        "celery-heimdall",
        "its 'key' would not pick the lock, which follows lock_args, and its other "
        "parts would do nothing",
        "use lock_args (or override lock_key_for) for its 'key', lock_on_busy='raise' for "
        "'unique_raises', and for 'unique_timeout', {no_expiry}",
    ),
}


def peer_refusal(
    task_name: str, option: str, value: object
) -> exceptions.ConfigurationError:
    names = value  # unique_on, or celery-once's 'keys' (without them: every argument)
    if option != "unique_on":
        names = value.get("keys", ...) if isinstance(value, dict) else ...
    names = [names] if isinstance(names, str) else names
    library, left_in_place, instead = PEER_OPTIONS[option]
    instead = instead.format(
        keys=f"lock_args={tuple(names)!r}"
        if isinstance(names, (list, tuple)) and names
        else "no lock_args (one lock per task)"
        if isinstance(names, (list, tuple))
        else "lock_args naming every parameter",
        no_expiry="remove it: the lock ends with the run, or with its database "
        "session when a worker dies, so there is no expiry to choose "
        "(lock_enqueue_lost_after bounds only a message that never starts)",
    )
    return exceptions.ConfigurationError(
        f"Task {task_name!r}: {option!r} is a {library} option, which SingletonTask "
        f"does not read (left in place, {left_in_place}); {instead}. See the "
        "migration guide (docs/migration.md)."
    )
