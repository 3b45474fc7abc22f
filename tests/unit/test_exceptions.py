"""The library's exceptions and skip records. No I/O.

Pickling, JSON result backends, and the holder read back from an application_name.
"""

from __future__ import annotations

import json
import pickle

import pytest

from celery_pglock import ConfigurationError, LockBusy, LockNotOwnedError, LockSkipped
from celery_pglock.lock import holder_lookup


@pytest.mark.parametrize(
    "error",
    [
        LockBusy("busy", key="1", name="t"),
        LockNotOwnedError("gone", key="1,2", name="t"),
    ],
)
def test_lock_errors_survive_pickling(error):
    """Result backends pickle exceptions; message, key and name must survive."""
    copy = pickle.loads(pickle.dumps(error))
    assert type(error) is type(copy)
    assert (error.message, error.key, error.name) == (copy.message, copy.key, copy.name)


def test_configuration_error_is_also_a_value_error():
    """Callers catching ValueError for bad settings keep working."""
    assert issubclass(ConfigurationError, ValueError)


def test_lock_skipped_round_trips_like_a_json_result_backend():
    """A JSON result backend rebuilds an exception as cls(*args): details survive."""
    skip = LockSkipped("busy", {"key": "1", "lock": "t", "holder": "h:1"})
    rebuilt = type(skip)(*json.loads(json.dumps(skip.args)))
    copy = pickle.loads(pickle.dumps(skip))
    for again in (rebuilt, copy):
        assert ("busy", "1", "t", "h:1") == (
            again.message,
            again.key,
            again.name,
            again.holder,
        )
    assert "LockSkipped('busy')" == repr(skip)
    assert isinstance(skip, LockBusy)


@pytest.mark.parametrize(
    ("application_name", "expected"),
    [
        (
            "pglock web-1:4242 -4311986427365126397 billing.settle",
            ("web-1:4242", "billing.settle"),
        ),
        ("pglock web-1:4242 42,1001 ~ng.settle", ("web-1:4242", "~ng.settle")),
        ("pglock web-1:4242 billing.settle", ("web-1:4242", "billing.settle")),
        ("pglock web-1:4242 @1796400000 b.settle", ("web-1:4242", "b.settle")),
        ("pglock web-1:4242 idle", ("web-1:4242", None)),
        ("pglock web-1:4242", ("web-1:4242", None)),
        ("psql", (None, None)),
        (None, (None, None)),
    ],
)
def test_holder_is_read_from_application_name(application_name, expected):
    """The holder's host:pid and task name come from its application_name."""
    assert expected == holder_lookup.parse_application_name(application_name)


@pytest.mark.parametrize(
    ("application_name", "expected"),
    [
        ("pglock web-1:4242 @1796400000 billing.settle", 1796400000),
        ("my app web-1:4242 @1796400000 billing.settle", 1796400000),
        ("pglock web-1:4242 -4311986427365126397 billing.settle", None),
        ("pglock web-1:4242 billing.settle", None),
        ("psql @1796400000", None),
        (None, None),
    ],
)
def test_held_since_is_read_from_a_process_sessions_application_name(
    application_name, expected
):
    """The process lock session shows, after its host:pid, the epoch second it began to
    hold its keys; nothing else is read as one."""
    assert expected == holder_lookup.held_since(application_name)
