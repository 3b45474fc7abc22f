"""A forked child never touches its parent's lock sessions.

Hazard: after a fork, in the child, every lock-database connection of this process gets
its socket replaced by ``/dev/null``, so nothing the child does (an unlock, a Terminate
sent when the connection is finalised) reaches the parent's session. This module's
after-fork hook must run before ``engines.py``'s (it is imported first). Why:
docs/operations/lock-loss.md ("Forks inside a body").
"""

from __future__ import annotations

import contextlib
import os
import weakref
from typing import Any

_connections: weakref.WeakSet[Any] = weakref.WeakSet()
_foreign: weakref.WeakSet[Any] = weakref.WeakSet()  #: The parent's, neutered here.


def adopt(dbapi_connection: Any) -> None:
    """Remember a lock-database connection of this process (idempotent, cheap)."""
    _connections.add(dbapi_connection)


def is_foreign(dbapi_connection: Any) -> bool:
    """True for a connection inherited from the parent process: never use it."""
    return dbapi_connection in _foreign


def _neuter_in_child() -> None:
    connections = list(_connections)
    _connections.clear()
    if not connections:
        return
    null = os.open(os.devnull, os.O_RDWR)
    try:
        for connection in connections:
            # A closed connection raises: it has no descriptor left to protect.
            with contextlib.suppress(Exception):
                fd = connection.fileno()
                if fd >= 0:
                    os.dup2(null, fd)
                _foreign.add(connection)
    finally:
        os.close(null)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_neuter_in_child)
