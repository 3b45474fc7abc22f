"""OverlapRecorder: the detector that proves (or disproves) mutual exclusion.

Task bodies running in many worker processes record when they start and end, as rows in
a PostgreSQL table; a test then asks for pairs of rows of one key whose intervals
intersect. Two intervals ``a`` and ``b`` overlap when::

    a.started_at < b.ended_at  AND  b.started_at < a.ended_at

Both instants come from the *server's* ``clock_timestamp()``, so they are comparable
across processes and hosts whatever their clocks say, and they are causally ordered
with the lock: ``begin()`` runs after the body's lock was granted and ``end()`` before it
is released, so a correct lock can never produce an overlap.

Fork hazard: the recorder keeps one psycopg2 connection per process, in autocommit mode,
separate from the lock engine (recording must never hold or free a lock). A child forked
after the parent connected must not use, or even close, the parent's connection: closing
sends a Terminate message on the shared socket and would end the parent's session. So a
child abandons the inherited connection (keeps a reference, never closes it) and opens
its own.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import threading
from typing import TYPE_CHECKING, Any

from celery_pglock.testing import _support

if TYPE_CHECKING:
    import datetime
    from collections.abc import Iterator

#: application_name of recorder sessions (deliberately not starting with "pglock").
APPLICATION_NAME = "celery_pglock.testing overlap"
#: A plain identifier short enough to leave room for the index name's suffix.
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,54}")
#: Connections inherited through fork(): referenced forever, never closed (see above).
_abandoned: list[Any] = []


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Interval:
    """One recorded run of a task body."""

    id: int  #: Row id, in insertion order.
    run: str  #: The test run (a test's namespace) the row belongs to.
    key: str  #: What must be exclusive, such as the lock key's text.
    task_id: str | None  #: Celery task id, if the body knew it.
    pid: int  #: Process that ran the body.
    started_at: datetime.datetime  #: Server clock at begin().
    ended_at: datetime.datetime | None  #: Server clock at end(); None while running.


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Overlap:
    """Two intervals of one key that ran at the same time: an exclusion failure."""

    first: Interval  #: The earlier row (smaller id).
    second: Interval  #: The later row.

    def __str__(self) -> str:
        return (
            f"key {self.first.key!r}: task {self.first.task_id} (pid {self.first.pid}) ran "
            f"{self.first.started_at.isoformat()}..{_iso(self.first.ended_at)} and task "
            f"{self.second.task_id} (pid {self.second.pid}) ran "
            f"{self.second.started_at.isoformat()}..{_iso(self.second.ended_at)}"
        )


class OverlapRecorder:
    """Record task-body intervals from any process; find the ones that overlap.

    Args:
        database_url: SQLAlchemy (``postgresql+psycopg2://``) or libpq URL.
        table: Name of the table holding the intervals (a plain identifier).

    Thread-safe: threads of one process share its connection under a lock.
    """

    def __init__(
        self, database_url: str, *, table: str = "pglock_test_intervals"
    ) -> None:
        if not _IDENTIFIER.fullmatch(table):
            raise ValueError(f"table must be a plain SQL identifier; got {table!r}.")
        self.database_url = database_url
        self.table = table
        self._connection: Any = None
        self._pid = os.getpid()
        self._lock = threading.Lock()
        #: row id -> server time this process last read while the row's body ran.
        self._alive: dict[int, datetime.datetime] = {}

    def setup(self) -> None:
        """Create the table and its index if they do not exist (safe to run concurrently)."""
        self._execute(
            f"""
            BEGIN;
            -- CREATE ... IF NOT EXISTS still races with itself; serialise the callers.
            SELECT pg_advisory_xact_lock(hashtext('celery_pglock.testing.overlap'));
            CREATE TABLE IF NOT EXISTS {self.table} (
                id bigserial PRIMARY KEY,
                run text NOT NULL,
                key text NOT NULL,
                task_id text,
                pid int NOT NULL,
                started_at timestamptz NOT NULL,
                ended_at timestamptz
            );
            CREATE INDEX IF NOT EXISTS {self.table}_run_key ON {self.table} (run, key);
            COMMIT;
            """
        )

    def begin(self, run: str, key: str, task_id: str | None = None) -> int:
        """Record that a body for ``key`` starts now; returns the row id for :meth:`end`."""
        row = self._execute(
            f"INSERT INTO {self.table} (run, key, task_id, pid, started_at) "
            "VALUES (%s, %s, %s, %s, clock_timestamp()) RETURNING id, started_at",
            (run, key, task_id, os.getpid()),
            fetch=True,
        )
        row_id = int(row[0][0])
        self._alive[row_id] = row[0][1]
        return row_id

    def end(self, row_id: int) -> None:
        """Record that the body of row ``row_id`` ends now."""
        self._execute(
            f"UPDATE {self.table} SET ended_at = clock_timestamp() WHERE id = %s",
            (row_id,),
        )
        self._alive.pop(row_id, None)

    def heartbeat(self, row_id: int) -> None:
        """Move the end of a running body's row to the last instant it is known alive.

        Call it periodically from a body that may be killed: its row then ends shortly
        before its death instead of staying unfinished. What is written is the server
        time of the *previous* heartbeat (or of :meth:`begin`), which this process lived
        to read, never the current time: a statement in flight when the process is
        killed can still execute after its death, once its lock was freed and taken by
        the next run, and would record an overlap that never happened.
        """
        rows = self._execute(
            f"UPDATE {self.table} SET ended_at = COALESCE(%s, ended_at, started_at) "
            "WHERE id = %s RETURNING clock_timestamp()",
            (self._alive.get(row_id), row_id),
            fetch=True,
        )
        if rows:
            self._alive[row_id] = rows[0][0]

    @contextlib.contextmanager
    def record(self, run: str, key: str, task_id: str | None = None) -> Iterator[int]:
        """``begin()`` on entry and ``end()`` on exit (also when the body raises)."""
        row_id = self.begin(run, key, task_id)
        try:
            yield row_id
        finally:
            self.end(row_id)

    def overlaps(self, run: str) -> list[Overlap]:
        """Every pair of finished intervals of one key in ``run`` that intersect."""
        columns = ", ".join(f"{side}.{name}" for side in "ab" for name in _COLUMNS)
        rows = self._execute(
            f"SELECT {columns} FROM {self.table} a JOIN {self.table} b "
            "ON a.run = b.run AND a.key = b.key AND a.id < b.id "
            "AND a.started_at < b.ended_at AND b.started_at < a.ended_at "
            "WHERE a.run = %s ORDER BY a.id, b.id",
            (run,),
            fetch=True,
        )
        width = len(_COLUMNS)
        return [
            Overlap(first=_interval(row[:width]), second=_interval(row[width:]))
            for row in rows
        ]

    def peak(self, run: str, key: str) -> int:
        """Most bodies of ``key`` in ``run`` running at one instant (0: none recorded).

        A semaphore's check (``lock_limit=N``: at most N): the largest number of intervals
        holding any interval's start, an unfinished one counted as still running.
        """
        rows = self._execute(
            f"SELECT coalesce(max((SELECT count(*) FROM {self.table} b "
            "WHERE b.run = a.run AND b.key = a.key AND b.started_at <= a.started_at "
            "AND (b.ended_at IS NULL OR a.started_at < b.ended_at))), 0) "
            f"FROM {self.table} a WHERE a.run = %s AND a.key = %s",
            (run, key),
            fetch=True,
        )
        return int(rows[0][0])

    def intervals(self, run: str) -> list[Interval]:
        """Every interval of ``run``, in insertion order."""
        rows = self._execute(
            f"SELECT {', '.join(_COLUMNS)} FROM {self.table} WHERE run = %s ORDER BY id",
            (run,),
            fetch=True,
        )
        return [_interval(row) for row in rows]

    def count(self, run: str, key: str | None = None) -> int:
        """How many bodies started in ``run`` (for ``key`` only, if given)."""
        rows = self._execute(
            f"SELECT count(*) FROM {self.table} WHERE run = %s AND (%s::text IS NULL OR key = %s)",
            (run, key, key),
            fetch=True,
        )
        return int(rows[0][0])

    def unfinished(self, run: str) -> list[Interval]:
        """Intervals of ``run`` without an end: bodies still running, or killed."""
        rows = self._execute(
            f"SELECT {', '.join(_COLUMNS)} FROM {self.table} WHERE run = %s AND ended_at IS NULL ORDER BY id",
            (run,),
            fetch=True,
        )
        return [_interval(row) for row in rows]

    def close(self) -> None:
        """Close this process's connection (a later call reconnects)."""
        self._forget_parent_connection()
        with self._lock:
            connection, self._connection = self._connection, None
            if connection is not None:
                connection.close()

    def _execute(
        self, sql: str, params: tuple[Any, ...] = (), *, fetch: bool = False
    ) -> list[tuple[Any, ...]]:
        self._forget_parent_connection()
        with self._lock:
            connection = self._connect()
            try:
                with connection.cursor() as cursor:
                    cursor.execute(sql, params)
                    return list(cursor.fetchall()) if fetch else []
            except Exception:
                # A broken or mid-transaction connection is not reused; the next call
                # reconnects (the server may have been restarted by the test).
                self._connection = None
                with contextlib.suppress(Exception):
                    connection.close()
                raise

    def _forget_parent_connection(self) -> None:
        """In a forked child: drop (never close) the parent's connection and lock."""
        if self._pid == os.getpid():
            return
        if self._connection is not None:
            _abandoned.append(self._connection)
        self._connection = None
        self._pid = os.getpid()
        # A lock held by another of the parent's threads at fork time stays held forever.
        self._lock = threading.Lock()

    def _connect(self) -> Any:
        if self._connection is None or self._connection.closed:
            self._connection = _support.connect(
                self.database_url, application_name=APPLICATION_NAME
            )
        return self._connection


_COLUMNS = ("id", "run", "key", "task_id", "pid", "started_at", "ended_at")


def _interval(row: tuple[Any, ...]) -> Interval:
    return Interval(**dict(zip(_COLUMNS, row, strict=True)))


def _iso(instant: datetime.datetime | None) -> str:
    return "(running)" if instant is None else instant.isoformat()
