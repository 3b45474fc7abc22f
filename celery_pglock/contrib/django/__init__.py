"""Django integration: add ``"celery_pglock.contrib.django"`` to ``INSTALLED_APPS`` and
``manage.py check`` reports bad lock settings (docs/guide/django.md).

The one part of celery-pglock that imports Django.
"""
