"""A real Django project (tests/integration/django_project/): ``manage.py check`` with
celery_pglock.contrib.django, and where a bad lock setting surfaces.

Each command runs in a subprocess from the project's directory, as a developer runs it,
with the settings module chosen by DJANGO_SETTINGS_MODULE.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

PROJECT = Path(__file__).parent.parent / "django_project"
TYPO = "proj.settings_typo"  # CELERY_PGLOCK_ON_BUSSY
INVALID = "proj.settings_invalid"  # CELERY_PGLOCK_ON_BUSY = "skp"


@pytest.fixture
def project(database_url):
    """Run a command in the project with the given settings module; returns the result."""

    def run(*args, settings="proj.settings"):
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("CELERY_PGLOCK_", "DJANGO_"))
        }
        env.update(DJANGO_SETTINGS_MODULE=settings, PROJ_LOCK_DATABASE_URL=database_url)
        return subprocess.run(
            [sys.executable, *args],
            cwd=PROJECT,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )

    return run


def test_manage_py_check_passes_with_good_settings(project):
    completed = project("manage.py", "check")
    assert 0 == completed.returncode, completed.stdout + completed.stderr
    assert "System check identified no issues" in completed.stdout


@pytest.mark.parametrize(
    ("settings", "expected"),
    [
        (
            TYPO,
            "(celery_pglock.E001) Unknown setting 'CELERY_PGLOCK_ON_BUSSY'; did you "
            "mean 'CELERY_PGLOCK_ON_BUSY'?",
        ),
        (
            INVALID,
            "(celery_pglock.E002) lock_on_busy (from app.conf.pglock_on_busy)='skp' is "
            "invalid; expected one of 'skip', 'raise', 'retry', 'wait'.",
        ),
        (
            "proj.settings_bad_url",
            "(celery_pglock.E003) pglock_database_url must be a PostgreSQL URL using "
            "psycopg2",
        ),
    ],
    ids=["typo", "invalid value", "not PostgreSQL"],
)
def test_manage_py_check_names_the_bad_setting(project, settings, expected):
    """The check fails (exit 1) with one Error naming the setting, the expected value,
    and the settings.py spelling of app.conf names."""
    completed = project("manage.py", "check", settings=settings)
    assert 1 == completed.returncode, completed.stdout + completed.stderr
    assert expected in completed.stderr
    assert "app.conf.pglock_<name> is CELERY_PGLOCK_<NAME>" in completed.stderr
    assert "System check identified 1 issue" in completed.stderr


def test_manage_py_check_warns_without_a_database_url(project):
    """No URL is a Warning, not an Error: a web process sends tasks without one."""
    completed = project("manage.py", "check", settings="proj.settings_no_url")
    assert 0 == completed.returncode, completed.stdout + completed.stderr
    output = completed.stdout + completed.stderr
    assert "(celery_pglock.W001) No lock database configured" in output
    assert "unless their environment sets CELERY_PGLOCK_DATABASE_URL" in output


def test_delay_in_the_web_process_raises_configuration_error(project):
    """A web process (django.setup(), then .delay()) raises ConfigurationError from its
    first .delay() with a typo'd setting, not from the import, and sends with good ones."""
    send = (
        "import django; django.setup()\n"
        "from billing.tasks import recompute_balance\n"
        "print('imported', flush=True)\n"
        "print('sent', recompute_balance.delay(7).id)\n"
    )
    good = project("-c", send)
    assert 0 == good.returncode, good.stdout + good.stderr
    assert "sent " in good.stdout
    bad = project("-c", send, settings=TYPO)
    assert 0 != bad.returncode
    assert "imported\n" == bad.stdout  # the import binds nothing: @shared_task waits
    assert (
        "celery_pglock.exceptions.ConfigurationError: Unknown setting "
        "'CELERY_PGLOCK_ON_BUSSY'" in bad.stderr
    )


def test_worker_refuses_to_start_with_a_typo(project):
    """The worker binds the shared tasks as it starts, before worker_init: it exits
    with a traceback whose last line is the ConfigurationError (docs/guide/django.md)."""
    completed = project(
        "-m", "celery", "-A", "proj", "worker", "--pool", "solo", settings=TYPO
    )
    assert 0 != completed.returncode
    last_line = completed.stderr.strip().splitlines()[-1]
    assert last_line.startswith(
        "celery_pglock.exceptions.ConfigurationError: Unknown setting "
        "'CELERY_PGLOCK_ON_BUSSY'; did you mean 'CELERY_PGLOCK_ON_BUSY'?"
    )


def test_worker_refuses_to_start_with_a_bad_url_in_one_line(project):
    """The URL is checked at worker_init, after the tasks are bound: one line, no
    traceback."""
    completed = project(
        "-m",
        "celery",
        "-A",
        "proj",
        "worker",
        "--pool",
        "solo",
        settings="proj.settings_bad_url",
    )
    assert 0 != completed.returncode
    assert "Traceback" not in completed.stderr
    assert (
        "celery-pglock: pglock_database_url must be a PostgreSQL URL using psycopg2"
        in completed.stderr
    )


def test_pglock_check_counts_the_django_apps_singleton_task(project):
    """`celery -A proj pglock check` imports the Django app's tasks.py (autodiscovery)."""
    completed = project("-m", "celery", "-A", "proj", "pglock", "check")
    assert 0 == completed.returncode, completed.stdout + completed.stderr
    assert "; 1 SingletonTask(s), scope session" in completed.stdout
    typo = project("-m", "celery", "-A", "proj", "pglock", "check", settings=TYPO)
    assert 1 == typo.returncode, typo.stdout + typo.stderr
    assert "FAIL  configuration" in typo.stdout
    assert "CELERY_PGLOCK_ON_BUSSY" in typo.stdout


def test_pglock_key_finds_the_django_apps_singleton_task(project):
    completed = project(
        "-m",
        "celery",
        "-A",
        "proj",
        "pglock",
        "key",
        "billing.tasks.recompute_balance",
        "--kwargs",
        json.dumps({"account_id": 7}),
        "--json",
    )
    assert 0 == completed.returncode, completed.stdout + completed.stderr
    forms = json.loads(completed.stdout)
    assert "billing.tasks.recompute_balance" == forms["task"]
    assert "proj" == forms["namespace"]
    assert '{"account_id":7}]' in forms["key_text"]
