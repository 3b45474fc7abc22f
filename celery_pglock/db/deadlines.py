"""A client-side bound on the blocking round trips of lock connections (either driver).

A per-process reaper thread shuts an expired :class:`Bound`'s socket down, waking the
blocked ``recv`` at once; the caller handles a dead session. Why (a cut link outwaits
``statement_timeout``) and the numbers: docs/operations/lock-loss.md.
"""

from __future__ import annotations

import math
import os
import socket
import threading
import time
from typing import Any

from celery_pglock.db import driver_errors

#: How often the reaper looks for expired bounds (seconds): a bound fires within TICK.
TICK = 0.25
NO_ANSWER = "no answer in time: the socket was shut down and the session closed"

#: The reaper's lock: a bound is disarmed (``deadline = math.inf``) under it, so the
#: reaper never shuts a socket (or a reused fd number) down after its round trip returned.
guard = threading.Lock()
_watched: set[Bound] = set()
_reaper: threading.Thread | None = None


class Bound:
    """A deadline on the round trips of one connection: ``deadline`` (time.monotonic(),
    ``math.inf`` when disarmed), and ``fired`` once the reaper shut its socket down.
    One-shot as :func:`bounded` makes it, or long-lived: :func:`watch` it once, then arm
    it by setting ``deadline``."""

    __slots__ = ("connection", "deadline", "fd", "fired", "late_answer_fails")

    def __init__(
        self,
        connection: Any,
        deadline: float = math.inf,
        late_answer_fails: bool = True,
    ) -> None:
        self.connection = connection
        self.fd = connection.fileno()
        self.deadline = deadline
        self.fired = False
        self.late_answer_fails = late_answer_fails

    def __enter__(self) -> Bound:
        watch(self)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *rest: object) -> None:
        with guard:
            _watched.discard(self)
        if self.fired and exc_type is None and self.late_answer_fails:
            # The answer came after the socket was shut down: the session is ending.
            raise driver_errors.operational_error(self.connection)(NO_ANSWER)


def bounded(
    dbapi_connection: Any, seconds: float, *, late_answer_fails: bool = True
) -> Bound:
    """Shut the connection's socket down if the ``with`` block has not ended after
    ``seconds`` (a connection this process owns, one thread at a time; the caller closes
    it after a fired bound). A block ending without an error after its bound fired raises
    OperationalError on exit, unless ``late_answer_fails`` is False (check ``fired``)."""

    return Bound(dbapi_connection, time.monotonic() + seconds, late_answer_fails)


def watch(bound: Bound) -> None:
    """Have the reaper watch ``bound`` (started on first use in each process)."""
    global _reaper
    with guard:
        _watched.add(bound)
        if _reaper is None:
            _reaper = threading.Thread(
                target=_reap, name="celery-pglock-deadline", daemon=True
            )
            _reaper.start()


def unwatch(bound: Bound) -> None:
    with guard:
        _watched.discard(bound)


def explain(bound: Bound | None) -> str:
    """A clause for an error message: why the connection died, if the bound cut it."""
    return f" ({NO_ANSWER})" if bound is not None and bound.fired else ""


def _reap() -> None:
    while True:
        time.sleep(TICK)
        now = time.monotonic()
        with guard:
            for bound in _watched:
                if bound.deadline <= now:
                    bound.deadline = math.inf
                    bound.fired = True
                    try:
                        # fromfd() duplicates the descriptor; shutdown acts on the
                        # socket itself, so the blocked recv returns at once.
                        with socket.fromfd(
                            bound.fd, socket.AF_INET, socket.SOCK_STREAM
                        ) as sock:
                            sock.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass  # already closed: nothing is blocked on it any more


def _forget_after_fork() -> None:
    global _reaper, guard
    _reaper = None
    guard = threading.Lock()  # the parent's may have been held at the fork
    _watched.clear()  # the parent's round trips


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_after_fork)
