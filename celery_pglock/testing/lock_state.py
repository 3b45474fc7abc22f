"""What the lock layer holds and does in this process, for tests' assertions: the one place
where the suite looks at the package's private state, kept beside the package it reads."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

from celery_pglock.db import engines
from celery_pglock.lock import sessions
from celery_pglock.watch import loss_watcher

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

    import sqlalchemy as sa

    from celery_pglock.lock import AdvisoryLock


def claimed(engine: sa.Engine, ids: tuple[int, ...]) -> bool:
    """Whether a run of this process has claimed the key ``ids`` on ``engine``'s sessions."""
    claims = sessions.for_lock(engine).claims
    with claims._mutex:
        return claims._holder(ids) is not None


def process_held_keys(engine: sa.Engine) -> list[tuple[int, ...]]:
    """The keys held on ``engine``'s process session, in the order they were granted."""
    session = sessions.process_session(engine)
    with session._mutex:
        return list(session._owners)


def watched_locks() -> list[AdvisoryLock]:
    """The locks the loss watcher watches in this process (their bodies running)."""
    with loss_watcher._mutex:
        return [entry.lock for entry in loss_watcher._entries.values()]


@contextlib.contextmanager
def watcher_checks() -> Iterator[Callable[[], int]]:
    """Count the loss watcher's checks answered in this process while inside; yields the
    count so far."""
    count = 0
    evaluate = loss_watcher.Observer._evaluate

    def counted(self: Any, *args: Any) -> dict[int, str]:
        nonlocal count
        count += 1
        return evaluate(self, *args)

    loss_watcher.Observer._evaluate = counted  # type: ignore[method-assign,assignment]
    try:
        yield lambda: count
    finally:
        loss_watcher.Observer._evaluate = evaluate  # type: ignore[method-assign]


def holding_connection(lock: AdvisoryLock) -> Any:
    """The DBAPI connection of the session that holds ``lock`` (held), to look at or
    break in a test."""
    hold = lock._hold
    if hold is None:
        raise AssertionError(f"{lock!r} is not held")
    return hold.connection


def kept_connection(engine: sa.Engine) -> Any:
    """``engine``'s kept connection (lock_enqueue's claims, engines.on_kept), or None until
    a send opens it: its ``cursor``, its ``dbapi`` connection and its ``busy`` lock (held:
    sends take a pooled connection instead)."""
    return engines._kept.get(engine)
