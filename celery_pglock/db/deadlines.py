"""A client-side bound on lock connections' round trips: a reaper thread shuts the socket down.
Why (a cut link outwaits statement_timeout): docs/operations/lock-loss.md ("Bounded release")."""

from __future__ import annotations

import dataclasses
import math
import socket
import threading
import time
from typing import Any, ClassVar

from celery_pglock.db import driver_errors, forks

TICK = 0.25  #: Seconds between the reaper's looks: a bound fires within TICK.
NO_ANSWER = "no answer in time: the socket was shut down and the session closed"

#: Disarm (``deadline = math.inf``) under it: never shut a reused fd down after the answer.
_watched: set[Bound] = set()
guard = forks.safe_lock(_watched)
_reaper: threading.Thread | None = None


@dataclasses.dataclass(slots=True, eq=False, repr=False)  # eq=False: hashed by identity
class Bound:
    """``deadline`` (monotonic; ``math.inf``: disarmed); ``fired`` once the socket is shut.
    One-shot from :func:`bounded`, or :func:`watch` once and arm by setting ``deadline``."""

    connection: Any
    deadline: float = math.inf
    late_answer_fails: bool = True
    fd: int = dataclasses.field(init=False)
    fired: bool = dataclasses.field(default=False, init=False)
    #: Watched for good and armed per statement (the process session's): never dropped.
    rearmed: ClassVar[bool] = False

    def __post_init__(self) -> None:
        self.fd = self.connection.fileno()

    def __enter__(self) -> Bound:
        watch(self)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *rest: object) -> None:
        # Inline, not unwatch(): an interrupt as a call starts would leave it armed.
        with guard:
            self.deadline = math.inf
            _watched.discard(self)
        if self.fired and exc_type is None and self.late_answer_fails:
            # The answer came after the shutdown: the session is ending anyway.
            raise driver_errors.operational_error(self.connection)(NO_ANSWER)


def bounded(
    dbapi_connection: Any, seconds: float, *, late_answer_fails: bool = True
) -> Bound:
    """Shut the socket down unless the ``with`` block ends within ``seconds`` (one thread;
    the caller closes it). A late answer raises OperationalError unless late_answer_fails."""
    return Bound(dbapi_connection, time.monotonic() + seconds, late_answer_fails)


def watch(bound: Bound) -> None:
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
    """An error message's clause, or "" unless the bound cut the connection."""
    return f" ({NO_ANSWER})" if bound is not None and bound.fired else ""


def _reap() -> None:
    while True:
        time.sleep(TICK)
        now = time.monotonic()
        with guard:
            for bound in [bound for bound in _watched if bound.deadline <= now]:
                bound.deadline = math.inf
                if not _in_statement(bound.connection):
                    # Its block ended with its __exit__ interrupted (a soft time limit on
                    # entering it): the connection may be pooled, or its fd reused.
                    if not bound.rearmed:
                        _watched.discard(bound)
                else:
                    bound.fired = True
                    try:  # on a dup of the fd: shutdown wakes the blocked recv at once
                        with socket.fromfd(
                            bound.fd, socket.AF_INET, socket.SOCK_STREAM
                        ) as sock:
                            sock.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass  # already closed: nothing is blocked on it any more


def _in_statement(connection: Any) -> bool:
    """A statement is under way on ``connection`` (libpq's PQTRANS_ACTIVE: psycopg2's and
    psycopg 3's status 1), or it cannot be told: then the bound fires, as it always did."""
    try:
        return not connection.closed and connection.info.transaction_status == 1
    except Exception:
        return True


@forks.reset_in_child
def _forget_after_fork() -> None:
    global _reaper
    _reaper = None  # the parent's thread
