"""A lock setting with a value no task may have."""

from __future__ import annotations

from .settings import *  # noqa: F403

CELERY_PGLOCK_ON_BUSY = "skp"
