"""The pglock command against real PostgreSQL (and a real PgBouncer, marker pgbouncer).

The command runs in-process through click's runner, as ``celery-pglock`` would; one test
runs it as ``celery -A ... pglock`` in a subprocess to prove the entry point.
"""

from __future__ import annotations

import contextlib
import getpass
import json
import os
import re
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
from click.testing import CliRunner

from celery_pglock import (
    AdvisoryLock,
    LockLostError,
    PgLockError,
    SingletonTask,
    cli,
    config,
    current_lock,
    keys,
)
from celery_pglock.db import engines
from celery_pglock.lock import sessions
from celery_pglock.task import groups
from celery_pglock.testing import EmbeddedPostgres, _support, lock_state
from celery_pglock.watch import loss_watcher
from tests.integration.loss_support import make_app, wait_for

APP = "tests.integration.cli_app:app"


@pytest.fixture
def cli_app(database_url, monkeypatch):
    monkeypatch.setenv("CELERY_PGLOCK_TEST_DATABASE_URL", database_url)
    from tests.integration import cli_app

    cli_app.app.conf.pglock_database_url = database_url
    return cli_app


def run(*args, expect=0):
    result = CliRunner().invoke(cli.standalone_command, list(args))
    assert expect == result.exit_code, result.output + repr(result.exception)
    return result.output


@pytest.fixture
def schema(database_url):
    """A schema of this test's own for the installed SQL; dropped afterwards.

    Its name has a ``%``: `sql --apply` once sent the SQL with an empty parameter list,
    and psycopg2 then read the ``%`` as a placeholder (TypeError).
    """
    name = f"pglock_cli_{uuid.uuid4().hex[:8]}_%"
    connection = _support.connect(database_url, application_name="cli test schema")
    with connection.cursor() as cursor:
        cursor.execute(f'CREATE SCHEMA "{name}"')
    yield name
    with connection.cursor() as cursor:
        cursor.execute(f'DROP SCHEMA "{name}" CASCADE')
    connection.close()


MATERIALS = [
    ((7,), {}),
    (("7",), {}),
    ((7, {"b": [1, True, None], "a": "x", "é": "ü", "Z": 'q"uote\\'}), {}),
    ((), {"tenant_id": "line\nbreak\ttab\x01", "spec": {"nested": {"k": [2, 3]}}}),
    ((-(2**40),), {"spec": ["a", "b"], "fmt": "pdf"}),
]


@pytest.mark.parametrize(("args", "kwargs"), MATERIALS)
def test_key_agrees_with_the_worker_and_the_sql_function(
    cli_app, database_url, schema, args, kwargs
):
    """`pglock key` prints the key SingletonTask.lock_key_for computes, and the installed
    celery_pglock_key() computes the same bigint in PostgreSQL."""
    expected = cli_app.export.lock_key_for(*args, **kwargs)
    forms = json.loads(
        run(
            "--app",
            APP,
            "key",
            cli_app.export.name,
            "--args",
            json.dumps(list(args)),
            "--kwargs",
            json.dumps(kwargs),
            "--json",
        )
    )
    assert str(expected) == forms["key"]
    assert list(expected.pg_locks_ids) == list(forms["pg_locks"].values())
    run("--database-url", database_url, "sql", "--apply", "--schema", schema)
    connection = _support.connect(database_url, application_name="cli test")
    try:
        with connection.cursor() as cursor:
            cursor.execute(f'SET search_path TO "{schema}", public')
            cursor.execute(forms["key_sql"])
            (in_sql,) = cursor.fetchone()
    finally:
        connection.close()
    assert expected.ids == (in_sql,)


def test_key_of_fixed_and_explicit_keys(cli_app):
    """A task without lock_args and a lock_id task: same forms, from the same code."""
    settle = json.loads(run("--app", APP, "key", cli_app.settle.name, "--json"))
    assert str(cli_app.settle.lock_key_for()) == settle["key"]
    pinned = json.loads(run("--app", APP, "key", cli_app.pinned.name, "--json"))
    assert "42,1001" == pinned["key"]
    assert None is pinned["key_sql"]
    assert "classid=42 objid=1001 objsubid=2" in run(
        "--app", APP, "key", cli_app.pinned.name
    )


def test_key_refuses_unknown_tasks_and_bad_json(cli_app):
    assert "is not a SingletonTask" in run("--app", APP, "key", "nope", expect=2)
    assert "must be JSON" in run(
        "--app", APP, "key", cli_app.export.name, "--args", "[7", expect=2
    )


def test_locks_names_holders_waiters_and_foreign_locks(cli_app, database_url):
    """`pglock locks` shows a held lock by task, host:pid and backend pid, who waits for
    it, and a lock some other program took, labelled as such; nothing once released."""
    engine = engines.engine_for(cli_app.app.conf)
    key = cli_app.settle.lock_key_for()
    lock = AdvisoryLock(engine=engine, key=key, label=cli_app.settle.name)
    assert lock.acquire()
    foreign = _support.connect(database_url, application_name="psql")
    waiter = _support.connect(database_url, application_name="cli test waiter")
    foreign_key = uuid.uuid4().int % 2**62
    waiting = threading.Thread(target=_wait_for, args=(waiter, key.ids[0]))
    try:
        with foreign.cursor() as cursor:
            cursor.execute("SELECT pg_advisory_lock(%s)", (foreign_key,))
        waiting.start()
        assert _support.wait_until(
            lambda: bool((_entry(cli_app, str(key)) or {}).get("waiters")), timeout=10
        )
        entry = _entry(cli_app, str(key))
        assert engines.process_tag() == entry["holder"]
        assert cli_app.settle.name == entry["task"]
        assert cli_app.settle.name == entry["lock_name"]  # a fixed key: known by name
        assert entry["celery_pglock"]
        assert entry["held_seconds"] >= 0
        assert ["cli test waiter"] == [w["application_name"] for w in entry["waiters"]]
        other = _entry(cli_app, str(foreign_key))
        assert not other["celery_pglock"]
        assert "psql" == other["application_name"]
        table = run("--app", APP, "locks")
        assert "(not celery-pglock)" in table
        assert engines.process_tag() in table
    finally:
        lock.release()
        waiting.join(10)
        foreign.close()
        waiter.close()
    assert None is _entry(cli_app, str(key))


def test_locks_and_key_show_the_slots_of_a_lock_limit_task(cli_app, database_url):
    """A lock_limit=3 task with a fixed key: `pglock key` prints its three slot keys, and
    `pglock locks` names each held slot of it as SLOT i/3."""
    forms = json.loads(run("--app", APP, "key", cli_app.batch.name, "--json"))
    slots = keys.slot_keys(cli_app.batch.lock_key_for(), 3)
    assert [str(slot) for slot in slots] == forms["slots"]
    assert f"slots:      0={slots[0]}  1={slots[1]}  2={slots[2]}" in run(
        "--app", APP, "key", cli_app.batch.name
    )
    engine = engines.create_engine(database_url)
    locks = [AdvisoryLock(engine=engine, key=slots[0]) for _ in range(2)]
    try:
        for lock in locks:
            lock.slots = slots
            assert lock.acquire()
        for slot in (0, 1):
            entry = _entry(cli_app, str(slots[slot]))
            assert f"{slot}/3" == entry["slot"]
            assert cli_app.batch.name == entry["lock_name"]
        assert None is _entry(cli_app, str(slots[2]))
        table = run("--app", APP, "locks").splitlines()
        assert ["KEY", "LOCK", "SLOT", "TASK"] == table[0].split()[:4]
        assert any(str(slots[1]) in line and " 1/3 " in line for line in table)
    finally:
        for lock in locks:
            if lock.owned():
                lock.release()
        sessions.close_for(engine)
        engine.dispose()


@pytest.mark.parametrize(("name", "of"), [("tenant_batch", "3"), ("tiered_batch", "*")])
def test_locks_names_the_slots_of_a_per_argument_lock_limit_task(
    cli_app, database_url, name, of
):
    """A lock_limit=3 task with lock_args: `pglock locks` names slot 1 of a tenant's key as
    1/3 of that key (slot 0), with its task; once slot 0 is released, the slot left is
    "?/3" (a slot key cannot be turned back into the key it was derived from). With
    lock_limit_for (3 for tenant 7), N is the key's own: "1/*", "?/*"; `pglock key`
    prints the call's own slots."""
    task = getattr(cli_app, name)
    base = task.lock_key_for(7)
    forms = json.loads(run("--app", APP, "key", task.name, "--args", "[7]", "--json"))
    assert 3 == len(forms["slots"])
    slots = keys.slot_keys(base, 3)
    engine = engines.create_engine(database_url)
    locks = [AdvisoryLock(engine=engine, key=base, label=task.name) for _ in range(2)]
    try:
        for lock in locks:
            lock.slots = slots
            assert lock.acquire()
        first, second = _entry(cli_app, str(slots[0])), _entry(cli_app, str(slots[1]))
        assert (f"0/{of}", None, task.name) == (
            first["slot"],
            first["slot_of"],
            first["task"],
        )
        assert (f"1/{of}", str(base), task.name, task.name) == (
            second["slot"],
            second["slot_of"],
            second["task"],
            second["lock_name"],
        )
        table = run("--app", APP, "locks")
        assert f" 1/{of} of {base} " in table, table
        locks[0].release()
        assert f"?/{of}" == _entry(cli_app, str(slots[1]))["slot"]
    finally:
        for lock in locks:
            if lock.owned():
                lock.release()
        sessions.close_for(engine)
        engine.dispose()


def test_locks_names_the_slots_of_a_group(cli_app, database_url):
    """lock_group: `pglock locks` names a held group slot "group exports", i/2, slot 0's
    key for the others, with the task its holder ran."""
    task = cli_app.grouped_export
    options = task.lock_config
    slots = keys.slot_keys(groups.group_key(options.namespace, "exports"), 2)
    engine = engines.create_engine(database_url)
    locks = [
        AdvisoryLock(engine=engine, key=slots[0], label=task.name) for _ in range(2)
    ]
    try:
        for lock in locks:
            lock.slots = slots
            assert lock.acquire()
        first, second = _entry(cli_app, str(slots[0])), _entry(cli_app, str(slots[1]))
        assert ("group exports", "0/2", None, task.name) == (
            first["lock_name"],
            first["slot"],
            first["slot_of"],
            first["task"],
        )
        assert ("group exports", "1/2", str(slots[0])) == (
            second["lock_name"],
            second["slot"],
            second["slot_of"],
        )
    finally:
        for lock in locks:
            lock.release()
        sessions.close_for(engine)
        engine.dispose()


@pytest.mark.parametrize("scope", ["session", "transaction"])
def test_locks_held_is_how_long_the_lock_has_been_held(cli_app, database_url, scope):
    """HELD counts from the grant, though the lock watcher (and other locks) run
    statements on the holder's session meanwhile; a lock taken later on the same session,
    once the first is released, counts from its own grant."""
    engine = engines.create_engine(database_url)
    options = config.LockConfig(
        task_name="t", name="t", watch_interval=0.1, on_lost=config.OnLost.SIGNAL
    )
    first = AdvisoryLock(
        engine=engine, key=keys.make_key("cli", "held", 1), scope=scope, label="t"
    )
    later = AdvisoryLock(engine=engine, key=keys.make_key("cli", "held", 2), label="t")
    try:
        assert first.acquire()
        with lock_state.watcher_checks() as checks:
            loss_watcher.watch(first, lambda cause: None, options)
            assert _support.wait_until(
                lambda: time.monotonic() - first.acquired_at > 2.5, timeout=5
            )
            with AdvisoryLock(engine=engine, key=keys.make_key("cli", "held", 3)):
                pass  # a statement of another lock on the process session, just now
        assert checks() > 5  # the watcher checked meanwhile
        held = _entry(cli_app, str(first.key))["held_seconds"]
        assert 2.5 <= held < 4.5, held
        loss_watcher.unwatch(first)
        first.release()
        released_at = time.monotonic()
        assert _support.wait_until(
            lambda: time.monotonic() - released_at > 1.5, timeout=5
        )
        assert later.acquire()
        held = _entry(cli_app, str(later.key))["held_seconds"]
        assert 0 <= held < 1.5, held
    finally:
        loss_watcher.unwatch(first)
        for lock in (first, later):
            if lock.owned():
                lock.release()
        sessions.close_for(engine)
        engine.dispose()


def _wait_for(connection, key_id):
    with connection.cursor() as cursor:
        cursor.execute("SET lock_timeout = '20s'")
        cursor.execute("SELECT pg_advisory_lock(%s)", (key_id,))
        cursor.execute("SELECT pg_advisory_unlock(%s)", (key_id,))


def _entry(cli_app, key):
    entries = json.loads(run("--app", APP, "locks", "--json"))
    found = [entry for entry in entries if entry["key"] == key]
    return found[0] if found else None


def test_check_passes_on_a_direct_primary(cli_app, database_url):
    output = run("--database-url", database_url, "check")
    assert "FAIL" not in output
    assert "pooler        no pooler or proxy detected" in output


def test_check_fails_with_a_fix_on_a_wrong_url():
    url = f"postgresql+psycopg2://postgres:s3cret@127.0.0.1:{_support.free_port()}/x"
    output = run("--database-url", url, "check", expect=1)
    assert "FAIL  connectivity" in output
    assert "fix: check host, port" in output
    assert "s3cret" not in output


def test_check_fails_with_a_fix_on_too_few_connections(database_url):
    output = run(
        "--database-url", database_url, "check", "--processes", "100000", expect=1
    )
    assert "FAIL  capacity" in output
    assert "raise max_connections" in output


def test_check_fails_on_a_standby(private_postgres):
    """A streaming standby of a private PostgreSQL: refused, with the primary named as fix."""
    standby_dir = private_postgres._root / "standby"
    private_postgres._run(
        "pg_basebackup",
        "-D",
        str(standby_dir),
        "-R",
        "-X",
        "stream",
        "-h",
        "127.0.0.1",
        "-p",
        str(private_postgres.port),
        "-U",
        "postgres",
        timeout=60,
    )
    standby = EmbeddedPostgres(data_dir=standby_dir)
    try:
        standby.start(timeout=60)
        output = run("--database-url", standby.url(), "check", expect=1)
    finally:
        standby.cleanup()
    assert "FAIL  standby" in output
    assert "at the primary" in output


def test_celery_subcommand_uses_the_projects_app(cli_app, database_url):
    """`celery -A proj pglock key ...` is registered through celery.commands."""
    completed = subprocess.run(
        [
            sys.executable,
            "-m",
            "celery",
            "-A",
            APP,
            "pglock",
            "key",
            cli_app.settle.name,
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={**os.environ, "CELERY_PGLOCK_TEST_DATABASE_URL": database_url},
    )
    assert 0 == completed.returncode, completed.stderr
    assert str(cli_app.settle.lock_key_for()) == json.loads(completed.stdout)["key"]


@pytest.mark.pgbouncer
@pytest.mark.parametrize(
    ("pool_mode", "ignore", "status", "fragment"),
    [
        ("transaction", "", "FAIL  pooler", "lock_scope='transaction'"),
        ("transaction", "options", "FAIL  pooler", "lock_scope='transaction'"),
        ("statement", "options", "FAIL  pooler", "statement pooling"),
        ("statement", "", "FAIL  pooler", "statement pooling"),
        ("session", "options", "OK    pooler", "a proxy in session mode"),
        ("session", "", "OK    pooler", "a proxy in session mode"),
    ],
)
def test_check_through_pgbouncer(
    pgbouncer_factory, pool_mode, ignore, status, fragment
):
    """A real PgBouncer: transaction and statement pooling are refused for session-scope
    locks with the fix named; session pooling is accepted. The default keepalive
    options, which PgBouncer refuses unless told to ignore them, are no obstacle."""
    settings = {"ignore_startup_parameters": ignore} if ignore else {}
    bouncer = pgbouncer_factory(pool_mode, **settings)
    output = run(
        "--database-url",
        bouncer.url(),
        "check",
        expect=0 if status.startswith("OK") else 1,
    )
    assert status in output, output
    assert fragment in output, output


def test_python_dash_m_runs_the_standalone_command(database_url):
    """`python -m celery_pglock` is the standalone command, exit status included."""
    ok = subprocess.run(
        [
            sys.executable,
            "-m",
            "celery_pglock",
            "--database-url",
            database_url,
            "check",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert 0 == ok.returncode, ok.stdout + ok.stderr
    bad = subprocess.run(
        [sys.executable, "-m", "celery_pglock", "check"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={k: v for k, v in os.environ.items() if k != "CELERY_PGLOCK_DATABASE_URL"},
    )
    assert 1 == bad.returncode
    assert "CELERY_PGLOCK_DATABASE_URL" in bad.stdout


def test_sql_fencing_prints_and_applies_the_fencing_table(
    cli_app, database_url, schema
):
    """`pglock sql --fencing` prints the table, its sequence and the grants to give;
    --apply creates them (twice is harmless); --uninstall drops them."""
    printed = run("sql", "--fencing", "--schema", schema)
    assert "CREATE TABLE IF NOT EXISTS" in printed
    assert "CACHE 1" in printed
    assert "-- GRANT USAGE ON SEQUENCE" in printed
    for _ in range(2):
        assert "Created" in run(
            "--database-url",
            database_url,
            "sql",
            "--fencing",
            "--apply",
            "--schema",
            schema,
        )
    connection = _support.connect(database_url, application_name="cli fencing test")
    try:
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT to_regclass(%s) IS NOT NULL",
                (f'"{schema}".celery_pglock_fencing',),
            )
            assert (True,) == cursor.fetchone()
        assert "Dropped" in run(
            "--database-url",
            database_url,
            "sql",
            "--fencing",
            "--apply",
            "--uninstall",
            "--schema",
            schema,
        )
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT to_regclass(%s) IS NULL",
                (f'"{schema}".celery_pglock_fencing',),
            )
            assert (True,) == cursor.fetchone()
    finally:
        connection.close()


# -- release ----------------------------------------------------------------------------


def test_release_ends_the_holder_which_reports_lock_lost(
    database_url, broker_url, result_backend_url, namespace, lost_events
):
    """`release --key` shows the holder, ends its session, and the run that held the
    lock learns it from its watcher: lock_lost, and FAILURE with LockLostError."""
    app = make_app(
        database_url,
        broker_url,
        result_backend_url,
        namespace,
        pglock_watch_interval=0.2,
    )
    started = threading.Event()

    @app.task(base=SingletonTask, shared=False, lock_args=("tenant",))
    def stuck(tenant):
        started.set()
        wait_for(lambda: current_lock().lost, 15, "the loss to be detected")
        current_lock().ensure_held()

    results = []
    runner = threading.Thread(target=lambda: results.append(stuck.apply((7,))))
    runner.start()
    assert started.wait(15)
    key = stuck.lock_key_for(7)
    output = run("--database-url", database_url, "release", "--key", str(key), "--yes")
    runner.join(20)
    assert str(key) in output
    assert "held by:" in output
    assert f"PostgreSQL freed lock {key}" in output
    (result,) = results
    assert "FAILURE" == result.state
    assert isinstance(result.result, LockLostError)
    (event,) = lost_events
    assert key == event["key"]
    assert not AdvisoryLock(engine=engines.engine_for(app.conf), key=key).locked()


def test_release_by_task_and_arguments_asks_first(cli_app, database_url):
    """By task and arguments: the key the worker would lock; a 'no' leaves it held, a
    'yes' frees it; a key nobody holds and a malformed key are told apart."""
    engine = engines.create_engine(database_url)
    key = cli_app.export.lock_key_for(7, spec={"b": 1})
    lock = AdvisoryLock(engine=engine, key=key)
    assert lock.acquire()
    call = ("--app", APP, "release", "tests.integration.cli_app.export")
    call += ("--args", "[7]", "--kwargs", '{"spec": {"b": 1}}')
    result = CliRunner().invoke(cli.standalone_command, list(call), input="n\n")
    assert 1 == result.exit_code, result.output
    assert "task tests.integration.cli_app.export (backend" in result.output
    assert lock.locked()
    result = CliRunner().invoke(cli.standalone_command, list(call), input="y\n")
    assert 0 == result.exit_code, result.output
    assert not lock.locked()
    with pytest.raises(PgLockError):
        lock.release()  # its session was ended
    assert "No session holds" in run(*call, "--yes", expect=1)
    run("--app", APP, "release", "--key", "1,x", expect=2)
    assert "Name the lock" in run("--app", APP, "release", expect=2)
    sessions.close_for(engine)
    engine.dispose()


@pytest.mark.parametrize(
    ("scope", "count"),
    [("session", 1), ("transaction", 2)],
)
def test_check_counts_the_lock_connections_a_process_holds(database_url, scope, count):
    """What tests/acceptance/test_sessions.py measures in real workers: 1 connection
    per process for session scope (the watcher checks on the lock session), 2 for
    transaction scope (the body uses its lock's connection)."""
    output = run(
        "--database-url",
        database_url,
        "check",
        "--processes",
        "3",
        "--scope",
        scope,
    )
    assert (
        f"{3 * count} lock connection(s) needed at most (3 process(es), from "
        f"--processes, x {count}:" in (" ".join(output.split()))
    ), output


def celery_pglock(app, *args, database_url=None):
    """``celery -A app pglock ...`` in a subprocess: only the command imports the tasks."""
    env = {k: v for k, v in os.environ.items() if k != "CELERY_PGLOCK_DATABASE_URL"}
    if database_url:
        env["CELERY_PGLOCK_DATABASE_URL"] = database_url
    return subprocess.run(
        [sys.executable, "-m", "celery", "-A", app, "pglock", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env=env,
    )


LAYOUTS = "tests.integration.cli_layouts"


@pytest.mark.parametrize(
    ("app", "task", "kwargs"),
    [
        (f"{LAYOUTS}.include_app", "proj.tasks.export_tenant", {"tenant_id": 42}),
        (f"{LAYOUTS}.autodiscover_app", "billing.settle_invoices", {}),
    ],
    ids=["include", "autodiscover_tasks"],
)
def test_key_finds_tasks_the_worker_imports(app, task, kwargs):
    """Tasks a worker imports at start (Celery(include=...), app.autodiscover_tasks()) are
    SingletonTasks to `pglock key`, though `-A` imports only the app's module."""
    completed = celery_pglock(
        app, "key", task, "--kwargs", json.dumps(kwargs), "--json"
    )
    assert 0 == completed.returncode, completed.stdout + completed.stderr
    forms = json.loads(completed.stdout)
    assert task == forms["task"]
    if kwargs:
        assert '{"tenant_id":42}]' in forms["key_text"]


@pytest.mark.parametrize(
    ("app", "task"),
    [
        (f"{LAYOUTS}.include_app", "proj.tasks.export_tenant"),
        (f"{LAYOUTS}.autodiscover_app", "billing.settle_invoices"),
    ],
    ids=["include", "autodiscover_tasks"],
)
def test_check_counts_tasks_the_worker_imports(database_url, app, task):
    completed = celery_pglock(app, "check", database_url=database_url)
    assert 0 == completed.returncode, completed.stdout + completed.stderr
    assert "; 1 SingletonTask(s), scope session" in completed.stdout


def test_check_fails_on_an_app_without_singleton_tasks(database_url):
    """An app whose tasks are all plain locks nothing: a FAIL naming the fix, exit 1."""
    completed = celery_pglock(
        f"{LAYOUTS}.plain_app", "check", database_url=database_url
    )
    assert 1 == completed.returncode, completed.stdout + completed.stderr
    assert "FAIL  tasks" in completed.stdout
    assert "has no SingletonTask" in completed.stdout
    assert "base=SingletonTask" in completed.stdout
    assert "OK    connectivity" in completed.stdout  # the other checks still ran


def test_check_names_the_closest_option_for_a_typo(database_url):
    """A misspelt task option fails `check` with the valid name as the fix line."""
    output = run(
        "--app",
        f"{LAYOUTS}.typo_app:app",
        "--database-url",
        database_url,
        "check",
        expect=1,
    )
    assert "FAIL  configuration" in output
    assert "fix: rename 'lock_arg' to 'lock_args', the closest valid name" in output


def test_check_shows_each_busy_policy_a_task_runs_as_and_why(database_url):
    """Where a busy run does other than its lock_on_busy reads (lock_enqueue=
    'until_started' implies 'wait' and re-queues a wait that runs out; a direct call
    raises; lock_shadow runs the body), `check` says so per task, without failing."""
    output = run(
        "--app",
        f"{LAYOUTS}.busy_app:app",
        "--database-url",
        database_url,
        "check",
    )
    module = f"{LAYOUTS}.busy_app"
    lines = {  # this app's tasks (another app's shared tasks join every app)
        line.split(": ", 1)[0].split()[-1]: " ".join(line.split())
        for line in output.splitlines()
        if line.startswith(f"INFO  busy policy   {module}.")
    }
    assert {f"{module}.{name}" for name in ("follow_up", "retried", "shadowed")} == set(
        lines
    ), output
    follow_up = lines[f"{module}.follow_up"]
    assert (
        "lock_on_busy='skip' (the default) runs as 'wait' because "
        "lock_enqueue='until_started'" in follow_up
    )
    assert (
        "a 'wait' that runs out (lock_wait_timeout 10s) runs as 'retry' "
        "(lock_retry_delay 30s), not 'raise'" in follow_up
    )
    assert "a direct call" not in follow_up  # a direct call waits, as configured
    assert (
        "a direct call (task(...), not through a worker) runs 'retry' as 'raise' "
        "(no message to skip or re-queue)" in lines[f"{module}.retried"]
    )
    assert (
        "lock_on_busy='skip' is only reported: lock_shadow=True runs a busy run's "
        "body anyway" in lines[f"{module}.shadowed"]
    )
    assert "FAIL" not in output


@pytest.mark.parametrize(
    ("args", "conf", "processes", "source"),
    [
        (["--concurrency", "7"], None, 7, "from --processes"),
        ([], 5, 5, "from the app's worker_concurrency"),
        ([], None, os.cpu_count(), "from this host's CPU count"),
    ],
    ids=["--concurrency", "worker_concurrency", "cpu_count"],
)
def test_check_sizes_for_the_concurrency_it_names(
    cli_app, database_url, monkeypatch, args, conf, processes, source
):
    """capacity counts --processes (alias --concurrency), else the app's
    worker_concurrency, else this host's CPUs, and says which it used."""
    monkeypatch.setitem(cli_app.app.conf, "worker_concurrency", conf)
    output = " ".join(run("--app", APP, "check", *args).split())
    assert f"({processes} process(es), {source}" in output, output


def _documented_exit_statuses():
    """The exit statuses docs/operations/cli.md's table lists."""
    text = (Path(__file__).resolve().parents[3] / "docs/operations/cli.md").read_text()
    return sorted(int(status) for status in re.findall(r"(?m)^\| (\d+) \|", text))


def _unreachable():
    return f"postgresql+psycopg2://app:pw@127.0.0.1:{_support.free_port()}/x"


#: For each exit status, the calls that must end with it (database_url filled in).
EXIT_STATUSES = {
    0: [("--database-url", "{db}", "check"), ("--database-url", "{db}", "locks")],
    1: [
        ("--database-url", "{unreachable}", "check"),
        ("--database-url", "{unreachable}", "locks"),
        ("--database-url", "{unreachable}", "sql", "--apply"),
        ("--database-url", "{db}", "release", "--key", "4242,4242", "--yes"),  # free
    ],
    2: [
        ("release", "--yes"),  # neither a task nor a key
        ("--database-url", "{db}", "release", "--key", "1,2,3", "--yes"),
        ("key", "some.task"),  # no app
        ("--app", "no_such_module_xyz", "check"),
        ("sql", "--apply"),  # no database URL
        ("--app", APP, "key", "tests.integration.cli_app.export", "--args", "[7"),
        ("--no-such-option",),
    ],
}


@pytest.mark.parametrize("status", _documented_exit_statuses())
def test_each_documented_exit_status_is_what_the_command_returns(
    database_url, monkeypatch, status
):
    """Each status in cli.md's table is returned, by the calls its line describes; no
    status is documented without a test, nor tested without being documented."""
    assert sorted(EXIT_STATUSES) == _documented_exit_statuses()
    monkeypatch.delenv("CELERY_PGLOCK_DATABASE_URL", raising=False)
    for call in EXIT_STATUSES[status]:
        args = [a.format(db=database_url, unreachable=_unreachable()) for a in call]
        result = CliRunner().invoke(cli.standalone_command, args)
        assert status == result.exit_code, (args, result.output)


def test_release_by_key_ends_the_holding_session(cli_app, database_url):
    """`release --key`: shows the holder and every other key its session holds, ends
    that session (PostgreSQL frees both locks), and says who did it."""
    engine = engines.engine_for(cli_app.app.conf)
    first = AdvisoryLock(engine=engine, key=cli_app.settle.lock_key_for(), label="a")
    second = AdvisoryLock(engine=engine, key=cli_app.pinned.lock_key_for(), label="b")
    assert first.acquire()
    assert second.acquire()
    try:
        call = ["--app", APP, "release", "--key", str(first.key)]
        kept = CliRunner().invoke(cli.standalone_command, call, input="n\n")
        assert 1 == kept.exit_code, kept.output
        assert engines.process_tag() in kept.output
        assert f"also held:  {second.key}" in kept.output
        assert _entry(cli_app, str(first.key)) is not None  # declined: nothing done
        output = run(*call, "--yes")
        assert "Ended backend" in output
        assert f"as {getpass.getuser()}@" in output
        assert None is _entry(cli_app, str(first.key))
        assert None is _entry(cli_app, str(second.key))
    finally:
        for lock in (first, second):
            with contextlib.suppress(Exception):
                lock.release()
