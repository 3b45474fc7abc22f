"""The Django app of celery-pglock: it registers the settings check."""

from __future__ import annotations

from django.apps import AppConfig
from django.core import checks


class PgLockConfig(AppConfig):
    name = "celery_pglock.contrib.django"
    label = "celery_pglock"
    verbose_name = "celery-pglock"

    def ready(self) -> None:
        from celery_pglock.contrib.django import checks as pglock_checks

        checks.register(pglock_checks.check_settings, pglock_checks.TAG)
