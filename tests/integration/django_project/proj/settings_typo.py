"""A misspelt lock setting."""

from __future__ import annotations

from .settings import *  # noqa: F403

CELERY_PGLOCK_ON_BUSSY = "raise"
