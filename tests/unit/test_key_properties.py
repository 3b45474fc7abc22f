"""Properties of the key function (hypothesis): stable, type-distinguishing, refusing with
the path named and no value shown, collision-free, bounded in time and memory.

Every @given is bounded (max_examples, and a deadline where timing is not measured
separately), so the file runs in a few seconds.
"""

from __future__ import annotations

import datetime
import decimal
import json
import pickle
import subprocess
import sys
import threading
import time
import tracemalloc
import uuid

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from celery_pglock import keys
from celery_pglock.exceptions import LockKeyError
from celery_pglock.keys import key_material, lock_keys

BOUNDED = settings(
    max_examples=150,
    deadline=None,  # shared 2-core machine: timing is asserted separately
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
#: Strings never hold lone surrogates (refused, tested below).
TEXT = st.text(st.characters(exclude_categories=("Cs",)), max_size=20)
SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(10**30), max_value=10**30)
    | st.floats(allow_nan=False, allow_infinity=False)
    | TEXT
    | st.uuids()
    | st.decimals(allow_nan=False, allow_infinity=False, places=3)
    | st.dates()
    | st.datetimes()
    | st.times()
)
MATERIAL = st.recursive(
    SCALARS,
    lambda children: (
        st.lists(children, max_size=4)
        | st.tuples(children, children)
        | st.dictionaries(TEXT, children, max_size=4)
    ),
    max_leaves=12,
)


def key(value):
    return keys.make_key("props", "t", value)


def text_of(value):
    return keys.key_text("props", "t", keys.canonical(value))


# -- stable ------------------------------------------------------------------------------

_SUBPROCESS = """
import pickle, sys
from celery_pglock import keys
values = pickle.load(sys.stdin.buffer)
print([keys.make_key("props", "t", value).ids[0] for value in values])
"""


@settings(max_examples=3, deadline=None, suppress_health_check=list(HealthCheck))
@given(values=st.lists(MATERIAL, min_size=40, max_size=40))
def test_keys_are_the_same_in_another_interpreter_with_another_hash_seed(values):
    """A fresh interpreter (PYTHONHASHSEED differs, so str/bytes hash() differs)
    computes the same ids for the same values (passed by pickle: types preserved)."""
    here = [key(value).ids[0] for value in values]
    for seed in ("0", "4242"):
        completed = subprocess.run(
            [sys.executable, "-c", _SUBPROCESS],
            input=pickle.dumps(values),
            capture_output=True,
            timeout=60,
            check=True,
            env={"PYTHONHASHSEED": seed, "PATH": ""},
        )
        assert here == json.loads(completed.stdout)


@BOUNDED
@given(
    mapping=st.dictionaries(TEXT, MATERIAL, min_size=2, max_size=6), rnd=st.randoms()
)
def test_dict_order_does_not_matter(mapping, rnd):
    """A dict built in another order (another producer) gives the same key."""
    items = list(mapping.items())
    rnd.shuffle(items)
    assert key(mapping) == key(dict(items))


@BOUNDED
@given(value=MATERIAL)
def test_tuples_key_as_lists_and_json_round_trips_keep_the_key(value):
    """What Celery's JSON serializer delivers (lists, ISO strings) keys like the
    producer's value: the worker and the producer's lock_key_for agree."""
    delivered = json.loads(json.dumps(keys.canonical(value)))
    assert key(value) == key(delivered)


# -- type-distinguishing -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("left", "right"),
    [
        (7, "7"),
        (True, 1),
        (False, 0),
        (1.0, 1),
        (0.0, -0.0),
        (None, "null"),
        (None, []),
        ([], {}),
        ([1], {"0": 1}),
        ([1, 2], [[1, 2]]),
        ("", None),
        ({"a": 1}, [["a", 1]]),
        (decimal.Decimal("1.0"), decimal.Decimal("1")),
        (decimal.Decimal("1"), 1),
        (datetime.date(2026, 1, 2), datetime.datetime(2026, 1, 2)),  # noqa: DTZ001
    ],
)
def test_distinct_types_give_distinct_keys(left, right):
    assert key(left).ids != key(right).ids


@BOUNDED
@given(
    value=st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.booleans()
)
def test_a_number_and_its_text_never_share_a_key(value):
    if isinstance(value, int) and abs(value) >= 10**keys.MAX_INT_DIGITS:
        return
    assert key(value).ids != key(str(value)).ids
    assert key(value).ids != key([value]).ids


@BOUNDED
@given(left=MATERIAL, right=MATERIAL)
def test_keys_differ_exactly_when_canonical_texts_differ(left, right):
    """No two different canonical texts share an id over the sample (and equal texts
    always do): the key is a function of the canonical text alone."""
    assert (text_of(left) == text_of(right)) == (key(left).ids == key(right).ids)


def test_no_collisions_over_a_large_sample():
    """200,000 distinct materials of mixed types: 200,000 distinct ids."""
    materials = [
        *range(50_000),
        *(str(i) for i in range(50_000)),
        *([i, f"t{i}"] for i in range(50_000)),
        *({"tenant": i, "day": f"2026-{i % 12 + 1:02d}"} for i in range(50_000)),
    ]
    ids = {key(material).ids for material in materials}
    assert len(materials) == len(ids)


# -- refusals name the path, never the value ----------------------------------------------

SECRET = "SeCrEt"
BAD_LEAVES = st.sampled_from(
    [
        ({1, 2}, "a value of type set"),
        (b"raw", "a value of type bytes"),
        (float("nan"), "float that is not finite"),
        (float("-inf"), "float that is not finite"),
        (decimal.Decimal("sNaN"), "Decimal that is not finite"),
        (object(), "a value of type object"),
        ({7: "x"}, "key of type int"),
        ("a\ud800b", "not valid Unicode"),
        (10**5000, f"more than {keys.MAX_INT_DIGITS} digits"),
    ]
)
#: One step down: into a list at an index, or into a dict at a key position.
STEPS = st.lists(
    st.tuples(st.sampled_from(["list", "dict"]), st.integers(0, 3)), max_size=6
)


def _bury(leaf, steps, filler):
    """Put ``leaf`` at ``steps`` inside containers padded with secret-bearing fillers;
    return the value and the path the error message must show."""
    value, path = leaf, ""
    for kind, position in reversed(steps):
        if kind == "list":
            value = [*[filler] * position, value, filler]
            path = f"[{position}]{path}"
        else:
            keys_ = [f"{SECRET}.{n}@example.com" for n in range(position + 2)]
            value = {
                k: (value if n == position else filler) for n, k in enumerate(keys_)
            }
            path = f"[key #{position}]{path}"
    return value, path


@BOUNDED
@given(
    leaf=BAD_LEAVES, steps=STEPS, filler=st.sampled_from([f"{SECRET} value", 7, None])
)
def test_refusals_name_path_and_type_but_no_value_or_dict_key(leaf, steps, filler):
    bad, expected_kind = leaf
    value, path = _bury(bad, steps, filler)
    where = "Task 'props.t': argument 'payload'"
    with pytest.raises(LockKeyError) as caught:
        keys.make_key("props", "t", value, where=where)
    message = str(caught.value)
    assert message.startswith(f"{where}{path}")
    assert expected_kind in message
    assert SECRET not in message
    assert "example.com" not in message


def test_refused_argument_through_a_task_names_the_parameter():
    """The same through a SingletonTask: the parameter name, the path, the type."""
    from celery import Celery

    from celery_pglock import SingletonTask

    app = Celery("props", broker="memory://", set_as_current=False)
    app.conf.pglock_database_url = "postgresql+psycopg2://u@db.invalid/app"

    @app.task(
        base=SingletonTask, name="props.export", lock_args=("payload",), shared=False
    )
    def export(payload):
        return payload

    app.finalize(auto=True)
    with pytest.raises(LockKeyError) as caught:
        app.tasks["props.export"].lock_key_for({f"{SECRET}@example.com": [1, {2}]})
    message = str(caught.value)
    assert "Task 'props.export': argument 'payload'[key #0][1]" in message
    assert "a value of type set" in message
    assert SECRET not in message


# -- bounded in time, memory and stack ----------------------------------------------------


def _nested(depth, make=lambda child: [child]):
    value = None
    for _ in range(depth):
        value = make(value)
    return value


@pytest.mark.parametrize(
    "value",
    [
        _nested(100_000),
        _nested(100_000, lambda child: {"k": child}),
        _nested(keys.MAX_DEPTH + 1),
    ],
    ids=["list-100k", "dict-100k", "just-over"],
)
def test_deep_nesting_is_a_clear_error_not_a_recursion_crash(value):
    # CPU time: it stops at the bound instead of walking the whole value, and a loaded
    # machine cannot fail it.
    started = time.process_time()
    with pytest.raises(LockKeyError, match=f"nested more than {keys.MAX_DEPTH} levels"):
        keys.make_key("n", "t", value, where="argument 'x'")
    assert time.process_time() - started < 1.0


def test_nesting_up_to_the_bound_is_accepted():
    assert key(_nested(keys.MAX_DEPTH)).ids


def test_a_container_holding_itself_is_refused():
    looping: list[object] = [1]
    looping.append(looping)
    with pytest.raises(LockKeyError, match="holds itself"):
        key(looping)


def test_a_nearly_full_stack_gives_a_lock_key_error():
    """Even when the caller has used most of the stack, no RecursionError escapes."""
    errors: list[BaseException] = []

    def deep(remaining):
        if remaining:
            return deep(remaining - 1)
        try:
            key(_nested(keys.MAX_DEPTH))
        except BaseException as exc:  # the test inspects what escapes
            errors.append(exc)
        return None

    limit = sys.getrecursionlimit()
    thread = threading.Thread(target=deep, args=(limit - 40,))
    thread.start()
    thread.join(timeout=30)
    assert 1 == len(errors)
    assert isinstance(errors[0], LockKeyError)
    assert "stack" in str(errors[0])


@pytest.mark.parametrize("char", ["x", "é", "€", "😀"])
def test_a_50_mb_string_is_keyed_in_linear_time_and_constant_memory(char):
    """The text is streamed, so the transient memory is a few slices (about 1 MB), and the
    key keeps nothing of it. Its speed is a benchmark's business (benchmarks/); the CPU
    bound here only catches a superlinear algorithm (about 0.15 s of CPU here; a
    quadratic one takes minutes), and is CPU time, so a loaded machine cannot fail it."""
    value = char * (50_000_000 // len(char.encode()))
    tracemalloc.start()
    try:
        started = time.process_time()
        lock_key = keys.make_key("n", "t", {"blob": value})
        cpu_seconds = time.process_time() - started
        current, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert cpu_seconds < 10.0
    assert peak < 4_000_000
    assert current < 100_000
    assert lock_key.text is None
    assert lock_key.ids == keys.make_key("n", "t", {"blob": value}).ids


@pytest.mark.parametrize("char", ["x", "é", "😀"])
def test_a_long_key_text_hashes_to_the_digest_of_its_utf8_bytes(char):
    """The key of a long text is its SHA-256 prefix, whatever its characters' widths."""
    import hashlib

    text = "a" + char * (3 * 64 * 1024 + 7)
    expected = int.from_bytes(
        hashlib.sha256(text.encode()).digest()[:8], "big", signed=True
    )
    assert expected == keys.key_from_text(text)


def test_uuid_and_text_are_the_same_key():
    value = uuid.uuid4()
    assert key(value) == key(str(value))


# -- streamed hashing of long key texts -----------------------------------------------------


@BOUNDED
@given(value=MATERIAL)
def test_streamed_json_is_exactly_the_key_text(value):
    """The streamed encoder writes exactly key_text()'s JSON, so a long key text is
    hashed to the same key it would get if it were built."""
    canonical_value = keys.canonical(value)
    streamed = "".join(
        key_material.json_chunks(["celery_pglock/1", "n", "t", canonical_value])
    )
    assert keys.key_text("n", "t", canonical_value) == streamed


@BOUNDED
@given(
    pad=st.text(st.characters(exclude_categories=("Cs",)), min_size=1, max_size=3),
    extra=MATERIAL,
)
def test_long_key_texts_get_the_same_key_when_streamed(pad, extra):
    """Past TEXT_MAX the text is streamed, not built (text is None); the key is what
    hashing the whole text gives, escapes and multi-byte characters included."""
    long_value = {"blob": pad * (keys.TEXT_MAX // len(pad) + 10) + '"\\\n', "x": extra}
    lock_key = keys.make_key("n", "t", long_value)
    whole = keys.key_text("n", "t", keys.canonical(long_value))
    assert lock_key.text is None
    assert keys.key_from_text(whole) == lock_key.ids[0]


def test_keys_just_under_the_text_limit_keep_their_text():
    lock_key = keys.make_key("n", "t", "x" * (keys.TEXT_MAX - 100))
    assert lock_key.text is not None
    assert keys.key_from_text(lock_key.text) == lock_key.ids[0]


#: What the per-task fast path (lock_keys.ScalarKeys) keys: exact str, int, bool or None.
FAST_SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.text(max_size=40)  # lone surrogates included: the fast path must decline them
)


@BOUNDED
@given(
    names=st.lists(TEXT, min_size=1, max_size=4, unique=True),
    data=st.data(),
    namespace=TEXT,
    lock_name=TEXT,
)
def test_the_scalar_fast_path_gives_exactly_the_general_key(
    names, data, namespace, lock_name
):
    """lock_keys.ScalarKeys writes the key text by hand: it must be key_text's, byte for
    byte, or two workers (or a psql session) would disagree on the key."""
    values = tuple(data.draw(FAST_SCALARS) for _ in names)
    fast = lock_keys.ScalarKeys(namespace, lock_name, names).key(values)
    try:
        material = {
            name: keys.canonical(value)
            for name, value in zip(names, values, strict=True)
        }
    except LockKeyError:
        assert fast is None  # a lone surrogate: declined, so canonical() says why
        return
    general = keys.make_key(namespace, lock_name, material)
    assert fast is not None
    assert (fast.text, fast.ids, fast.name) == (general.text, general.ids, general.name)
