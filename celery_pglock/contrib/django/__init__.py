"""Django integration, the one part that imports Django: docs/guide/django.md."""
