"""celery_pglock_enqueued_total where it is counted: in the process that sends.

A real producer process (tests/acceptance/producer.py, a web process's stand-in) sends a
lock_enqueue task with delay() and serves its outcomes, through serve_producer() or through
producer_registry() mounted in its own WSGI app; the test scrapes it over HTTP as
Prometheus would (docs/operations/metrics.md, "Producers").
"""

from __future__ import annotations

import os
import subprocess
import sys
import urllib.request
import uuid

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import REPO_ROOT

TASK = "tests.acceptance.enqueue_app.until_finished"


def _scrape(port: int) -> dict[str, float]:
    """``{outcome: value}`` of celery_pglock_enqueued_total for TASK."""
    with urllib.request.urlopen(
        f"http://127.0.0.1:{port}/metrics", timeout=10
    ) as response:
        text = response.read().decode()
    return {
        sample.labels["outcome"]: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "celery_pglock_enqueued_total"
        and sample.labels["task"] == TASK
    }


@pytest.mark.parametrize("mode", ["serve", "mount"])
def test_a_producer_serves_the_outcomes_of_its_sends(acceptance_env, mode):
    """Before any send, published and duplicate are served at 0; after two delay() calls
    of one key, the scrape shows 1 published and 1 duplicate (one message, one id)."""
    env = {**acceptance_env, "PGLOCK_TEST_QUEUE": f"pglock-nobody-{uuid.uuid4().hex}"}
    with subprocess.Popen(
        [sys.executable, "-m", "tests.acceptance.producer", mode],
        cwd=REPO_ROOT,
        env={**os.environ, **env},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    ) as producer:
        assert producer.stdout is not None
        assert producer.stdin is not None
        try:
            port = int(producer.stdout.readline())
            assert {"published": 0.0, "duplicate": 0.0} == _scrape(port)
            run = uuid.uuid4().hex[:8]
            ids = []
            for _ in range(2):
                producer.stdin.write(f"{run} k\n")
                producer.stdin.flush()
                ids.append(producer.stdout.readline().strip())
            assert ids[0] == ids[1]
            assert {"published": 1.0, "duplicate": 1.0} == _scrape(port)
        finally:
            producer.terminate()
            producer.wait(timeout=30)
