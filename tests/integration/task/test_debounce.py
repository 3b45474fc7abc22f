"""lock_debounce in-process against real PostgreSQL and Redis: a batch's first send is
published due after the quiet time; later sends push the start back (never past
lock_debounce_max after the first) without publishing; the carrier re-publishes the latest
send due when the row says. Real workers and timings: tests/acceptance/test_debounce.py."""

from __future__ import annotations

import datetime
import time

import pytest
from celery import signals as celery_signals

from celery_pglock import ConfigurationError
from tests.integration.task.test_enqueue import deliver, rows
from tests.integration.task.test_replace import execute, replaced_by
from tests.integration.task_support import define


@pytest.fixture
def published():
    """(task id, eta) of each message published during the test."""
    sent: list[tuple[str, datetime.datetime | None]] = []

    def count(sender=None, headers=None, **_):
        eta = headers.get("eta")
        sent.append((headers["id"], None if eta is None else _parse(eta)))

    celery_signals.after_task_publish.connect(count, weak=False)
    yield sent
    celery_signals.after_task_publish.disconnect(count)


def _parse(eta: str) -> datetime.datetime:
    return datetime.datetime.fromisoformat(eta)


def debounced(app, name, ran, **options):
    def body(tenant, value):
        ran.append(value)
        return value

    body.__name__ = f"debounce_{name}"
    return define(
        app, body, lock_args=("tenant",), lock_enqueue="until_started", **options
    )


def due_seconds(app, task, tenant):
    """(seconds until the key's row is due, seconds from its batch's first send)."""
    key = task.lock_key_for(tenant)
    [row] = execute(
        app,
        "SELECT extract(epoch FROM due_at - now())::float8, "
        "extract(epoch FROM due_at - first_at)::float8 FROM celery_pglock_queued "
        "WHERE (classid, objid, objsubid) = (%s, %s, %s)",
        *key.pg_locks_ids,
    )
    return row


def test_sends_push_the_start_back_and_the_latest_runs_when_quiet(app, published):
    """The first send is published due after the quiet time; the second only moves the
    row's due time; the carrier, taken early, re-publishes the latest due then."""
    ran: list[int] = []
    task = debounced(app, "push", ran, lock_debounce=30)
    before = datetime.datetime.now(datetime.timezone.utc)
    first = task.delay(1, 10)
    [(carrier, eta)] = published
    assert carrier == first.id
    assert 29 <= (eta - before).total_seconds() <= 31
    time.sleep(0.5)
    second = task.delay(1, 20)
    assert 1 == len(published)  # into the row
    left, since_first = due_seconds(app, task, 1)
    assert 29 <= left <= 30
    assert 30.3 <= since_first <= 31  # pushed past the first send's due time
    deliver(task, first.id, 1, 10)  # as if taken at its eta
    assert [] == ran
    (_, (latest, latest_eta)) = published
    assert second.id == latest
    assert second.id == replaced_by(task, first.id)
    assert 28 <= (latest_eta - before).total_seconds() - 0.5 <= 31
    assert second.id == rows(task, 1)[0]
    deliver(task, second.id, 1, 20)
    assert [20] == ran


def test_the_start_is_never_pushed_past_the_longest_wait(app):
    ran: list[int] = []
    task = debounced(app, "longest", ran, lock_debounce=2, lock_debounce_max=3)
    task.delay(2, 1)
    for value in (2, 3, 4):
        time.sleep(0.6)
        task.delay(2, value)
    left, since_first = due_seconds(app, task, 2)
    assert 2.9 <= since_first <= 3.1  # capped: 3 s after the first send
    assert left <= 3 - 1.7


def test_a_debounced_send_may_not_set_its_own_start(app):
    task = debounced(app, "countdown", [], lock_debounce=1)
    with pytest.raises(ConfigurationError, match="countdown=5 is invalid"):
        task.apply_async((3, 1), countdown=5)


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        ({"lock_enqueue": "until_finished", "lock_debounce": 1}, "lock_debounce=1"),
        ({"lock_debounce_max": 5}, "lock_debounce_max=5.0 is invalid"),
        ({"lock_debounce": 2, "lock_debounce_max": 1}, "at least lock_debounce"),
        (
            {"lock_debounce": 1, "lock_enqueue_on_duplicate": "raise"},
            "'replace' (or unset) with lock_debounce",
        ),
    ],
)
def test_bad_debounce_options_are_refused_at_bind(app, options, expected):
    def body(tenant):
        return tenant

    body.__name__ = "debounce_bad"
    options.setdefault("lock_enqueue", "until_started")
    with pytest.raises(ConfigurationError) as raised:
        define(app, body, lock_args=("tenant",), **options)
    assert expected in str(raised.value)
