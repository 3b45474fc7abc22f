"""Fencing tokens against a real PostgreSQL: strictly increasing per key, never reissued
after a rollback or a restart, refused when stale, and set up by (or for) a
least-privilege role.

Cross-process order on real workers: tests/acceptance/test_fencing.py.
"""

from __future__ import annotations

import threading
import time
import uuid

import psycopg2
import pytest
import sqlalchemy as sa
from celery import Celery

from celery_pglock import (
    AdvisoryLock,
    ConfigurationError,
    DatabaseError,
    LockLostError,
    LockScope,
    PgLockError,
    SingletonTask,
    current_lock,
    fencing,
    keys,
)
from celery_pglock.db import engines
from celery_pglock.lock import sessions
from tests.integration.task_support import close_app, define, hold


@pytest.fixture
def app(database_url, broker_url, result_backend_url, namespace):
    app = Celery(
        "fence", broker=broker_url, backend=result_backend_url, set_as_current=False
    )
    app.conf.pglock_database_url = database_url
    app.conf.pglock_namespace = namespace
    yield app
    close_app(app)


def take(engine, key, scope=LockScope.SESSION):
    lock = AdvisoryLock(engine=engine, key=key, scope=scope)
    assert lock.acquire()
    return lock, fencing.issue_token(lock)


@pytest.mark.parametrize("scope", [LockScope.SESSION, LockScope.TRANSACTION])
def test_tokens_strictly_increase_per_key_across_acquisitions(
    lock_engine, namespace, scope
):
    """Each acquisition of one key gets a token above every earlier one of that key."""
    key = keys.make_key(namespace, "fence", {"tenant": 1})
    tokens = []
    for _ in range(5):
        lock, token = take(lock_engine, key, scope)
        assert token == lock.fencing_token
        lock.release()
        tokens.append(token)
    assert sorted(set(tokens)) == tokens
    with lock_engine.connect() as connection:
        assert tokens[-1] == fencing.last_token(connection, lock)


def test_bigint_and_two_int_keys_with_the_same_bits_are_separate_rows(
    lock_engine, namespace
):
    """A bigint key and the two-int key of the same 64 bits are different locks in
    PostgreSQL (objsubid 1 and 2): they are different rows of the fencing table too."""
    high, low = 1_000_000 + uuid.uuid4().int % 1_000_000, 7
    wide = keys.explicit_key("wide", (high << 32) | low)
    pair = keys.explicit_key("pair", (high, low))
    assert wide.pg_locks_ids[:2] == pair.pg_locks_ids[:2]
    lock_wide, token_wide = take(lock_engine, wide)
    lock_pair, token_pair = take(lock_engine, pair)  # both held at once: not one lock
    lock_wide.release()
    lock_pair.release()
    with lock_engine.connect() as connection:
        assert token_wide == fencing.last_token(connection, lock_wide)
        assert token_pair == fencing.last_token(connection, lock_pair)


def test_a_rolled_back_transaction_scope_token_is_never_issued_again(
    lock_engine, namespace
):
    """Transaction scope: the row update rolls back with the run, the sequence does
    not, so the next holder's token is still greater than the rolled-back one."""
    key = keys.make_key(namespace, "fence-rollback")
    first, committed = take(lock_engine, key, LockScope.TRANSACTION)
    first.release()
    second, rolled_back = take(lock_engine, key, LockScope.TRANSACTION)
    second.release(commit=False)
    third, after = take(lock_engine, key, LockScope.TRANSACTION)
    third.release()
    assert committed < rolled_back < after
    with lock_engine.connect() as connection:
        assert after == fencing.last_token(connection, third)


@pytest.mark.parametrize("scope", [LockScope.SESSION, LockScope.TRANSACTION])
def test_a_cut_off_holders_token_is_never_issued_again_after_a_crash(
    private_postgres, scope
):
    """A private PostgreSQL crashes (immediate stop: no checkpoint) right after a holder
    got its token and before anything else committed. The holder's lock died with the
    server but its body may still write with its token, so the next holder's token
    must be greater. (Issued inside the lock's uncommitted transaction, the sequence
    step was lost with the WAL buffers and the same token was issued again.)"""
    url = f"postgresql+psycopg2://postgres@127.0.0.1:{private_postgres.port}/postgres"
    key = keys.make_key("restart", "fence")
    engine = engines.create_engine(url)
    before = []
    for _ in range(3):
        lock, token = take(engine, key, scope)
        lock.release()
        before.append(token)
    engine.dispose()
    # Recovery ends with a checkpoint, so the next nextval writes a fresh WAL record:
    # the one a crash can lose.
    private_postgres.crash()
    private_postgres.start()
    engine = engines.create_engine(url)
    _holder, held = take(engine, key, scope)
    private_postgres.crash()  # the holder's session dies; it never releases
    private_postgres.start()
    after_engine = engines.create_engine(url)
    try:
        lock, after = take(after_engine, key, scope)
        lock.release()
    finally:
        after_engine.dispose()
        engine.dispose()
    assert sorted(set(before)) == before
    assert max(before) < held < after


def test_the_table_is_created_on_first_use_by_racing_creators(database_url):
    """Two processes' first fenced acquisitions create the table once, without error."""
    import concurrent.futures

    schema = f"fence_{uuid.uuid4().hex[:8]}"
    admin = sa.create_engine(database_url, poolclass=sa.NullPool)
    with admin.begin() as connection:
        connection.exec_driver_sql(f"CREATE SCHEMA {schema}")
    options = {"connect_args": {"options": f"-c search_path={schema}"}}
    made = [
        engines.create_engine(database_url, {"pglock_engine_options": options})
        for _ in range(4)
    ]
    try:

        def first_use(index):
            key = keys.make_key(schema, "race", index)
            lock, token = take(made[index], key)
            lock.release()
            return token

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            tokens = list(pool.map(first_use, range(4)))
        assert 4 == len(set(tokens))
        with admin.connect() as connection:
            assert (
                4
                == connection.exec_driver_sql(
                    f"SELECT count(*) FROM {schema}.celery_pglock_fencing"
                ).scalar()
            )
    finally:
        for engine in made:
            engine.dispose()
        with admin.begin() as connection:
            connection.exec_driver_sql(f"DROP SCHEMA {schema} CASCADE")
        admin.dispose()


@pytest.fixture
def own_schema_engine(database_url):
    """A lock engine whose search_path is a fresh schema: a fencing table of its own."""
    schema = f"fence_{uuid.uuid4().hex[:8]}"
    admin = sa.create_engine(database_url, poolclass=sa.NullPool)
    with admin.begin() as connection:
        connection.exec_driver_sql(f"CREATE SCHEMA {schema}")
    options = {"connect_args": {"options": f"-c search_path={schema}"}}
    engine = engines.create_engine(database_url, {"pglock_engine_options": options})
    yield engine
    engine.dispose()
    with admin.begin() as connection:
        connection.exec_driver_sql(f"DROP SCHEMA {schema} CASCADE")
    admin.dispose()


def test_a_sequence_set_back_is_refused_and_the_lock_released(
    own_schema_engine, namespace
):
    """Someone sets the sequence back (setval): the next token would not be above the
    key's last one, so it is refused with the fix named, and the lock is given back."""
    key = keys.make_key(namespace, "fence-reset")
    lock, token = take(own_schema_engine, key)
    lock.release()
    with own_schema_engine.connect() as connection:  # the next nextval() gives `token`
        connection.exec_driver_sql(
            "SELECT setval('celery_pglock_fencing_token_seq', %s, false)", (token,)
        )
        connection.commit()
    lock = AdvisoryLock(engine=own_schema_engine, key=key)
    assert lock.acquire()
    with pytest.raises(DatabaseError, match="CACHE 1 and the sequence past max"):
        fencing.issue_token(lock)
    assert not lock.owned()
    assert not lock.locked()
    assert lock.fencing_token is None


def test_a_token_is_only_issued_to_the_holder(lock_engine, namespace):
    """issue_token() on a lock that is not held is an error, not a token."""
    lock = AdvisoryLock(engine=lock_engine, key=keys.make_key(namespace, "nope"))
    with pytest.raises(PgLockError, match="only issued to the holder"):
        fencing.issue_token(lock)


def test_a_task_sees_its_token_and_none_without_fencing(app):
    """current_lock().fencing_token: an int under lock_fencing=True, None otherwise."""
    seen = []

    def fenced():
        seen.append(current_lock().fencing_token)

    def plain():
        seen.append(current_lock().fencing_token)

    fenced_task = define(app, fenced, lock_fencing=True)
    plain_task = define(app, plain)
    fenced_task.apply().get()
    fenced_task.apply().get()
    plain_task.apply().get()
    assert isinstance(seen[0], int)
    assert seen[0] < seen[1]
    assert seen[2] is None


def test_app_wide_setting_turns_fencing_on(app):
    """app.conf.pglock_fencing = True applies to every SingletonTask without the option."""
    app.conf.pglock_fencing = True
    seen = []

    def body():
        seen.append(current_lock().fencing_token)

    define(app, body).apply().get()
    assert isinstance(seen[0], int)


def terminate(engine, pid, timeout=10.0):
    """End a backend and wait (bounded) until it is gone: pg_terminate_backend only
    signals it."""
    with engine.connect() as connection:
        connection.exec_driver_sql(
            # With a timeout (PostgreSQL >= 14) it waits for the backend to exit.
            "SELECT pg_terminate_backend(%s, %s)",
            (pid, int(timeout * 1000)),
        )
        gone = connection.exec_driver_sql(
            "SELECT NOT EXISTS (SELECT 1 FROM pg_stat_activity WHERE pid = %s)", (pid,)
        ).scalar()
        connection.commit()
    assert gone, f"backend {pid} still there after {timeout}s"


# -- the downstream guard --------------------------------------------------------------


@pytest.fixture
def reports(lock_engine, namespace):
    name = f"reports_{namespace.replace('-', '_')}"
    with lock_engine.begin() as connection:
        connection.exec_driver_sql(
            f"CREATE TABLE {name} (tenant int PRIMARY KEY, body text, fencing_token bigint)"
        )
    yield name
    with lock_engine.begin() as connection:
        connection.exec_driver_sql(f"DROP TABLE {name}")


@pytest.mark.parametrize("write", [fencing.fenced_update, fencing.fenced_upsert])
def test_the_guard_refuses_a_paused_holders_late_write(
    lock_engine, namespace, reports, write, database_url, session_mode
):
    """Run A gets a token and pauses; its lock ends (its session is terminated), run B
    (another process: an engine of its own) gets a newer token and writes; A's late
    write with its older token is refused."""
    other_process = engines.create_engine(database_url)
    with lock_engine.begin() as connection:
        connection.exec_driver_sql(f"INSERT INTO {reports} VALUES (7, 'none', NULL)")
    key = keys.make_key(namespace, "fence-guard")
    run_a, token_a = take(lock_engine, key)
    # A "pauses"; the server ends its session (as after a partition or a restart).
    pid = run_a.backend_pid
    terminate(lock_engine, pid)
    run_b, token_b = take(other_process, key)
    assert token_a < token_b
    with lock_engine.begin() as connection:
        assert write(
            connection, reports, key={"tenant": 7}, values={"body": "B"}, token=token_b
        )
    run_b.release()
    with lock_engine.begin() as connection:  # A wakes up and writes
        assert not write(
            connection, reports, key={"tenant": 7}, values={"body": "A"}, token=token_a
        )
    with pytest.raises(PgLockError):
        run_a.release()  # its session is gone: the release says so
    with lock_engine.begin() as connection:  # the same holder may write again
        assert write(
            connection, reports, key={"tenant": 7}, values={"body": "B2"}, token=token_b
        )
        assert ("B2", token_b) == tuple(
            connection.exec_driver_sql(
                f"SELECT body, fencing_token FROM {reports} WHERE tenant = 7"
            ).one()
        )
    sessions.close_for(other_process)
    other_process.dispose()


def hold_outside(engine, key):
    """A session outside the library holding ``key`` (session level); returns it open."""
    connection = engine.raw_connection()
    connection.dbapi_connection.autocommit = True
    with connection.dbapi_connection.cursor() as cursor:
        cursor.execute("SELECT pg_advisory_lock(%s)", key.ids)
    return connection


def wait_for_waiter(engine, key, timeout=10.0):
    """The backend pid waiting (not granted) for ``key``, once there is one."""
    deadline = time.monotonic() + timeout
    with engine.connect() as connection:
        while time.monotonic() < deadline:
            pid = connection.exec_driver_sql(
                "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND NOT granted "
                "AND classid = %s::oid AND objid = %s::oid AND objsubid = %s::smallint",
                key.pg_locks_ids,
            ).scalar()
            connection.rollback()
            if pid is not None:
                return pid
            time.sleep(0.02)
    raise AssertionError(f"nobody waited for {key} within {timeout}s")


@pytest.mark.parametrize("scope", [LockScope.SESSION, LockScope.TRANSACTION])
@pytest.mark.parametrize("path", ["try", "wait"])
def test_a_run_that_lost_its_lock_after_the_grant_gets_no_token(
    lock_engine, namespace, reports, database_url, session_mode, scope, path
):
    """Issue 20's sequence: run A is granted the key (at once, or after waiting for a
    session outside the library), then stalls before its token; its session is ended and
    run B takes the key, gets a token and writes. When A goes on, it gets no token
    (LockLostError, lock released): B's write stands, and B keeps writing."""
    other_process = engines.create_engine(database_url)
    with lock_engine.begin() as connection:
        connection.exec_driver_sql(f"INSERT INTO {reports} VALUES (7, 'none', NULL)")
    key = keys.make_key(namespace, f"fence-lost-{path}-{scope.value}")
    # A token issued before on A's session: A's session is then named from a cache, and
    # only the issue's own check in pg_locks can tell that it no longer holds the key.
    warm, _ = take(lock_engine, keys.make_key(namespace, "fence-warm-up"))
    warm.release()
    run_a = AdvisoryLock(engine=lock_engine, key=key, scope=scope)
    if path == "try":
        assert run_a.acquire()
    else:
        outside = hold_outside(lock_engine, key)
        granted: list[bool] = []
        waiter = threading.Thread(
            target=lambda: granted.append(run_a.acquire(timeout=30))
        )
        waiter.start()
        wait_for_waiter(lock_engine, key)
        with outside.dbapi_connection.cursor() as cursor:
            cursor.execute("SELECT pg_advisory_unlock(%s)", key.ids)
        outside.close()
        waiter.join(30)
        assert [True] == granted
    # A stalls here (a pause, SIGSTOP, GC); the server ends its session meanwhile.
    terminate(lock_engine, run_a.backend_pid)
    run_b, token_b = take(other_process, key, scope)
    with lock_engine.begin() as connection:
        assert fencing.fenced_update(
            connection, reports, key={"tenant": 7}, values={"body": "B"}, token=token_b
        )
    with pytest.raises(LockLostError, match="no token was issued"):
        fencing.issue_token(run_a)  # A goes on: its token would be the newest
    assert run_a.fencing_token is None
    assert not run_a.owned()
    assert run_a.lost
    with lock_engine.begin() as connection:  # the real holder still writes
        assert fencing.fenced_update(
            connection, reports, key={"tenant": 7}, values={"body": "B2"}, token=token_b
        )
    run_b.release()
    run_c, token_c = take(other_process, key, scope)  # and tokens go on rising
    assert token_b < token_c
    run_c.release()
    sessions.close_for(other_process)
    other_process.dispose()


def test_shadow_mode_applies_a_would_be_skips_writes_unfenced(app, reports):
    """lock_fencing=True under shadow mode: the run that gets the lock gets a token; a
    would-be skip runs its body without one (fencing_token None), and the fenced helpers
    apply its writes as they would without the library, leaving the stored token as it
    was, instead of failing the body."""
    with engines.engine_for(app.conf).begin() as connection:
        connection.exec_driver_sql(f"INSERT INTO {reports} VALUES (1, 'none', NULL)")
    seen = []

    def shadowed(tenant, body):
        token = current_lock().fencing_token
        with engines.engine_for(app.conf).begin() as connection:
            applied = (
                fencing.fenced_update(
                    connection,
                    reports,
                    key={"tenant": tenant},
                    values={"body": body},
                    token=token,
                ),
                fencing.fenced_upsert(
                    connection,
                    reports,
                    key={"tenant": tenant + 1},
                    values={"body": body},
                    token=token,
                ),
            )
        seen.append((token, applied))

    task = define(
        app, shadowed, lock_args=("tenant",), lock_fencing=True, lock_shadow=True
    )
    task.apply((1, "holder")).get()
    held = hold(task, 1, "x")  # a running duplicate holds the key
    try:
        task.apply((1, "shadow")).get()
    finally:
        held.release()
    (holder_token, holder_applied), (shadow_token, shadow_applied) = seen
    assert isinstance(holder_token, int)
    assert (True, True) == holder_applied
    assert shadow_token is None
    assert (True, True) == shadow_applied
    with engines.engine_for(app.conf).connect() as connection:
        rows = connection.exec_driver_sql(
            f"SELECT tenant, body, fencing_token FROM {reports} ORDER BY tenant"
        ).all()
    assert [(1, "shadow", holder_token), (2, "shadow", holder_token)] == [
        tuple(row) for row in rows
    ]


def test_token_none_is_refused_outside_a_shadowed_body(app, reports):
    """token=None is a shadowed body's only: outside any run, and in a locked run called
    from a shadowed body (which fences its own writes), the write is refused loudly."""
    says = "token=None: this run has no fencing token"
    with (
        engines.engine_for(app.conf).begin() as connection,
        pytest.raises(ConfigurationError, match=says),
    ):
        fencing.fenced_update(
            connection, reports, key={"tenant": 1}, values={"body": "x"}, token=None
        )
    refused = []

    def inner(tenant):
        with engines.engine_for(app.conf).begin() as connection:
            try:
                fencing.fenced_update(
                    connection,
                    reports,
                    key={"tenant": tenant},
                    values={"body": "inner"},
                    token=current_lock().fencing_token,
                )
            except ConfigurationError as error:
                refused.append(str(error))

    inner_task = define(app, inner, lock_args=("tenant",))

    def outer(tenant):
        inner_task(tenant + 100)

    outer_task = define(app, outer, lock_args=("tenant",), lock_shadow=True)
    held = hold(outer_task, 1)  # the outer run is shadowed: its key is held
    try:
        outer_task.apply((1,)).get()
    finally:
        held.release()
    assert len(refused) == 1
    assert says in refused[0]

    def quiet(tenant):
        return tenant

    quiet_task = define(app, quiet, lock_args=("tenant",), lock_shadow=True)
    held = hold(quiet_task, 2)
    try:
        quiet_task.apply((2,)).get()  # shadowed, calling nothing
    finally:
        held.release()
    with (  # the shadowed run has ended: outside any run again
        engines.engine_for(app.conf).begin() as connection,
        pytest.raises(ConfigurationError, match=says),
    ):
        fencing.fenced_update(
            connection, reports, key={"tenant": 1}, values={"body": "x"}, token=None
        )


def test_upsert_inserts_a_missing_row_and_update_reports_it(lock_engine, reports):
    """fenced_upsert creates the row; fenced_update on a missing row applies nothing."""
    with lock_engine.begin() as connection:
        assert not fencing.fenced_update(
            connection, reports, key={"tenant": 1}, values={"body": "x"}, token=3
        )
        assert fencing.fenced_upsert(
            connection, reports, key={"tenant": 1}, values={"body": "x"}, token=3
        )
        assert fencing.fenced_update(
            connection, reports, key={"tenant": 1}, values={}, token=4
        )
        assert (4,) == tuple(
            connection.exec_driver_sql(
                f"SELECT fencing_token FROM {reports} WHERE tenant = 1"
            ).one()
        )


@pytest.mark.parametrize(
    ("table", "key", "values", "token", "says"),
    [
        ("reports; DROP TABLE x", {"tenant": 1}, {}, 1, "plain SQL identifier"),
        ("a.b.c", {"tenant": 1}, {}, 1, "'schema.name'"),
        ("reports", {'tenant" = 1 --': 1}, {}, 1, "plain SQL identifier"),
        ("reports", {}, {"body": "x"}, 1, "at least one column"),
        ("reports", {"tenant": 1}, {"tenant": 2}, 1, "both key and values"),
        ("reports", {"tenant": 1}, {}, None, "lock_fencing=True"),
        ("reports", {"tenant": 1}, {}, "5", "must be an int"),
    ],
)
def test_the_guard_refuses_bad_input_before_any_sql(
    lock_engine, table, key, values, token, says
):
    """Identifiers are validated, never spliced as given; a missing token is named."""
    with (
        lock_engine.connect() as connection,
        pytest.raises(ConfigurationError, match=says),
    ):
        fencing.fenced_update(connection, table, key=key, values=values, token=token)


# -- least privilege -------------------------------------------------------------------


@pytest.fixture
def lp_role(database_url):
    """A LOGIN role with CONNECT and USAGE (not CREATE) on a schema of its own search_path."""
    role = f"pglock_fence_{uuid.uuid4().hex[:8]}"
    schema = f"fence_lp_{uuid.uuid4().hex[:8]}"
    admin = sa.make_url(database_url)
    conn = psycopg2.connect(
        host=admin.host,
        port=admin.port or 5432,
        user=admin.username,
        password=admin.password,
        dbname=admin.database,
    )
    conn.autocommit = True
    with conn.cursor() as cursor:
        cursor.execute(f'CREATE ROLE "{role}" LOGIN')
        cursor.execute(f'GRANT CONNECT ON DATABASE "{admin.database}" TO "{role}"')
        cursor.execute(f'CREATE SCHEMA "{schema}"')
        cursor.execute(f'GRANT USAGE ON SCHEMA "{schema}" TO "{role}"')
        cursor.execute(f'ALTER ROLE "{role}" SET search_path = "{schema}"')
    url = admin.set(username=role).render_as_string(hide_password=False)
    try:
        yield url, role, schema, conn
    finally:
        engines.dispose_all()
        with conn.cursor() as cursor:
            cursor.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = %s",
                (role,),
            )
            cursor.execute(f'DROP SCHEMA "{schema}" CASCADE')
            cursor.execute(f'DROP OWNED BY "{role}"')
            cursor.execute(f'DROP ROLE "{role}"')
        conn.close()


def test_a_role_without_create_is_told_the_fix_then_works_after_the_grant(
    lp_role, broker_url, result_backend_url, namespace
):
    """No table and no CREATE: the run fails (never runs unfenced) naming `pglock sql
    --fencing --apply` and the grants; after the owner applies exactly that, it runs."""
    url, role, schema, admin = lp_role
    app = Celery(
        "lp", broker=broker_url, backend=result_backend_url, set_as_current=False
    )
    app.conf.pglock_database_url = url
    app.conf.pglock_namespace = namespace
    ran = []

    @app.task(base=SingletonTask, name="lp.fenced", lock_fencing=True, shared=False)
    def fenced():
        ran.append(current_lock().fencing_token)

    app.finalize(auto=True)
    try:
        result = app.tasks["lp.fenced"].apply()
        assert "FAILURE" == result.state
        assert isinstance(result.result, DatabaseError)
        assert "pglock sql --fencing --apply" in str(result.result)
        assert "GRANT" not in str(result.result) or "USAGE" in str(result.result)
        assert [] == ran
        with admin.cursor() as cursor:  # the owner creates it; the grant is missing
            cursor.execute(fencing.create_sql(schema))
        result = app.tasks["lp.fenced"].apply()
        assert "FAILURE" == result.state
        assert "is not writable by this role" in str(result.result)
        assert [] == ran
        with admin.cursor() as cursor:
            cursor.execute(fencing.grant_sql(role, schema))
        assert None is app.tasks["lp.fenced"].apply().get()
        assert 1 == len(ran)
        assert isinstance(ran[0], int)
    finally:
        app.close()
