"""lock_period against a real PostgreSQL: one start per key per period, the time left,
every busy policy, both scopes, shadow mode, racing starts, a crashed holder, and a
database error at the period's statement.

Two real beats and a real worker: tests/acceptance/test_period.py.
"""

from __future__ import annotations

import contextlib
import datetime
import subprocess
import sys
import threading
import time
import uuid

import pytest
from celery import Celery, signals
from click.testing import CliRunner
from sqlalchemy import event

from celery_pglock import (
    AdvisoryLock,
    DatabaseError,
    LockBusy,
    LockSkipped,
    config,
    keys,
)
from celery_pglock import cli as cli_module
from celery_pglock import signals as pglock_signals
from celery_pglock.task import periods
from celery_pglock.testing import _support
from tests.integration import test_fencing
from tests.integration.task_support import (
    close_app,
    current_engine,
    define,
    hold,
    is_held,
    trace_delivery,
)


@pytest.fixture
def app(database_url, broker_url, result_backend_url, namespace):
    app = Celery(
        "period", broker=broker_url, backend=result_backend_url, set_as_current=False
    )
    app.conf.pglock_database_url = database_url
    app.conf.pglock_namespace = namespace
    yield app
    close_app(app)


lp_role = test_fencing.lp_role  # a role without CREATE, on a schema of its own


@pytest.fixture
def skips():
    """The lock_skipped signals sent during the test (their kwargs)."""
    seen: list[dict] = []

    def receiver(sender=None, signal=None, **kwargs):
        seen.append(kwargs)

    pglock_signals.lock_skipped.connect(receiver, weak=False)
    yield seen
    pglock_signals.lock_skipped.disconnect(receiver)


def body_counter(app, name="tick", **options):
    """A lock_period task ``it.<name>`` whose body appends its task id to the list."""
    ran: list[str | None] = []

    def tick(self):
        ran.append(self.request.id)
        return "ran"

    tick.__name__ = name
    return define(app, tick, bind=True, **options), ran


def row(task, database_url):
    """The key's period row: (started_at, task_id), or None."""
    ids = task.lock_key_for().pg_locks_ids
    connection = _support.connect(database_url, application_name="period test")
    try:
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT started_at, task_id FROM celery_pglock_periods "
                "WHERE (classid, objid, objsubid) = (%s, %s, %s)",
                ids,
            )
            return cursor.fetchone()
    finally:
        connection.close()


@contextlib.contextmanager
def published_headers():
    """The headers of every message published inside the block (before_task_publish)."""
    published: list[dict] = []

    def capture(headers=None, **_):
        published.append(headers)

    signals.before_task_publish.connect(capture, weak=False)
    try:
        yield published
    finally:
        signals.before_task_publish.disconnect(capture)


def seconds_until_eta(headers) -> float:
    eta = datetime.datetime.fromisoformat(headers["eta"])
    return (eta - datetime.datetime.now(datetime.timezone.utc)).total_seconds()


@pytest.mark.parametrize("scope", ["session", "transaction"])
def test_one_start_per_period_then_the_next_runs(app, skips, scope):
    """The first start runs; a second within the period is skipped (reason 'period',
    the seconds left, the start's task id) without its body and with the lock released;
    once the period has passed the next one runs. Both scopes."""
    task, ran = body_counter(app, lock_period=1.0, lock_scope=scope)
    first = task.apply()
    assert "ran" == first.get()
    second = task.apply()
    assert "FAILURE" == second.state
    skip = second.result
    assert isinstance(skip, LockSkipped)
    details = skip.details
    assert "period" == details["reason"]
    assert "skip" == details["policy"]
    assert first.id == details["last_task"]
    assert 0.0 < details["seconds_left"] <= 1.0
    # It names the start that opened the period, never as a holder: it may have ended.
    assert f"run {first.id} started less than lock_period 1s ago" in str(skip)
    assert f"{task.name}[{second.id}] did not run." in str(skip)
    assert [first.id] == ran
    assert not is_held(task)
    assert [("skip", "period", False)] == [
        (s["action"], s["reason"], s["shadow"]) for s in skips
    ]
    time.sleep(details["seconds_left"])  # the period's deadline, from the server
    third = task.apply()
    assert "ran" == third.get()
    assert [first.id, third.id] == ran


@pytest.mark.parametrize(
    ("scope", "checkouts"),
    [("session", {"per_process": 0, "per_lock": 1}), ("transaction", 2)],
)
def test_the_start_is_one_statement_on_the_session_holding_the_key(
    app, session_mode, scope, checkouts
):
    """Session scope: the start is one more statement on the session that holds the key
    (the process session: no checkout at all; per lock: the pinned one alone).
    Transaction scope checks out a connection of its own for it: in the lock's
    transaction it would commit with the body."""
    task, ran = body_counter(app, lock_period=0.001, lock_scope=scope)
    assert "ran" == task.apply().get()  # warm: the session, the table's check
    pool = current_engine(app).pool
    seen: list[object] = []

    def checkout(*_):
        seen.append(_)

    event.listen(pool, "checkout", checkout)
    try:
        time.sleep(0.002)
        assert "ran" == task.apply().get()
    finally:
        event.remove(pool, "checkout", checkout)
    expected = checkouts[session_mode] if isinstance(checkouts, dict) else checkouts
    assert expected == len(seen)
    assert 2 == len(ran)


@pytest.mark.parametrize("starts", [1, 3])
def test_racing_starts_of_one_key_record_exactly_n(lock_engine, namespace, starts):
    """Eight sessions send the start at once for one key (without the advisory lock
    that normally serialises them), in four rounds: on no row, then three times on an
    expired one. Each round records exactly ``starts`` (lock_rate's N), and every other
    start is refused naming one of them. The row lock decides, not the snapshot."""
    key = keys.make_key(namespace, f"race{starts}")
    locks = [AdvisoryLock(engine=lock_engine, key=key) for _ in range(8)]
    rate = config.Rate(starts, 0.3)
    for round_ in range(4):
        barrier = threading.Barrier(len(locks))
        outcomes: dict[str, periods.Throttle | None] = {}

        def start(index, round_=round_, barrier=barrier, outcomes=outcomes):
            task_id = f"r{round_}t{index}"
            barrier.wait(timeout=10)
            outcomes[task_id] = periods.start(locks[index], task_id, rate)

        threads = [threading.Thread(target=start, args=(i,)) for i in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=30)
        assert len(locks) == len(outcomes)
        winners = [task for task, throttle in outcomes.items() if throttle is None]
        assert starts == len(winners), (round_, outcomes)
        refused = [throttle for throttle in outcomes.values() if throttle is not None]
        # A start committed after a loser's snapshot reads as none: the whole window.
        assert all(0 < t.seconds_left <= rate.window for t in refused), refused
        assert all(t.last_task_id in (*winners, None) for t in refused), refused
        time.sleep(rate.window)  # the window's end: the next round races an expired row


def test_a_rate_starts_n_per_window_and_names_the_start_whose_slot_opens_next(
    app, skips
):
    """lock_rate=(3, 1.5): three starts run, the fourth is skipped (reason 'rate') with
    the time until the earliest start leaves the window and that start's id; once it has,
    one more starts, and the next is refused until the second one leaves."""
    task, ran = body_counter(app, lock_rate=(3, 1.5))
    first = task.apply()
    time.sleep(0.5)  # the second's slot opens 0.5 s after the first's
    second, third = task.apply(), task.apply()
    assert ["ran"] * 3 == [first.get(), second.get(), third.get()]
    fourth = task.apply()
    skip = fourth.result
    assert isinstance(skip, LockSkipped)
    details = skip.details
    assert ("rate", first.id) == (details["reason"], details["last_task"])
    assert 0.0 < details["seconds_left"] <= 1.0
    assert (
        f"3 runs started within lock_rate 3/1.5s, the earliest run {first.id}, "
        in str(skip)
    )
    assert [("skip", "rate")] == [(s["action"], s["reason"]) for s in skips]
    time.sleep(details["seconds_left"])
    fifth = task.apply()
    assert "ran" == fifth.get()
    sixth = task.apply()
    assert isinstance(sixth.result, LockSkipped)
    assert second.id == sixth.result.details["last_task"]
    assert [first.id, second.id, third.id, fifth.id] == ran


def test_lock_rate_of_one_start_says_rate_not_period(app):
    """lock_rate="1/m" is lock_period=60 in effect, but its refusal is named as the task
    set it: reason "rate", "1 run started within lock_rate 1/60s"."""
    task, _ = body_counter(app, lock_rate="1/m")
    first = task.apply()
    skip = task.apply().result
    assert "rate" == skip.details["reason"]
    message = f"1 run started within lock_rate 1/60s, the earliest run {first.id}, "
    assert message in str(skip)


def test_a_retry_of_any_start_within_the_window_runs_without_a_new_start(
    app, database_url
):
    """lock_rate=(2, 60): a retry of the earlier of two starts runs and records nothing;
    a new message is refused; so is a retry of a start whose slot the window has left
    behind, which counts as a new start."""
    task, ran = body_counter(app, lock_rate=(2, 60))
    task.apply(task_id="a")
    task.apply(task_id="b")
    recorded = row(task, database_url)
    assert "ran" == task.apply(task_id="a", retries=1).get()
    assert recorded == row(task, database_url)
    assert isinstance(task.apply().result, LockSkipped)
    assert isinstance(task.apply(task_id="c", retries=1).result, LockSkipped)
    assert ["a", "b", "a"] == ran


def test_a_table_made_before_lock_rate_is_brought_up_to_date(app, database_url):
    """A celery_pglock_periods without lock_rate's columns (an older version made it):
    the first start adds them, and the row it held counts as the key's one start."""
    connection = _support.connect(database_url, application_name="period test")
    connection.autocommit = True
    try:
        with connection.cursor() as cursor:
            cursor.execute("DROP TABLE IF EXISTS celery_pglock_periods")
            cursor.execute(
                "CREATE TABLE celery_pglock_periods (classid oid NOT NULL, "
                "objid oid NOT NULL, objsubid smallint NOT NULL, started_at timestamptz "
                "NOT NULL, task_id text, PRIMARY KEY (classid, objid, objsubid))"
            )
            task, ran = body_counter(app, lock_rate=(2, 60))
            cursor.execute(
                "INSERT INTO celery_pglock_periods VALUES (%s, %s, %s, now(), 'old')",
                task.lock_key_for().pg_locks_ids,
            )
            periods.TABLE.forget(current_engine(app))
            assert "ran" == task.apply(task_id="new").get()
            skip = task.apply().result
            assert isinstance(skip, LockSkipped)
            assert "old" == skip.details["last_task"]
            cursor.execute(
                "SELECT earlier_ids, task_id FROM celery_pglock_periods "
                "WHERE (classid, objid, objsubid) = (%s, %s, %s)",
                task.lock_key_for().pg_locks_ids,
            )
            assert (["old"], "new") == cursor.fetchone()
    finally:
        connection.close()
    assert ["new"] == ran


def test_the_slots_of_a_key_share_its_period(app):
    """lock_limit=2 with lock_period: a run on the second slot (the first is held) is
    still throttled by the first slot's start. One start per key per period."""
    task, ran = body_counter(app, lock_limit=2, lock_period=60, lock_fencing=False)
    first = task.apply()
    assert "ran" == first.get()
    first_slot = hold(task)
    try:
        second = task.apply()
    finally:
        first_slot.release()
    assert isinstance(second.result, LockSkipped)
    assert "period" == second.result.details["reason"]
    assert first.id == second.result.details["last_task"]
    assert [first.id] == ran


def test_raise_and_a_direct_call_fail_with_lock_busy(app):
    """lock_on_busy='raise' raises LockBusy within the period; so does a direct call
    under the default 'skip' (it has no message to skip), as for a held lock."""
    task, ran = body_counter(app, lock_period=60, lock_on_busy="raise")
    assert "ran" == task.apply().get()
    with pytest.raises(LockBusy, match="lock_period 60s"):
        task.apply().get()
    direct, direct_ran = body_counter(app, "direct", lock_period=60)
    direct()
    with pytest.raises(LockBusy, match="lock_period 60s") as caught:
        direct()
    assert not isinstance(caught.value, LockSkipped)
    message = str(caught.value)
    assert "a run started (a direct call, or one whose id is unknown)" in message
    assert f"{direct.name} (direct call) did not run." in message
    assert "None" not in message
    assert 1 == len(ran)
    assert 1 == len(direct_ran)


def test_retry_is_published_with_the_time_left_as_countdown(app):
    """lock_on_busy='retry': the throttled run is re-queued for when the period ends,
    not after lock_retry_delay."""
    task, _ran = body_counter(
        app, lock_period=30, lock_on_busy="retry", lock_retry_delay=1000
    )
    trace_delivery(task, str(uuid.uuid4()), redelivered=False)
    retried = str(uuid.uuid4())
    with published_headers() as published:
        trace_delivery(task, retried, redelivered=False)
    assert "RETRY" == task.AsyncResult(retried).state
    [headers] = published
    assert retried == headers["id"]
    assert 25 < seconds_until_eta(headers) <= 30


def test_wait_waits_out_a_period_shorter_than_the_wait_timeout(app):
    """lock_on_busy='wait': a period ending within lock_wait_timeout is waited out and
    the run starts; one ending later fails at once with LockBusy."""
    task, ran = body_counter(
        app, lock_period=1.0, lock_on_busy="wait", lock_wait_timeout=5
    )
    first = task.apply()
    asked = time.monotonic()
    second = task.apply()
    assert "ran" == second.get()
    assert time.monotonic() - asked >= 0.5
    assert [first.id, second.id] == ran
    long, long_ran = body_counter(
        app, "long", lock_period=60, lock_on_busy="wait", lock_wait_timeout=1
    )
    long.apply()
    asked = time.monotonic()
    with pytest.raises(LockBusy, match="more than lock_wait_timeout 1s"):
        long.apply().get()
    assert time.monotonic() - asked < 1.0
    assert 1 == len(long_ran)


def test_a_retry_of_the_message_that_opened_the_period_runs(app, database_url):
    """A retry (its request's retries) of the message that opened the period starts
    again, and the period keeps its first start; another message is still throttled, and
    so is a new message that reuses the opener's task id."""
    task, ran = body_counter(app, lock_period=60)
    task.apply(task_id="opener")
    opened = row(task, database_url)
    assert "ran" == task.apply(task_id="opener", retries=1).get()
    assert opened == row(task, database_url)
    assert isinstance(task.apply().result, LockSkipped)
    assert isinstance(task.apply(task_id="opener").result, LockSkipped)
    assert ["opener", "opener"] == ran


def test_a_start_in_the_future_is_taken_over(app, database_url):
    """A recorded start later than the server's now() (its clock was set back) does not
    block the key until the clock catches up: the next start takes the row over."""
    task, ran = body_counter(app, lock_period=60)
    task.apply()
    connection = _support.connect(database_url, application_name="period test")
    try:
        with connection.cursor() as cursor:
            cursor.execute(
                "UPDATE celery_pglock_periods SET started_at = now() + interval '1 hour' "
                "WHERE (classid, objid, objsubid) = (%s, %s, %s)",
                task.lock_key_for().pg_locks_ids,
            )
    finally:
        connection.close()
    second = task.apply()
    assert "ran" == second.get()
    assert second.id == row(task, database_url)[1]
    assert 2 == len(ran)


def test_shadow_mode_reports_the_throttle_and_runs_under_the_lock(app, skips):
    """lock_shadow=True: a throttled start is reported (shadow) and runs anyway,
    under its lock; the period still counts from the first start."""
    held = []

    def shadowed(self):
        held.append(is_held(self))
        return "ran"

    task = define(app, shadowed, bind=True, lock_period=60, lock_shadow=True)
    first = task.apply()
    assert ["ran", "ran"] == [first.get(), task.apply().get()]
    assert [True, True] == held
    assert [("skip", "period", True)] == [
        (s["action"], s["reason"], s["shadow"]) for s in skips
    ]


CRASH = """
import os, signal, sys
from celery import Celery
from celery_pglock import SingletonTask
app = Celery("period", broker="memory://", set_as_current=False)
app.conf.pglock_database_url, app.conf.pglock_namespace = sys.argv[1], sys.argv[2]
@app.task(base=SingletonTask, name="it.tick", shared=False, lock_period=60)
def tick():
    os.kill(os.getpid(), signal.SIGKILL)
app.finalize(auto=True)
app.tasks["it.tick"].apply(task_id="crashed")
"""


def test_the_period_outlives_a_crashed_holder(app, database_url, namespace):
    """A holder SIGKILLed in its body leaves its start behind: the next start within
    the period is throttled, naming the crashed run; its lock died with it."""
    crashed = subprocess.run(
        [sys.executable, "-c", CRASH, database_url, namespace],
        capture_output=True,
        timeout=60,
        check=False,
    )
    assert -9 == crashed.returncode, crashed.stderr
    task, ran = body_counter(app, lock_period=60)
    assert "it.tick" == task.name
    skip = task.apply().result
    assert isinstance(skip, LockSkipped)
    assert "crashed" == skip.details["last_task"]
    assert [] == ran


def test_a_database_error_at_the_start_releases_the_lock_and_runs_nothing(
    app, database_url, namespace, caplog
):
    """The period's row is locked by another session: the server ends the start's wait
    (lock_timeout, half of lock_db_timeout) and the run fails with DatabaseError, its
    body never runs, and the key's lock is released at once (not left to task_postrun's
    safety net); as an error at acquire. The start ran on the process's lock session,
    whose other lock survives: the client never had to cut the socket."""
    task, ran = body_counter(app, lock_period=0.001, lock_db_timeout=1)
    task.apply().get()
    bystander = AdvisoryLock(
        engine=current_engine(app), key=keys.make_key(namespace, "bystander")
    )
    assert bystander.acquire()
    blocker = _support.connect(database_url, application_name="period blocker")
    blocker.autocommit = False  # hold the row lock until the rollback
    try:
        with blocker.cursor() as cursor:
            cursor.execute(
                "SELECT 1 FROM celery_pglock_periods "
                "WHERE (classid, objid, objsubid) = (%s, %s, %s) FOR UPDATE",
                task.lock_key_for().pg_locks_ids,
            )
            result = task.apply()
            assert not is_held(task)
    finally:
        blocker.rollback()
        blocker.close()
    assert "FAILURE" == result.state
    assert isinstance(result.result, DatabaseError)
    assert "lock timeout" in str(result.result)
    assert 1 == len(ran)
    assert bystander.locked()
    assert not bystander.lost
    bystander.release()  # raises if the process session had ended
    leftovers = [
        r
        for r in caplog.records
        if getattr(r, "action", "") == "lock_leftover_released"
    ]
    assert [] == leftovers


def test_a_role_without_create_is_told_the_fix_then_works_after_pglock_sql(
    lp_role, database_url, broker_url, result_backend_url, namespace
):
    """No table and no CREATE: the run fails (never runs unchecked) naming `pglock sql
    --periods --apply`; the owner applies it with the CLI, which also prints the GRANT
    to give; the run still fails (not writable) until that GRANT, then runs."""
    url, role, schema, admin = lp_role
    app = Celery(
        "lp", broker=broker_url, backend=result_backend_url, set_as_current=False
    )
    app.conf.pglock_database_url = url
    app.conf.pglock_namespace = namespace
    task, ran = body_counter(app, lock_period=60)

    def cli(*args):
        result = CliRunner().invoke(cli_module.standalone_command, list(args))
        assert 0 == result.exit_code, result.output + repr(result.exception)
        return result.output

    try:
        result = task.apply()
        assert isinstance(result.result, DatabaseError)
        assert "pglock sql --periods --apply" in str(result.result)
        assert [] == ran
        printed = cli("sql", "--periods", "--schema", schema)
        assert "CREATE TABLE IF NOT EXISTS" in printed
        for _ in range(2):  # twice is harmless
            made = cli(
                "--database-url",
                database_url,
                "sql",
                "--periods",
                "--apply",
                "--schema",
                schema,
            )
            assert f"Created (if missing) {schema}.celery_pglock_periods." in made
        result = task.apply()
        assert "not writable by this role" in str(result.result)
        assert [] == ran
        grant = next(line for line in printed.splitlines() if "GRANT" in line)
        with admin.cursor() as cursor:
            cursor.execute(
                grant.removeprefix("-- ").replace('"<lock role>"', f'"{role}"')
            )
        assert "ran" == task.apply().get()
        assert 1 == len(ran)
        dropped = cli(
            "--database-url",
            database_url,
            "sql",
            "--periods",
            "--apply",
            "--uninstall",
            "--schema",
            schema,
        )
        assert f"Dropped {schema}.celery_pglock_periods." in dropped
    finally:
        app.close()


def test_until_finished_with_a_period_a_throttled_message_frees_its_key(app):
    """lock_enqueue='until_finished' + lock_period: a send after the run ended is
    published (its duplicates return it); throttled at its start, it is skipped and
    gives its key back, so the next send publishes again."""
    task, ran = body_counter(
        app, "enqueued_tick", lock_period=30, lock_enqueue="until_finished"
    )
    first = task.delay()
    trace_delivery(task, first.id, redelivered=False)
    assert [first.id] == ran
    second = task.delay()
    assert second.id != first.id
    assert second.id == task.delay().id  # queued: a duplicate
    trace_delivery(task, second.id, redelivered=False)
    assert isinstance(task.AsyncResult(second.id).result, LockSkipped)
    assert [first.id] == ran
    assert not is_held(task)
    assert task.delay().id not in (first.id, second.id)  # the key was given back


def test_until_started_with_a_period_coalesces_into_one_run_at_the_next_period(app):
    """lock_enqueue='until_started' + lock_period: the follow-up throttled at its start
    is re-queued at once for the period's end (30 s left: more than lock_wait_timeout,
    10 s, so waiting would not help), and it keeps the key: later sends return it, so
    one run carries every change made meanwhile."""
    task, ran = body_counter(
        app, "coalesced_tick", lock_period=30, lock_enqueue="until_started"
    )
    first = task.delay()
    trace_delivery(task, first.id, redelivered=False)
    follow_up = task.delay()
    assert follow_up.id == task.delay().id
    began = time.monotonic()
    with published_headers() as published:
        trace_delivery(task, follow_up.id, redelivered=False)
    assert time.monotonic() - began < 5  # no hopeless wait holds the worker
    assert "RETRY" == task.AsyncResult(follow_up.id).state
    [headers] = published
    assert follow_up.id == headers["id"]
    # The period's end, not lock_retry_delay after.
    assert 5 < seconds_until_eta(headers) <= 30
    assert follow_up.id == task.delay().id  # the re-queued follow-up keeps the key
    assert [first.id] == ran
