"""``pglock release`` against a real worker: the holder's session ends, PostgreSQL frees
the lock, and the run that held it finds it lost (its result: LockLostError)."""

from __future__ import annotations

import json
import time

from click.testing import CliRunner

from celery_pglock import cli

from .conftest import wait_until

APP = "tests.acceptance.app"
TASK = "tests.acceptance.app.protected"


def test_release_ends_the_holder_which_reports_its_lock_lost(
    acceptance, start_workers, recorder, run
):
    queue = f"{acceptance.app.conf.task_default_queue}-release"
    start_workers(1, concurrency=2, queues=[queue])
    gate = f"{run}-gate"
    holder = acceptance.protected.apply_async((run, "k"), {"gate": gate}, queue=queue)
    wait_until(
        lambda: recorder.count(run, "k") == 1, timeout=30, what="the holder to start"
    )
    call = ["--app", APP, "release", TASK, "--args", json.dumps([run, "k"])]

    declined = CliRunner().invoke(cli.standalone_command, call, input="n\n")
    assert 1 == declined.exit_code, declined.output
    assert f"task {TASK}" in declined.output  # the holder is shown before asking
    assert "Aborted" in declined.output

    done = CliRunner().invoke(cli.standalone_command, [*call, "--yes"])
    assert 0 == done.exit_code, done.output
    assert "Ended backend" in done.output
    # The lock is free at once: a duplicate runs instead of being skipped.
    duplicate = acceptance.protected.apply_async((run, "k"), queue=queue)
    assert "k" == duplicate.get(timeout=30)
    # The holder's lock watcher checks every lock_watch_interval (1 s): give it three
    # ticks before the body may return (a body that ends first finds its release
    # failing instead, and reports lock_release_failed).
    time.sleep(3)
    acceptance.open_gate(gate)
    wait_until(holder.ready, timeout=30, what="the holder to end")
    assert "FAILURE" == holder.state
    assert "LockLostError" == type(holder.result).__name__
    holder.forget()

    again = CliRunner().invoke(cli.standalone_command, [*call, "--yes"])
    assert 1 == again.exit_code
    assert "No session holds the lock" in again.output
