"""The lock database URL and the application_name built from it. No I/O.

Where the URL comes from, what is refused, and that it is never printed with a secret.
"""

from __future__ import annotations

import pytest

from celery_pglock import ConfigurationError
from celery_pglock import config as config_module
from celery_pglock.db import engines


def test_missing_database_url_names_setting_and_variable(monkeypatch):
    """The error names both the app setting and the environment variable."""
    monkeypatch.delenv(config_module.DATABASE_URL_ENV, raising=False)
    with pytest.raises(ConfigurationError) as caught:
        config_module.database_url({})
    assert "pglock_database_url" in str(caught.value)
    assert "CELERY_PGLOCK_DATABASE_URL" in str(caught.value)
    monkeypatch.setenv(config_module.DATABASE_URL_ENV, "postgresql://x@h/db")
    assert "postgresql://x@h/db" == config_module.database_url({})


@pytest.mark.parametrize(
    "url", ["mysql://u:pw@h/db", "postgresql+asyncpg://u:pw@h/db", "not a url"]
)
def test_unsupported_urls_are_refused_with_password_masked(url):
    """Only PostgreSQL + psycopg2; the message never shows the password."""
    with pytest.raises(ConfigurationError) as caught:
        engines.check_url(url)
    assert "pw" not in str(caught.value)


def test_plain_postgresql_url_means_psycopg2():
    """postgresql:// (no driver) is accepted and runs on psycopg2, whatever SQLAlchemy's default."""
    assert "psycopg2" == engines.check_url("postgresql://u@h/db").get_driver_name()


def test_mask_url_hides_password():
    """Passwords never reach logs."""
    masked = engines.mask_url("postgresql+psycopg2://app:s3cr3t@db:5432/app")
    assert "s3cr3t" not in masked
    assert "app:***@db:5432/app" in masked


def test_application_name_fits_and_keeps_task_tail():
    """application_name stays within 63 bytes and keeps the most specific part of the name."""
    name = engines.application_name(
        "pglock",
        "host:123",
        -9223372036854775808,
        "project.module." * 10 + "daily_settlement",
    )
    assert len(name.encode()) <= 63
    assert name.endswith("daily_settlement")
    assert name.startswith("pglock host:123 -9223372036854775808 ~")


@pytest.mark.parametrize(
    "url",
    [
        "postgresql+psycopg2://u@h/db?password=s3cret",
        "postgresql+psycopg2://u@h/db?sslpassword=s3cret&sslmode=require",
        "postgresql+psycopg2://u:s3cret@h/db",
    ],
)
def test_mask_url_hides_secrets_in_query_parameters(url):
    """Passwords in the query string are masked too."""
    masked = engines.mask_url(url)
    assert "s3cret" not in masked
    assert "***" in masked
