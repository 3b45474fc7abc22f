"""The shipped dashboard and alert rules only use metrics the library exports. No I/O."""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import prometheus_client
import pytest

from celery_pglock import ConfigurationError, metrics
from celery_pglock.metrics import server as metrics_server

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
METRIC = re.compile(r"\bcelery_pglock_[a-z_]+")


def exported_names() -> set[str]:
    registry = prometheus_client.CollectorRegistry()
    sink = metrics.PrometheusMetrics(registry=registry)
    sink.declare([("t", "skip")])
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


def test_a_taken_port_is_reported_and_changes_nothing(monkeypatch, tmp_path):
    """serve() on a port in use raises ConfigurationError naming the setting, and leaves
    no multiprocess directory or environment variable behind (children keep counting in
    memory; tasks are unaffected)."""
    import socket

    monkeypatch.delenv(metrics_server.MULTIPROC_ENV, raising=False)
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ConfigurationError, match=f"pglock_metrics_port={port}"):
            metrics_server.serve(
                {"pglock_metrics_port": port, "pglock_metrics_address": "127.0.0.1"}
            )
    assert metrics_server.MULTIPROC_ENV not in os.environ
    assert [] == list(tmp_path.iterdir())


def test_without_prometheus_client_only_the_worker_refuses(monkeypatch):
    """A process without the extra registers tasks (NullMetrics); a worker start names
    the extra to install."""
    from celery import Celery

    from celery_pglock import SingletonTask
    from celery_pglock.task import worker_hooks

    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # import fails
    app = Celery("unit", broker="memory://", set_as_current=False)
    app.conf.pglock_database_url = "postgresql+psycopg2://u@db.invalid/app"
    app.conf.pglock_metrics_port = 9808

    @app.task(base=SingletonTask, name="unit.no_prometheus", shared=False)
    def no_prometheus():
        return 1

    app.finalize(auto=True)
    assert isinstance(metrics.current(), metrics.NullMetrics)
    with pytest.raises(ConfigurationError, match=r"celery-pglock\[prometheus\]"):
        worker_hooks.check_app(app)


def _values(registry, name):
    return {
        tuple(sorted(sample.labels.items())): sample.value
        for family in registry.collect()
        for sample in family.samples
        if sample.name == name
    }


def test_declared_series_exist_at_zero_before_any_event():
    """declare(): every task's counters, gauges and the info series, before any run."""
    registry = prometheus_client.CollectorRegistry()
    sink = metrics.PrometheusMetrics(registry=registry)
    sink.declare([("t", "retry")])
    for name in (
        "celery_pglock_acquired_total",
        "celery_pglock_release_failed_total",
        "celery_pglock_lost_total",
        "celery_pglock_held_locks",
        "celery_pglock_oldest_held_seconds",
    ):
        assert {(("task", "t"),): 0.0} == _values(registry, name), name
    assert {(("policy", "retry"), ("task", "t")): 0.0} == _values(
        registry, "celery_pglock_skipped_total"
    )
    (info,) = _values(registry, "celery_pglock_info").items()
    assert 1.0 == info[1]


def test_held_locks_and_the_oldest_age_follow_acquire_and_release(monkeypatch):
    """In one process: the count of locks held now and the age of the oldest, per task;
    a release takes away the lock whose start matches its held time."""
    clock = [1000.0]
    monkeypatch.setattr(metrics.time, "time", lambda: clock[0])
    registry = prometheus_client.CollectorRegistry()
    sink = metrics.PrometheusMetrics(registry=registry)
    sink.acquired("t", 0.0)  # at 1000
    clock[0] = 1010.0
    sink.acquired("t", 0.0)  # at 1010
    clock[0] = 1030.0
    assert {(("task", "t"),): 2.0} == _values(registry, "celery_pglock_held_locks")
    assert {(("task", "t"),): 30.0} == _values(
        registry, "celery_pglock_oldest_held_seconds"
    )
    sink.released("t", "SUCCESS", 30.0)  # the first one ends
    assert {(("task", "t"),): 1.0} == _values(registry, "celery_pglock_held_locks")
    assert {(("task", "t"),): 20.0} == _values(
        registry, "celery_pglock_oldest_held_seconds"
    )
    sink.released("t", "FAILURE", 20.0)
    assert {(("task", "t"),): 0.0} == _values(registry, "celery_pglock_held_locks")
    assert {(("task", "t"),): 0.0} == _values(
        registry, "celery_pglock_oldest_held_seconds"
    )


#: celery_pglock_* names in the docs that are SQL objects, not metrics.
SQL_OBJECTS = {
    "celery_pglock_key",
    "celery_pglock_canonical",
    "celery_pglock_locks",
    "celery_pglock_fencing",
    "celery_pglock_fencing_token_seq",
    "celery_pglock_queued",
    "celery_pglock_periods",
    "celery_pglock_history",
    "celery_pglock_replaced",
    # Prepared statements: each name and a hash of its text (sql_text.versioned).
    "celery_pglock_claim_",
    "celery_pglock_claim_first_",
    "celery_pglock_s",  # the lock session's: celery_pglock_s + a hash
    "celery_pglock_period_",
}
DOCS = Path(__file__).resolve().parents[2] / "docs"


def _served_families():
    """{documented name: type} of every family a worker serves (counters as ``_total``)."""
    registry = prometheus_client.CollectorRegistry()
    sink = metrics.PrometheusMetrics(registry=registry)
    sink.declare([("t", "skip")])
    return {
        family.name + ("_total" if family.type == "counter" else ""): family.type
        for family in registry.collect()
    }


def test_the_metrics_table_lists_exactly_what_is_served():
    """docs/operations/metrics.md's table: every metric served, and nothing else, with its
    type."""
    text = (DOCS / "operations" / "metrics.md").read_text()
    table = dict(re.findall(r"(?m)^\| `(celery_pglock_\w+)` \| (\w+) \|", text))
    assert _served_families() == table


def test_every_metric_the_docs_name_exists():
    """Any celery_pglock_* metric named in README.md or docs/ (queries included) is one
    a worker serves, a sample of one, or the documented raw form of the held age."""
    served = set(exported_names()) | set(_served_families()) | {metrics.OLDEST_START}
    pages = [DOCS.parent / "README.md", *DOCS.rglob("*.md")]
    named = {
        (page.name, name)
        for page in pages
        for name in METRIC.findall(page.read_text())
        if name not in SQL_OBJECTS
    }
    assert named
    assert set() == {(page, name) for page, name in named if name not in served}
