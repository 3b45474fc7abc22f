"""Lock keys: task name + arguments -> a PostgreSQL advisory key. Pure functions, no I/O.

Why: docs/reference/keys.md (a contract with every process that locks, psql included)."""

from __future__ import annotations

import dataclasses
import datetime
import decimal
import enum
import functools
import hashlib
import inspect
import json.encoder
import math
import re
import uuid
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, TypeAlias

from celery_pglock import exceptions

#: Changed only with a migration note: old and new workers would not exclude each other.
KEY_FORMAT = "celery_pglock/1"

#: The SQL twin of :func:`key_from_text`, with the key text as its only parameter.
KEY_SQL = (
    "('x' || left(encode(sha256(convert_to(%s, 'UTF8')), 'hex'), 16))::bit(64)::bigint"
)

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1

#: Longest key text kept in :attr:`LockKey.text` (characters); longer ones are streamed.
TEXT_MAX = 64 * 1024
#: Characters encoded per piece (at most 256 KiB of UTF-8).
CHUNK = 64 * 1024
#: Per-task memo bounds (only small scalars are memoised): a memo stays under ~10 MiB.
MEMO_ENTRIES = 4096
MEMO_MAX_CHARS = 256
_MEMO_SCALARS = frozenset({int, str, bool, type(None)})
#: Deepest list/dict nesting accepted: far from the recursion limit, in any thread.
MAX_DEPTH = 64
#: Largest int accepted, in digits: under Python's int/str conversion limit (4300).
MAX_INT_DIGITS = 4000
_INT_LIMIT = 10**MAX_INT_DIGITS
_DICT_KEY_NOTE = (
    "dict keys are numbered in the dict's own order, from 0; their text is never shown"
)

#: The first int of every run lock (b"pglr"): reserved, refused in an explicit lock_id.
RUN_NAMESPACE = 0x70676C72
RUN_LOCK_NAME = "celery_pglock.run"

#: JSON's string form as ``key_text`` writes it (``ensure_ascii`` off; C when available).
_encode_string = json.encoder.encode_basestring
#: Reused: ``json.dumps`` builds one per call; encode() is stateless, so threads share it.
_ENCODER = json.JSONEncoder(
    ensure_ascii=False, sort_keys=True, separators=(",", ":"), allow_nan=False
)
_SURROGATE = re.compile("[\ud800-\udfff]")

Json: TypeAlias = "bool | int | float | str | list[Json] | dict[str, Json] | None"


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


def key_text(namespace: str, name: str, material: Json) -> str:
    """Return the canonical key text for already-canonical material."""
    return _ENCODER.encode([KEY_FORMAT, namespace, name, material])


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
    return key_for_canonical(namespace, name, canonical(material, where))


def key_for_canonical(namespace: str, name: str, canonical_material: Json) -> LockKey:
    """:func:`make_key` for material :func:`canonical` already returned."""
    if _longer_than(canonical_material, TEXT_MAX):
        hasher = hashlib.sha256()
        for chunk in json_chunks([KEY_FORMAT, namespace, name, canonical_material]):
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
        self._names = [_encode_string(argument_names[i]) for i in self._order]

    def key(self, values: tuple[Any, ...]) -> LockKey | None:
        """For short, exact str/int/bool/None ``values``; None where canonical() refuses."""
        parts = []
        for encoded_name, index in zip(self._names, self._order, strict=True):
            value = values[index]
            if type(value) is str:
                if not value.isascii() and _SURROGATE.search(value):
                    return None
                text = _encode_string(value)
            elif value is None:
                text = "null"
            elif value is True or value is False:
                text = "true" if value else "false"
            else:
                text = int.__repr__(value)
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
            name: canonical(value, f"Task {self.task_name!r}: argument {name!r}")
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
    """The run lock of an ``acks_late`` run (docs/reference/keys.md, Collision risk)."""
    digest = hashlib.sha256(f"{KEY_FORMAT}/run\0{task_id}".encode()).digest()
    return LockKey(
        name=RUN_LOCK_NAME,
        ids=(RUN_NAMESPACE, int.from_bytes(digest[:4], "big", signed=True)),
    )


#: Most slots a ``lock_limit`` may ask for: the slot statement lists them all.
SLOT_MAX = 64


#: The SQL twin of slot ``i`` >= 1 of a key; params: ``str(key)`` ("1001", "42,1001"), ``i``.
SLOT_KEY_SQL = (
    "('x' || left(encode(sha256(convert_to('celery_pglock/1/slot', 'UTF8') || "
    "decode('00', 'hex') || convert_to(%s, 'UTF8') || decode('00', 'hex') || "
    "convert_to(%s::text, 'UTF8')), 'hex'), 16))::bit(64)::bigint"
)


def slot_keys(key: LockKey, limit: int) -> tuple[LockKey, ...]:
    """``key``'s ``limit`` slots, ``key`` first (docs/reference/keys.md, Slots)."""
    return (key, *_more_slots(key.name, str(key), limit))


@functools.lru_cache(maxsize=MEMO_ENTRIES)  # by ids only: never keeps a long key text
def _more_slots(name: str, key: str, limit: int) -> tuple[LockKey, ...]:
    texts = (f"{KEY_FORMAT}/slot\0{key}\0{slot}" for slot in range(1, limit))
    digests = (hashlib.sha256(text.encode()).digest() for text in texts)
    return tuple(LockKey(name=name, ids=(_key_from_digest(d),)) for d in digests)


def canonical(value: object, where: str = "value") -> Json:
    """Return ``value`` as plain JSON data whose text form is stable across processes.

    The rules: docs/reference/keys.md ("Canonical forms"). Also refused: nesting deeper
    than :data:`MAX_DEPTH` and ints of more than :data:`MAX_INT_DIGITS` digits.

    Raises:
        LockKeyError: naming ``where``, the path (``[2]``, ``[key #0]``) and type, never a value.
    """
    try:
        return _canonical(value, 0)
    except _Refusal as refusal:
        raise exceptions.LockKeyError(refusal.message(where)) from None
    except RecursionError:  # MAX_DEPTH fits any sane stack; this one was nearly full
        raise exceptions.LockKeyError(
            f"{where} is nested too deeply for this thread's stack; it cannot be part "
            "of a lock key."
        ) from None


class _Refusal(Exception):  # noqa: N818 - internal, never escapes canonical()
    """Each _canonical level adds its path segment on the way out: success builds none."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason
        self.segments: list[str] = []  # innermost first

    def message(self, where: str) -> str:
        segments = self.segments[::-1]
        if len(segments) > 12:
            segments = [
                *segments[:6],
                f"...({len(segments) - 10} more)...",
                *segments[-4:],
            ]
        if "key #" in self.reason or any(s.startswith("[key #") for s in segments):
            return f"{where}{''.join(segments)} ({_DICT_KEY_NOTE}) {self.reason}"
        return f"{where}{''.join(segments)} {self.reason}"


def _unkeyable(reason: str) -> _Refusal:
    return _Refusal(f"{reason}; it cannot be part of a lock key.")


def _canonical(value: object, depth: int) -> Json:
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, int):
        if not -_INT_LIMIT < value < _INT_LIMIT:
            raise _unkeyable(f"is an int of more than {MAX_INT_DIGITS} digits")
        return int(value)
    if isinstance(value, str):
        # isascii() is O(1): the common case pays nothing for the surrogate check.
        if not value.isascii() and _SURROGATE.search(value):
            raise _unkeyable(
                "is a string that is not valid Unicode text (it holds a lone surrogate)"
            )
        return str.__str__(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise _unkeyable("is a float that is not finite (NaN or infinity)")
        return float(value)
    if isinstance(value, (list, tuple, Mapping)) and depth >= MAX_DEPTH:
        raise _unkeyable(
            f"is nested more than {MAX_DEPTH} levels deep (or holds itself)"
        )
    if isinstance(value, (list, tuple)):
        items: list[Json] = []
        for index, item in enumerate(value):
            try:
                items.append(_canonical(item, depth + 1))
            except _Refusal as refusal:
                refusal.segments.append(f"[{index}]")
                raise
        return items
    if isinstance(value, Mapping):
        result: dict[str, Json] = {}
        for position, (item_key, item) in enumerate(value.items()):
            if not isinstance(item_key, str):
                raise _Refusal(
                    f"has a key of type {type(item_key).__qualname__} as key #{position}; "
                    "only str keys are allowed in lock key material, so that {1: x} "
                    "and {'1': x} cannot silently collide."
                )
            try:
                result[str.__str__(item_key)] = _canonical(item, depth + 1)
            except _Refusal as refusal:
                refusal.segments.append(f"[key #{position}]")
                raise
        return result
    if isinstance(value, uuid.UUID):
        return str(value)
    if isinstance(value, decimal.Decimal):
        if not value.is_finite():
            raise _unkeyable("is a Decimal that is not finite (NaN or infinity)")
        return str(value)
    if isinstance(value, (datetime.datetime, datetime.date, datetime.time)):
        return value.isoformat()
    kind = (
        "an enum member"
        if isinstance(value, enum.Enum)
        else f"a value of type {type(value).__qualname__}"  # no a/an to get wrong
    )
    raise _Refusal(
        f"is {kind}, which has no stable text form for a lock key. Pass plain "
        "data (str, int, float, bool, None, lists, dicts with str keys, UUID, Decimal, "
        "date/time), or override lock_key_for in a SingletonTask subclass to return such data."
    )


def _longer_than(value: Json, limit: int) -> bool:
    """Could ``value``'s JSON exceed ``limit`` characters? (Over-estimates are harmless.)"""
    budget = limit
    stack: list[Json] = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            budget -= len(item) + 2
        elif isinstance(item, int):  # bool too: bit_length() 1, a slight over-estimate
            budget -= item.bit_length() // 3 + 2  # digits, rounded up, and a sign
        elif isinstance(item, dict):
            budget -= len(item) + 1
            for item_key, item_value in item.items():
                budget -= len(item_key) + 3
                stack.append(item_value)
        elif isinstance(item, list):
            budget -= len(item) + 1
            stack.extend(item)
        else:
            budget -= 24  # a float's repr, or null
        if budget < 0:
            return True
    return False


def json_chunks(value: Json) -> Iterator[str]:
    """:func:`key_text`'s JSON of a canonical value, in chunks."""
    if value is None:
        yield "null"
    elif value is True:
        yield "true"
    elif value is False:
        yield "false"
    elif isinstance(value, int):
        yield int.__repr__(value)
    elif isinstance(value, float):
        yield float.__repr__(value)
    elif isinstance(value, str):
        yield from string_chunks(value)
    elif isinstance(value, list):
        yield "["
        for index, item in enumerate(value):
            if index:
                yield ","
            yield from json_chunks(item)
        yield "]"
    else:
        yield "{"
        for index, item_key in enumerate(sorted(value)):
            if index:
                yield ","
            yield from string_chunks(item_key)
            yield ":"
            yield from json_chunks(value[item_key])
        yield "}"


def string_chunks(text: str) -> Iterator[str]:
    # JSON escapes per character: escaped slices join to the whole string's escape.
    yield '"'
    for start in range(0, len(text), CHUNK):
        yield _encode_string(text[start : start + CHUNK])[1:-1]
    yield '"'
