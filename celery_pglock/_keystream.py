"""Streamed key texts: hash a huge key text without ever building it. Pure functions.

Used by :func:`celery_pglock.keys.make_key` past ``keys.TEXT_MAX`` characters. The
stream must be byte-for-byte the JSON of ``keys.key_text`` (the key format is a contract
with every process that takes these locks): that equality is property-tested against
``json.dumps`` in tests/unit/test_key_properties.py and against PostgreSQL's own sha256
in tests/integration/test_keys_sql.py.
"""

from __future__ import annotations

import json.encoder
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Iterator

    from celery_pglock.keys import Json

#: Characters encoded per piece (at most 256 KiB of UTF-8).
CHUNK = 64 * 1024
#: What json.dumps(ensure_ascii=False) uses for strings (the C version when available).
_encode_string = json.encoder.encode_basestring


def longer_than(value: Json, limit: int) -> bool:
    """Could ``value``'s JSON text exceed ``limit`` characters? (Cheap, early exit; a
    slight over-estimate is harmless: the stream gives the same key.)"""
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


def encoded_pieces(value: Json) -> Iterator[bytes]:
    """The UTF-8 of ``value``'s key text (exactly ``keys.key_text``'s JSON), in pieces of
    about CHUNK characters: no piece of the text is ever copied whole."""
    buffer: list[str] = []
    size = 0
    for chunk in json_chunks(value):
        buffer.append(chunk)
        size += len(chunk)
        if size >= CHUNK:
            yield "".join(buffer).encode("utf-8")
            buffer.clear()
            size = 0
    if buffer:
        yield "".join(buffer).encode("utf-8")


def json_chunks(value: Json) -> Iterator[str]:
    """json.dumps(value, ensure_ascii=False, sort_keys=True, separators=(",", ":")) in
    chunks, for canonical values (exact JSON types). Property-tested against json.dumps."""
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
    # JSON escapes character by character, so escaping slices separately gives the same
    # text as escaping the whole string.
    if len(text) <= CHUNK:
        yield _encode_string(text)
        return
    yield '"'
    for start in range(0, len(text), CHUNK):
        yield _encode_string(text[start : start + CHUNK])[1:-1]
    yield '"'
