"""The database boundary: engines, driver errors, redaction, the server probe.
Imports only ``exceptions``, ``config`` and ``keys``. Why: docs/design.md ("Layers")."""

from __future__ import annotations

from celery_pglock.db.engines import create_engine, engine_for, mask_url

__all__ = ["create_engine", "engine_for", "mask_url"]
