"""The key algorithm (format 1): test vectors, canonical forms, refusals."""

from __future__ import annotations

import datetime
import decimal
import enum
import hashlib
import json
import uuid

import pytest

from celery_pglock import keys
from celery_pglock.exceptions import ConfigurationError, LockKeyError
from celery_pglock.keys import lock_keys

#: Frozen vectors: if one of these changes, the key format changed. That is a
#: rolling-deploy hazard (old and new workers would not exclude each other), so it needs a
#: new KEY_FORMAT and a migration note, never a silent edit of these numbers.
VECTORS = [
    (
        "default",
        "billing.daily_settlement",
        None,
        '["celery_pglock/1","default","billing.daily_settlement",null]',
        330713264628809466,
    ),
    (
        "default",
        "exports.build_tenant_export",
        {"tenant_id": 7},
        '["celery_pglock/1","default","exports.build_tenant_export",{"tenant_id":7}]',
        4690220028534471837,
    ),
    (
        "default",
        "exports.build_tenant_export",
        {"tenant_id": "7"},
        '["celery_pglock/1","default","exports.build_tenant_export",{"tenant_id":"7"}]',
        8094861082609616090,
    ),
    (
        "acme",
        "exports.build_tenant_export",
        {"tenant_id": 7},
        '["celery_pglock/1","acme","exports.build_tenant_export",{"tenant_id":7}]',
        8071966892187253879,
    ),
    (
        "default",
        "t",
        {"name": "Zürich"},
        '["celery_pglock/1","default","t",{"name":"Zürich"}]',
        -5258013937716352565,
    ),
    (
        "default",
        "t",
        [1, 2.5, True, None, "x"],
        '["celery_pglock/1","default","t",[1,2.5,true,null,"x"]]',
        6691227350830464112,
    ),
    # Dicts given in unsorted order, at the top and nested: their keys are sorted.
    (
        "default",
        "exports.build_tenant_export",
        {"tenant_id": 7, "day": "2026-12-01"},
        '["celery_pglock/1","default","exports.build_tenant_export",'
        '{"day":"2026-12-01","tenant_id":7}]',
        -7698462220568348273,
    ),
    (
        "default",
        "t",
        {"z": {"c": "é", "b": 1}, "m": [{"y": 2, "x": 1}], "a": None},
        '["celery_pglock/1","default","t",{"a":null,"m":[{"x":1,"y":2}],"z":{"b":1,"c":"é"}}]',
        3541699780874026306,
    ),
]


@pytest.mark.parametrize(("namespace", "name", "material", "text", "key"), VECTORS)
def test_vectors(namespace, name, material, text, key):
    """Each documented vector gives exactly its text and key."""
    lock_key = keys.make_key(namespace, name, material)
    assert text == lock_key.text
    assert (key,) == lock_key.ids


@pytest.mark.parametrize(
    ("namespace", "name", "material", "text", "key"),
    [
        vector
        for vector in VECTORS
        if isinstance(vector[2], dict)
        and all(type(v) in (str, int) for v in vector[2].values())
    ],
)
def test_vectors_through_the_lock_args_path(namespace, name, material, text, key):
    """A task's lock_args build the key without the JSON encoder (lock_keys.ScalarKeys), from
    the arguments in signature order: the same text and key, names sorted."""
    lock_key = lock_keys.ScalarKeys(namespace, name, list(material)).key(
        tuple(material.values())
    )
    assert lock_key is not None
    assert text == lock_key.text
    assert (key,) == lock_key.ids


def test_hash_is_first_eight_sha256_bytes_big_endian_signed():
    """The integer is the first 8 SHA-256 bytes, big-endian, two's complement."""
    text = VECTORS[0][3]
    digest = hashlib.sha256(text.encode()).digest()
    expected = int.from_bytes(digest[:8], "big")
    expected = expected - 2**64 if expected >= 2**63 else expected
    assert expected == keys.key_from_text(text)


def test_keyword_order_does_not_matter():
    """Object keys are sorted, so dict insertion order never changes the key."""
    assert keys.make_key("n", "t", {"a": 1, "b": 2}) == keys.make_key(
        "n", "t", {"b": 2, "a": 1}
    )


def test_int_and_str_are_different_keys():
    """7 and "7" are different values and different keys (documented)."""
    assert keys.make_key("n", "t", 7).ids != keys.make_key("n", "t", "7").ids
    assert keys.make_key("n", "t", True).ids != keys.make_key("n", "t", 1).ids


def test_tuple_and_list_are_the_same_key():
    """Celery's JSON serializer turns tuples into lists in transit; keys must agree."""
    assert keys.make_key("n", "t", (1, "a")) == keys.make_key("n", "t", [1, "a"])


def test_uuid_decimal_dates_key_as_their_text():
    """UUID/Decimal/date values key like the string a non-Python producer would send."""
    value = uuid.UUID("12345678-1234-5678-1234-567812345678")
    assert keys.make_key("n", "t", value) == keys.make_key("n", "t", str(value))
    assert keys.make_key("n", "t", decimal.Decimal("1.10")) == keys.make_key(
        "n", "t", "1.10"
    )
    day = datetime.date(2026, 11, 29)
    assert keys.make_key("n", "t", day) == keys.make_key("n", "t", "2026-11-29")
    moment = datetime.datetime(2026, 11, 29, 12, 0, tzinfo=datetime.timezone.utc)
    assert keys.make_key("n", "t", moment) == keys.make_key(
        "n", "t", "2026-11-29T12:00:00+00:00"
    )


def test_unicode_is_hashed_exactly_without_normalisation():
    """NFC and NFD spellings are different keys: no silent normalisation."""
    composed, decomposed = "Z\u00fcrich", "Zu\u0308rich"
    assert (
        keys.make_key("n", "t", composed).ids != keys.make_key("n", "t", decomposed).ids
    )
    assert "Zürich" in keys.make_key("n", "t", composed).text


def test_very_large_values_are_exact():
    """Integers beyond 64 bits and long strings are hashed exactly, not truncated."""
    big = 2**200 + 1
    assert str(big) in keys.make_key("n", "t", big).text
    assert keys.make_key("n", "t", big).ids != keys.make_key("n", "t", big + 1).ids
    long_text = "x" * 1_000_000
    assert (
        keys.make_key("n", "t", long_text).ids
        != keys.make_key("n", "t", long_text + "y").ids
    )


def test_int_and_str_enums_count_as_their_value():
    """IntEnum/StrEnum members are ints/strings on the wire, so they key as their value."""

    class Color(enum.IntEnum):
        RED = 1

    assert keys.make_key("n", "t", Color.RED) == keys.make_key("n", "t", 1)


class Opaque:
    pass


class Obj:
    pass


class Plain(enum.Enum):
    A = "a"


@pytest.mark.parametrize(
    ("value", "fragment"),
    [
        (Opaque(), "is a value of type Opaque, which has no stable text form"),
        (Obj(), "is a value of type Obj,"),  # was "a Obj"
        (Plain.A, "enum member"),
        (b"bytes", "bytes"),
        ({1, 2}, "set"),
        (float("nan"), "float that is not finite"),
        (float("inf"), "float that is not finite"),
        (decimal.Decimal("NaN"), "Decimal that is not finite"),
        ({1: "int key"}, "key of type int as key #0"),
        ("\ud800", "not valid Unicode"),
        ({"nested": [Opaque()]}, "[key #0][0]"),
    ],
)
def test_values_without_a_stable_text_form_are_refused(value, fragment):
    """Unstable or ambiguous values raise LockKeyError naming where they are."""
    with pytest.raises(LockKeyError) as caught:
        keys.make_key("n", "t", value, where="argument 'x'")
    assert fragment in str(caught.value)
    assert "argument 'x'" in str(caught.value)


def test_key_text_is_compact_sorted_json():
    """The text is plain JSON another language can rebuild."""
    text = keys.make_key("n", "t", {"b": [1], "a": None}).text
    assert text == '["celery_pglock/1","n","t",{"a":null,"b":[1]}]'
    assert json.loads(text) == ["celery_pglock/1", "n", "t", {"a": None, "b": [1]}]


@pytest.mark.parametrize(
    "value", [0, -(2**63), 2**63 - 1, (42, 1001), (-(2**31), 2**31 - 1)]
)
def test_explicit_ids_in_range_are_accepted(value):
    """One signed 64-bit int or two signed 32-bit ints."""
    expected = value if isinstance(value, tuple) else (value,)
    assert expected == keys.explicit_key("t", value).ids


@pytest.mark.parametrize(
    "value",
    [
        2**63,
        -(2**63) - 1,
        (2**31, 1),
        (1, -(2**31) - 1),
        (1, 2, 3),
        "42",
        True,
        1.5,
        (1, "2"),
    ],
)
def test_explicit_ids_out_of_range_are_refused(value):
    """Out-of-range or wrongly shaped ids name the option and the accepted forms."""
    with pytest.raises(ConfigurationError) as caught:
        keys.explicit_key("t", value)
    assert "lock_id" in str(caught.value)


@pytest.mark.parametrize(
    ("ids", "expected"),
    [
        ((1,), (0, 1, 1)),
        ((-1,), (0xFFFFFFFF, 0xFFFFFFFF, 1)),
        ((2**32 + 5,), (1, 5, 1)),
        ((42, 1001), (42, 1001, 2)),
        ((-1, 7), (0xFFFFFFFF, 7, 2)),
    ],
)
def test_pg_locks_ids(ids, expected):
    """Keys map to pg_locks' unsigned (classid, objid, objsubid) columns, and back."""
    assert expected == keys.LockKey(name="t", ids=ids).pg_locks_ids
    assert ids == keys.LockKey.from_pg_locks("t", *expected).ids


def test_remaining_canonical_rules():
    """1 and 1.0 differ; time and naive/aware datetimes key as ISO text; str enums as their value;
    Decimal infinity is refused."""
    assert keys.make_key("n", "t", 1).ids != keys.make_key("n", "t", 1.0).ids
    assert keys.make_key("n", "t", datetime.time(12, 30)) == keys.make_key(
        "n", "t", "12:30:00"
    )
    naive = datetime.datetime(2026, 11, 29, 12, 0)  # noqa: DTZ001 - naive on purpose
    aware = naive.replace(tzinfo=datetime.timezone.utc)
    assert keys.make_key("n", "t", naive) == keys.make_key(
        "n", "t", "2026-11-29T12:00:00"
    )
    assert keys.make_key("n", "t", naive).ids != keys.make_key("n", "t", aware).ids

    class Region(str, enum.Enum):
        EU = "eu"

    assert keys.make_key("n", "t", Region.EU) == keys.make_key("n", "t", "eu")
    with pytest.raises(LockKeyError, match="Decimal that is not finite"):
        keys.make_key("n", "t", decimal.Decimal("Infinity"))
