"""lock_limit: the option's validation at bind, the slot keys, the slot statement. No I/O."""

from __future__ import annotations

import re

import pytest

from celery_pglock import ConfigurationError, keys
from celery_pglock.db import sql_text

from .test_config import app, register  # noqa: F401 - app is a fixture

#: Slot keys as every process must derive them (docs/reference/keys.md, Slots).
VECTORS = [
    ((1001,), 3, [(1001,), (-4627661780298343129,), (-2134087329791553576,)]),
    ((42, 1001), 2, [(42, 1001), (6293669143609670619,)]),
]


def test_limit_is_one_by_default_and_set_per_task(app):  # noqa: F811
    """Default 1 (one run of a key, as before); any int from 1 to 64 is taken."""
    assert 1 == register(app).lock_config.limit


def test_the_largest_limit_is_64(app):  # noqa: F811
    assert 64 == register(app, lock_limit=64).lock_config.limit


@pytest.mark.parametrize("value", [0, 65, -1, True, 2.0, "3"])
def test_bad_limits_are_refused_at_bind_naming_the_option(app, value):  # noqa: F811
    with pytest.raises(ConfigurationError) as caught:
        register(app, lock_limit=value)
    message = str(caught.value)
    assert f"lock_limit={value!r} is invalid" in message
    assert "expected an int from 1 to 64" in message


def test_fencing_with_several_slots_is_refused_at_bind(app):  # noqa: F811
    """A fencing token orders the holders of a key; N holders at once have no order."""
    with pytest.raises(ConfigurationError) as caught:
        register(app, lock_limit=2, lock_fencing=True)
    assert re.search(
        r"lock_fencing=True is invalid; expected False with lock_limit=2",
        str(caught.value),
    )


def test_shadow_mode_works_with_slots(app):  # noqa: F811
    assert register(app, lock_limit=3, lock_shadow=True).lock_config.shadow


@pytest.mark.parametrize(("ids", "limit", "expected"), VECTORS)
def test_slot_keys_are_stable_and_slot_0_is_the_key(ids, limit, expected):
    """Slot 0 is the key itself (lock_limit=1 locks what it always did); slot i >= 1 is
    derived from the key's ids alone, so lock_id keys have slots too."""
    key = keys.LockKey(name="unit", ids=ids)
    slots = keys.slot_keys(key, limit)
    assert key is slots[0]
    assert expected == [slot.ids for slot in slots]
    assert ["unit"] * limit == [slot.name for slot in slots]


def test_slot_keys_of_a_long_key_are_cached_by_ids():
    """The cache keeps ids, never a key's (possibly long) text."""
    key = keys.make_key("ns", "unit", {"x": "y" * 1000})
    assert keys.slot_keys(key, 4)[1:] == keys.slot_keys(key, 4)[1:]
    assert all(slot.text is None for slot in keys.slot_keys(key, 4)[1:])
    assert 4 == len({slot.ids for slot in keys.slot_keys(key, 4)})


def test_the_slot_statement_is_one_text_whatever_the_slots():
    """The slots are parameters, so a session prepares one text per form (scope, label,
    run lock), never one per limit or per set of free slots. It steps through them
    (a recursive CTE that stops at the first granted), never a set-returning form, which
    would evaluate every row and take every slot."""
    statement = sql_text.try_slots(transaction=False, named=False, run=False)
    assert statement.startswith("WITH RECURSIVE t(i, got) AS (")
    assert "FROM t WHERE NOT t.got AND t.i < cardinality(%(k1)s::bigint[])" in statement
    assert "unnest" not in statement
    forms = {
        sql_text.try_slots(transaction=transaction, named=named, run=run)
        for transaction in (False, True)
        for named in (False, True)
        for run in (False, True)
    }
    assert 8 == len(forms)
    xact = sql_text.try_slots(transaction=True, named=True, run=True)
    assert 3 == xact.count(
        "pg_try_advisory_xact_lock"
    )  # a slot of either arity, the run
    assert "pg_try_advisory_lock(" not in xact


def test_the_slot_params_carry_both_key_forms():
    """An (int, int) slot 0 and bigint slots: one array per id, and which form each is."""
    assert {
        "k1": "{42,6293669143609670619}",
        "k2": "{1001,0}",
        "pair": "{t,f}",
        "names": ["a", "b"],
        "r1": 5,
        "r2": 6,
    } == sql_text.slot_params([(42, 1001), (6293669143609670619,)], ["a", "b"], (5, 6))
    assert {"k1": "{7}", "k2": "{0}", "pair": "{f}"} == sql_text.slot_params(
        [(7,)], None, None
    )
