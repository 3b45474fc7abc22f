"""What a PostgreSQL crash (``pg_ctl stop -m immediate``) in the middle of a burst does to
the feature tables, on a private server: ``lock_enqueue``'s rows are gone with its
UNLOGGED table, so no key stays blocked; ``lock_period``'s rows are durable, so no period
reopens. Why each table is what it is: docs/guide/enqueue.md and docs/guide/period.md."""

from __future__ import annotations

import threading
import time
import uuid

import pytest
from celery import Celery

from celery_pglock import EnqueueUnavailable, LockSkipped
from celery_pglock.testing import _support
from tests.integration.task_support import close_app, define

#: Sends (or starts) that commit before the crash; the burst goes on through it.
BEFORE_CRASH = 60
#: Sends after the restart that must have been checked again, to end the burst.
AFTER_RESTART = 20


@pytest.fixture
def app(private_postgres, broker_url, namespace):
    app = Celery("crashes", broker=broker_url, set_as_current=False)
    app.conf.pglock_database_url = (
        f"postgresql+psycopg2://postgres@127.0.0.1:{private_postgres.port}/postgres"
    )
    app.conf.pglock_namespace = namespace
    app.conf.task_default_queue = f"crashes-{uuid.uuid4().hex}"
    app.conf.task_ignore_result = True
    yield app
    with app.connection_for_write() as connection:
        connection.default_channel.queue_delete(app.conf.task_default_queue)
    close_app(app)


def persistence(app, table):
    """pg_class.relpersistence of ``table``: "u" unlogged, "p" WAL-logged."""
    connection = _support.connect(
        app.conf.pglock_database_url, application_name="crash test"
    )
    try:
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT relpersistence FROM pg_class WHERE relname = %s", (table,)
            )
            return cursor.fetchone()[0]
    finally:
        connection.close()


def test_a_crash_mid_burst_leaves_no_queued_key_blocked(app, private_postgres):
    """A producer sends new keys while the server crashes and restarts. Every key whose
    send returned before the restart is free afterwards (a send publishes a new message):
    its row was written before the crash. The table still deduplicates the keys whose
    sends began after the restart."""

    def body(n):
        return n

    task = define(
        app, body, lock_args=("n",), lock_enqueue="until_finished", lock_db_timeout=1.0
    )
    # (key, id returned, when its send began, when it returned)
    sent: list[tuple[int, str, float, float]] = []
    refused = [0]  # sends made while the server was down
    crash_now, stop = threading.Event(), threading.Event()
    restart_began = [float("inf")]

    def burst():
        for n in range(5000):
            if stop.is_set():
                return
            began = time.monotonic()
            try:
                sent.append((n, task.delay(n).id, began, time.monotonic()))
            except EnqueueUnavailable:
                refused[0] += 1
                time.sleep(0.05)
            if len(sent) == BEFORE_CRASH:
                crash_now.set()
            if sum(1 for s in sent if s[2] > restart_began[0]) >= AFTER_RESTART:
                return

    sender = threading.Thread(target=burst, daemon=True)
    sender.start()
    assert crash_now.wait(60), "the burst never reached the crash"
    # Long enough for the WAL writer to flush the first sends' commits (asynchronous):
    # in a WAL-logged table their rows would outlive the crash.
    time.sleep(1.0)
    private_postgres.crash()
    time.sleep(0.5)  # sends meet the dead server
    restart_began[0] = time.monotonic()
    private_postgres.start()
    sender.join(60)
    stop.set()
    assert not sender.is_alive(), "the burst did not end after the restart"
    assert refused[0] > 0, "no send met the crashed server"
    assert "u" == persistence(app, "celery_pglock_queued")

    # A send that spans the restart is left out: its row may predate the crash or not.
    before = [(k, i) for k, i, _, ended in sent if ended < restart_began[0]]
    after = [(k, i) for k, i, began, _ in sent if began > restart_began[0]]
    assert len(before) >= BEFORE_CRASH
    # No key blocked: each key of the crashed burst publishes a new message.
    assert [] == [k for k, i in before if task.delay(k).id == i]
    # The table works on: a key sent after the restart is still queued.
    assert [i for _, i in after] == [task.delay(k).id for k, _ in after]


def test_a_crash_right_after_starts_reopens_no_period(app, private_postgres):
    """Periods started just before the server crashes are still closed after recovery:
    each key's next start is skipped for the period, naming the start before the crash."""

    def tick(n):
        return n

    task = define(app, tick, lock_args=("n",), lock_period=3600)
    starts = {n: task.apply(args=(n,)) for n in range(BEFORE_CRASH)}
    assert all(r.successful() for r in starts.values())
    private_postgres.crash()  # at once: the last start committed a moment ago
    private_postgres.start()
    assert "p" == persistence(app, "celery_pglock_periods")
    for n, started in starts.items():
        again = task.apply(args=(n,))
        assert isinstance(again.result, LockSkipped), (n, again.state)
        assert "period" == again.result.details["reason"]
        assert started.id == again.result.details["last_task"]


def test_a_send_creates_the_queued_table_again_when_it_was_dropped(app):
    """The table was dropped after this process checked it (an uninstall, a restore):
    the next send creates it again and is checked, instead of failing until a restart."""

    def body(n):
        return n

    task = define(app, body, lock_args=("n",), lock_enqueue="until_finished")
    task.delay(1)
    connection = _support.connect(
        app.conf.pglock_database_url, application_name="crash test"
    )
    try:
        with connection.cursor() as cursor:
            cursor.execute("DROP TABLE celery_pglock_queued")
    finally:
        connection.close()
    sent = task.delay(2)
    assert sent.id == task.delay(2).id
    assert "u" == persistence(app, "celery_pglock_queued")
