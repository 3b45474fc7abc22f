"""Skipped runs finish for their callers and monitors, on a real prefork worker.

The worker runs with ``-E`` and the test listens to Celery's event stream with Celery's own
``Receiver`` and ``State`` (what ``celery events`` and Flower use), so "a terminal event for
every skip" is checked the way a monitor sees it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import pytest
from celery import chain, chord, group
from celery.exceptions import ChordError

from celery_pglock import LockSkipped, skip_info

from .conftest import wait_until

BURST = 20


@pytest.fixture(scope="module")
def workers(start_workers):
    """One prefork worker with two children, sending task events (-E)."""
    return start_workers(1, concurrency=2, extra_args=("-E",))


class EventLog:
    """Every task event of the broker's event stream, fed to a celery.events.State."""

    def __init__(self, app) -> None:
        self.app = app
        self.state = app.events.State()
        self.events: list[dict] = []
        self._guard = threading.Lock()
        self._receiver = None
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with self.app.connection_for_read() as connection:
            self._receiver = self.app.events.Receiver(
                connection, handlers={"*": self._on_event}
            )
            self._receiver.capture(limit=None, timeout=None, wakeup=True)

    def _on_event(self, event: dict) -> None:
        with self._guard:
            self.events.append(event)
            self.state.event(event)

    def start(self) -> EventLog:
        self._thread.start()
        # wakeup=True asks every worker for a heartbeat: once one arrives, the event
        # queue is bound and no task event of the test can be missed.
        wait_until(
            lambda: any(e["type"] == "worker-heartbeat" for e in list(self.events)),
            timeout=30,
            what="the event stream to deliver a worker heartbeat",
        )
        return self

    def stop(self) -> None:
        if self._receiver is not None:
            self._receiver.should_stop = True
        self._thread.join(10)

    def task_events(self, task_id: str) -> list[dict]:
        with self._guard:
            return [e for e in self.events if e.get("uuid") == task_id]

    def task_state(self, task_id: str) -> str | None:
        with self._guard:
            task = self.state.tasks.get(task_id)
            return None if task is None else task.state


@pytest.fixture(scope="module")
def event_log(acceptance, workers):
    log = EventLog(acceptance.app).start()
    yield log
    log.stop()


def hold_key(acceptance, recorder, run, task=None, key="k"):
    """Start a run of ``task`` holding ``key`` until the returned gate opens."""
    task = task or acceptance.protected
    gate = f"{run}-{key}-gate"
    holder = task.delay(run, key, gate=gate)
    wait_until(
        lambda: recorder.count(run, key) == 1, timeout=30, what="the holder to start"
    )
    return holder, gate


def test_a_burst_of_skips_is_ready_at_once_with_a_terminal_event(
    acceptance, workers, event_log, recorder, run
):
    """Every duplicate of a burst is ready within a second of its skip, get() raises
    LockSkipped naming the holder, and monitors see a terminal task-failed event whose
    exception says LockSkipped, so Celery's State (Flower's) never leaves it STARTED."""
    holder, gate = hold_key(acceptance, recorder, run)
    duplicates = [acceptance.protected.delay(run, "k") for _ in range(BURST)]
    ready_at: dict[str, float] = {}
    deadline = time.monotonic() + 60
    while len(ready_at) < BURST and time.monotonic() < deadline:
        for result in duplicates:
            if result.id not in ready_at and result.ready():
                ready_at[result.id] = time.time()
    assert BURST == len(ready_at)
    wait_until(
        lambda: all(event_log.task_state(r.id) == "FAILURE" for r in duplicates),
        timeout=10,
        what="a terminal event for every skip",
    )
    holder_tag = f"{_host()}:{recorder.intervals(run)[0].pid}"
    lags = []
    for result in duplicates:
        started = time.monotonic()
        with pytest.raises(LockSkipped) as raised:
            result.get(timeout=5)
        assert time.monotonic() - started < 1.0
        assert holder_tag == raised.value.holder
        (failed,) = [
            e for e in event_log.task_events(result.id) if e["type"] == "task-failed"
        ]
        assert failed["exception"].startswith("LockSkipped(")
        assert holder_tag in failed["exception"]
        lags.append(ready_at[result.id] - failed["timestamp"])
    assert max(lags) < 1.0, lags
    acceptance.open_gate(gate)
    assert "k" == holder.get(timeout=30)
    assert 1 == recorder.count(run, "k")


def test_a_chord_with_a_skipped_header_member_ends(acceptance, workers, recorder, run):
    """A chord whose header holds a skipped run does not stall: it ends at once with the
    skip (its callback does not run)."""
    holder, gate = hold_key(acceptance, recorder, run)
    result = chord(
        [acceptance.protected.si(run, "k"), acceptance.protected.si(run, "free")]
    )(acceptance.collect.s())
    started = time.monotonic()
    with pytest.raises((LockSkipped, ChordError)) as raised:
        result.get(timeout=30)
    assert time.monotonic() - started < 10
    # Celery ends the chord with the failed member's exception (or a ChordError naming it).
    assert isinstance(raised.value, LockSkipped) or "LockSkipped" in str(raised.value)
    acceptance.open_gate(gate)
    holder.get(timeout=30)


def test_a_group_with_skips_is_ready_and_tells_skips_apart(
    acceptance, workers, recorder, run
):
    """A group of duplicates ends at once; join(propagate=False) gives each run's value
    or its LockSkipped, and skip_info() tells them apart."""
    holder, gate = hold_key(acceptance, recorder, run)
    results = group(acceptance.protected.si(run, "k") for _ in range(3)).delay()
    values = results.join(timeout=30, propagate=False)
    assert 3 == len(values)
    assert all(skip_info(value)["reason"] == "lock_busy" for value in values)
    acceptance.open_gate(gate)
    holder.get(timeout=30)


def test_success_mode_returns_a_record_and_stops_the_chain(
    acceptance, workers, recorder, run
):
    """lock_skip_result='success': the skipped link is SUCCESS with a skip record, the
    rest of the chain does not run, and a chord counts the skipped part."""
    task = acceptance.protected_success
    holder, gate = hold_key(acceptance, recorder, run, task=task)
    skipped_chain = chain(task.si(run, "k"), acceptance.after.s(run)).delay()
    record = skipped_chain.parent.get(timeout=30)
    assert "skipped" == record["celery_pglock"]
    assert "tests.acceptance.app.protected_success" == skip_info(record)["task"]
    counted = chord([task.si(run, "k"), task.si(run, "free")])(acceptance.collect.s())
    assert 2 == counted.get(timeout=30)
    acceptance.open_gate(gate)
    holder.get(timeout=30)
    assert 0 == recorder.count(run, "after")
    assert "PENDING" == skipped_chain.state  # documented: the next link never runs


def test_shadow_mode_runs_every_body(acceptance, workers, recorder, run):
    """lock_shadow=True on a real worker: duplicates of a held key run anyway."""
    holder, gate = hold_key(acceptance, recorder, run, task=acceptance.shadowed)
    duplicates = [acceptance.shadowed.delay(run, "k") for _ in range(3)]
    assert ["k"] * 3 == [result.get(timeout=30) for result in duplicates]
    acceptance.open_gate(gate)
    assert "k" == holder.get(timeout=30)
    assert 4 == recorder.count(run, "k")
    assert recorder.overlaps(run)  # what shadow mode reports instead of preventing


def test_pglock_locks_shows_the_running_holder_and_nothing_after(
    acceptance, acceptance_env, workers, recorder, run
):
    """`celery -A app pglock locks` shows a running body's lock by task name, worker
    host:pid and how long it has been held, counted from the grant although the lock
    watcher checks it on the holder's session every second meanwhile (the session's
    application_name carries the grant's second; docs/operations/cli.md); once the body
    ends, the lock is gone."""
    key = str(acceptance.protected.lock_key_for(run, "k"))
    asked = time.monotonic()
    holder, gate = hold_key(acceptance, recorder, run)
    granted_by = time.monotonic()  # the body runs: its lock was granted before
    try:
        wait_until(
            lambda: time.monotonic() - granted_by > 2.5,
            timeout=5,
            what="the watcher to check the lock twice",
        )
        entry = _lock_entry(acceptance_env, key)
        assert entry is not None
        assert acceptance.protected.name == entry["task"]
        assert f"{_host()}:{recorder.intervals(run)[0].pid}" == entry["holder"]
        assert 2.5 <= entry["held_seconds"] <= time.monotonic() - asked + 1.0, entry
        assert entry["celery_pglock"]
    finally:
        acceptance.open_gate(gate)
    assert "k" == holder.get(timeout=30)
    assert None is _lock_entry(acceptance_env, key)


def _lock_entry(env, key):
    completed = subprocess.run(
        [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "tests.acceptance.app",
            "pglock",
            "locks",
            "--json",
        ],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert 0 == completed.returncode, completed.stderr
    found = [e for e in json.loads(completed.stdout) if e["key"] == key]
    return found[0] if found else None


def _host() -> str:
    from celery_pglock.db import engines

    return engines.process_tag().rsplit(":", 1)[0]
