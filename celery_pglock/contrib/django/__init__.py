"""Django integration, the one part that imports Django (docs/guide/django.md): with it in
``INSTALLED_APPS``, ``manage.py check`` reports bad lock settings."""
