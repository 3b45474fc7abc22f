"""The Celery app the benchmark's workers run: one contender per worker.

``BENCH_CONTENDER`` picks which tasks a worker registers, so that each contender runs
in a worker carrying only its own library (a plain worker never imports celery_pglock,
a celery-once worker never imports celery-singleton):

- ``plain``: ``bench.plain(key, body)``, a plain Celery task: the baseline; and
  ``bench.plain_round_trips``, the same with a blocking ``SELECT 1`` before and after
  the body (psycopg2, no celery_pglock): the floor of any lock that is taken before the
  body and whose release is awaited, as SingletonTask's is. ``bench.plain_row_writes``
  and ``bench.plain_period_write`` are the floors of issue 18's designs: the rows that
  ``lock_enqueue`` and ``lock_period`` write, sent by hand (see below).
- ``pglock``: ``bench.session`` and ``bench.transaction``, SingletonTask with
  ``lock_args=("key",)`` in session and transaction scope; ``bench.until_finished`` and
  ``bench.until_started``, the session task with ``lock_enqueue`` (the producer checks
  the key's queued row in ``apply_async``, as the peers lock there).
- ``once``: ``bench.once``, celery-once's ``QueueOnce`` keyed on ``key`` (graceful).
- ``singleton``: ``bench.singleton``, celery-singleton's ``Singleton`` keyed on ``key``.
- ``all`` (the benchmark process itself): everything, so it can publish through each
  peer's ``apply_async`` (both peers lock when a message is *published*).

Every body sleeps ``body`` seconds (0: a trivial body) and returns. Results are ignored,
so the result backend is not what is measured.

Measurement hooks: ``task_prerun``/``task_postrun`` write one 24-byte record per task
(start, end, outcome) to a per-process file in ``BENCH_RECORD_DIR``; the same few
microseconds for every contender, and outside ``SingletonTask.__call__``, so acquire and
release are inside the measured interval. Each task process warms up (opens its lock
session or Redis connection) and then writes ``<pid>.warm`` there before the benchmark
publishes anything. Per-task INFO logs are silenced (they cost more than any lock).
"""

from __future__ import annotations

import json
import logging
import os
import struct
import threading
import time
import uuid
from typing import Any

from celery import Celery, signals

CONTENDER_ENV = "BENCH_CONTENDER"
BROKER_URL_ENV = "BENCH_BROKER_URL"
DATABASE_URL_ENV = "BENCH_DATABASE_URL"
NAMESPACE_ENV = "BENCH_NAMESPACE"
RECORD_DIR_ENV = "BENCH_RECORD_DIR"
POOL_ENV = "BENCH_POOL"
SESSION_MODE_ENV = "BENCH_SESSION_MODE"
#: Run each prefork child under cProfile and dump its stats there when it exits.
PROFILE_DIR_ENV = "BENCH_PROFILE_DIR"

#: (start ns, end ns, outcome) per task; time.monotonic_ns is system-wide on Linux.
RECORD = struct.Struct("<qqq")
RAN, SKIPPED, OTHER = 0, 1, 2
WARM_SUFFIX = ".warm"
#: application_name prefix of the benchmark's lock sessions.
APPLICATION_NAME = "pglock-bench"

PLAIN = "bench.plain"
PLAIN_ROUND_TRIPS = "bench.plain_round_trips"
PLAIN_ROW_WRITES = "bench.plain_row_writes"
PLAIN_UNLOGGED_ROW_WRITES = "bench.plain_unlogged_row_writes"
PLAIN_PERIOD_WRITE = "bench.plain_period_write"
PLAIN_GROUP_SLOT = "bench.plain_group_slot"
PLAIN_LATEST_ROW = "bench.plain_latest_row"
PLAIN_DEBOUNCED_ROW = "bench.plain_debounced_row"
SESSION = "bench.session"
#: SingletonTask session with lock_skip_result="success": a skip ends like a run.
SKIP_SUCCESS = "bench.session_skip_success"
TRANSACTION = "bench.transaction"
UNTIL_FINISHED = "bench.until_finished"
UNTIL_STARTED = "bench.until_started"
LATEST = "bench.latest"  #: until_started with lock_enqueue_on_duplicate="replace"
DEBOUNCED = "bench.debounced"  #: LATEST with lock_debounce=DEBOUNCE
DEBOUNCE = 0.1  #: Seconds: short, so that a drain's end to end is mostly work.
LIMIT = "bench.limit"
PERIOD = "bench.period"
RATE = "bench.rate"
GROUP = "bench.group"
#: SingletonTask session in a worker whose app keeps pglock_history.
HISTORY = "pglock-history"
ONCE = "bench.once"
SINGLETON = "bench.singleton"

#: A measurement only, never a library mode: SingletonTask with its release sent but its
#: reply read only before the session's next statement (see _unawaited_release below).
UNAWAITED = "pglock-unawaited"
#: SingletonTask from the checkout on BENCH_BASELINE (compare.py --baseline).
BASELINE = "pglock-baseline"
contender = os.environ.get(CONTENDER_ENV, "all")
_broker_url = os.environ.get(BROKER_URL_ENV, "memory://")

app = Celery("bench", broker=_broker_url)
app.conf.update(
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=False,
    task_ignore_result=True,
    result_backend=None,
    # Peers lock in Redis, on the broker's server and database.
    ONCE={
        "backend": "celery_once.backends.Redis",
        "settings": {"url": _broker_url, "default_timeout": 600},
    },
    singleton_backend_url=_broker_url,
    singleton_key_prefix="bench-singleton-",
)


def _body(body: float) -> None:
    if body:
        time.sleep(body)


@app.task(name=PLAIN)
def plain(key: str, body: float = 0.0) -> None:
    _body(body)


_raw: dict[int, Any] = {}  # pid -> psycopg2 connection (never shared by a fork)

#: The floors' tables: the rows lock_enqueue and lock_period write, keyed by the key text.
#: Locked: prefork children warm up at once, and IF NOT EXISTS races itself.
_FLOOR_TABLES = """
BEGIN;
SELECT pg_advisory_xact_lock(hashtext('celery_pglock bench floors'));
CREATE TABLE IF NOT EXISTS bench_floor_queued (k text PRIMARY KEY, task_id text NOT NULL,
  started_at timestamptz);
CREATE UNLOGGED TABLE IF NOT EXISTS bench_floor_queued_unlogged (k text PRIMARY KEY,
  task_id text NOT NULL, started_at timestamptz);
CREATE TABLE IF NOT EXISTS bench_floor_periods (k text PRIMARY KEY,
  started_at timestamptz NOT NULL, task_id text);
CREATE UNLOGGED TABLE IF NOT EXISTS bench_floor_latest (k text PRIMARY KEY,
  task_id text NOT NULL, payload bytea NOT NULL, carrier text);
ALTER TABLE bench_floor_latest ADD COLUMN IF NOT EXISTS due_at timestamptz;
COMMIT;
"""


def raw_connection() -> Any:
    """This process's psycopg2 connection (autocommit), named like a lock session so that
    the benchmark reads its backend's CPU as a worker's (or the producer's) lock CPU."""
    import socket

    import psycopg2

    connection = _raw.get(os.getpid())
    if connection is None:
        # A worker is told by its environment; the benchmark process configured the app.
        url = str(
            os.environ.get(DATABASE_URL_ENV) or app.conf.get("pglock_database_url")
        )
        connection = psycopg2.connect(
            url.replace("postgresql+psycopg2://", "postgresql://", 1),
            application_name=f"{APPLICATION_NAME} {socket.gethostname()}:{os.getpid()}",
        )
        connection.autocommit = True
        with connection.cursor() as cursor:
            cursor.execute(_FLOOR_TABLES)
            for name, (types, text) in _FLOOR_STATEMENTS.items():
                cursor.execute(f"PREPARE {name}({types}) AS {text}")
        _raw[os.getpid()] = connection
    return connection


def forget_floor_rows(keys: str) -> None:
    """Delete the floors' rows whose key is LIKE ``keys``, and close this connection."""
    connection = raw_connection()
    try:
        with connection.cursor() as cursor:
            for table in (*QUEUED_FLOOR_TABLES.values(), "bench_floor_periods"):
                cursor.execute(f"DELETE FROM {table} WHERE k LIKE %s", (keys,))
            # Its keys are the workloads' own ("hot", "t7"): a row a killed run left
            # would swallow every later send of its key.
            cursor.execute("DELETE FROM bench_floor_latest")
    finally:
        connection.close()
        _raw.pop(os.getpid(), None)


@app.task(name=PLAIN_ROUND_TRIPS)
def plain_round_trips(key: str, body: float = 0.0) -> None:
    """A plain task plus a blocking ``SELECT 1`` before and after its body."""
    with raw_connection().cursor() as cursor:
        cursor.execute("SELECT 1")
        cursor.fetchone()
        _body(body)
        cursor.execute("SELECT 1")
        cursor.fetchone()


# The floors of issue 18's designs: the rows they prescribe, written by hand in the
# round trips the design allows and nothing else (no celery_pglock, no claim logic, no
# checks). What any implementation of that design pays at least, measured beside it.
# Queued rows commit asynchronously, as celery_pglock's do; period starts synchronously.
# Prepared once per connection, as the library prepares its statements (issue 35: the
# floor of the design shipped; an unprepared statement costs PostgreSQL ~60 % more).
_ASYNC = "s AS MATERIALIZED (SELECT set_config('synchronous_commit', 'off', true))"
#: The queued row's floor task -> its table: WAL-logged, and UNLOGGED (issue 35: no WAL
#: for the row; a crash or a failover empties the table).
QUEUED_FLOOR_TABLES = {
    PLAIN_ROW_WRITES: "bench_floor_queued",
    PLAIN_UNLOGGED_ROW_WRITES: "bench_floor_queued_unlogged",
}
#: name -> (parameter types, text); sent as ``EXECUTE name(%s, ...)``.
_FLOOR_STATEMENTS = {
    "floor_start": ("text", "SELECT pg_try_advisory_lock(hashtext($1))"),
    **{
        f"floor_end_{table}": (
            "text",
            f"WITH d AS (DELETE FROM {table} WHERE k = $1 RETURNING 1), {_ASYNC} "
            "SELECT pg_advisory_unlock(hashtext($1)) FROM s",
        )
        for table in QUEUED_FLOOR_TABLES.values()
    },
    **{
        f"floor_publish_{table}": (
            "text, text",
            f"WITH i AS (INSERT INTO {table} (k, task_id) VALUES ($1, $2) "
            f"ON CONFLICT DO NOTHING RETURNING task_id), {_ASYNC} "
            "SELECT task_id FROM i, s",
        )
        for table in QUEUED_FLOOR_TABLES.values()
    },
    # lock_group's floor: the key and a group slot taken in one statement, both released
    # in one (the design issue 34 asks for; the library sends two more round trips).
    "floor_group_start": (
        "text",
        "SELECT pg_try_advisory_lock(hashtext($1)), pg_try_advisory_lock(hashtext('g'))",
    ),
    "floor_group_end": (
        "text",
        "SELECT pg_advisory_unlock(hashtext($1)), pg_advisory_unlock(hashtext('g'))",
    ),
    # Latest wins' floor (issue 34), the design shipped: a send is one upsert (a new row
    # publishes; a replacing send writes its arguments into the row and names the queued
    # message as their carrier); a run is one statement that either hands the row over
    # (a carrier: the latest send goes out as its own message) or waits for the key and
    # deletes its own row (until_started); the unlock ends it. Debounce's floor is the
    # same with a due time ($4: the quiet time, NULL for none) that each send pushes and
    # that a hand-over's publish waits for.
    "floor_latest_publish": (
        "text, text, bytea, float8",
        "WITH u AS (INSERT INTO bench_floor_latest AS q (k, task_id, payload, due_at) "
        "VALUES ($1, $2, $3, now() + make_interval(secs => $4)) ON CONFLICT (k) DO "
        "UPDATE SET task_id = EXCLUDED.task_id, payload = EXCLUDED.payload, "
        "carrier = coalesce(q.carrier, q.task_id), due_at = EXCLUDED.due_at "
        f"RETURNING q.carrier IS NULL AS new), {_ASYNC} SELECT new FROM u, s",
    ),
    "floor_latest_start": (
        "text, text",
        "WITH h AS (UPDATE bench_floor_latest q SET carrier = NULL "
        "WHERE q.k = $1 AND q.carrier = $2 RETURNING q.task_id, q.payload, "
        "greatest(0, extract(epoch FROM q.due_at - now()))::float8 AS wait), "
        "l AS MATERIALIZED (SELECT pg_advisory_lock(hashtext($1)) "
        "WHERE NOT EXISTS (SELECT 1 FROM h)), "
        "d AS (DELETE FROM bench_floor_latest q WHERE EXISTS (SELECT 1 FROM l) "
        "AND q.k = $1 AND q.task_id = $2 AND q.carrier IS NULL RETURNING 1), "
        f"{_ASYNC} SELECT h.task_id, h.payload, h.wait FROM s LEFT JOIN h ON true",
    ),
    "floor_unlock": ("text", "SELECT pg_advisory_unlock(hashtext($1))"),
    "floor_period": (
        "text, text",
        "INSERT INTO bench_floor_periods (k, started_at, task_id) VALUES ($1, now(), $2) "
        "ON CONFLICT (k) DO UPDATE SET started_at = EXCLUDED.started_at, "
        "task_id = EXCLUDED.task_id "
        "WHERE bench_floor_periods.started_at <= EXCLUDED.started_at - interval '1 hour' "
        "RETURNING 1",
    ),
}


def _floor(cursor: Any, name: str, *params: Any) -> Any:
    """Execute the prepared floor statement ``name``; its first row."""
    cursor.execute(f"EXECUTE {name}({', '.join(['%s'] * len(params))})", params)
    return cursor.fetchone()


class _PublishesARow(app.Task):  # type: ignore[name-defined, misc]
    """Takes the key's queued row at publish (one round trip), as lock_enqueue does."""

    def apply_async(self, args: Any = None, kwargs: Any = None, **options: Any) -> Any:
        task_id = options.setdefault("task_id", str(uuid.uuid4()))
        publish = f"floor_publish_{QUEUED_FLOOR_TABLES[self.name]}"
        with raw_connection().cursor() as cursor:
            if _floor(cursor, publish, args[0], task_id) is None:
                return None  # the key is queued: dropped at publish
        return super().apply_async(args, kwargs, **options)


def _row_writes(table: str, key: str, body: float) -> None:
    """lock_enqueue's floor: a row inserted at publish, a try-lock before the body, the row
    deleted by the statement that unlocks after it. Two writes, the fewest the design of
    issue 18 allows ("removed in the same round trip that takes or releases the run lock")."""
    with raw_connection().cursor() as cursor:
        _floor(cursor, "floor_start", key)
        _body(body)
        _floor(cursor, f"floor_end_{table}", key)


@app.task(name=PLAIN_ROW_WRITES, base=_PublishesARow)
def plain_row_writes(key: str, body: float = 0.0) -> None:
    _row_writes(QUEUED_FLOOR_TABLES[PLAIN_ROW_WRITES], key, body)


@app.task(name=PLAIN_UNLOGGED_ROW_WRITES, base=_PublishesARow)
def plain_unlogged_row_writes(key: str, body: float = 0.0) -> None:
    _row_writes(QUEUED_FLOOR_TABLES[PLAIN_UNLOGGED_ROW_WRITES], key, body)


#: Keys a latest-wins floor send replaced into their row (compare.py: each key's carrier
#: publishes one more message).
FLOOR_REPLACED: list[str] = []


class _PublishesLatest(app.Task):  # type: ignore[name-defined, misc]
    """Writes the send into its key's row (one round trip), as latest wins does."""

    #: Debounce's quiet time (s): the first send's countdown, and each send's push.
    quiet: float | None = None

    def apply_async(self, args: Any = None, kwargs: Any = None, **options: Any) -> Any:
        task_id = options.setdefault("task_id", str(uuid.uuid4()))
        payload = json.dumps([list(args or ()), kwargs or {}]).encode()
        with raw_connection().cursor() as cursor:
            publish = "floor_latest_publish"
            if not _floor(cursor, publish, args[0], task_id, payload, self.quiet)[0]:
                FLOOR_REPLACED.append(args[0])
                return None  # written into the key's row: published by its carrier
        return super().apply_async(args, kwargs, countdown=self.quiet, **options)


def _latest_row(task: Any, key: str, body: float) -> None:
    with raw_connection().cursor() as cursor:
        latest, payload, wait = _floor(
            cursor, "floor_latest_start", key, task.request.id
        )
        if latest is not None:  # a carrier: its key's latest send goes out as its own
            args, kwargs = json.loads(bytes(payload))
            queue: str = (task.request.delivery_info or {})["routing_key"]
            due = {"countdown": wait} if wait else {}  # debounce: when the row is due
            app.Task.apply_async(task, args, kwargs, task_id=latest, queue=queue, **due)
            return
        _body(body)
        _floor(cursor, "floor_unlock", key)


@app.task(name=PLAIN_LATEST_ROW, base=_PublishesLatest, bind=True)
def plain_latest_row(self: Any, key: str, body: float = 0.0) -> None:
    _latest_row(self, key, body)


@app.task(name=PLAIN_DEBOUNCED_ROW, base=_PublishesLatest, bind=True, quiet=DEBOUNCE)
def plain_debounced_row(self: Any, key: str, body: float = 0.0) -> None:
    _latest_row(self, key, body)


@app.task(name=PLAIN_GROUP_SLOT)
def plain_group_slot(key: str, body: float = 0.0) -> None:
    """lock_group's floor: the key and one group slot in the lock's two round trips."""
    with raw_connection().cursor() as cursor:
        _floor(cursor, "floor_group_start", key)
        _body(body)
        _floor(cursor, "floor_group_end", key)


@app.task(name=PLAIN_PERIOD_WRITE)
def plain_period_write(key: str, body: float = 0.0) -> None:
    """lock_period's floor: plain + 2 round trips plus the period's row, written durably
    in a statement of its own."""
    with raw_connection().cursor() as cursor:
        cursor.execute("SELECT 1")
        cursor.fetchone()
        _floor(cursor, "floor_period", key, key)
        _body(body)
        cursor.execute("SELECT 1")
        cursor.fetchone()


if contender in ("pglock", UNAWAITED, BASELINE, HISTORY, "all"):
    from celery_pglock import SingletonTask

    if contender == HISTORY:
        app.conf.pglock_history = 3600
    app.conf.update(
        pglock_database_url=os.environ.get(DATABASE_URL_ENV),
        pglock_namespace=os.environ.get(NAMESPACE_ENV, "bench"),
        pglock_application_name=APPLICATION_NAME,
    )
    if os.environ.get(SESSION_MODE_ENV) == "per_lock":
        from celery_pglock.testing import strategies

        strategies.use_per_lock_sessions()

    @app.task(name=SESSION, base=SingletonTask, lock_args=("key",))
    def session(key: str, body: float = 0.0) -> None:
        _body(body)

    @app.task(
        name=SKIP_SUCCESS,
        base=SingletonTask,
        lock_args=("key",),
        lock_skip_result="success",
    )
    def session_skip_success(key: str, body: float = 0.0) -> None:
        _body(body)

    @app.task(
        name=TRANSACTION,
        base=SingletonTask,
        lock_args=("key",),
        lock_scope="transaction",
    )
    def transaction(key: str, body: float = 0.0) -> None:
        _body(body)


if contender in (
    "pglock",
    "all",
):  # not the baseline: its code may predate lock_enqueue

    @app.task(
        name=UNTIL_FINISHED,
        base=SingletonTask,
        lock_args=("key",),
        lock_enqueue="until_finished",
    )
    def until_finished(key: str, body: float = 0.0) -> None:
        _body(body)

    @app.task(
        name=UNTIL_STARTED,
        base=SingletonTask,
        lock_args=("key",),
        lock_enqueue="until_started",
    )
    def until_started(key: str, body: float = 0.0) -> None:
        _body(body)

    @app.task(
        name=LATEST,
        base=SingletonTask,
        lock_args=("key",),
        lock_enqueue="until_started",
        lock_enqueue_on_duplicate="replace",
    )
    def latest(key: str, body: float = 0.0) -> None:
        _body(body)

    @app.task(
        name=DEBOUNCED,
        base=SingletonTask,
        lock_args=("key",),
        lock_enqueue="until_started",
        lock_debounce=DEBOUNCE,
    )
    def debounced(key: str, body: float = 0.0) -> None:
        _body(body)

    @app.task(name=LIMIT, base=SingletonTask, lock_args=("key",), lock_limit=3)
    def limit(key: str, body: float = 0.0) -> None:
        _body(body)

    # Distinct keys only: each key's first run, so each message runs (and is timed).
    @app.task(name=PERIOD, base=SingletonTask, lock_args=("key",), lock_period=3600)
    def period(key: str, body: float = 0.0) -> None:
        _body(body)

    @app.task(name=RATE, base=SingletonTask, lock_args=("key",), lock_rate=(3, 3600))
    def rate(key: str, body: float = 0.0) -> None:
        _body(body)

    # A group no drain fills (64 slots, 2 children): the cost of taking and giving back a slot.
    @app.task(
        name=GROUP,
        base=SingletonTask,
        lock_args=("key",),
        lock_group="bench",
        lock_group_limit=64,
    )
    def group(key: str, body: float = 0.0) -> None:
        _body(body)


if contender in ("once", "all"):
    from celery_once import QueueOnce

    @app.task(name=ONCE, base=QueueOnce, once={"graceful": True, "keys": ["key"]})
    def once(key: str, body: float = 0.0) -> None:
        _body(body)


if contender in ("singleton", "all"):
    from celery_singleton import Singleton

    @app.task(name=SINGLETON, base=Singleton, unique_on=["key"])
    def singleton(key: str, body: float = 0.0) -> None:
        _body(body)


# -- the unawaited release (measured, not offered) ---------------------------------------


def _unawaited_release() -> None:
    """Patch the process session to send its unlock without waiting for the reply.

    What issue 7 asked to measure: the reply is read (and checked) before the session's
    next statement instead of before the task returns. It is not offered by the library,
    because it cannot keep the guarantee that a client who saw the result and re-sends is
    never skipped by the finished run's lock (docs/design.md). psycopg2 can only send
    without waiting on an asynchronous connection, so the session gets one here.
    """
    import select

    import psycopg2
    import psycopg2.extensions as ext

    from celery_pglock.db import engines, sql_text
    from celery_pglock.lock import sessions

    session_class = sessions.ProcessSession
    waits_first = session_class.acquire

    def wait(connection: Any, *, until_sent: bool = False) -> None:
        while True:
            state = connection.poll()
            if state == ext.POLL_OK or (until_sent and state == ext.POLL_READ):
                return
            readable = [connection.fileno()] if state == ext.POLL_READ else []
            writable = [connection.fileno()] if state == ext.POLL_WRITE else []
            select.select(readable, writable, [], 10.0)

    def connect(self: Any, key: Any) -> Any:
        url = str(os.environ.get(DATABASE_URL_ENV))
        name = engines.application_name(self._prefix, engines.process_tag(), "idle")
        connection = psycopg2.connect(
            url.replace("postgresql+psycopg2://", "postgresql://", 1),
            application_name=name,
            async_=1,
        )
        wait(connection)
        self._connection, self._cursor = connection, connection.cursor()
        self._pending = False
        return self._cursor

    def settle(self: Any) -> None:
        if getattr(self, "_pending", False):
            wait(self._connection)
            row = self._cursor.fetchone()
            self._pending = False
            if not (row and row[0]):
                logging.getLogger(__name__).error("an unawaited unlock found no lock")

    def acquire(self: Any, request: Any) -> Any:
        if request.run is not None or request.rider is not None:
            raise NotImplementedError("no run locks (acks_late, lock_enqueue) here")
        if len(request.slots) > 1:
            raise NotImplementedError("no lock_limit here")
        if request.transaction or request.timeout_ms is not None:
            return waits_first(self, request)
        key, on_granted = request.slots[0], request.on_granted
        ids = key.ids
        with self._mutex:
            if ids in self._owners:
                return None
            cursor = self._cursor if self._cursor is not None else connect(self, key)
            settle(self)
            cursor.execute(sql_text.TRY_LOCK_SESSION_BARE[len(ids)], ids)
            wait(self._connection)
            row = cursor.fetchone()
            if not (row and row[0] is True):
                return None
            hold = sessions.Hold(self, ids)
            hold.connection = self._connection
            self._owners[ids] = hold
            if on_granted is not None:
                on_granted(hold)
            return hold

    def release(self: Any, hold: Any, key: Any, commit: bool, timeout: float) -> None:
        if hold.session is not self:
            return
        with self._mutex:
            del self._owners[hold.ids]
            self._cursor.execute(
                sql_text.UNLOCK_SESSION_KEEP_NAME[len(hold.ids)], hold.ids
            )
            # On the wire; the reply is read later.
            wait(self._connection, until_sent=True)
            self._pending = True

    def holder_of(self: Any, key: Any, *, bound: float) -> Any:
        with self._mutex:
            if self._cursor is None:
                return None
            settle(self)
            self._cursor.execute(sql_text.HOLDER, key.pg_locks_ids)
            wait(self._connection)
            row = self._cursor.fetchone()
            return None if row is None else row[0]

    session_class.acquire = acquire  # type: ignore[method-assign]
    session_class.release = release  # type: ignore[method-assign]
    session_class.holder_of = holder_of  # type: ignore[method-assign]


if contender == UNAWAITED:
    _unawaited_release()


# -- measurement hooks -------------------------------------------------------------------

_record_dir = os.environ.get(RECORD_DIR_ENV)
_starts: dict[str, int] = {}
_fd: tuple[int, int] | None = None  # (pid, descriptor): re-opened after a fork
_fd_guard = threading.Lock()


def _record_fd() -> int:
    global _fd
    current = _fd
    if current is not None and current[0] == os.getpid():
        return current[1]
    with _fd_guard:
        if _fd is None or _fd[0] != os.getpid():
            path = os.path.join(str(_record_dir), f"{os.getpid()}.rec")
            _fd = (
                os.getpid(),
                os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644),
            )
        return _fd[1]


def _on_prerun(task_id: str | None = None, **_: Any) -> None:
    if task_id is not None:
        _starts[task_id] = time.monotonic_ns()


def _on_postrun(
    task_id: str | None = None,
    state: str | None = None,
    retval: Any = None,
    **_: Any,
) -> None:
    end = time.monotonic_ns()
    start = _starts.pop(task_id, end) if task_id is not None else end
    # A SingletonTask skip ends in a non-SUCCESS state (FAILURE with LockSkipped by
    # default; IGNORED for a skipped redelivery; SKIPPED under lock_skip_result='skipped').
    outcome = RAN if state == "SUCCESS" else SKIPPED if state else OTHER
    # O_APPEND and one 24-byte write: atomic, so the threads of a process may share it.
    os.write(_record_fd(), RECORD.pack(start, end, outcome))


def _quiet_task_logs(**_: Any) -> None:
    for name in ("celery.app.trace", "celery.worker.strategy", "celery.worker.request"):
        logging.getLogger(name).setLevel(logging.WARNING)


def _warm_up() -> None:
    """Open what the first task would open (lock session, Redis), then say so."""
    if contender in ("pglock", UNAWAITED, HISTORY):
        from celery_pglock import AdvisoryLock, keys
        from celery_pglock.db import engines

        lock = AdvisoryLock(
            engine=engines.engine_for(app.conf),
            key=keys.make_key("bench-warm", str(os.getpid())),
        )
        if lock.acquire():
            lock.release()
    elif contender == "plain" and os.environ.get(DATABASE_URL_ENV):
        plain_round_trips("warm")  # opens this process's connection
    elif contender == "once":
        once_task: Any = app.tasks[ONCE]  # celery-once is untyped
        once_task.once_backend.redis.ping()
    elif contender == "singleton":
        singleton_task: Any = app.tasks[SINGLETON]  # celery-singleton is untyped
        singleton_task.singleton_backend.redis.ping()
    if _record_dir:
        path = os.path.join(_record_dir, f"{os.getpid()}{WARM_SUFFIX}")
        with open(path, "w", encoding="ascii") as marker:
            marker.write("warm\n")


_profiler: Any = None


def _on_child_init(**_: Any) -> None:
    global _profiler
    _warm_up()
    if os.environ.get(PROFILE_DIR_ENV):
        import cProfile

        # CPU time, not wall: waiting for PostgreSQL or the broker is not cost.
        _profiler = cProfile.Profile(time.process_time)
        _profiler.enable()


def _on_child_shutdown(**_: Any) -> None:
    if _profiler is not None:
        _profiler.disable()
        _profiler.dump_stats(
            os.path.join(os.environ[PROFILE_DIR_ENV], f"{os.getpid()}.prof")
        )


def _on_worker_ready(**_: Any) -> None:
    if os.environ.get(POOL_ENV, "prefork") != "prefork":
        _warm_up()  # threads and solo pools run tasks in the main process


if _record_dir:
    signals.task_prerun.connect(_on_prerun, weak=False)
    signals.task_postrun.connect(_on_postrun, weak=False)
    signals.worker_process_init.connect(_on_child_init, weak=False)
    signals.worker_ready.connect(_on_worker_ready, weak=False)
    signals.worker_process_shutdown.connect(_on_child_shutdown, weak=False)
    _quiet_task_logs()
    signals.after_setup_logger.connect(_quiet_task_logs, weak=False)
    signals.after_setup_task_logger.connect(_quiet_task_logs, weak=False)
