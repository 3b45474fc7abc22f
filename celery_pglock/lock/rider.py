"""The seam features plug into the lock through: a statement that rides with the grant and
with the release, in the lock's own round trip. The lock sends it and knows nothing of what
it is for (docs/design.md, "Features plug into the lock")."""

from __future__ import annotations

import functools
from typing import Any, Protocol


class Rider(Protocol):
    """What a feature changes with a grant and with its release (``task.queued.Queued``)."""

    def on_grant(self) -> tuple[str, tuple[Any, ...]] | None:
        """A data-modifying statement ending in RETURNING, and its params (sent after the
        lock's own); None: nothing to send. Its ``{granted}`` is replaced by SQL that is
        true where the lock was granted."""
        ...

    def on_reply(self, changed: int) -> None:
        """How many rows ``on_grant``'s statement changed, once it has been sent."""
        ...

    def on_release(self) -> tuple[str, tuple[Any, ...]] | None:
        """The statement sent with the unlock, and its params; None: nothing to send."""
        ...


@functools.lru_cache(maxsize=64)
def riding(statement: str, change: str, granted: str = "true") -> str:
    """``statement`` (one SELECT) and ``change`` as one statement, the change applied where
    ``granted`` (SQL over ``l.g``, the statement's first column) is true, the rows it
    changed counted in a last column. MATERIALIZED: the lock functions run once; a
    data-modifying CTE always runs to completion."""
    change = change.format(granted=granted)
    # A crash may lose the last changes: a rider's rows must tolerate that (never block).
    return (
        f"WITH l(g) AS MATERIALIZED ({statement}), c AS ({change}), "
        "s AS MATERIALIZED (SELECT set_config('synchronous_commit', 'off', true)) "
        "SELECT l.*, (SELECT count(*) FROM c)::int FROM l, s"
    )
