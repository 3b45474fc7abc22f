"""Runnable examples of celery-pglock: the two scenarios of the article this library grew
from (docs/design.md, "The article") and the demo.

- ``examples.settlement``: the daily settlement job, one transaction, a numeric key.
- ``examples.tenant_export``: a per-tenant export under a session lock, made idempotent.
- ``examples.demo`` (run by ``bash scripts/demo.sh``) with ``examples.demo_app``.

Run them from the repository root, so that ``examples`` is importable by ``celery -A``.
"""

from __future__ import annotations
