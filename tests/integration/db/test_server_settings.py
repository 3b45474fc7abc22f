"""A role's or database's timeouts never end a lock session (issue 16), on a private server.

Each test gives a role of its own one setting (``ALTER ROLE ... SET``, which every new
session of that role starts with) and locks as that role: a body longer than
``idle_session_timeout`` (session scope) or ``idle_in_transaction_session_timeout``
(transaction scope) keeps its lock to the end, with nobody else let in meanwhile; a wait
longer than ``statement_timeout`` waits its ``lock_wait_timeout`` and says how long it
waited. A user's own ``statement_timeout`` still bounds the body's statements.
"""

from __future__ import annotations

import contextlib
import re
import threading
import time
import uuid
from typing import TYPE_CHECKING

import psycopg2
import pytest

from celery_pglock import AdvisoryLock, LockBusy, SingletonTask, current_lock, keys
from celery_pglock.db import engines
from celery_pglock.lock import sessions
from celery_pglock.testing import lock_state
from celery_pglock.testing.postgres import EmbeddedPostgres
from tests.integration.loss_support import dsn, make_app

if TYPE_CHECKING:
    from collections.abc import Iterator


@pytest.fixture(scope="module")
def server() -> Iterator[EmbeddedPostgres]:
    """One private server for this module: its tests alter roles of their own only."""
    postgres = EmbeddedPostgres()
    try:
        yield postgres.start()
    finally:
        postgres.cleanup()


def _admin(server: EmbeddedPostgres, *statements: str) -> None:
    with contextlib.closing(psycopg2.connect(dsn(server.url()))) as connection:
        connection.autocommit = True
        with connection.cursor() as cursor:
            for statement in statements:
                cursor.execute(statement)


@pytest.fixture
def role_url(server: EmbeddedPostgres) -> Iterator[object]:
    """``role_url("idle_session_timeout", "1s")``: the URL of a new role with that setting."""
    roles: list[str] = []

    def make(setting: str, value: str) -> str:
        role = f"r_{uuid.uuid4().hex[:8]}"
        roles.append(role)
        _admin(
            server,
            f"CREATE ROLE {role} LOGIN",
            f"GRANT pg_read_all_stats TO {role}",
            f"ALTER ROLE {role} SET {setting} = '{value}'",
        )
        return server.url().replace("://postgres@", f"://{role}@")

    yield make
    sessions.close_all()
    engines.dispose_all()
    for role in roles:
        _admin(
            server,
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            f"WHERE usename = '{role}'",
        )


def _show(url: str, setting: str) -> str:
    """The setting as a new session of the URL's role starts with it."""
    with (
        contextlib.closing(psycopg2.connect(dsn(url))) as connection,
        connection.cursor() as cursor,
    ):
        cursor.execute(f"SHOW {setting}")
        return str(cursor.fetchone()[0])


class Competitor:
    """Another process's view, as a second lock engine: tries the key while a body runs."""

    def __init__(self, url: str, key: object) -> None:
        self.engine = engines.create_engine(url)
        self.key = key
        self.granted = 0
        self.tries = 0

    def try_once(self) -> None:
        lock = AdvisoryLock(engine=self.engine, key=self.key)  # type: ignore[arg-type]
        self.tries += 1
        if lock.acquire():
            self.granted += 1
            lock.release()

    def close(self) -> None:
        sessions.close_for(self.engine)
        self.engine.dispose()


def _body_outlives(seconds: float, competitor_box: list[Competitor], url: str) -> None:
    """The body: for ``seconds``, a competitor tries the key every 0.25 s."""
    lock = current_lock()
    competitor = Competitor(url, lock.key)
    competitor_box.append(competitor)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        competitor.try_once()
        time.sleep(0.25)


def test_idle_session_timeout_does_not_end_a_session_scope_body(
    role_url, broker_url, result_backend_url, namespace, lost_events, session_mode
):
    """idle_session_timeout = 1s for the role: a 2.5 s body keeps its lock (before: its
    session was ended after 1 s, the lock freed, the run failed with LockLostError)."""
    url = role_url("idle_session_timeout", "1s")
    assert "1s" == _show(url, "idle_session_timeout")  # the role's setting is in force
    app = make_app(
        url,
        broker_url,
        result_backend_url,
        namespace,
        pglock_watch_interval=0.3,
    )
    competitors: list[Competitor] = []

    @app.task(base=SingletonTask, shared=False)
    def body():
        time.sleep(1.5)  # idle past the timeout before anything else
        _body_outlives(1.0, competitors, url)
        return "finished"

    try:
        result = body.apply()
        assert "finished" == result.get(), result.result
        assert [] == lost_events
        (competitor,) = competitors
        assert competitor.tries >= 3
        assert 0 == competitor.granted  # 0 overlaps
    finally:
        for competitor in competitors:
            competitor.close()


@pytest.mark.parametrize(
    "setting", ["idle_in_transaction_session_timeout", "transaction_timeout"]
)
def test_transaction_timeouts_do_not_end_a_transaction_scope_body(
    role_url, broker_url, result_backend_url, namespace, lost_events, setting
):
    """idle_in_transaction_session_timeout or (PostgreSQL 17+) transaction_timeout = 1s: a
    2.5 s transaction-scope body keeps its lock, and its transaction, whose work commits
    at the end."""
    url = role_url(setting, "1s")
    assert "1s" == _show(url, setting)
    app = make_app(
        url,
        broker_url,
        result_backend_url,
        namespace,
        pglock_watch_interval=0.3,
        pglock_scope="transaction",
    )
    competitors: list[Competitor] = []

    @app.task(base=SingletonTask, shared=False)
    def body():
        connection = current_lock().connection
        connection.exec_driver_sql("CREATE TEMP TABLE t (x int)")
        time.sleep(1.5)  # idle in transaction past the timeout
        _body_outlives(1.0, competitors, url)
        connection.exec_driver_sql(
            "INSERT INTO t VALUES (1)"
        )  # still the same transaction
        return connection.exec_driver_sql("SELECT count(*) FROM t").scalar()

    try:
        result = body.apply()
        assert 1 == result.get(), result.result
        assert [] == lost_events
        (competitor,) = competitors
        assert competitor.tries >= 3
        assert 0 == competitor.granted  # 0 overlaps
    finally:
        for competitor in competitors:
            competitor.close()


@pytest.mark.parametrize("scope", ["session", "transaction"])
def test_statement_timeout_does_not_cut_a_wait_and_the_message_says_how_long(
    role_url, broker_url, result_backend_url, namespace, scope
):
    """statement_timeout = 300ms: lock_on_busy='wait' waits its lock_wait_timeout (1.5 s;
    before: it ended after 0.3 s) and the message says the time it really waited."""
    url = role_url("statement_timeout", "300ms")
    app = make_app(
        url,
        broker_url,
        result_backend_url,
        namespace,
        pglock_scope=scope,
        pglock_on_busy="wait",
        pglock_wait_timeout=1.5,
    )

    @app.task(base=SingletonTask, shared=False)
    def body():
        return "ran"

    holder = AdvisoryLock(engine=engines.create_engine(url), key=body.lock_key_for())
    assert holder.acquire()
    try:
        started = time.monotonic()
        result = body.apply()
        took = time.monotonic() - started
    finally:
        holder.release()
        sessions.close_for(holder.engine)
        holder.engine.dispose()
    assert isinstance(result.result, LockBusy), result.result
    assert 1.5 <= took < 4.0, took
    waited = re.search(r"after waiting ([0-9.]+)s", str(result.result))
    assert waited is not None, str(result.result)
    assert abs(float(waited.group(1)) - took) < 0.5, (str(result.result), took)


@pytest.mark.parametrize("scope", ["session", "transaction"])
def test_a_wait_longer_than_statement_timeout_is_granted(
    role_url, broker_url, result_backend_url, namespace, scope
):
    """statement_timeout = 300ms: a wait granted after 1 s runs the body."""
    url = role_url("statement_timeout", "300ms")
    app = make_app(
        url,
        broker_url,
        result_backend_url,
        namespace,
        pglock_scope=scope,
        pglock_on_busy="wait",
        pglock_wait_timeout=5,
    )

    @app.task(base=SingletonTask, shared=False)
    def body():
        if scope == "transaction":  # the body's own bound is back after the wait
            return (
                current_lock()
                .connection.exec_driver_sql("SHOW statement_timeout")
                .scalar()
            )
        return "ran"

    holder = AdvisoryLock(engine=engines.create_engine(url), key=body.lock_key_for())
    assert holder.acquire()
    timer = threading.Timer(1.0, holder.release)
    timer.start()
    try:
        started = time.monotonic()
        result = body.apply()
        took = time.monotonic() - started
    finally:
        timer.join()
        sessions.close_for(holder.engine)
        holder.engine.dispose()
    assert ("300ms" if scope == "transaction" else "ran") == result.get()
    assert took >= 0.9, took


def test_the_body_keeps_its_own_statement_timeout_in_transaction_scope(
    role_url, broker_url, result_backend_url, namespace
):
    """The lock's settings are the lock's: a transaction-scope body still runs under the
    role's statement_timeout (and idle_session_timeout = 0 is all a lock session
    changes at connect)."""
    url = role_url("statement_timeout", "300ms")
    app = make_app(
        url, broker_url, result_backend_url, namespace, pglock_scope="transaction"
    )

    @app.task(base=SingletonTask, shared=False)
    def body():
        connection = current_lock().connection
        with pytest.raises(Exception, match="statement timeout"):
            connection.exec_driver_sql("SELECT pg_sleep(2)")
        return "bounded"

    result = body.apply()
    # The body's statement failed: its transaction is aborted, and the run still ends
    # (the release rolls back instead of committing).
    assert "bounded" == result.result or result.failed(), result.result


@pytest.mark.parametrize(
    "conf",
    [
        {},
        {"pglock_server_keepalives": False},
        # The user's own startup options win: ours are then set by a statement.
        {"pglock_engine_options": {"connect_args": {"options": "-c work_mem=8MB"}}},
    ],
    ids=["startup-options", "no-keepalives", "user-options"],
)
def test_lock_sessions_carry_their_settings(role_url, namespace, conf):
    """Whatever carries them (startup options, or one statement at connect), a lock
    session has idle_session_timeout 0 under a role that says 1s; with keepalives, the
    server-side keepalives and tcp_user_timeout are set too."""
    url = role_url("idle_session_timeout", "1s")
    engine = engines.create_engine(url, conf)
    try:
        with AdvisoryLock(
            engine=engine, key=keys.make_key(namespace, "settings")
        ) as lock:
            cursor = lock_state.holding_connection(lock).cursor()
            cursor.execute(
                "SELECT current_setting('idle_session_timeout'), "
                "current_setting('tcp_keepalives_idle'), "
                "current_setting('tcp_user_timeout')"
            )
            idle, keepalives_idle, user_timeout = cursor.fetchone()
            cursor.close()
        assert "0" == idle
        if conf == {}:
            assert ("30", "60000") == (keepalives_idle, user_timeout)
    finally:
        sessions.close_for(engine)
        engine.dispose()
