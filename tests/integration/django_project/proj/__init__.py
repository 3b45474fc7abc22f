"""A minimal Django project laid out as Celery's Django guide shows (test_django.py).

Importing the Celery app here makes it the app ``@shared_task`` binds to.
"""

from __future__ import annotations

from .celery import app as celery_app

__all__ = ["celery_app"]
