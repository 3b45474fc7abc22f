"""lock_enqueue in-process against real PostgreSQL and Redis: what a send publishes or
returns, how a run changes its key's row, and what frees a key whose message never ran.
Real workers, revokes and kills: tests/acceptance/test_enqueue.py."""

from __future__ import annotations

import threading
import time
import types
import uuid

import celery
import pytest
from celery import signals as celery_signals
from celery.app.trace import build_tracer

from celery_pglock import (
    AlreadyQueued,
    ConfigurationError,
    EnqueueUnavailable,
    LockBusy,
    LockSkipped,
    current_lock,
)
from celery_pglock.db import engines, sql_text
from celery_pglock.lock import rider
from celery_pglock.task import enqueue, queued, queued_writes
from celery_pglock.testing import lock_state
from tests.integration.task_support import (
    current_engine,
    define,
    hold,
    lose_first_reply,
)


@pytest.fixture
def published():
    """Task ids published during the test (after_task_publish, this process)."""
    ids: list[str] = []

    def count(sender=None, headers=None, **_):
        ids.append(headers["id"])

    celery_signals.after_task_publish.connect(count, weak=False)
    yield ids
    celery_signals.after_task_publish.disconnect(count)


def rows(task, *args):
    """(task_id, mode, started) of the key's row, or None."""
    key = task.lock_key_for(*args)
    with (
        engines.autocommit(current_engine(task.app)) as dbapi,
        dbapi.cursor() as cursor,
    ):
        cursor.execute(
            "SELECT task_id, mode, started_at IS NOT NULL FROM celery_pglock_queued "
            "WHERE (classid, objid, objsubid) = (%s, %s, %s)",
            key.pg_locks_ids,
        )
        return cursor.fetchone()


def make(app, name, fun, **options):
    """A SingletonTask named ``it.<name>`` (define() names tasks by function)."""
    fun.__name__ = f"enqueue_{name}"
    return define(app, fun, **options)


def deliver(task, task_id, *args):
    """Run a published message's body as a worker's pool would (Celery's tracer)."""
    tracer = build_tracer(task.name, task, app=task.app)
    request = {
        "id": task_id,
        "root_id": task_id,
        "hostname": "it@localhost",
        "delivery_info": {"exchange": "", "routing_key": "q", "redelivered": False},
    }
    return tracer(task_id, list(args), {}, request)


def test_until_finished_publishes_once_until_the_run_ends(app, published):
    """A second send of a queued key publishes nothing and returns the queued id; the
    row is kept (started) through the run and deleted by the release; then a send
    publishes again."""
    seen = []

    def report(tenant):
        seen.append(rows(task, tenant))
        # While it runs, a send is still a duplicate of the running message.
        seen.append(task.delay(tenant).id)

    task = define(app, report, lock_args=("tenant",), lock_enqueue="until_finished")
    first = task.delay(7)
    second = task.delay(7)
    other = task.delay(8)  # another key: its own message
    assert second.id == first.id
    assert [first.id, other.id] == published
    assert (first.id, "f", False) == rows(task, 7)
    deliver(task, first.id, 7)
    assert [(first.id, "f", True), first.id] == seen
    assert rows(task, 7) is None
    third = task.delay(7)
    assert third.id not in (first.id, other.id)
    assert [first.id, other.id, third.id] == published


def test_the_publish_statement_is_planned_once_per_connection(app, published):
    """Each send reuses one prepared statement on the claim's kept connection instead
    of planning it anew (both drivers bind on the client): the lean FIRST for new keys
    and fresh duplicates, CLAIM only for a row FIRST leaves to it."""
    task = make(
        app,
        "planned",
        lambda tenant: None,
        lock_args=("tenant",),
        lock_enqueue="until_finished",
    )
    engine = current_engine(app)

    def executions():
        queued_writes.drain_writers()  # the confirmations, on the same kept connection
        kept = lock_state.kept_connection(engine)
        with kept.busy:
            kept.cursor.execute(
                "SELECT name, generic_plans + custom_plans FROM pg_prepared_statements "
                "WHERE name LIKE 'celery_pglock_claim%'"
            )
            return dict(kept.cursor.fetchall())

    task.delay(-1)  # the table, the connection
    before = executions()
    sends = 8
    for tenant in range(sends):
        task.delay(tenant)
        queued_writes.drain_writers()  # never busy with a confirmation at the next send
    assert task.delay(0).id != published[-1]  # a duplicate of a fresh row
    assert 1 + sends == len(published)
    after = executions()
    assert before[queued.FIRST_NAME] + sends + 1 == after[queued.FIRST_NAME]
    assert before.get(queued.CLAIM_NAME) == after.get(queued.CLAIM_NAME)
    # A stale row whose message is gone: FIRST leaves it to CLAIM, which takes it over.
    with engines.autocommit_cursor(engine, 5.0) as cursor:
        cursor.execute(
            "UPDATE celery_pglock_queued SET stale_at = now() - interval '1 s' "
            "WHERE (classid, objid, objsubid) = (%s, %s, %s)",
            task.lock_key_for(1).pg_locks_ids,
        )
    task.delay(1)
    assert 2 + sends == len(published)
    assert 1 == executions()[queued.CLAIM_NAME] - (after.get(queued.CLAIM_NAME) or 0)


@pytest.mark.parametrize("on_duplicate", ["return", "replace"])
def test_a_claim_whose_reply_was_lost_is_still_published(
    app, published, monkeypatch, on_duplicate
):
    """The claim committed, then the connection died before its reply came: the send
    checks again on a fresh connection, finds the row its own, and publishes (it used to
    return its own id unpublished, leaving its caller waiting for nothing)."""
    task = make(
        app,
        f"lost_reply_{on_duplicate}",
        lambda tenant: None,
        lock_args=("tenant",),
        lock_enqueue="until_started",
        lock_enqueue_on_duplicate=on_duplicate,
    )
    task.delay(0)  # the tables and the kept connection
    cut = lose_first_reply(monkeypatch)
    sent = task.delay(1)
    assert "new" == cut[0][0]  # committed by the first try
    assert sent.id in published
    assert sent.id == rows(task, 1)[0]


def test_a_connection_reset_by_discard_all_prepares_the_claim_again(app, published):
    """A transaction-scope body that used its lock's connection gets it reset with
    DISCARD ALL, which drops the session's prepared statements: the next send on that
    pooled connection (the kept one busy) prepares CLAIM again instead of failing."""
    task = make(
        app,
        "after_reset",
        lambda tenant: None,
        lock_args=("tenant",),
        lock_enqueue="until_finished",
    )

    def use_the_connection():
        current_lock().connection.exec_driver_sql("SELECT 1")

    resets = make(app, "resets", use_the_connection, lock_scope="transaction")
    engine = current_engine(app)
    queued_writes.drain_writers()  # earlier tests' row changes: none may open a second
    engine.dispose()  # a pool of one: the send, the run and the send share it
    task.delay(0)  # the claim's kept connection, out of the pool
    with lock_state.kept_connection(
        engine
    ).busy:  # another thread's claim: sends take the pool
        task.delay(1)
        queued_writes.drain_writers()  # its confirmation, on the same pooled connection
        resets.apply().get()
        assert 1 == engine.pool.checkedin()
        task.delay(2)
    assert 3 == len(published)


def test_a_send_after_its_claim_connection_was_closed_checks_again(
    app, published, caplog
):
    """The server closed the kept claim connection (a restart, an idle cut): the next
    send fails at once on it and is checked again on a fresh one, logging no error."""
    task = make(
        app,
        "reconnects",
        lambda tenant: None,
        lock_args=("tenant",),
        lock_enqueue="until_finished",
    )
    engine = current_engine(app)
    task.delay(1)
    kept = lock_state.kept_connection(engine)
    kept.cursor.execute("SELECT pg_backend_pid()")
    (pid,) = kept.cursor.fetchone()
    with engines.autocommit(engine) as dbapi, dbapi.cursor() as cursor:
        cursor.execute("SELECT pg_terminate_backend(%s)", (pid,))
    task.delay(2)
    assert 2 == len(published)
    assert lock_state.kept_connection(engine) is not kept
    assert [] == [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]


def test_a_run_plans_its_row_changes_once_per_session(app, session_mode):
    """The lock statements that change a queued row (a CTE: costlier to plan than to
    run) are prepared once on the lock session and executed after that."""
    seen = []

    def body(tenant):
        seen.append(tenant)

    task = make(
        app, "row_plans", body, lock_args=("tenant",), lock_enqueue="until_finished"
    )
    sends = [task.delay(tenant) for tenant in range(3)]
    for tenant, sent in enumerate(sends):
        deliver(task, sent.id, tenant)
    assert [0, 1, 2] == seen
    assert all(rows(task, tenant) is None for tenant in range(3))
    # The later runs' start (lock + row UPDATE) and end (unlock + row DELETE).
    arity = len(task.lock_key_for(0).ids)
    if session_mode == "per_process":
        lock, unlock = (
            sql_text.TRY_LOCK_SESSION_BARE_RUN,
            sql_text.UNLOCK_SESSION_KEEP_NAME_RUN,
        )
    else:  # a pooled connection per lock, labelled and unlabelled each time
        lock, unlock = sql_text.TRY_LOCK_SESSION_RUN, sql_text.UNLOCK_SESSION_RUN
    expected = {
        sql_text.name_for(
            rider.riding(lock[arity], queued.ON_START_FINISHED, "l.g IS NOT NULL")
        ),
        sql_text.name_for(rider.riding(unlock[arity], queued.ON_END)),
    }
    assert expected <= set().union(*sql_text._prepared.values())


def test_until_started_frees_the_key_when_the_run_starts(app, published):
    """until_started: the run's lock statement deletes its row, so a send during the
    run is queued as the one follow-up, and its duplicates return the follow-up."""
    during = []

    def report(tenant):
        during.append(rows(task, tenant))
        follow_up = task.delay(tenant)
        during.append((follow_up.id, task.delay(tenant).id))

    task = define(app, report, lock_args=("tenant",), lock_enqueue="until_started")
    first = task.delay(1)
    assert task.delay(1).id == first.id
    deliver(task, first.id, 1)
    follow_up, duplicate = during[1]
    assert during[0] is None
    assert follow_up == duplicate != first.id
    assert [first.id, follow_up] == published
    assert (follow_up, "s", False) == rows(task, 1)


def test_until_started_follow_up_waits_for_the_run_then_retries(app):
    """until_started defaults lock_on_busy to 'wait': a follow-up delivered while the
    run holds the key is not skipped; past lock_wait_timeout it is re-queued."""
    task = make(
        app,
        "follow",
        lambda tenant: None,
        lock_args=("tenant",),
        lock_enqueue="until_started",
        lock_wait_timeout=0.2,
        lock_retry_delay=60,
    )
    assert "wait" == task.lock_config.on_busy.value
    follow_up = task.delay(4)
    holder = hold(task, 4)
    try:
        outcome = deliver(task, follow_up.id, 4)
    finally:
        holder.release()
    assert "RETRY" == task.AsyncResult(follow_up.id).state, outcome
    assert follow_up.id == rows(task, 4)[0]  # the retry is the key's message still


def test_a_follow_up_out_of_retries_gives_its_key_back(app):
    """A busy follow-up whose retry is refused (max_retries reached) ends unrun: its row
    goes with it, or every later send would return its id until the row is stale."""
    task = make(
        app,
        "no_retries_left",
        lambda tenant: None,
        lock_args=("tenant",),
        lock_enqueue="until_started",
        lock_wait_timeout=0.2,
        max_retries=0,
    )
    follow_up = task.delay(6)
    holder = hold(task, 6)
    try:
        deliver(task, follow_up.id, 6)
    finally:
        holder.release()
    assert isinstance(task.AsyncResult(follow_up.id).result, LockBusy)
    assert rows(task, 6) is None


def test_a_skipped_message_gives_its_key_back(app):
    task = make(
        app,
        "skip",
        lambda tenant: None,
        lock_args=("tenant",),
        lock_enqueue="until_finished",
        lock_on_busy="skip",
    )
    message = task.delay(5)
    holder = hold(task, 5)
    try:
        deliver(task, message.id, 5)
    finally:
        holder.release()
    assert isinstance(task.AsyncResult(message.id).result, LockSkipped)
    assert rows(task, 5) is None


def test_on_duplicate_raise_names_the_queued_message(app, published):
    task = make(
        app,
        "raise",
        lambda tenant: None,
        lock_args=("tenant",),
        lock_enqueue="until_finished",
        lock_enqueue_on_duplicate="raise",
    )
    first = task.delay(2)
    with pytest.raises(AlreadyQueued) as raised:
        task.apply_async(args=(2,))
    assert first.id == raised.value.task_id
    assert str(task.lock_key_for(2)) == raised.value.key
    assert [first.id] == published


def test_racing_sends_publish_one_message(app, published):
    """40 threads send one key at once: one message, every caller holds its id."""
    task = make(
        app,
        "race",
        lambda tenant: None,
        lock_args=("tenant",),
        lock_enqueue="until_finished",
    )
    barrier = threading.Barrier(40)
    ids: list[str] = []

    def send():
        barrier.wait(timeout=30)
        # No result subscription: the backend is per thread, and the publishing thread's
        # would stay open past close_app (Celery 5.3's ResourceWarning at teardown).
        ids.append(task.apply_async((9,), ignore_result=True).id)

    threads = [threading.Thread(target=send) for _ in range(40)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert 40 == len(ids)
    assert 1 == len(set(ids))
    assert ids[:1] == published


def test_an_expired_message_frees_its_key_at_its_expiry(app, published):
    """expires bounds the row: after it, the next send takes the key over."""
    task = make(
        app,
        "expires",
        lambda tenant: None,
        lock_args=("tenant",),
        lock_enqueue="until_finished",
    )
    first = task.apply_async(args=(3,), expires=0.5)
    assert task.delay(3).id == first.id
    time.sleep(0.8)
    assert task.delay(3).id != first.id
    assert 2 == len(published)


def test_a_lost_message_frees_its_key_after_lost_after(app):
    """A message that never runs (purged, lost) holds its key lock_enqueue_lost_after
    past its due time, and not longer; a countdown adds to it."""
    task = make(
        app,
        "lost",
        lambda tenant: None,
        lock_args=("tenant",),
        lock_enqueue="until_finished",
        lock_enqueue_lost_after=0.5,
    )
    first = task.delay(6)
    time.sleep(0.8)
    second = task.delay(6)
    assert second.id != first.id
    later = task.apply_async(args=(7,), countdown=1.0)
    time.sleep(0.8)
    assert task.delay(7).id == later.id  # due in 1 s, plus 0.5 s


def test_a_stale_row_whose_run_lock_is_held_is_not_taken_over(app):
    """Past stale_at, a row is free only if its run lock is free: a long run keeps its
    key however long it runs."""
    task = make(
        app,
        "long",
        lambda tenant: None,
        lock_args=("tenant",),
        lock_enqueue="until_finished",
        lock_enqueue_lost_after=0.2,
    )
    first = task.delay(8)
    from celery_pglock import AdvisoryLock, keys

    run_lock = AdvisoryLock(engine=current_engine(app), key=keys.run_key(first.id))
    assert run_lock.acquire()
    try:
        time.sleep(0.4)
        assert task.delay(8).id == first.id
    finally:
        run_lock.release()
    assert task.delay(8).id != first.id


def test_a_retry_keeps_the_key_for_itself(app, published):
    """A run that retries publishes its retry (same id) and leaves the row to it."""

    def flaky(self, tenant):
        if self.request.retries == 0:
            raise self.retry(countdown=60)

    task = app.task(
        base=__import__("celery_pglock").SingletonTask,
        bind=True,
        name=f"it.flaky.{uuid.uuid4().hex[:6]}",
        shared=False,
        lock_args=("tenant",),
        lock_enqueue="until_finished",
        max_retries=2,
    )(flaky)
    app.finalize(auto=True)
    task = app.tasks[task.name]
    first = task.delay(1)
    deliver(task, first.id, 1)
    assert [first.id, first.id] == published  # the retry was published
    assert first.id == rows(task, 1)[0]
    assert task.delay(1).id == first.id


def test_a_send_with_a_callback_is_published_even_when_queued(app, published):
    """Deduplicated, a callback, group member or chain link would never complete:
    published (unchecked) instead."""
    task = make(
        app,
        "canvas",
        lambda tenant: None,
        lock_args=("tenant",),
        lock_enqueue="until_finished",
    )
    first = task.delay(2)
    linked = task.apply_async(args=(2,), link=task.si(3))
    assert linked.id != first.id
    # A group's result and a chain's links are ids frozen before the send.
    grouped = celery.group(task.si(2), task.si(2)).apply_async()
    chained = celery.chain(task.si(2), task.si(2)).apply_async()
    members = [result.id for result in grouped.results]
    assert [first.id, linked.id, *members, chained.parent.id] == published


def test_unreachable_database_publishes_nothing(app, published, database_url):
    app.conf.pglock_database_url = "postgresql+psycopg2://u:secret@127.0.0.1:9/x"
    app.conf.pglock_db_timeout = 1.0
    task = make(
        app,
        "down",
        lambda tenant: None,
        lock_args=("tenant",),
        lock_enqueue="until_finished",
    )
    started = time.monotonic()
    with pytest.raises(EnqueueUnavailable) as raised:
        task.delay(1)
    assert time.monotonic() - started < 5
    assert "secret" not in str(raised.value)
    assert "lock_enqueue_on_error" in str(raised.value)
    assert [] == published
    task2 = make(
        app,
        "down2",
        lambda tenant: None,
        lock_args=("tenant",),
        lock_enqueue="until_finished",
        lock_enqueue_on_error="publish",
    )
    result = task2.delay(1)
    assert [result.id] == published


def test_revoked_and_rejected_messages_free_their_keys(app):
    """The worker's main-process hooks: task_revoked (revoke, expiry) and task_rejected
    delete the row of that message only, off the consumer thread."""
    task = make(
        app,
        "revoke",
        lambda tenant: None,
        lock_args=("tenant",),
        lock_enqueue="until_finished",
    )
    first = task.delay(1)
    header = queued.header_of(task.lock_key_for(1))

    request = types.SimpleNamespace(id=first.id, headers={queued.HEADER: header})
    enqueue.on_revoked(sender=task, request=request)
    deadline = time.monotonic() + 5
    while rows(task, 1) is not None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert rows(task, 1) is None
    second = task.delay(1)

    message = types.SimpleNamespace(
        headers={queued.HEADER: header, "task": task.name, "id": "another id"}
    )
    consumer = types.SimpleNamespace(app=app)
    enqueue.on_rejected(sender=consumer, message=message)
    time.sleep(0.5)
    assert second.id == rows(task, 1)[0]  # not its message: kept
    message.headers["id"] = second.id
    enqueue.on_rejected(sender=consumer, message=message)
    deadline = time.monotonic() + 5
    while rows(task, 1) is not None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert rows(task, 1) is None


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        ({"lock_enqueue": "always"}, "'until_finished', 'until_started'"),
        (
            {"lock_enqueue": "until_finished", "lock_scope": "transaction"},
            "lock_scope='session'",
        ),
        ({"lock_enqueue": "until_finished", "lock_shadow": True}, "lock_shadow"),
        ({"lock_enqueue_on_duplicate": "ignore"}, "'return', 'raise'"),
        ({"lock_enqueue_lost_after": 0}, "positive number of seconds"),
    ],
)
def test_bad_enqueue_options_are_refused_at_bind(app, options, expected):
    with pytest.raises(ConfigurationError) as raised:
        make(app, "bad", lambda tenant: None, lock_args=("tenant",), **options)
    assert expected in str(raised.value)


def test_current_lock_in_an_enqueued_run(app):
    task = make(
        app, "cur", lambda: str(current_lock().key), lock_enqueue="until_started"
    )
    message = task.delay()
    deliver(task, message.id)
    assert rows(task) is None


def test_two_enqueue_tasks_sharing_a_lock_name_are_refused_at_registration(app):
    """A send of one would return the other's queued message: refused, naming both.
    Sharing the lock with a task that does not enqueue is fine (the run lock only)."""
    make(
        app,
        "first",
        lambda tenant: None,
        lock_args=("tenant",),
        lock_name="shared",
        lock_enqueue="until_finished",
    )
    make(app, "plain", lambda tenant: None, lock_args=("tenant",), lock_name="shared")
    make(
        app,
        "other_name",
        lambda tenant: None,
        lock_args=("tenant",),
        lock_name="other",
        lock_enqueue="until_finished",
    )
    with pytest.raises(ConfigurationError) as raised:
        make(
            app,
            "second",
            lambda tenant: None,
            lock_args=("tenant",),
            lock_name="shared",
            lock_enqueue="until_started",
        )
    assert "'it.enqueue_first' and 'it.enqueue_second'" in str(raised.value)
    assert "lock_name" in str(raised.value)


def test_dispose_closes_the_claim_connection(app, published):
    """engine.dispose() closes the kept claim connection with the pool's, and the next
    send opens a new one."""
    task = make(
        app,
        "disposed",
        lambda tenant: None,
        lock_args=("tenant",),
        lock_enqueue="until_finished",
    )
    engine = current_engine(app)
    task.delay(1)
    queued_writes.drain_writers()
    kept = lock_state.kept_connection(engine)
    engine.dispose()
    assert kept.dbapi.closed
    task.delay(2)
    assert lock_state.kept_connection(engine) is not kept
    assert 2 == len(published)
