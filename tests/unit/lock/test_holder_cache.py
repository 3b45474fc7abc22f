"""The holder of a busy key is looked up once a second per key and session, and the
cache of those lookups keeps no session (and so no engine) alive."""

from __future__ import annotations

import gc
import weakref
from types import SimpleNamespace

from celery_pglock import keys
from celery_pglock.lock import holder_lookup


class Session:
    """Stands in for a lock-session strategy: only the lookup the cache wraps."""

    def __init__(self) -> None:
        self.lookups = 0

    def holder_of(self, key: keys.LockKey, *, bound: float) -> str:
        self.lookups += 1
        return "4242 pglock web-1:7 billing.settle"


def busy_lock(session: Session) -> SimpleNamespace:
    return SimpleNamespace(
        key=keys.make_key("ns", "billing.settle", 1),
        session=session,
        round_trip_timeout=1.0,
    )


def test_a_key_is_looked_up_once_per_session_within_the_window():
    first, second = Session(), Session()
    for _ in range(3):
        holder = holder_lookup.find(busy_lock(first))
        assert holder is not None
        assert (holder.backend_pid, holder.process) == (4242, "web-1:7")
    holder_lookup.find(busy_lock(second))
    assert (first.lookups, second.lookups) == (1, 1)


def test_the_cache_keeps_no_session_alive():
    session = Session()
    holder_lookup.find(busy_lock(session))
    gone = weakref.ref(session)
    del session
    gc.collect()
    assert gone() is None
