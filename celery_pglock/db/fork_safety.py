"""A forked child never touches its parent's lock sessions.

A task body may fork (``os.fork``, ``multiprocessing`` with the fork start method, a
library that forks). The child inherits every lock session's socket and the Python objects
around it. Whatever the child then does - return or raise through the task's frames,
``sys.exit``, garbage collection, interpreter shutdown - must not reach the parent's
server session: an unlock would free the parent's lock while its body still runs, and
psycopg2's connection deallocation calls ``PQfinish``, which sends a Terminate message
that ends the parent's session (and so its lock). Only ``os._exit`` was safe before.
(psycopg 3's deallocation skips ``PQfinish`` in a process that did not connect, but its
``close()``, which a pool's disposal calls, does not.)

After a fork, in the child, every lock-database connection this process opened gets its
socket descriptor replaced by ``/dev/null`` (``os.dup2``): the parent's socket is closed in
the child and nothing written by the child reaches it (a Terminate goes to /dev/null; a
query fails as a lost connection). This handler is registered before ``engines.py``'s own
after-fork hook, whose ``engine.dispose(close=False)`` drops pooled connections that
would otherwise be finalised on the real socket. The release paths also check the pid
that took the lock (``AdvisoryLock.owner_pid``), so a child never even tries.
"""

from __future__ import annotations

import contextlib
import os
import weakref
from typing import Any

_connections: weakref.WeakSet[Any] = weakref.WeakSet()
#: The parent's connections, neutered in this (child) process.
_foreign: weakref.WeakSet[Any] = weakref.WeakSet()


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
