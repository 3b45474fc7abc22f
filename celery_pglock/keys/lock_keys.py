"""LockKey and every way one is made: from a key text, a task's call (``CallKeys``), a
``lock_id``, a run lock or a slot. The format: docs/reference/keys.md."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import inspect
from typing import TYPE_CHECKING, Any

from celery_pglock import exceptions
from celery_pglock.keys import key_material

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

    from celery_pglock.keys.key_material import Json

#: Changed only with a migration note: old and new workers would not exclude each other.
KEY_FORMAT = "celery_pglock/1"

#: The SQL twin of :func:`key_from_text`, with the key text as its only parameter.
KEY_SQL = (
    "('x' || left(encode(sha256(convert_to(%s, 'UTF8')), 'hex'), 16))::bit(64)::bigint"
)
#: The SQL twin of slot ``i`` >= 1 of a key; params: ``str(key)`` ("1001", "42,1001"), ``i``.
SLOT_KEY_SQL = (
    "('x' || left(encode(sha256(convert_to('celery_pglock/1/slot', 'UTF8') || "
    "decode('00', 'hex') || convert_to(%s, 'UTF8') || decode('00', 'hex') || "
    "convert_to(%s::text, 'UTF8')), 'hex'), 16))::bit(64)::bigint"
)

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1

#: Longest key text kept in :attr:`LockKey.text` (characters); longer ones are streamed.
TEXT_MAX = 64 * 1024
#: Most slots a ``lock_limit`` may ask for: the slot statement lists them all.
SLOT_MAX = 64
#: Per-task memo bounds (only small scalars are memoised): a memo stays under ~10 MiB.
MEMO_ENTRIES = 4096
MEMO_MAX_CHARS = 256
_MEMO_SCALARS = frozenset({int, str, bool, type(None)})
_LITERALS = {None: "null", True: "true", False: "false"}

#: The first int of every run lock (b"pglr"): reserved, refused in an explicit lock_id.
RUN_NAMESPACE = 0x70676C72
RUN_LOCK_NAME = "celery_pglock.run"


@dataclasses.dataclass(frozen=True, slots=True)
class LockKey:
    """One advisory lock key, with what an operator needs to recognise it."""

    #: The lock name: the task name unless the task sets ``lock_name``.
    name: str
    #: The advisory key: ``(bigint,)`` or the two-int form ``(namespace, resource)``.
    ids: tuple[int] | tuple[int, int]
    #: The hashed key text; None for ``lock_id`` or a text over :data:`TEXT_MAX`.
    #: It holds argument values, so ``repr()`` leaves it out.
    text: str | None = dataclasses.field(default=None, repr=False)

    def __str__(self) -> str:
        return ",".join(str(i) for i in self.ids)

    @property
    def pg_locks_ids(self) -> tuple[int, int, int]:
        """This key in ``pg_locks``: ``(classid, objid, objsubid)`` (docs/reference/keys.md)."""
        if len(self.ids) == 1:
            unsigned = self.ids[0] & 0xFFFFFFFFFFFFFFFF
            return unsigned >> 32, unsigned & 0xFFFFFFFF, 1
        return self.ids[0] & 0xFFFFFFFF, self.ids[-1] & 0xFFFFFFFF, 2

    @classmethod
    def from_pg_locks(
        cls, name: str, classid: int, objid: int, objsubid: int
    ) -> LockKey:
        """The key of ``pg_locks``' ids: the inverse of :attr:`pg_locks_ids`."""
        if objsubid == 1:
            unsigned = (classid << 32) | objid
            return cls(name, (unsigned - (1 << 64) if unsigned >> 63 else unsigned,))
        high, low = (i - (1 << 32) if i >> 31 else i for i in (classid, objid))
        return cls(name, (high, low))


def key_text(namespace: str, name: str, material: Json) -> str:
    """Return the canonical key text for already-canonical material."""
    return key_material.ENCODER.encode([KEY_FORMAT, namespace, name, material])


def key_from_text(text: str) -> int:
    """Hash a key text to a signed 64-bit advisory key (step 3 of the format)."""
    return _key_from_digest(hashlib.sha256(text.encode("utf-8")).digest())


def make_key(
    namespace: str, name: str, material: object = None, *, where: str = "key"
) -> LockKey:
    """Build the ``LockKey`` for ``material`` under ``namespace`` and lock ``name``.

    Args:
        namespace: Separates applications that share one database.
        name: The lock name (normally the task name).
        material: Anything ``canonical()`` accepts; ``None`` for one lock per name.
        where: How to name the material in error messages.

    Raises:
        LockKeyError: ``material`` holds a value without a stable canonical form.
    """
    return key_for_canonical(namespace, name, key_material.canonical(material, where))


def key_for_canonical(namespace: str, name: str, canonical_material: Json) -> LockKey:
    """:func:`make_key` for material ``key_material.canonical`` already returned."""
    if key_material.longer_than(canonical_material, TEXT_MAX):
        hasher = hashlib.sha256()
        for chunk in key_material.json_chunks(
            [KEY_FORMAT, namespace, name, canonical_material]
        ):
            hasher.update(chunk.encode("utf-8"))
        return LockKey(name=name, ids=(_key_from_digest(hasher.digest()),))
    text = key_text(namespace, name, canonical_material)
    return LockKey(name=name, ids=(key_from_text(text),), text=text)


class ScalarKeys:
    """Scalar ``lock_args`` keys without the JSON encoder: key_text's text (property-tested)."""

    __slots__ = ("_head", "_names", "_order", "name")

    def __init__(self, namespace: str, name: str, argument_names: list[str]) -> None:
        self.name = name
        self._head = key_text(namespace, name, None)[: -len("null]")]
        self._order = sorted(range(len(argument_names)), key=argument_names.__getitem__)
        self._names = [
            key_material.encode_string(argument_names[i]) for i in self._order
        ]

    def key(self, values: tuple[Any, ...]) -> LockKey | None:
        """For short, exact str/int/bool/None ``values``; None where canonical() refuses."""
        parts = []
        for encoded_name, index in zip(self._names, self._order, strict=True):
            value = values[index]
            if type(value) is str:
                if not value.isascii() and key_material.SURROGATE.search(value):
                    return None
                text = key_material.encode_string(value)
            elif type(value) is int:
                text = int.__repr__(value)
            else:  # None, True or False
                text = _LITERALS[value]
            parts.append(f"{encoded_name}:{text}")
        text = f"{self._head}{{{','.join(parts)}}}]"
        return LockKey(name=self.name, ids=(key_from_text(text),), text=text)


class CallKeys:
    """One task's keys: binds a call as Python would, memoised by exact type (1 is not True)."""

    __slots__ = (
        "_scalars",
        "arguments",
        "fixed",
        "memo",
        "name",
        "namespace",
        "task_name",
    )

    def __init__(
        self,
        task_name: str,
        namespace: str,
        name: str,
        parameters: Sequence[inspect.Parameter],
        lock_args: Sequence[str],
        fixed: LockKey | None,
    ) -> None:
        self.task_name = task_name
        self.namespace = namespace
        self.name = name
        self.fixed = fixed
        positional = [
            p.name
            for p in parameters
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
        by_name = {p.name: p for p in parameters}
        #: (name, position or None, may be passed by keyword, default) per lock_args name
        self.arguments = [
            (
                arg,
                positional.index(arg) if arg in positional else None,
                by_name[arg].kind is not inspect.Parameter.POSITIONAL_ONLY,
                by_name[arg].default,
            )
            for arg in lock_args
        ]
        self._scalars = ScalarKeys(namespace, name, list(lock_args))
        self.memo = functools.lru_cache(maxsize=MEMO_ENTRIES)(self._scalar_key)

    def key(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> LockKey:
        if self.fixed is not None:
            return self.fixed
        # One plain loop (no generator or comprehension frames): this runs once per task.
        values = []
        typed = []
        for name, position, keyword, default in self.arguments:
            if keyword and name in kwargs:
                value = kwargs[name]
            elif position is not None and position < len(args):
                value = args[position]
            elif default is not inspect.Parameter.empty:
                value = default
            else:
                raise exceptions.LockKeyError(
                    f"Task {self.task_name!r} was called without its lock argument "
                    f"{name!r}, so there is no key to lock; the body did not run."
                )
            values.append(value)
            typed.append((type(value), value))
        if _memoisable(values):
            return self.memo(tuple(typed))
        return self._make_key(tuple(values))

    def _make_key(self, values: tuple[Any, ...]) -> LockKey:
        material = {
            name: key_material.canonical(
                value, f"Task {self.task_name!r}: argument {name!r}"
            )
            for (name, *_), value in zip(self.arguments, values, strict=True)
        }
        return key_for_canonical(self.namespace, self.name, material)

    def _scalar_key(self, typed_values: tuple[tuple[type, Any], ...]) -> LockKey:
        values = tuple(value for _, value in typed_values)
        # _scalars refuses only lone surrogates; _make_key then raises LockKeyError.
        return self._scalars.key(values) or self._make_key(values)


def _memoisable(values: list[Any]) -> bool:
    chars = 0
    for value in values:
        kind = type(value)
        if kind is str:
            chars += len(value)
        elif kind is int:
            if not INT64_MIN <= value < 2**64:
                return False
        elif kind not in _MEMO_SCALARS:
            return False
    return chars <= MEMO_MAX_CHARS


def _key_from_digest(digest: bytes) -> int:
    return int.from_bytes(digest[:8], "big", signed=True)


def explicit_key(name: str, lock_id: object, *, where: str = "lock_id") -> LockKey:
    """Validate a ``lock_id`` (one int64 or two int32s); ConfigurationError if it is not."""
    if isinstance(lock_id, int) and not isinstance(lock_id, bool):
        if not INT64_MIN <= lock_id <= INT64_MAX:
            raise exceptions.ConfigurationError(
                f"{where}={lock_id!r} is out of range: a single lock id must be a signed "
                f"64-bit integer ({INT64_MIN} to {INT64_MAX})."
            )
        return LockKey(name=name, ids=(lock_id,))
    if (
        isinstance(lock_id, tuple)
        and len(lock_id) == 2
        and all(isinstance(i, int) and not isinstance(i, bool) for i in lock_id)
    ):
        first, second = lock_id
        if not (INT32_MIN <= first <= INT32_MAX and INT32_MIN <= second <= INT32_MAX):
            raise exceptions.ConfigurationError(
                f"{where}={lock_id!r} is out of range: a (namespace, resource) lock id "
                f"must be two signed 32-bit integers ({INT32_MIN} to {INT32_MAX})."
            )
        if first == RUN_NAMESPACE:
            raise exceptions.ConfigurationError(
                f"{where}={lock_id!r} uses the namespace {RUN_NAMESPACE}, which "
                "celery-pglock reserves for its run locks; choose another one."
            )
        return LockKey(name=name, ids=(first, second))
    raise exceptions.ConfigurationError(
        f"{where}={lock_id!r} is not a lock id: expected one signed 64-bit int or a "
        "tuple of two signed 32-bit ints, such as 1001 or (42, 1001)."
    )


def run_key(task_id: str) -> LockKey:
    """The run lock of a run that others must see alive: acks_late, lock_enqueue or
    lock_limit (docs/reference/keys.md, Collision risk)."""
    digest = hashlib.sha256(f"{KEY_FORMAT}/run\0{task_id}".encode()).digest()
    return LockKey(
        name=RUN_LOCK_NAME,
        ids=(RUN_NAMESPACE, int.from_bytes(digest[:4], "big", signed=True)),
    )


def slot_keys(key: LockKey, limit: int) -> tuple[LockKey, ...]:
    """``key``'s ``limit`` slots, ``key`` first (docs/reference/keys.md, Slots)."""
    return (key, *_more_slots(key.name, str(key), limit))


@functools.lru_cache(maxsize=MEMO_ENTRIES)  # by ids only: never keeps a long key text
def _more_slots(name: str, key: str, limit: int) -> tuple[LockKey, ...]:
    texts = (f"{KEY_FORMAT}/slot\0{key}\0{slot}" for slot in range(1, limit))
    return tuple(LockKey(name=name, ids=(key_from_text(text),)) for text in texts)
