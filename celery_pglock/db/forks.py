"""Process state a forked child must not inherit: locks another thread held at the fork
(only the forking thread survives it) and what they guarded. One at-fork hook frees the
locks, runs the resets in declaration order (the engines' first: they neuter the parent's
sockets), then forgets the guarded state."""

from __future__ import annotations

import logging
import os
import threading
import weakref
from collections.abc import Callable, MutableMapping, MutableSet
from typing import Any

logger = logging.getLogger(__name__)

_Forgettable = MutableSet[Any] | MutableMapping[Any, Any]
_locks: list[tuple[weakref.ref[Any], tuple[_Forgettable, ...]]] = []
_resets: list[Callable[[], None]] = []


def safe_lock(*forget: _Forgettable) -> threading.Lock:
    """A Lock that a forked child finds free, with ``forget`` emptied. Never fork inside
    its ``with``."""
    guard = threading.Lock()
    _locks.append((weakref.ref(guard), forget))
    return guard


def reset_in_child(reset: Callable[[], None]) -> Callable[[], None]:
    """Run ``reset`` in a forked child, after the locks are freed (a decorator)."""
    _resets.append(reset)
    return reset


def _after_fork_in_child() -> None:
    # Each step on its own, as CPython runs separate at-fork hooks: one failing (out of
    # descriptors, say) must not leave the child on its parent's sessions.
    for ref, _ in _locks:
        if (guard := ref()) is not None:
            _step(guard._at_fork_reinit)  # what threading and logging do in a child
    for reset in _resets:
        _step(reset)
    for _, forget in _locks:  # last: the parent's sockets are neutered by now
        for state in forget:
            _step(state.clear)


def _step(action: Callable[[], object]) -> None:
    try:
        action()
    except Exception:  # reported, as CPython reports an at-fork hook's error
        logger.exception("Resetting %r in a forked child failed", action)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
