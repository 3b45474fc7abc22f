"""Imported only by the loader, as ``include=`` names it."""

from __future__ import annotations

from celery_pglock import SingletonTask
from tests.integration.cli_layouts.include_app import app


@app.task(base=SingletonTask, name="proj.tasks.export_tenant", lock_args=("tenant_id",))
def export_tenant(tenant_id):
    return tenant_id
