"""`pglock why` with a real prefork worker keeping pglock_history: a run, a skip naming
the holder, and a run re-queued while its group was full, each told as it happened."""

from __future__ import annotations

import json
import time

import pytest
from click.testing import CliRunner

from celery_pglock import LockSkipped, cli

from .conftest import wait_until


@pytest.fixture(scope="module")
def workers(start_workers):
    return start_workers(1, concurrency=4, env={"PGLOCK_TEST_HISTORY": "1"})


def why(acceptance, task_id, last_event):
    """`pglock why --json`, once ``last_event`` is written (batched off the run)."""
    found: dict = {}

    def written():
        result = CliRunner().invoke(
            cli.standalone_command,
            ["--database-url", acceptance.database_url, "why", task_id, "--json"],
        )
        found.update(json.loads(result.output))
        return last_event in [event["event"] for event in found["events"]]

    wait_until(written, timeout=15, what=f"{task_id}'s {last_event} event")
    return found


def test_why_tells_a_run_a_skip_and_a_retried_run(acceptance, workers, recorder, run):
    ran = acceptance.protected.delay(run, "ran")
    assert "ran" == ran.get(timeout=30)
    told = why(acceptance, ran.id, "ended")
    pid = recorder.intervals(run)[0].pid
    assert pid in workers[0].child_pids()
    assert told["verdict"].startswith("ran on ")
    assert f":{pid}" in told["verdict"]

    gate = f"{run}-gate"
    holder = acceptance.protected.delay(run, "held", gate=gate)
    wait_until(lambda: recorder.count(run, "held") == 1, timeout=30, what="holder")
    skipped = acceptance.protected.delay(run, "held")
    with pytest.raises(LockSkipped):
        skipped.get(timeout=30)
    holder_pid = next(i.pid for i in recorder.intervals(run) if i.key == "held")
    told = why(acceptance, skipped.id, "skipped")
    assert told["verdict"].startswith("did not run: lock_busy, held by ")
    assert f":{holder_pid}" in told["verdict"]

    # The group (limit 2) full: a third key is re-queued, then runs once a slot frees.
    fillers = [acceptance.grouped.delay(run, f"g{i}", gate=gate) for i in range(2)]
    wait_until(lambda: recorder.count(run, "group") == 2, timeout=30, what="fillers")
    waiting = acceptance.grouped.delay(run, "g3")
    time.sleep(0.5)
    acceptance.open_gate(gate)
    assert "g3" == waiting.get(timeout=30)
    for result in (holder, *fillers):
        result.get(timeout=30)
    told = why(acceptance, waiting.id, "ended")
    events = [(e["event"], e.get("reason")) for e in told["events"]]
    assert ("skipped", "group") in events
    assert events[-2:] == [("started", None), ("ended", None)]
    assert told["verdict"].startswith("ran on ")
