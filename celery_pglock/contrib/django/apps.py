"""The Django app: ``manage.py check`` reports bad lock settings (docs/guide/django.md)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import celery
from django.apps import AppConfig
from django.core import checks

from celery_pglock import celery_compat, config, exceptions, metrics
from celery_pglock.db import engines

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping, Sequence

#: The task name config.resolve's messages get for the app-wide defaults (then removed).
_DEFAULTS = "app-wide defaults"


class PgLockConfig(AppConfig):
    name = "celery_pglock.contrib.django"
    label = "celery_pglock"
    verbose_name = "celery-pglock"

    def ready(self) -> None:
        checks.register(check_settings, "celery_pglock")


def check_settings(
    app_configs: Sequence[AppConfig] | None = None, **_: Any
) -> list[checks.CheckMessage]:
    """Check the ``pglock_*`` settings of the current (the project's) Celery app, each alone."""
    conf = celery.current_app.conf
    messages: list[checks.CheckMessage] = []

    def run(check: Callable[[], object], error_id: str) -> bool:
        try:
            check()
        except exceptions.ConfigurationError as error:
            text = str(error).removeprefix(f"Task {_DEFAULTS!r}: ")
            messages.append(checks.Error(text, hint=_spelling_hint(conf), id=error_id))
            return False
        return True

    if run(lambda: config.check_unknown_settings(conf), "celery_pglock.E001"):
        run(lambda: _resolve_defaults(conf), "celery_pglock.E002")
    run(lambda: metrics.from_conf(conf), "celery_pglock.E002")
    try:
        url = config.database_url(conf)
    except exceptions.ConfigurationError as error:
        # The web process sends tasks without it; only workers (and eager runs) lock.
        messages.append(
            checks.Warning(
                str(error),
                hint="workers refuse to start without it, unless their environment "
                f"sets {config.DATABASE_URL_ENV}",
                id="celery_pglock.W001",
            )
        )
    else:
        run(lambda: engines.check_url(url), "celery_pglock.E003")
    return messages


def _resolve_defaults(conf: Mapping[str, Any]) -> None:
    config.resolve(task_name=_DEFAULTS, attributes={}, conf=conf, parameters=())


def _spelling_hint(conf: Any) -> str:
    prefix = celery_compat.conf_prefix(conf)
    if not prefix:
        return "Fix the setting the message names (app.conf.pglock_*)."
    return (
        f"Fix the setting the message names in settings.py: with "
        f"namespace={prefix.rstrip('_')!r}, app.conf.pglock_<name> is "
        f"{prefix.upper()}PGLOCK_<NAME>."
    )
