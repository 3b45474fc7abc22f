"""Through a real PgBouncer: what is detected, what is refused, what works.

Each test starts its own PgBouncer (marker pgbouncer) in front of the test database, in
the pooling mode it is about. The expected outcomes (docs/operations/pgbouncer.md):

=============  ==============  ==================
pool_mode      session scope   transaction scope
=============  ==============  ==================
session        works           works
transaction    refused         works
statement      refused         refused
=============  ==============  ==================
"""

from __future__ import annotations

import logging
import time

import pytest

from celery_pglock import AdvisoryLock, ConfigurationError, DatabaseError, keys
from celery_pglock.db import driver_errors, server_probe
from celery_pglock.db import engines as db_engines
from celery_pglock.testing import _support, lock_state

MODES = ("session", "transaction", "statement")
POOLING = {
    "session": server_probe.Pooling.NONE,
    "transaction": server_probe.Pooling.TRANSACTION,
    "statement": server_probe.Pooling.STATEMENT,
}
#: pool_mode -> is the scope refused?
SESSION_REFUSED = {"session": False, "transaction": True, "statement": True}
TRANSACTION_REFUSED = {"session": False, "transaction": False, "statement": True}


@pytest.fixture
def engines():
    """Lock engines made by the test (engines.create_engine), disposed at teardown."""
    made = []

    def make(url, conf=None):
        engine = db_engines.create_engine(url, conf)
        made.append(engine)
        return engine

    yield make
    for engine in made:
        engine.dispose()


def make_key(namespace):
    return keys.make_key(namespace, "it.pooler")


def test_probe_of_a_direct_connection_sees_no_pooler(database_url):
    """Direct to PostgreSQL: no multiplexing, no proxy, a primary."""
    facts = server_probe.probe(database_url)
    assert server_probe.Pooling.NONE == facts.pooling
    assert facts.proxied is False
    assert facts.reports_backend_pid is True  # the watcher trusts libpq's pid
    assert facts.is_standby is False
    assert facts.server_version_num >= 100000
    assert facts.refusal("session") is None
    assert facts.refusal("transaction") is None


@pytest.mark.pgbouncer
@pytest.mark.parametrize("round_robin", ["0", "1"])
@pytest.mark.parametrize("mode", MODES)
def test_probe_tells_the_pgbouncer_pool_mode(pgbouncer_factory, mode, round_robin):
    """The pooling mode is told right with PgBouncer's LIFO default and round robin."""
    bouncer = pgbouncer_factory(mode, server_round_robin=round_robin)
    facts = server_probe.probe(bouncer.url())
    assert POOLING[mode] == facts.pooling
    assert facts.proxied is True
    assert facts.reports_backend_pid is False  # PgBouncer invents the pid it reports
    assert facts.is_standby is False


@pytest.mark.pgbouncer
@pytest.mark.parametrize("mode", MODES)
def test_probe_is_right_with_a_busy_pool(pgbouncer_factory, mode, database_url):
    """Other clients using the pooler at the same time do not change the verdict."""
    bouncer = pgbouncer_factory(mode)
    others = [
        _support.connect(bouncer.url(), application_name="celery_pglock tests other")
        for _ in range(3)
    ]
    try:
        for other in others:  # one idle in a transaction, two idle
            with other.cursor() as cursor:
                cursor.execute("SELECT 1")
        if mode != "statement":
            with others[0].cursor() as cursor:
                cursor.execute("BEGIN")
                cursor.execute("SELECT pg_backend_pid()")
        assert POOLING[mode] == server_probe.probe(bouncer.url()).pooling
    finally:
        for other in others:
            other.close()


@pytest.mark.pgbouncer
@pytest.mark.parametrize("mode", MODES)
def test_session_scope_through_pgbouncer(pgbouncer_factory, engines, namespace, mode):
    """Session scope: works in session pooling, refused in transaction and statement
    pooling, with the fix named."""
    bouncer = pgbouncer_factory(mode)
    engine = engines(bouncer.url())
    lock = AdvisoryLock(engine=engine, key=make_key(namespace), scope="session")
    if SESSION_REFUSED[mode]:
        with pytest.raises(ConfigurationError) as refused:
            lock.acquire()
        assert not lock.owned()
        message = str(refused.value)
        assert f"{mode}-pooling" in message
        assert "pglock_database_url" in message
        if mode == "transaction":
            assert "lock_scope='transaction'" in message
        return
    other = AdvisoryLock(
        engine=engines(bouncer.url()), key=make_key(namespace), scope="session"
    )
    assert lock.acquire()
    try:
        assert not other.acquire()
    finally:
        lock.release()
    assert other.acquire()
    other.release()


@pytest.mark.pgbouncer
@pytest.mark.parametrize("mode", MODES)
def test_transaction_scope_through_pgbouncer(
    pgbouncer_factory, engines, namespace, mode
):
    """Transaction scope: works in session and transaction pooling, refused in
    statement pooling (no multi-statement transactions)."""
    bouncer = pgbouncer_factory(mode)
    lock = AdvisoryLock(
        engine=engines(bouncer.url()), key=make_key(namespace), scope="transaction"
    )
    if TRANSACTION_REFUSED[mode]:
        with pytest.raises(ConfigurationError, match="statement-pooling"):
            lock.acquire()
        assert not lock.owned()
        return
    other = AdvisoryLock(
        engine=engines(bouncer.url()), key=make_key(namespace), scope="transaction"
    )
    assert lock.acquire()
    try:
        assert 1 == lock.connection.exec_driver_sql("SELECT 1").scalar()
        assert not other.acquire()
    finally:
        lock.release()
    assert other.acquire()
    other.release()


@pytest.mark.pgbouncer
def test_default_options_work_through_pgbouncer(
    pgbouncer_factory, engines, namespace, database_url, caplog
):
    """The default keepalive startup options, refused by PgBouncer, are dropped once
    (one INFO line), and kept on a direct connection; idle_session_timeout = 0 is then set
    by a statement at connect."""
    bouncer = pgbouncer_factory("session")
    engine = engines(bouncer.url())
    caplog.set_level(logging.INFO, logger="celery_pglock.db.startup_options")
    locks = [
        AdvisoryLock(engine=engine, key=make_key(f"{namespace}-{index}"))
        for index in range(2)
    ]
    try:
        assert all(lock.acquire() for lock in locks)  # two pooled connections
        for lock in locks:
            # The session settings the refused options carried were set by a statement
            # at connect instead (source 'session': not the server's default).
            cursor = lock_state.holding_connection(lock).cursor()
            cursor.execute(
                "SELECT setting, source FROM pg_settings "
                "WHERE name = 'idle_session_timeout'"
            )
            assert ("0", "session") == cursor.fetchone()
            cursor.close()
    finally:
        for lock in locks:
            if lock.owned():
                lock.release()
    dropped = [r for r in caplog.records if "refused the server keepalive" in r.message]
    assert 1 == len(dropped)
    assert "lock_options_dropped" == dropped[0].action  # type: ignore[attr-defined]
    with engines(database_url).connect() as direct:
        assert "30" == direct.exec_driver_sql("SHOW tcp_keepalives_idle").scalar()


@pytest.mark.pgbouncer
def test_options_the_user_set_are_not_dropped(pgbouncer_factory, engines, namespace):
    """Only the library's own options are dropped: a user's own refused options fail."""
    bouncer = pgbouncer_factory("session")
    engine = engines(
        bouncer.url(),
        {
            "pglock_engine_options": {
                "connect_args": {"options": "-c statement_timeout=5000"}
            }
        },
    )
    with pytest.raises(DatabaseError, match="unsupported startup parameter"):
        AdvisoryLock(engine=engine, key=make_key(namespace)).acquire()


@pytest.mark.pgbouncer
def test_probe_is_bounded_in_time(pgbouncer_factory):
    """A pooler with no free server connection cannot hold the probe past its timeout."""
    bouncer = pgbouncer_factory("transaction", default_pool_size="1")
    holder = _support.connect(
        bouncer.url(), application_name="celery_pglock tests holder"
    )
    try:
        with holder.cursor() as cursor:
            cursor.execute("BEGIN")
            cursor.execute("SELECT 1")  # the only server connection is now ours
        started = time.monotonic()
        with pytest.raises(
            DatabaseError, match=r"probe had no answer within 1 s"
        ) as late:
            server_probe.probe(bouncer.url(), timeout=1.0)
        assert time.monotonic() - started < 3.0
        # autoretry_for=(DatabaseError,) retries it.
        assert driver_errors.is_transient(late.value.__cause__)
    finally:
        holder.close()


@pytest.mark.pgbouncer
def test_probe_runs_once_per_engine(pgbouncer_factory, engines, namespace):
    """The refusal is cached per engine: later acquires are refused without a probe."""
    bouncer = pgbouncer_factory("transaction")
    engine = engines(bouncer.url())
    lock = AdvisoryLock(engine=engine, key=make_key(namespace))
    with pytest.raises(ConfigurationError):
        lock.acquire()
    facts = server_probe.facts_for(engine)
    with pytest.raises(ConfigurationError):
        lock.acquire()
    assert facts is server_probe.facts_for(engine)
