"""Key material: the values a lock key may be made of, and their one JSON text. The
rules: docs/reference/keys.md ("Canonical forms")."""

from __future__ import annotations

import datetime
import decimal
import enum
import json.encoder
import math
import re
import uuid
from collections.abc import Iterator, Mapping
from typing import TypeAlias

from celery_pglock import exceptions

#: Characters encoded per piece (at most 256 KiB of UTF-8).
CHUNK = 64 * 1024
#: Deepest list/dict nesting accepted: far from the recursion limit, in any thread.
MAX_DEPTH = 64
#: Largest int accepted, in digits: under Python's int/str conversion limit (4300).
MAX_INT_DIGITS = 4000
_INT_LIMIT = 10**MAX_INT_DIGITS
_DICT_KEY_NOTE = (
    "dict keys are numbered in the dict's own order, from 0; their text is never shown"
)

#: JSON's string form as the key text writes it (``ensure_ascii`` off; C when available).
encode_string = json.encoder.encode_basestring
#: The key text's JSON writer, stateless, so built once for all threads (not per call).
ENCODER = json.JSONEncoder(
    ensure_ascii=False, sort_keys=True, separators=(",", ":"), allow_nan=False
)
#: A lone surrogate: a str that is not valid Unicode text, so it has no UTF-8 to hash.
SURROGATE = re.compile("[\ud800-\udfff]")

Json: TypeAlias = "bool | int | float | str | list[Json] | dict[str, Json] | None"


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
        if not value.isascii() and SURROGATE.search(value):
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


def longer_than(value: Json, limit: int) -> bool:
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
    """:data:`ENCODER`'s JSON of a canonical value, in chunks: the same text, never whole."""
    if isinstance(value, str):
        yield from string_chunks(value)
    elif isinstance(value, list):
        yield "["
        for index, item in enumerate(value):
            if index:
                yield ","
            yield from json_chunks(item)
        yield "]"
    elif isinstance(value, dict):
        yield "{"
        for index, item_key in enumerate(sorted(value)):
            if index:
                yield ","
            yield from string_chunks(item_key)
            yield ":"
            yield from json_chunks(value[item_key])
        yield "}"
    else:  # a scalar: its text is short
        yield ENCODER.encode(value)


def string_chunks(text: str) -> Iterator[str]:
    # JSON escapes per character: escaped slices join to the whole string's escape.
    yield '"'
    for start in range(0, len(text), CHUNK):
        yield encode_string(text[start : start + CHUNK])[1:-1]
    yield '"'
