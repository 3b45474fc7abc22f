"""A Django-style app package: its tasks live in ``tasks.py``, found by autodiscovery."""
