"""The lock-loss watcher: notices, while a body runs, that its lock is gone.

Layer 4 of docs/design.md (docs/operations/lock-loss.md). May import the bottom, ``db``
and ``lock``; never ``task`` or the operator surfaces (the task hands it a callback).
"""

from __future__ import annotations
