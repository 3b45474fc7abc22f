"""Lock keys: task name + arguments -> a PostgreSQL advisory key (a bottom layer: pure,
no I/O, docs/design.md "Layers"). The contract: docs/reference/keys.md."""

from __future__ import annotations

from celery_pglock.keys.key_material import MAX_DEPTH, MAX_INT_DIGITS, canonical
from celery_pglock.keys.lock_keys import (
    KEY_FORMAT,
    KEY_SQL,
    RUN_NAMESPACE,
    SLOT_KEY_SQL,
    SLOT_MAX,
    TEXT_MAX,
    CallKeys,
    LockKey,
    explicit_key,
    key_from_text,
    key_text,
    make_key,
    run_key,
    slot_keys,
)

__all__ = [
    "KEY_FORMAT",
    "KEY_SQL",
    "MAX_DEPTH",
    "MAX_INT_DIGITS",
    "RUN_NAMESPACE",
    "SLOT_KEY_SQL",
    "SLOT_MAX",
    "TEXT_MAX",
    "CallKeys",
    "LockKey",
    "canonical",
    "explicit_key",
    "key_from_text",
    "key_text",
    "make_key",
    "run_key",
    "slot_keys",
]
