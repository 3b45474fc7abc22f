"""A lock database URL that is not PostgreSQL's."""

from __future__ import annotations

from .settings import *  # noqa: F403

CELERY_PGLOCK_DATABASE_URL = "mysql://app@db/app"
