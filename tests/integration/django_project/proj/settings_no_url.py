"""No lock database URL: a web process may send tasks without one."""

from __future__ import annotations

from .settings import *  # noqa: F403

del CELERY_PGLOCK_DATABASE_URL  # noqa: F821
