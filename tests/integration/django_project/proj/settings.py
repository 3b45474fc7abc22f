"""Good settings. The lock database URL comes from the test (PROJ_LOCK_DATABASE_URL)."""

from __future__ import annotations

import os

SECRET_KEY = "test-only"
INSTALLED_APPS = ["celery_pglock.contrib.django", "billing"]
USE_TZ = True

CELERY_BROKER_URL = "memory://"
CELERY_PGLOCK_DATABASE_URL = os.environ["PROJ_LOCK_DATABASE_URL"]
CELERY_PGLOCK_ON_BUSY = "skip"
CELERY_PGLOCK_NAMESPACE = "proj"
