"""The database boundary: lock engines, driver errors, URL redaction, the server probe.

Layer 2 of docs/design.md. May import ``exceptions``, ``config`` and ``keys`` only; never
the lock, watch, task or operator layers. The public helpers are re-exported here.
"""

from __future__ import annotations

from celery_pglock.db.engines import create_engine, engine_for, mask_url

__all__ = ["create_engine", "engine_for", "mask_url"]
