"""Task options and app settings, resolved once at bind. A bottom layer: pure, no I/O,
nothing imported from above (docs/design.md, "Layers")."""

from __future__ import annotations

from celery_pglock.config.options import (
    DEFAULT_ON_BUSY,
    TASK_OPTIONS,
    Enqueue,
    LockConfig,
    LockScope,
    OnBusy,
    OnDuplicate,
    OnEnqueueError,
    OnLost,
    Rate,
    SkipResult,
    implied_on_busy,
)
from celery_pglock.config.peers import PEER_OPTIONS
from celery_pglock.config.resolution import resolve
from celery_pglock.config.settings import (
    DATABASE_URL_ENV,
    DATABASE_URL_SETTING,
    KNOWN_SETTINGS,
    ON_MISCONFIGURED_DATABASE_SETTING,
    OnMisconfiguredDatabase,
    app_seconds,
    check_unknown_settings,
    database_url,
    on_misconfigured_database,
)

__all__ = [
    "DATABASE_URL_ENV",
    "DATABASE_URL_SETTING",
    "DEFAULT_ON_BUSY",
    "KNOWN_SETTINGS",
    "ON_MISCONFIGURED_DATABASE_SETTING",
    "PEER_OPTIONS",
    "TASK_OPTIONS",
    "Enqueue",
    "LockConfig",
    "LockScope",
    "OnBusy",
    "OnDuplicate",
    "OnEnqueueError",
    "OnLost",
    "OnMisconfiguredDatabase",
    "Rate",
    "SkipResult",
    "app_seconds",
    "check_unknown_settings",
    "database_url",
    "implied_on_busy",
    "on_misconfigured_database",
    "resolve",
]
