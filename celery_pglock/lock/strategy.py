"""Which PostgreSQL session carries a lock: :func:`for_lock` picks a strategy.

``ProcessSession`` (:mod:`~celery_pglock.lock.per_process`): session-scope try-locks in
``pglock_session_mode='per_process'`` (the default), one connection per process and
engine. ``PerLockSessions`` (:mod:`~celery_pglock.lock.per_lock`): transaction scope,
bounded waits, and everything in ``pglock_session_mode='per_lock'``, a pooled connection
pinned from acquire to release. Both implement :class:`~celery_pglock.lock.base.LockSession`.

A forked child forgets its parent's sessions (keeping them referenced, so no finaliser
of the child writes to the parent's socket) and opens its own. See docs/design.md.
"""

from __future__ import annotations

import os
import threading
import weakref
from typing import TYPE_CHECKING

from celery_pglock import config
from celery_pglock.db import engines
from celery_pglock.lock import base, per_lock, per_process

if TYPE_CHECKING:
    import sqlalchemy as sa

_per_lock_sessions: weakref.WeakKeyDictionary[sa.Engine, per_lock.PerLockSessions] = (
    weakref.WeakKeyDictionary()
)
_process: dict[sa.Engine, per_process.ProcessSession] = {}
#: The keys held by runs of this process, per engine, shared by both strategies (see
#: base.Claims). Never cleared while the process lives: a run that lost its session
#: keeps its key until its release, even across close_for() and a new session.
_claims: weakref.WeakKeyDictionary[sa.Engine, base.Claims] = weakref.WeakKeyDictionary()
_process_pid = os.getpid()
_registry_guard = threading.Lock()
#: A forked child's copies of its parent's sessions: kept referenced, never used or
#: closed, so no finaliser of the child ever writes to the parent's socket.
_inherited: list[per_process.ProcessSession] = []


def for_lock(engine: sa.Engine, *, transaction: bool) -> base.LockSession:
    """The strategy a lock of ``engine`` uses (a cheap lookup: once per lock)."""
    if _process_pid == os.getpid():
        session = _process.get(engine)
        if session is not None and not transaction:
            return session
    if transaction or (
        engines.engine_info(engine)["session_mode"] == config.SessionMode.PER_LOCK.value
    ):
        pinned = _per_lock_sessions.get(engine)
        if pinned is None:
            with _registry_guard:
                _forget_after_fork()
                pinned = _per_lock_sessions.get(engine)
                if pinned is None:
                    pinned = _per_lock_sessions[engine] = per_lock.PerLockSessions(
                        engine, _claims_of(engine)
                    )
        return pinned
    return process_session(engine)


def process_session(engine: sa.Engine) -> per_process.ProcessSession:
    """This process's session for ``engine`` (created on first use, not at import)."""
    with _registry_guard:
        _forget_after_fork()
        session = _process.get(engine)
        if session is None:
            session = _process[engine] = per_process.ProcessSession(
                engine, _claims_of(engine)
            )
        return session


def open_process_session(
    engine: sa.Engine,
) -> per_process.ProcessSession | None:
    """This process's session for ``engine`` if it has one (never creates it): the lock
    watcher checks locks on it, instead of a connection of its own."""
    if _process_pid != os.getpid():
        return None
    return _process.get(engine)


def _claims_of(engine: sa.Engine) -> base.Claims:
    """The claims table of ``engine`` in this process (call with _registry_guard held)."""
    claims = _claims.get(engine)
    if claims is None:
        claims = _claims[engine] = base.Claims()
    return claims


def sessions() -> list[per_process.ProcessSession]:
    """This process's lock sessions (for shutdown)."""
    with _registry_guard:
        _forget_after_fork()
        return list(_process.values())


def close_all() -> None:
    """Close this process's lock sessions (worker shutdown, tests)."""
    for session in sessions():
        session.close()
    with _registry_guard:
        _process.clear()


def close_for(engine: sa.Engine) -> None:
    """Close this process's session of ``engine``, if any (before disposing of it).

    Not tied to ``engine.dispose()``: disposing of a pool (after a fork, say) must not
    end the locks of every other task of the process.
    """
    with _registry_guard:
        _forget_after_fork()
        session = _process.pop(engine, None)
    if session is not None:
        session.close()


def _forget_after_fork() -> None:
    global _process_pid
    if _process_pid == os.getpid():
        return
    _inherited.extend(_process.values())
    _process.clear()
    _per_lock_sessions.clear()
    _claims.clear()  # the parent's runs: none of them runs in this child
    _process_pid = os.getpid()


def _after_fork_in_child() -> None:
    global _registry_guard
    _registry_guard = threading.Lock()  # another thread of the parent may have held it
    _forget_after_fork()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
