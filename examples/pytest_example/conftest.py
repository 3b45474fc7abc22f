"""What a project puts in its conftest.py to use the celery-pglock pytest plugin.

Nothing is imported from the plugin: ``pip install '/path/to/celery-pglock[pytest]'`` registers it,
and its fixtures only need to know which Celery app to run.
"""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def pglock_app_name() -> str:
    """The app under test, as ``celery -A`` takes it."""
    return "examples.tenant_export"
