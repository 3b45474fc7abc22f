"""App-wide ``pglock_*`` settings that are not a task's option, and every setting's name
(an unknown one is refused with the closest). docs/reference/settings.md."""

from __future__ import annotations

import difflib
import enum
import os
from typing import TYPE_CHECKING, Any

from celery_pglock import celery_compat, exceptions
from celery_pglock.config import options

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

DATABASE_URL_ENV = "CELERY_PGLOCK_DATABASE_URL"
DATABASE_URL_SETTING = "pglock_database_url"


class OnMisconfiguredDatabase(str, enum.Enum):
    """What a worker does when its lock database refuses it at start for a reason waiting
    does not fix (pglock_on_misconfigured_database; docs/operations/failure-modes.md)."""

    STOP = "stop"  #: Exit non-zero before "ready", the fix on stderr. The default.
    RUN = "run"  #: Log an ERROR and start anyway; each SingletonTask then fails.


ON_MISCONFIGURED_DATABASE_SETTING = "pglock_on_misconfigured_database"
#: Every setting (the options', db/'s, metrics/', the worker hooks'), to catch typos.
KNOWN_SETTINGS = (
    *options.APP_SETTINGS.values(),
    DATABASE_URL_SETTING,
    "pglock_engine_options",
    "pglock_application_name",
    "pglock_server_keepalives",
    "pglock_metrics",
    "pglock_metrics_port",
    "pglock_metrics_address",
    "pglock_history",
    ON_MISCONFIGURED_DATABASE_SETTING,
)


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


def on_misconfigured_database(conf: Mapping[str, Any]) -> OnMisconfiguredDatabase:
    """``pglock_on_misconfigured_database`` (default "stop"), or ConfigurationError."""
    setting = ON_MISCONFIGURED_DATABASE_SETTING
    value = conf.get(setting)
    if value is None:
        return OnMisconfiguredDatabase.STOP
    try:
        return options.choice(OnMisconfiguredDatabase)(value)  # type: ignore[no-any-return]
    except ValueError as exc:
        raise exceptions.ConfigurationError(
            f"{setting}={value!r} is invalid; expected {exc}: 'stop' to end the worker "
            "at start when the lock database refuses it (a wrong password, a missing "
            "database), 'run' to start anyway."
        ) from None


def app_seconds(conf: Mapping[str, Any], option: str) -> float:
    """The app-wide ``pglock_<option>`` in seconds, or the option's default when unset or
    invalid (binding a task refuses that): for code with no task at hand."""
    try:
        return options.seconds(conf.get(f"pglock_{option}"))
    except ValueError:
        return float(getattr(options.DEFAULTS, option))


def check_unknown_settings(conf: Mapping[str, Any]) -> None:
    """Refuse unknown ``pglock_*`` settings, named as written (CELERY_PGLOCK_*)."""
    # list() first: the settings know their namespace prefix once read (celery_compat).
    settings = list(conf)
    prefix = celery_compat.conf_prefix(conf)
    for spelled in settings:
        setting = spelled
        if prefix and setting.upper().startswith(prefix.upper()):
            setting = setting[len(prefix) :].lower()
        if not setting.lower().startswith("pglock_") or setting in KNOWN_SETTINGS:
            continue
        known: Sequence[str] = KNOWN_SETTINGS
        if spelled != setting:  # show names the way this configuration writes them
            known = [f"{prefix}{name}".upper() for name in known]
        raise unknown_name("", "setting", spelled, known)


def unknown_name(
    where: str, kind: str, spelled: str, known: Sequence[str]
) -> exceptions.ConfigurationError:
    """The error for an unknown option or setting ``spelled``, with the closest ``known``."""
    bare = spelled.lower().split("pglock_" if kind == "setting" else "lock_", 1)[-1]
    hint: list[str] | None = None  # set for a name that never existed
    if kind == "setting" and bare in options.PER_TASK:
        message = f"{spelled!r} is not a setting: set lock_{bare} on the task ({options.PER_TASK[bare]})."
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
