"""The lock-loss watcher. Why: docs/operations/lock-loss.md; imports: docs/design.md."""

from __future__ import annotations
