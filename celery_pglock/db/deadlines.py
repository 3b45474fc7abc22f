"""A client-side bound on one blocking round trip of a lock connection (either driver).

A lock statement sent on a cut or frozen link waits for an answer that may never come:
``statement_timeout`` is enforced by the server, which never saw the statement, and TCP
gives up on unacknowledged data only after minutes (a frozen middlebox acknowledges
everything). Releases blocked 25-214 s that way. :func:`bounded` closes the gap: if the
round trip has not returned after ``seconds``, a per-process reaper thread shuts the
socket down (``shutdown(SHUT_RDWR)``), which wakes the blocked ``recv`` at once; libpq then
reports a lost connection, and the caller handles it as it handles any dead session
(closing it, which is the one release PostgreSQL always honours).

Cost on the hot path: one small object and two uncontended lock round trips. The reaper
thread is started on first use in each process and wakes every :data:`TICK` seconds, so
a bound is enforced within ``seconds + TICK``; it never runs SQL and never touches a
connection whose round trip has returned.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from typing import Any

from celery_pglock.db import driver_errors

#: How often the reaper looks for expired round trips (seconds).
TICK = 0.25


class Bound:
    """One bounded round trip (a context manager, see :func:`bounded`); ``fired`` tells
    the caller why its connection died."""

    __slots__ = ("connection", "deadline", "done", "fd", "fired", "late_answer_fails")

    def __init__(
        self, connection: Any, deadline: float, late_answer_fails: bool
    ) -> None:
        self.connection = connection
        self.fd = connection.fileno()
        self.deadline = deadline
        self.done = False
        self.fired = False
        self.late_answer_fails = late_answer_fails

    def __enter__(self) -> Bound:
        if _reaper is None:
            _start_reaper()
        with _guard:
            _pending[id(self)] = self
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *rest: object) -> None:
        # Under the guard, so the reaper never shuts down a socket (or a reused fd
        # number) after the round trip has returned.
        with _guard:
            self.done = True
            _pending.pop(id(self), None)
        if self.fired and exc_type is None and self.late_answer_fails:
            # The answer came, but after the reaper had shut the socket down (this
            # thread was descheduled in between): the server is ending the session and
            # everything it holds. A dead session, however well the statement went.
            raise driver_errors.operational_error(self.connection)(
                "no answer in time: the socket was shut down and the session closed"
            )


_pending: dict[int, Bound] = {}
_guard = threading.Lock()
#: This process's reaper thread (a forked child starts its own: see _forget_after_fork).
_reaper: threading.Thread | None = None


def bounded(
    dbapi_connection: Any, seconds: float, *, late_answer_fails: bool = True
) -> Bound:
    """Shut the connection's socket down if the ``with`` block has not ended after
    ``seconds``.

    Only for a connection this process owns, used by one thread at a time. After a
    fired bound the connection is dead: the caller must close (invalidate) it. A block
    that ended without an error after its bound fired raises OperationalError on exit,
    unless ``late_answer_fails`` is False (the caller then checks ``fired``): an answer
    is no success for a statement whose effect lives in the session. (A class, not a
    generator context manager: this runs twice per task.)
    """
    return Bound(dbapi_connection, time.monotonic() + seconds, late_answer_fails)


def explain(bound: Bound | None) -> str:
    """A clause for an error message: why the connection died, if the bound cut it."""
    if bound is None or not bound.fired:
        return ""
    return " (no answer in time: the socket was shut down and the session closed)"


def _start_reaper() -> None:
    global _reaper
    with _guard:
        if _reaper is not None:
            return
        thread = threading.Thread(
            target=_reap, name="celery-pglock-deadline", daemon=True
        )
        thread.start()
        _reaper = thread


def _forget_after_fork() -> None:
    """In a forked child: no reaper runs, and the parent's round trips are not ours."""
    global _reaper, _guard
    _reaper = None
    _guard = threading.Lock()  # the parent's may have been held at the fork
    _pending.clear()


def _reap() -> None:
    global _reaper
    try:
        _reap_forever()
    finally:  # only if something unforeseen killed it: the next round trip restarts it
        if _reaper is threading.current_thread():
            _reaper = None


def _reap_forever() -> None:
    while True:
        time.sleep(TICK)
        now = time.monotonic()
        with _guard:
            for key, bound in list(_pending.items()):
                if bound.deadline <= now and not bound.done:
                    del _pending[key]
                    bound.fired = True
                    _shutdown(bound.fd)


def _shutdown(fd: int) -> None:
    try:
        # fromfd() duplicates the descriptor; shutdown acts on the socket itself, so
        # the blocked recv in the owning thread returns at once.
        with socket.fromfd(fd, socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass  # already closed: nothing is blocked on it any more


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_after_fork)
