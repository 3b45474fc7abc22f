"""The shipped dashboard and alert rules only use metrics the library exports. No I/O."""

from __future__ import annotations

import json
import re
from pathlib import Path

import prometheus_client
import pytest

from celery_pglock import metrics

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
METRIC = re.compile(r"\bcelery_pglock_[a-z_]+")


def exported_names() -> set[str]:
    registry = prometheus_client.CollectorRegistry()
    sink = metrics.PrometheusMetrics(registry=registry)
    sink.acquired("t", 0.1)
    sink.skipped("t", "skip", 0.1)
    sink.released("t", "SUCCESS", 1.0)
    sink.release_failed("t")
    sink.lost("t")
    return {sample.name for family in registry.collect() for sample in family.samples}


@pytest.mark.parametrize("name", ["grafana-dashboard.json", "prometheus-alerts.yml"])
def test_examples_use_exported_metrics(name):
    text = (EXAMPLES / name).read_text()
    used = set(METRIC.findall(text)) - {"celery_pglock_locks"}
    assert used
    assert set() == used - exported_names()


def test_dashboard_is_valid_json_with_a_task_variable():
    dashboard = json.loads((EXAMPLES / "grafana-dashboard.json").read_text())
    assert "task" in [v["name"] for v in dashboard["templating"]["list"]]
    assert all(panel["targets"] for panel in dashboard["panels"])


def test_prometheus_labels_never_carry_more_than_names():
    """Labels are task, policy, state: nothing per call."""
    registry = prometheus_client.CollectorRegistry()
    metrics.PrometheusMetrics(registry=registry).skipped("t", "skip", 0.0)
    labels = {
        key
        for family in registry.collect()
        for sample in family.samples
        for key in sample.labels
    }
    assert {"task", "policy", "le"} >= labels
