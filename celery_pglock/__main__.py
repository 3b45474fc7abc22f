"""``python -m celery_pglock``: the standalone ``celery-pglock`` command."""

from __future__ import annotations

import sys

from celery_pglock import cli

if __name__ == "__main__":
    sys.exit(cli.main())
