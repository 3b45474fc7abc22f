"""A task's resolved lock options and the per-call key binding (the hot path's first step).

Built once per task class when Celery binds it (``SingletonTask.on_bound``): the frozen
LockConfig, where each ``lock_args`` value sits in a call, and the process's lock engine
(re-fetched after a fork). ``Guard.key()`` then turns one call's arguments into a LockKey
without ``inspect.Signature.bind`` and, for plain scalar arguments, from a cache.
"""

from __future__ import annotations

import functools
import inspect
import os
from typing import TYPE_CHECKING, Any

from celery_pglock import config, exceptions, keys
from celery_pglock.db import engines

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

    import sqlalchemy as sa

_MISSING = inspect.Parameter.empty
#: Exact types whose keys are memoised per task (hashable, and canonical() keeps them).
_SCALARS = frozenset({int, str, bool, type(None)})
#: Memo bounds. An entry holds its argument values and its LockKey (whose text repeats
#: them), so entries are bounded in size as well as in number: only calls whose str
#: arguments total at most MEMO_MAX_CHARS characters, and whose ints fit in 64 bits,
#: are memoised. Worst case per task: MEMO_ENTRIES * (2 * 4 bytes * MEMO_MAX_CHARS +
#: ~0.5 KiB) = about 10 MiB (4-byte characters); ASCII tenant ids: well under 2 MiB.
#: Anything larger is keyed afresh on each call and freed with the run.
MEMO_ENTRIES = 4096
MEMO_MAX_CHARS = 256
_MEMO_INT_MIN, _MEMO_INT_MAX = -(2**63), 2**64


class KeyArgument:
    """Where one ``lock_args`` value comes from in a call: precomputed for the hot path."""

    __slots__ = ("default", "keyword", "name", "position")

    def __init__(self, parameter: inspect.Parameter, position: int | None) -> None:
        self.name = parameter.name
        self.position = position
        self.keyword = parameter.kind is not parameter.POSITIONAL_ONLY
        self.default = parameter.default

    def value(
        self, task_name: str, args: Sequence[Any], kwargs: Mapping[str, Any]
    ) -> Any:
        # The same binding Python does for the call itself, without Signature.bind's cost:
        # f(7), f(tenant_id=7) and f(7, fmt="pdf") all yield 7, and defaults apply.
        if self.keyword and self.name in kwargs:
            return kwargs[self.name]
        if self.position is not None and self.position < len(args):
            return args[self.position]
        if self.default is not _MISSING:
            return self.default
        raise exceptions.LockKeyError(
            f"Task {task_name!r} was called without its lock argument {self.name!r}, so "
            "there is no key to lock; the body did not run."
        )


class Guard:
    """One task's resolved options plus its per-process engine: built once at bind."""

    def __init__(
        self,
        options: config.LockConfig,
        parameters: Sequence[inspect.Parameter],
        conf: Any,
    ) -> None:
        self.config = options
        self.conf = conf
        positional = [
            p
            for p in parameters
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
        by_name = {p.name: p for p in parameters}
        self.arguments = [
            KeyArgument(
                by_name[name],
                positional.index(by_name[name])
                if by_name[name] in positional
                else None,
            )
            for name in options.lock_args
        ]
        self._engine: tuple[int, sa.Engine] | None = None
        self._scalar_keys = keys.ScalarKeys(
            options.namespace, options.name, [a.name for a in self.arguments]
        )
        self._scalar_key = functools.lru_cache(maxsize=MEMO_ENTRIES)(self._scalar_key)  # type: ignore[method-assign]

    def engine(self) -> sa.Engine:
        cached = self._engine
        if cached is not None and cached[0] == os.getpid():
            return cached[1]
        engine = engines.engine_for(self.conf)
        self._engine = (os.getpid(), engine)
        return engine

    def key(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> keys.LockKey:
        options = self.config
        if options.fixed_key is not None:
            return options.fixed_key
        if options.lock_key is not None:
            material = options.lock_key(*args, **kwargs)
            where = f"Task {options.task_name!r}: the value returned by lock_key"
            return keys.make_key(options.namespace, options.name, material, where=where)
        values = tuple(
            argument.value(options.task_name, args, kwargs)
            for argument in self.arguments
        )
        if _memoisable(values):
            # The everyday case (a tenant id, a date string): memoise, keyed with each
            # value's exact type so that 7, "7", 7.0 and True stay distinct keys.
            return self._scalar_key(tuple((type(value), value) for value in values))
        return self._make_key(values)

    def _make_key(
        self, values: tuple[Any, ...], *, short: bool = False
    ) -> keys.LockKey:
        options = self.config
        material = {
            argument.name: keys.canonical(
                value, f"Task {options.task_name!r}: argument {argument.name!r}"
            )
            for argument, value in zip(self.arguments, values, strict=True)
        }
        return keys.key_for_canonical(
            options.namespace, options.name, material, short=short
        )

    def _scalar_key(self, typed_values: tuple[tuple[type, Any], ...]) -> keys.LockKey:
        values = tuple(value for _, value in typed_values)
        # Memoisable values are short (MEMO_MAX_CHARS): no need to measure the text.
        return self._scalar_keys.key(values) or self._make_key(values, short=True)


def _memoisable(values: tuple[Any, ...]) -> bool:
    """Small scalars only: see MEMO_MAX_CHARS (a 5 MB argument must not be pinned)."""
    chars = 0
    for value in values:
        kind = type(value)
        if kind is str:
            chars += len(value)
        elif kind is int:
            if not _MEMO_INT_MIN <= value < _MEMO_INT_MAX:
                return False
        elif kind not in _SCALARS:
            return False
    return chars <= MEMO_MAX_CHARS


def option_attributes(cls: type, reserved: set[str]) -> dict[str, Any]:
    """The task's ``lock_*`` (and peer) attributes that are set (not None), unwrapped."""
    found: dict[str, Any] = {}
    for klass in reversed(cls.__mro__):
        for name in vars(klass):
            # Peer libraries' option names are collected too, so that resolve() can
            # refuse them instead of silently running with one lock for all values.
            if (
                name.startswith("lock_")
                and (name in config.TASK_OPTIONS or name not in reserved)
            ) or name in config.PEER_OPTIONS:
                value = inspect.getattr_static(cls, name)
                if isinstance(value, staticmethod):
                    value = value.__func__
                if value is not None:
                    found[name] = value
                else:
                    found.pop(name, None)
    return found


def call_parameters(cls: type) -> list[inspect.Parameter]:
    run = inspect.getattr_static(cls, "run")
    if isinstance(run, staticmethod):  # @app.task without bind=True
        return config.task_parameters(run.__func__, drop_self=False)
    return config.task_parameters(run, drop_self=True)  # bind=True, or a class
