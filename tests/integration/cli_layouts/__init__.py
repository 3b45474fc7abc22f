"""Celery apps in the two usual layouts, whose tasks only a worker's start-up imports.

The CLI tests run ``celery -A <one of these> pglock ...`` in a subprocess, so that nothing
but the command itself imports the task modules.
"""
