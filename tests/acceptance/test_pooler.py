"""Real workers whose locks go through a real PgBouncer (marker pgbouncer).

Transaction scope through transaction pooling, and both scopes through session pooling,
never let two runs of one key overlap; a worker with session-scope tasks behind
transaction pooling refuses to start, naming the fix.
"""

from __future__ import annotations

import importlib
import os
import random
import subprocess
import sys
import uuid

import pytest

from .conftest import outcomes, wait_until

pytestmark = pytest.mark.pgbouncer

APP = "tests.acceptance.pooler_app"
QUEUE = f"pglock-pooler-{uuid.uuid4().hex[:8]}"
SENT = 90


@pytest.fixture(scope="module")
def pooler_app(services):
    """The pooler app in this process (it only sends tasks), on this module's queue."""
    module = importlib.import_module(APP)
    module.app.conf.task_default_queue = QUEUE
    module.recorder.setup()
    yield module
    module.recorder.close()


@pytest.mark.parametrize(
    ("mode", "scope"),
    [
        ("transaction", "transaction"),
        ("session", "session"),
        ("session", "transaction"),
    ],
)
def test_no_overlap_through_pgbouncer(
    pooler_app, pgbouncer_factory, worker_factory, mode, scope
):
    """Two prefork workers (four processes) race on three keys through PgBouncer:
    every message runs or is skipped, and no two runs of a key overlap."""
    bouncer = pgbouncer_factory(mode)
    env = {
        "PGLOCK_TEST_LOCK_DATABASE_URL": bouncer.url(),
        "PGLOCK_TEST_SCOPE": scope,
        "PGLOCK_TEST_QUEUE": QUEUE,
    }
    workers = [
        worker_factory(APP, env=env, concurrency=2, timeout=90) for _ in range(2)
    ]
    # The start-up report connected through PgBouncer with the default options.
    assert "unreachable" not in workers[0].log_text()
    run = uuid.uuid4().hex[:12]
    rng = random.Random(run)  # noqa: S311 - reproducible test data, not crypto
    results = [
        pooler_app.pooled.delay(
            run, f"k{rng.randrange(3)}", hold=rng.choice([0, 0.01, 0.03])
        )
        for _ in range(SENT)
    ]
    wait_until(
        lambda: all(o in ("SUCCESS", "skipped") for o in outcomes(results)),
        timeout=120,
        what="every run to end",
    )
    outcome = outcomes(results)
    assert SENT == outcome.count("SUCCESS") + outcome.count("skipped")
    assert outcome.count("SUCCESS") == pooler_app.recorder.count(run)
    assert [] == pooler_app.recorder.overlaps(run)
    for key in ("k0", "k1", "k2"):
        assert pooler_app.recorder.count(run, key) >= 1


def test_worker_refuses_session_scope_behind_transaction_pooling(
    pgbouncer_factory, services
):
    """The worker exits at start, naming the task, the pooling mode and both fixes."""
    from tests.conftest import REPO_ROOT

    bouncer = pgbouncer_factory("transaction")
    env = {
        **os.environ,
        **services.env(),
        "PYTHONPATH": str(REPO_ROOT),
        "PGLOCK_TEST_LOCK_DATABASE_URL": bouncer.url(),
        "PGLOCK_TEST_SCOPE": "session",
        "PGLOCK_TEST_QUEUE": QUEUE,
    }
    command = [sys.executable, "-m", "celery", "-A", APP, "worker"]
    completed = subprocess.run(
        [*command, "--pool", "solo", "--loglevel", "INFO", "--without-mingle"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    output = completed.stdout + completed.stderr
    assert 0 != completed.returncode, output
    assert "transaction-pooling" in output
    assert "lock_scope='transaction'" in output
    assert "pglock_database_url" in output
    assert "tests.acceptance.pooler_app.pooled" in output
