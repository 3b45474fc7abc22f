"""A Django app whose tasks.py Celery's autodiscover_tasks() finds."""
