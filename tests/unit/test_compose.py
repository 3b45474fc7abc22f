"""docker-compose.yml: valid against the compose-spec schema, and wired as documented.

No Docker engine runs here: the schema is the official compose-spec JSON schema that
check-jsonschema ships (``vendor.compose-spec``), and the wiring (ports on loopback,
health checks, start order, Prometheus scraping the worker's /metrics, Grafana loading
the shipped dashboard) is read from the files themselves.
tests/acceptance/test_compose.py runs the same services without Docker.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
#: Services that keep running, so need a health check others can wait for.
LONG_RUNNING = ("postgres", "redis", "worker", "flower", "prometheus", "grafana")


@pytest.fixture(scope="module")
def compose():
    return yaml.safe_load(COMPOSE.read_text())


def _check_schema(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            *(sys.executable, "-m", "check_jsonschema"),
            *("--builtin-schema", "vendor.compose-spec", str(path)),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_the_compose_file_is_valid_compose_spec():
    checked = _check_schema(COMPOSE)
    assert 0 == checked.returncode, checked.stdout + checked.stderr


@pytest.mark.parametrize(
    ("old", "new"),
    [
        (
            '    healthcheck:\n      test: ["CMD", "redis-cli"',
            '    healthchek:\n      test: ["CMD", "redis-cli"',
        ),
        ("condition: service_completed_successfully", "condition: service_done"),
    ],
    ids=["misspelt-key", "unknown-condition"],
)
def test_the_schema_check_refuses_a_mistake(tmp_path, old, new):
    """The check is not vacuous: a misspelt key or a made-up condition fails it."""
    text = COMPOSE.read_text()
    assert old in text
    broken = tmp_path / "docker-compose.yml"
    broken.write_text(text.replace(old, new))
    assert 0 != _check_schema(broken).returncode


def test_every_port_is_published_on_loopback_only(compose):
    published = [
        (name, port)
        for name, service in compose["services"].items()
        for port in service.get("ports", [])
    ]
    assert published
    assert [] == [p for p in published if not str(p[1]).startswith("127.0.0.1:")]
    # Not the ports a local PostgreSQL or Redis already uses.
    hosts = {str(port).split(":")[1] for _, port in published}
    assert not hosts & {"5432", "6379"}


def test_services_wait_for_what_they_need_to_be_healthy(compose):
    services = compose["services"]
    for name in LONG_RUNNING:
        assert "test" in services[name].get("healthcheck", {}), name
    for name, service in services.items():
        needs = service.get("depends_on", {})
        assert isinstance(needs, dict), f"{name}: depends_on without conditions"
        for needed, how in needs.items():
            expected = (
                "service_completed_successfully"
                if needed == "setup"
                else "service_healthy"
            )
            assert expected == how["condition"], (name, needed)
    assert {"postgres", "redis", "setup"} <= set(services["worker"]["depends_on"])
    assert "worker" in services["beat"]["depends_on"]


def test_worker_and_beat_run_the_example_with_metrics(compose):
    services = compose["services"]
    for name in ("setup", "worker", "beat"):
        assert "examples.settlement" in services[name]["command"], name
        assert "CELERY_PGLOCK_DATABASE_URL" in services[name]["environment"]
    assert "worker" in services["worker"]["command"]
    assert "beat" in services["beat"]["command"]
    port = services["worker"]["environment"]["PGLOCK_METRICS_PORT"]
    assert f"127.0.0.1:{port}:{port}" in services["worker"]["ports"]
    assert f":{port}/metrics" in " ".join(services["worker"]["healthcheck"]["test"])
    dockerfile = ROOT / services["worker"]["build"]["dockerfile"]
    for line in dockerfile.read_text().splitlines():
        if line.startswith("COPY "):
            for source in line.split()[1:-1]:
                assert (ROOT / source).exists(), line


def _mounts(service):
    """{container path: repository path} of a service's bind mounts."""
    mounts = {}
    for volume in service.get("volumes", []):
        source, target, *_ = volume.split(":")
        assert (ROOT / source).exists(), volume
        mounts[target] = ROOT / source
    return mounts


def test_prometheus_scrapes_the_worker_and_loads_the_alerts(compose):
    services = compose["services"]
    mounts = _mounts(services["prometheus"])
    config = yaml.safe_load(mounts["/etc/prometheus/prometheus.yml"].read_text())
    targets = [
        target
        for job in config["scrape_configs"]
        for static in job["static_configs"]
        for target in static["targets"]
    ]
    port = services["worker"]["environment"]["PGLOCK_METRICS_PORT"]
    assert [f"worker:{port}"] == targets
    for rules in config["rule_files"]:
        assert rules in mounts, rules
        assert "celery_pglock_" in mounts[rules].read_text()


def test_grafana_loads_the_shipped_dashboard_from_prometheus(compose):
    grafana = compose["services"]["grafana"]
    mounts = _mounts(grafana)
    providers = [
        yaml.safe_load(path.read_text())
        for target, path in mounts.items()
        if target.startswith("/etc/grafana/provisioning/dashboards/")
    ]
    (folder,) = [p["options"]["path"] for doc in providers for p in doc["providers"]]
    dashboards = [path for target, path in mounts.items() if target.startswith(folder)]
    assert [ROOT / "examples" / "grafana-dashboard.json"] == dashboards
    assert json.loads(dashboards[0].read_text())["panels"]
    (sources,) = [
        yaml.safe_load(path.read_text())
        for target, path in mounts.items()
        if target.startswith("/etc/grafana/provisioning/datasources/")
    ]
    (source,) = sources["datasources"]
    assert "prometheus" == source["type"]
    assert source["isDefault"]  # the dashboard's ${datasource} variable picks it
    assert "http://prometheus:9090" == source["url"]
    assert "127.0.0.1:9090:9090" in compose["services"]["prometheus"]["ports"]
