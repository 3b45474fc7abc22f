"""The ``pglock`` command (``celery pglock …`` and ``celery-pglock …``): an operator surface.

Beside the task layer in docs/design.md: may import any layer below it and ``fencing``;
nothing imports it but the entry points. docs/operations/cli.md is its manual.
"""

from __future__ import annotations

from celery_pglock.cli.commands import celery_command, main, standalone_command

__all__ = ["celery_command", "main", "standalone_command"]
