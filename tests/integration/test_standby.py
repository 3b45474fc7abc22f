"""A standby is refused as a lock database, in both scopes.

PostgreSQL grants advisory locks on a hot standby, but only there: the primary and
other standbys know nothing of them. The first test shows that on a real streaming
replica (pg_basebackup -R of a private primary); the others, that the library refuses it.
"""

from __future__ import annotations

import pytest

from celery_pglock import AdvisoryLock, ConfigurationError, _server, db, keys
from celery_pglock.testing import EmbeddedPostgres, _support
from celery_pglock.testing.postgres import SUPERUSER


@pytest.fixture(scope="module")
def replica():
    """A private primary and a hot standby streaming from it: (primary, standby)."""
    primary = EmbeddedPostgres().start()
    standby = None
    try:
        target = primary.data_dir.parent / "standby-data"
        # As the server's own user (root: the unprivileged one), like initdb.
        primary._run(
            "pg_basebackup",
            *("-h", _support.HOST, "-p", str(primary.port), "-U", SUPERUSER),
            *("-D", str(target), "-R", "-X", "stream", "--no-sync"),
            timeout=120,
        )
        standby = EmbeddedPostgres(data_dir=target).start()
        yield primary, standby
    finally:
        if standby is not None:
            standby.cleanup()
        primary.cleanup()


def query(url, sql):
    connection = _support.connect(url, application_name="celery_pglock tests standby")
    try:
        with connection.cursor() as cursor:
            cursor.execute(sql)
            return cursor.fetchone()[0]
    finally:
        connection.close()


def test_postgres_grants_a_standby_advisory_lock_that_excludes_nobody(replica):
    """Why the refusal exists: the standby grants the lock, and so does the primary."""
    primary, standby = replica
    assert query(standby.url(), "SELECT pg_is_in_recovery()") is True
    on_standby = _support.connect(standby.url(), application_name="celery_pglock tests")
    try:
        with on_standby.cursor() as cursor:
            cursor.execute("SELECT pg_try_advisory_lock(4242)")
            assert cursor.fetchone()[0] is True
        assert query(primary.url(), "SELECT pg_try_advisory_lock(4242)") is True
    finally:
        on_standby.close()


@pytest.mark.parametrize("scope", ["session", "transaction"])
def test_standby_is_refused_in_both_scopes(replica, scope):
    """A lock on a standby raises ConfigurationError naming the primary as the fix."""
    _, standby = replica
    engine = db.create_engine(standby.url())
    try:
        lock = AdvisoryLock(
            engine=engine, key=keys.make_key("standby", "it.standby"), scope=scope
        )
        with pytest.raises(ConfigurationError) as refused:
            lock.acquire()
        assert not lock.owned()
        message = str(refused.value)
        assert "standby" in message
        assert "pg_is_in_recovery()" in message
        assert "primary" in message
    finally:
        engine.dispose()


def test_probe_reports_standby_and_primary(replica):
    primary, standby = replica
    assert _server.probe(standby.url()).is_standby is True
    assert _server.probe(primary.url()).is_standby is False
