"""A standby is refused as a lock database, in both scopes; a failover is a lock loss.

PostgreSQL grants advisory locks on a hot standby, but only there: the primary and
other standbys know nothing of them. The first test shows that on a real streaming
replica (pg_basebackup -R of a private primary); the others, that the library refuses it.
The last one fails the primary over to its standby while a body holds a lock.
"""

from __future__ import annotations

import contextlib
import time

import pytest
from celery import Celery

from celery_pglock import (
    AdvisoryLock,
    ConfigurationError,
    LockLostError,
    SingletonTask,
    current_lock,
    keys,
    signals,
)
from celery_pglock.db import engines, server_probe
from celery_pglock.testing import EmbeddedPostgres, _support
from celery_pglock.testing.postgres import SUPERUSER
from tests.acceptance._proxy import FreezableProxy
from tests.integration.watch.test_lock_loss import wait_for


@pytest.fixture(scope="module")
def replica():
    """A private primary and a hot standby streaming from it: (primary, standby)."""
    with _primary_and_standby() as pair:
        yield pair


@contextlib.contextmanager
def _primary_and_standby():
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
    engine = engines.create_engine(standby.url())
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
    assert server_probe.probe(standby.url()).is_standby is True
    assert server_probe.probe(primary.url()).is_standby is False


@pytest.mark.parametrize(
    ("promote_first", "cause"),
    [
        (True, "the server restarted or was replaced"),
        (False, "the server is now a standby"),
    ],
    ids=["promoted-then-moved", "moved-then-promoted"],
)
def test_failover_to_the_promoted_standby_is_a_lock_loss(
    broker_url, result_backend_url, namespace, promote_first, cause
):
    """The lock database's address (a proxy) moves from a crashed primary to its
    standby while a body holds a lock. The new server never had the lock: the watcher
    reports it lost and the run fails. Promoted before the address moves (the usual
    failover), the cause names a replaced server: the watcher cannot tell a failover
    from a restart, both change pg_postmaster_start_time(). Moved first, the watcher
    finds a standby. Either way the next run locks on the promoted server through the
    same URL."""
    seen: list[dict] = []

    def receiver(sender=None, signal=None, **kwargs):
        seen.append(kwargs)

    with _primary_and_standby() as (primary, standby):
        proxy = FreezableProxy((_support.HOST, primary.port))
        url = primary.url().replace(f":{primary.port}/", f":{proxy.port}/")
        app = Celery("failover", broker=broker_url, backend=result_backend_url)
        app.conf.update(
            pglock_database_url=url,
            pglock_namespace=namespace,
            pglock_watch_interval=0.3,
            # Room for the crash and the promotion: a check fails over with them.
            pglock_db_timeout=15,
            pglock_on_lost="signal",  # the body goes on, to time the detection
        )
        timings = {}

        @app.task(base=SingletonTask, shared=False)
        def body():
            lock = current_lock()
            time.sleep(0.8)  # checked on the primary: the watcher knows its start time
            primary.crash()
            started = time.monotonic()
            if promote_first:
                query(standby.url(), "SELECT pg_promote(true, 30)")
            proxy.retarget((_support.HOST, standby.port))
            timings["moved"] = time.monotonic() - started
            wait_for(lambda: lock.lost, 10, "the failover to be detected")
            timings["detected"] = time.monotonic() - started
            return "finished"

        signals.lock_lost.connect(receiver, weak=False)
        try:
            result = body.apply()
        finally:
            signals.lock_lost.disconnect(receiver)
        try:
            assert isinstance(result.result, LockLostError), result.result
            (event,) = seen
            assert event["cause"].startswith(cause), event["cause"]
            print(
                f"failover: address moved {timings['moved']:.2f}s after the crash; "
                f"lock_lost {timings['detected']:.2f}s after it ({event['cause']})"
            )
            if not promote_first:
                query(standby.url(), "SELECT pg_promote(true, 30)")
            # The promoted server takes locks through the same URL, same app.
            assert query(standby.url(), "SELECT pg_is_in_recovery()") is False

            @app.task(base=SingletonTask, shared=False)
            def after():
                return _granted(standby.url(), current_lock().key.pg_locks_ids)

            assert after.apply().get() == 1
        finally:
            proxy.close()


def _granted(url, pg_locks_ids) -> int:
    """How many sessions of the server at ``url`` are granted this advisory key."""
    connection = _support.connect(url, application_name="celery_pglock tests standby")
    try:
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted "
                "AND classid = %s::oid AND objid = %s::oid AND objsubid = %s::int2",
                pg_locks_ids,
            )
            return cursor.fetchone()[0]
    finally:
        connection.close()
