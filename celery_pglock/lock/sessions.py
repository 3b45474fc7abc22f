"""The sessions that carry a key from acquire to release, picked by :func:`for_lock`.
Why: docs/design.md ("One lock session per process", "A key stays claimed")."""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import os
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any, NoReturn, cast

from celery_pglock import exceptions
from celery_pglock.config import LockScope
from celery_pglock.db import (
    deadlines,
    driver_errors,
    engines,
    server_probe,
    sql_text,
    startup_options,
)
from celery_pglock.lock import fencing_tokens, queued

if TYPE_CHECKING:
    from collections.abc import Callable

    import sqlalchemy as sa

    from celery_pglock.keys import LockKey

    #: A statement run on a holder's own session: (DBAPI connection, cursor) -> its row.
    Work = Callable[[Any, Any], tuple[Any, ...]]
    #: A statement -> the EXECUTE of it prepared on the session that will send it.
    Prepare = Callable[[str], str]

logger = logging.getLogger(__name__)

DEFAULT_ROUND_TRIP_TIMEOUT = 5.0  #: AdvisoryLock.round_trip_timeout's, in seconds.
_HOLDER = "celery_pglock_fencing_holder"  #: pooled.info key: its fencing Holder.


@dataclasses.dataclass(eq=False)  # no slots: Claims refers to holds weakly (3.10)
class Hold:
    session: ProcessSession | PerLockSessions
    ids: tuple[int, ...]
    idle_name: str = ""  # per lock: what its connection shows once released
    holding_name: str | None = None  # what its session showed when granted
    pid: int = dataclasses.field(default_factory=os.getpid)
    connection: Any = None  # the DBAPI connection it lives on
    pooled: Any = None  # per lock: the pool's proxy, pinned until release
    sa_connection: sa.Connection | None = None  # transaction scope: lent to the body
    transaction: sa.RootTransaction | None = None
    lent: bool = False
    lost: str | None = None  # why its session ended before its release
    run_ids: tuple[int, ...] | None = None  # the run lock held beside the key
    row: queued.Queued | None = None  # lock_enqueue: its queued row
    slot: int = 0  # lock_limit: which of the key's slots (keys.slot_keys) ids is


class Claims:
    """The keys this process's runs hold until their release; thread-safe."""

    __slots__ = ("_cond", "_held", "_mutex", "_waiting")

    #: Longest a bounded wait sleeps before looking again (a dropped hold notifies nobody).
    POLL = 0.25

    def __init__(self) -> None:
        self._held: dict[tuple[int, ...], weakref.ref[Hold]] = {}
        # Taken bare on the hot path (C code, unlike Condition.__enter__).
        self._mutex = threading.Lock()
        self._cond = threading.Condition(self._mutex)
        self._waiting = 0

    def claim(self, hold: Hold, deadline: float | None = None) -> bool:
        """False if another run still holds ``hold.ids`` at monotonic ``deadline``
        (None: at once). Blocks; pair with :meth:`release`, granted or not."""
        ids = hold.ids
        with self._mutex:
            if self._holder(ids) is not None:
                if deadline is None:
                    return False
                self._waiting += 1
                try:
                    while self._holder(ids) is not None:
                        remaining = deadline - time.monotonic()
                        if remaining <= 0:
                            return False
                        self._cond.wait(min(remaining, self.POLL))
                finally:
                    self._waiting -= 1
            self._held[ids] = weakref.ref(hold)
            return True

    def release(self, hold: Hold) -> None:
        with self._mutex:
            if self._holder(hold.ids) is hold:
                del self._held[hold.ids]
                if self._waiting:
                    self._cond.notify_all()

    def held(self, ids: tuple[int, ...]) -> bool:
        with self._mutex:
            return self._holder(ids) is not None

    def _holder(self, ids: tuple[int, ...]) -> Hold | None:
        ref = self._held.get(ids)
        return None if ref is None else ref()


class LockSessions:
    def __init__(self, engine: sa.Engine, claims: Claims) -> None:
        self.engine = engine
        self.claims = claims  #: Shared by both strategies of ``engine``.
        self.pid = os.getpid()
        self._prefix = engines.engine_info(engine)["application_name_prefix"]
        self._names: dict[tuple[str, ...], str] = {}

    def holder_of(self, key: LockKey, *, bound: float) -> str | None:
        """``"<backend pid> <application_name>"`` of ``key``'s holder; None if unknown."""
        what = f"looking up the holder of {key.name!r}"
        row = self._one_row(what, sql_text.HOLDER, key.pg_locks_ids, bound)
        return None if row is None else row[0]

    def acquire_slot(
        self,
        slots: tuple[LockKey, ...],
        label: str,
        transaction: bool,
        bound: float,
        run: LockKey | None,
        on_granted: Callable[[Hold], None] | None,
    ) -> Hold | None:
        """As ``acquire``, without waiting, of the first free of ``slots`` (lock_limit),
        tried only where no run of the process claims it (session locks re-enter)."""
        # Only the two strategies are ever made, and each has its _take_slot.
        session = cast("ProcessSession | PerLockSessions", self)
        holds = [Hold(session, key.ids, slot=slot) for slot, key in enumerate(slots)]
        granted = None
        try:
            free = [hold for hold in holds if self.claims.claim(hold)]
            if free:  # else all are claimed here: busy without a round trip
                granted = session._take_slot(
                    free, slots, label, transaction, bound, run, on_granted
                )
        finally:
            for hold in holds:
                if hold is not granted:
                    self.claims.release(hold)  # a no-op if its claim was refused
        return granted

    def run_alive(self, run: LockKey, *, bound: float) -> bool | None:
        what = f"checking run lock {run}"
        row = self._one_row(what, sql_text.RUN_ALIVE, (*run.ids, *run.ids), bound)
        return None if row is None else bool(row[0])

    def _one_row(
        self, what: str, statement: str, params: tuple[Any, ...], bound: float
    ) -> tuple[Any, ...] | None:
        """The row; None on failure (DEBUG log: a lookup adds detail, never decides)."""
        try:
            with (
                engines.autocommit(self.engine) as dbapi,
                deadlines.bounded(dbapi, bound),
                dbapi.cursor() as cursor,
            ):
                cursor.execute(statement, params)
                row: tuple[Any, ...] | None = cursor.fetchone()
        except Exception:
            logger.debug("%s failed", what, exc_info=True)
            return None
        return row

    def _retire_if_dead(self, pooled: Any, exc: BaseException) -> None:
        if driver_errors.is_disconnect(exc):
            engines.mark_pool_stale(self.engine, pooled, exc)

    def _name(self, *parts: str) -> str:
        name = self._names.get(parts)
        if name is None:
            if len(self._names) >= 4096:
                self._names.clear()
            name = self._names[parts] = engines.application_name(
                self._prefix, engines.process_tag(), *parts
            )
        return name

    def _raise(
        self, exc: BaseException, action: str, *, connecting: bool = False
    ) -> NoReturn:
        """Raise ``exc`` again, a driver error as a DatabaseError."""
        if isinstance(exc, Exception):
            with driver_errors.wrap_db_errors(
                action, self.engine, connecting=connecting
            ):
                raise exc
        raise exc


class SessionBusyError(Exception):
    """The lock session was kept busy by other statements until a check's deadline."""


class _Bound(deadlines.Bound):
    __slots__ = ()

    def __call__(self, seconds: float) -> _Bound:
        self.fired = False
        self.deadline = time.monotonic() + seconds
        return self

    def __enter__(self) -> _Bound:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *rest: object) -> None:
        with deadlines.guard:
            self.deadline = math.inf
        if self.fired and exc_type is None:
            # The answer came after the socket was shut down: the session is ending.
            raise driver_errors.operational_error(self.connection)(deadlines.NO_ANSWER)


class ProcessSession(LockSessions):
    """One connection for all session-scope try-locks; a mutex guards it and its holds."""

    def __init__(self, engine: sa.Engine, claims: Claims) -> None:
        super().__init__(engine, claims)
        self.waits = PerLockSessions(engine, claims)
        self._mutex = threading.Lock()
        self._pooled: Any = None  # the detached pool proxy owning the connection
        self._connection: Any = None
        self._cursor: Any = None
        self._bound: Any = None  # a _Bound while connected
        self._holder: fencing_tokens.Holder | None = None  # asked once per connection
        self._shown: str | None = None  # the application_name the session shows
        self._since = 0  # the epoch second it shows: when it last began to hold keys
        #: key ids -> hold on the current connection (a lost hold leaves; its claim stays).
        self._owners: dict[tuple[int, ...], Hold] = {}
        self._runs: dict[tuple[int, ...], Hold] = {}  #: run lock ids -> its hold.
        #: Statement -> the EXECUTE of it prepared on the current connection.
        self._executes: dict[str, str] = {}

    def acquire(
        self,
        key: LockKey,
        label: str,
        timeout_ms: int | None,
        transaction: bool,
        bound: float,
        run: LockKey | None,
        on_granted: Callable[[Hold], None] | None,
        row: queued.Queued | None = None,
    ) -> Hold | None:
        """The hold of ``key`` (and of the run lock ``run``), or None if busy.
        ``on_granted`` gets it once recorded: a soft time limit then cannot orphan it.
        ``row``: the queued row to change in the same statement, if granted."""
        if transaction:
            return self.waits.acquire(
                key, label, timeout_ms, transaction, bound, run, on_granted, row
            )
        hold = self._try_here(key, label, bound, run, on_granted, row)
        if hold is not None or timeout_ms is None:
            return hold
        # Busy: a blocking wait here would stall every lock of the process.
        return self.waits.acquire(
            key, label, timeout_ms, transaction, bound, run, on_granted, row
        )

    def _try_here(
        self,
        key: LockKey,
        label: str,
        bound: float,
        run: LockKey | None,
        on_granted: Callable[[Hold], None] | None,
        row: queued.Queued | None,
    ) -> Hold | None:
        hold = Hold(self, key.ids, row=row)
        ids = hold.ids
        with self._mutex:
            try:
                # In the try: a soft time limit after the claim must not orphan the key.
                if not self.claims.claim(hold):
                    return None
                # A run lock already held here (one task id twice) is not re-entered, so
                # this run's release ends no other run's.
                run_ids = None if run is None or run.ids in self._runs else run.ids
                if self._cursor is None:
                    self._connect(key)
                since = self._held_since()
                name = self._name(f"@{since}", label)
                try:
                    # Bounded: a frozen link would stall every lock statement here.
                    with self._bound(bound):
                        granted, run_granted = self._try(ids, name, run_ids, row)
                    if granted:  # inside the try, for the same reason
                        self._record(
                            hold, name, since, run_ids, run_granted, on_granted
                        )
                except BaseException as exc:
                    self._fail(f"acquiring lock {key.name!r} failed: {exc!r}", exc)
                    self._raise(exc, f"acquire lock {key.name!r}")
            finally:
                if self._owners.get(ids) is not hold:
                    self.claims.release(hold)  # a no-op if the claim was refused
            return hold if self._owners.get(ids) is hold else None

    def _take_slot(
        self,
        free: list[Hold],
        slots: tuple[LockKey, ...],
        label: str,
        transaction: bool,  # never: transaction scope has its per-lock sessions
        bound: float,
        run: LockKey | None,
        on_granted: Callable[[Hold], None] | None,
    ) -> Hold | None:
        with self._mutex:
            run_ids = None if run is None or run.ids in self._runs else run.ids
            if self._cursor is None:
                self._connect(slots[0])
            since = self._held_since()
            name = self._name(f"@{since}", label)
            for hold in free:
                hold.holding_name = name
            try:
                with self._bound(bound):  # bounded, as in acquire
                    granted, run_granted = _try_slots(
                        self._cursor,
                        free,
                        name != self._shown,
                        run_ids,
                        prepare=self._ready,
                    )
                if granted is not None:
                    self._record(granted, name, since, run_ids, run_granted, on_granted)
            except BaseException as exc:
                self._fail(f"acquiring lock {slots[0].name!r} failed: {exc!r}", exc)
                self._raise(exc, f"acquire lock {slots[0].name!r}")
            owned = granted is not None and self._owners.get(granted.ids) is granted
            return granted if owned else None

    def _held_since(self) -> int:
        """Under the mutex: the epoch second to show for a grant now: that of the keys
        already held, else now (docs/operations/monitoring.md, application_name). Whole
        seconds: a run of one task within a second needs no relabel."""
        return self._since if self._owners else int(time.time())

    def _record(
        self,
        hold: Hold,
        name: str,
        since: int,
        run_ids: tuple[int, ...] | None,
        run_granted: bool,
        on_granted: Callable[[Hold], None] | None,
    ) -> None:
        """Under the mutex: ``hold`` was granted on this session."""
        self._shown = hold.holding_name = name
        self._since = since
        hold.connection = self._connection
        self._owners[hold.ids] = hold
        if run_granted and run_ids is not None:
            hold.run_ids = run_ids
            self._runs[run_ids] = hold
        if on_granted is not None:
            on_granted(hold)

    def _try(
        self,
        ids: tuple[int, ...],
        name: str,
        run_ids: tuple[int, ...] | None,
        queued_row: queued.Queued | None,
    ) -> tuple[bool, bool]:
        cursor = self._cursor
        if name != self._shown:  # a relabel costs about what the lock does
            return _try_named(
                cursor, ids, name, run_ids, False, queued_row, prepare=self._ready
            )
        if run_ids is None:
            statement = sql_text.TRY_LOCK_SESSION_BARE[len(ids)]
            _execute(cursor, statement, ids, queued_row, "l.g", prepare=self._ready)
            row = cursor.fetchone()
            return row is not None and row[0] is True, False
        statement = sql_text.TRY_LOCK_SESSION_BARE_RUN[len(ids)]
        _execute(cursor, statement, (*ids, *run_ids), queued_row, prepare=self._ready)
        row = cursor.fetchone()
        return row is not None and row[0] is not None, bool(row and row[0])

    def release(self, hold: Hold, key: LockKey, commit: bool, timeout: float) -> None:
        """Unlock; the claim is returned in any case (raises as AdvisoryLock.release)."""
        ids, run_ids = hold.ids, hold.run_ids
        with self._mutex:
            # Under the mutex: no try-lock of the process runs before the unlock below.
            self.claims.release(hold)
            if self._owners.get(ids) is not hold:
                raise exceptions.LockNotOwnedError(
                    f"The process's lock session ended while lock {key.name!r} (key {key}) was "
                    f"held ({hold.lost or 'closed'}), so PostgreSQL had already freed the lock.",
                    key=str(key),
                    name=key.name,
                )
            del self._owners[ids]
            if run_ids is None:
                statement, params = sql_text.UNLOCK_SESSION_KEEP_NAME[len(ids)], ids
            else:
                del self._runs[run_ids]
                statement = sql_text.UNLOCK_SESSION_KEEP_NAME_RUN[len(ids)]
                params = (*ids, *run_ids)
            bound = self._bound
            try:
                with bound(timeout):
                    _execute_end(
                        self._cursor, statement, params, hold.row, prepare=self._ready
                    )
                    row = self._cursor.fetchone()
            except BaseException as exc:
                self._fail(f"releasing lock {key.name!r} failed: {exc!r}", exc)
                why = deadlines.explain(bound)
                self._raise(exc, f"release lock {key.name!r}{why}")
        if not (row and row[0]):
            # Unlocked behind our back; closing the session would free every other lock.
            raise exceptions.LockNotOwnedError(
                f"PostgreSQL says the process's lock session no longer held lock {key.name!r} "
                f"(key {key}) at release; the session is kept for its other locks.",
                key=str(key),
                name=key.name,
            )

    def fencing_holder(
        self, hold: Hold, key: LockKey, *, bound: float
    ) -> fencing_tokens.Holder | None:
        with self._mutex:
            if not self._still_holds(hold):
                return None  # the session that was granted the key has ended
            if self._holder is None:
                try:
                    with self._bound(bound):
                        self._holder = fencing_tokens.session_holder(self._cursor)
                except BaseException as exc:
                    if self._ended(f"naming the session failed: {exc!r}", exc):
                        return None
                    self._raise(exc, f"issue a fencing token for lock {key.name!r}")
            return self._holder

    def on_holder(
        self, hold: Hold, action: str, bound: float, work: Work
    ) -> tuple[Any, ...] | None:
        """``work(connection, cursor)`` on the session holding ``hold``, under its mutex;
        None once that session has ended (the hold is lost)."""
        with self._mutex:
            if not self._still_holds(hold):
                return None
            try:
                with self._bound(bound):
                    return work(self._connection, self._cursor)
            except BaseException as exc:
                self._ended(f"{action} failed: {exc!r}", exc)
                raise

    def _still_holds(self, hold: Hold) -> bool:
        """Under the mutex: ``hold`` was granted on this session, which has not ended."""
        return (
            self._owners.get(hold.ids) is hold and hold.connection is self._connection
        )

    def run_alive(self, run: LockKey, *, bound: float) -> bool | None:
        with self._mutex:
            if run.ids in self._runs:
                return True  # a run of this process (on this session it would re-enter)
        return super().run_alive(run, bound=bound)

    def _one_row(
        self, what: str, statement: str, params: tuple[Any, ...], bound: float
    ) -> tuple[Any, ...] | None:
        with self._mutex:  # on this session when it is open: no second connection
            if self._cursor is not None:
                try:
                    with self._bound(bound):
                        self._cursor.execute(statement, params)
                        row: tuple[Any, ...] | None = self._cursor.fetchone()
                except Exception as exc:
                    logger.debug("%s failed", what, exc_info=True)
                    self._ended(f"{what} failed: {exc!r}", exc)
                    return None
                return row
        return super()._one_row(what, statement, params, bound)

    def run_check(
        self, statement: str, params: tuple[Any, ...], deadline: float, least: float
    ) -> list[tuple[Any, ...]] | None:
        """The watcher's statement's rows by monotonic ``deadline``; None if closed. Raises
        SessionBusyError if busy past ``deadline - least``; a dead or late session ends."""
        if not self._mutex.acquire(
            timeout=max(0.0, deadline - least - time.monotonic())
        ):
            raise SessionBusyError
        try:
            if self._cursor is None:
                return None
            remaining = deadline - time.monotonic()
            if remaining < least:
                raise SessionBusyError
            try:
                with self._bound(remaining):
                    self._cursor.execute(statement, params)
                    rows: list[tuple[Any, ...]] = self._cursor.fetchall()
            except BaseException as exc:
                self._ended(f"checking its locks failed: {exc!r}", exc)
                raise
            return rows
        finally:
            self._mutex.release()

    def holds(self) -> list[Hold]:
        with self._mutex:
            return list(self._owners.values())

    def lose(self, cause: str) -> list[Hold]:
        """Close the session (which frees all its locks) and mark its holds lost."""
        with self._mutex:
            return self._close(cause)

    def close(self) -> None:
        if lost := self.lose("the process's lock session was closed"):
            logger.warning(
                "The lock session was closed still holding %d lock(s); PostgreSQL freed them",
                len(lost),
                extra={"action": "lock_checkin_unlock_all"},
            )

    def _connect(self, key: LockKey) -> None:
        server_probe.check(self.engine, LockScope.SESSION, key.name)
        try:
            # Detached: no pool reset or check-in touches it, nor counts it in the size.
            pooled = self.engine.raw_connection()
            pooled.detach()
            dbapi: Any = pooled.dbapi_connection
            dbapi.autocommit = True
            cursor = dbapi.cursor()
        except Exception as exc:
            self._raise(exc, f"acquire lock {key.name!r}", connecting=True)
        self._pooled, self._connection, self._cursor = pooled, dbapi, cursor
        self._bound = _Bound(dbapi)
        deadlines.watch(self._bound)
        self._shown = None
        self._executes = {}

    def _ready(self, statement: str) -> str:
        """Under the mutex: ``statement`` as an EXECUTE, prepared on first use. Every
        statement this session sends goes through here: it saves the server a plan per
        call (benchmarks/README.md, "Planning a lock statement")."""
        execute = self._executes.get(statement)
        if execute is None:
            execute = self._executes[statement] = _prepared(self._cursor, statement)
        return execute

    def _ended(self, cause: str, exc: BaseException) -> bool:
        """Under the mutex, after a failed statement: end the session if it is dead."""
        if self._connection.closed or driver_errors.is_disconnect(exc):
            self._fail(cause, exc)
            return True
        return False

    def _fail(self, cause: str, exc: BaseException) -> None:
        """Under the mutex: end the session; a dead one retires the pool's connections."""
        self._close(cause)
        if driver_errors.is_disconnect(exc):
            engines.mark_pool_stale(self.engine, None, exc)

    def _close(self, cause: str) -> list[Hold]:
        """Under the mutex: end the session; its holds are lost but stay claimed."""
        connection, self._connection = self._connection, None
        if self._bound is not None:
            deadlines.unwatch(self._bound)
        self._pooled = self._cursor = self._holder = self._bound = None
        lost = list(self._owners.values())
        self._owners.clear()
        self._runs.clear()
        for hold in lost:
            hold.lost = cause
        if connection is not None:
            try:
                connection.close()  # ends the session: the release PostgreSQL always honours
            except Exception:  # a dead socket may complain; it is gone either way
                logger.debug("Closing the lock session failed", exc_info=True)
        return lost


class PerLockSessions(LockSessions):
    """A pooled connection per held lock, pinned from acquire to release."""

    def __init__(self, engine: sa.Engine, claims: Claims) -> None:
        super().__init__(engine, claims)
        self.waits = self

    def acquire(
        self,
        key: LockKey,
        label: str,
        timeout_ms: int | None,
        transaction: bool,
        bound: float,
        run: LockKey | None,
        on_granted: Callable[[Hold], None] | None,
        row: queued.Queued | None = None,
    ) -> Hold | None:
        scope = LockScope.TRANSACTION if transaction else LockScope.SESSION
        server_probe.check(self.engine, scope, key.name)  # probed once per engine
        hold = Hold(self, key.ids, self._name("idle"), row=row)
        # str(key): the ids only (the key text may be megabytes, kept by the cache).
        hold.holding_name = self._name(str(key), label)
        deadline = None if timeout_ms is None else time.monotonic() + timeout_ms / 1000
        handed = False
        try:
            # Inside the try, as in ProcessSession.acquire.
            if not self.claims.claim(hold, deadline):
                return None
            if deadline is not None:
                # What the wait in the process left, never 0 (lock_timeout 0: unbounded).
                timeout_ms = max(1, math.ceil((deadline - time.monotonic()) * 1000))
            run_ids = None if run is None else run.ids
            if self._pin(hold, key, timeout_ms, bound, run_ids, transaction):
                # From here a pinned connection nobody knows is unlocked at check-in.
                if on_granted is not None:
                    on_granted(hold)
                handed = True
        finally:
            if not handed:
                self.claims.release(hold)  # a no-op if the claim was refused
        return hold if handed else None

    def _take_slot(
        self,
        free: list[Hold],
        slots: tuple[LockKey, ...],
        label: str,
        transaction: bool,
        bound: float,
        run: LockKey | None,
        on_granted: Callable[[Hold], None] | None,
    ) -> Hold | None:
        scope = LockScope.TRANSACTION if transaction else LockScope.SESSION
        server_probe.check(self.engine, scope, slots[0].name)
        for hold in free:
            hold.idle_name = self._name("idle")
            hold.holding_name = self._name(str(slots[hold.slot]), label)
        run_ids = None if run is None else run.ids
        pinned = self._pin(free[0], slots[0], None, bound, run_ids, transaction, free)
        if pinned is not None and on_granted is not None:
            on_granted(pinned)
        return pinned

    def fencing_holder(
        self, hold: Hold, key: LockKey, *, bound: float
    ) -> fencing_tokens.Holder | None:
        connection = hold.connection
        if not _pinned_alive(hold):
            return None
        try:
            with deadlines.bounded(connection, bound), connection.cursor() as cursor:
                if hold.sa_connection is not None:  # which transaction: each time
                    return fencing_tokens.transaction_holder(cursor, key)
                info = hold.pooled.info  # who the session is: once per connection
                if _HOLDER not in info:
                    info[_HOLDER] = fencing_tokens.session_holder(cursor)
                holder: fencing_tokens.Holder = info[_HOLDER]
                return holder
        except BaseException as exc:
            if connection.closed or driver_errors.is_disconnect(exc):
                return None  # its session ended; the release says so
            self._raise(exc, f"issue a fencing token for lock {key.name!r}")

    def on_holder(
        self, hold: Hold, action: str, bound: float, work: Work
    ) -> tuple[Any, ...] | None:
        """As ProcessSession.on_holder, on the hold's pinned connection: session scope
        only (a statement in the lock's transaction would commit with the body)."""
        connection = hold.connection
        if hold.transaction is not None or not _pinned_alive(hold):
            return None
        with deadlines.bounded(connection, bound), connection.cursor() as cursor:
            return work(connection, cursor)

    def _pin(
        self,
        hold: Hold,
        key: LockKey,
        timeout_ms: int | None,
        bound: float,
        run_ids: tuple[int, ...] | None,
        transaction: bool,
        slots: list[Hold] | None = None,
    ) -> Hold | None:
        """Take ``key`` (or the first free of ``slots``) on a pooled connection pinned to
        its hold; None if busy."""
        action = f"acquire lock {key.name!r}"
        with driver_errors.wrap_db_errors(action, self.engine, connecting=True):
            owner: Any = (
                self.engine.connect() if transaction else self.engine.raw_connection()
            )
        pooled: Any = None
        lock_transaction: Any = None
        try:
            pooled = owner.connection if transaction else owner
            dbapi: Any = pooled.dbapi_connection
            dbapi.autocommit = not transaction
            if transaction:
                lock_transaction = owner.begin()
            with dbapi.cursor() as cursor:
                if slots is None:
                    granted, run_granted, discard = _lock(
                        cursor, key, hold, transaction, timeout_ms, bound, run_ids
                    )
                else:
                    with deadlines.bounded(dbapi, bound):
                        chosen, run_granted = _try_slots(
                            cursor, slots, True, run_ids, transaction
                        )
                    granted, discard, hold = chosen is not None, False, chosen or hold
            if not granted:
                if transaction:
                    lock_transaction.rollback()
                elif discard:
                    owner.invalidate()
                owner.close()
                return None
        except BaseException as exc:
            # Unknown state (interrupted mid-statement): closing is the only safe release.
            self._retire_if_dead(pooled, exc)
            owner.invalidate()
            owner.close()
            self._raise(exc, action)
        if transaction:
            hold.sa_connection, hold.transaction = owner, lock_transaction
        else:
            engines.held_keys(pooled.info)[hold.ids] += 1
            pooled.info[engines.IDLE_NAME] = hold.idle_name
        hold.pooled, hold.connection = pooled, dbapi
        # A transaction-level run lock ends with the transaction: nothing to release.
        hold.run_ids = run_ids if run_granted else None
        return hold

    def release(self, hold: Hold, key: LockKey, commit: bool, timeout: float) -> None:
        """Unlock or end the transaction; the connection is closed after any failure."""
        transaction = hold.transaction
        owner: Any = hold.pooled if transaction is None else transaction.connection
        bound: deadlines.Bound | None = None
        try:
            if transaction is None:
                statement, params = sql_text.UNLOCK_SESSION, (*key.ids, hold.idle_name)
                if hold.run_ids is not None:
                    statement = sql_text.UNLOCK_SESSION_RUN
                    params = (*params, *hold.run_ids)
                with (
                    deadlines.bounded(hold.connection, timeout) as bound,
                    hold.connection.cursor() as cursor,
                ):
                    _execute_end(cursor, statement[len(key.ids)], params, hold.row)
                    row = cursor.fetchone()
                held = engines.held_keys(hold.pooled.info)
                held[key.ids] -= 1
                if held[key.ids] <= 0:
                    del held[key.ids]
                if not (row and row[0]):
                    raise exceptions.LockNotOwnedError(
                        f"PostgreSQL says the session no longer held lock {key.name!r} (key {key}) "
                        "at release; the connection was closed instead of being pooled.",
                        key=str(key),
                        name=key.name,
                    )
            else:
                if not transaction.is_active:
                    raise exceptions.LockLostError(
                        f"The transaction of lock {key.name!r} (key {key}) was ended before "
                        "release (committed or rolled back by the task?), so the lock ended early.",
                        key=str(key),
                        name=key.name,
                    )
                # A late answer still counts: the transaction ended, releasing the lock.
                with deadlines.bounded(
                    hold.connection, timeout, late_answer_fails=False
                ) as bound:
                    if commit:
                        transaction.commit()
                    else:
                        transaction.rollback()
                if bound.fired:
                    owner.invalidate()  # the socket was shut down: the session ends
                elif hold.lent:
                    self._discard_all(hold, owner, timeout)
        except BaseException as exc:
            if transaction is None:
                engines.held_keys(hold.pooled.info).clear()
                verb = "release"
            else:
                verb = "commit" if commit else "roll back"
            self._retire_if_dead(hold.pooled, exc)
            owner.invalidate()  # the session's end frees whatever it held
            self._raise(exc, f"{verb} lock {key.name!r}{deadlines.explain(bound)}")
        finally:
            try:
                owner.close()
            finally:  # the run has ended, whatever became of its lock
                self.claims.release(hold)

    def _discard_all(
        self, hold: Hold, connection: sa.Connection, timeout: float
    ) -> None:
        """DISCARD ALL (docs/guide/scopes.md); a failure only costs the connection."""
        try:
            with deadlines.bounded(hold.connection, timeout):
                hold.connection.autocommit = True
                with hold.connection.cursor() as cursor:
                    sql_text.forget_prepared(hold.connection)
                    cursor.execute(sql_text.DISCARD_ALL)
                fallback = startup_options.fallback_of(self.engine)
                if fallback is None or not fallback.carries_settings():
                    # DISCARD ALL restores startup values; ours were SET (startup_options).
                    startup_options.apply_session_settings(hold.connection)
        except Exception as exc:
            logger.debug("DISCARD ALL after lock %s failed", hold.ids, exc_info=True)
            self._retire_if_dead(hold.pooled, exc)
            connection.invalidate()


def _pinned_alive(hold: Hold) -> bool:
    """A per-lock hold whose pinned connection has not ended (as far as we know)."""
    connection = hold.connection
    return hold.lost is None and connection is not None and not connection.closed


def _execute(
    cursor: Any,
    statement: str,
    params: tuple[Any, ...],
    row: queued.Queued | None,
    granted: str = "l.g IS NOT NULL",
    *,
    prepare: Prepare | None = None,
) -> None:
    """Send a lock statement, with ``row``'s start change applied where ``granted``;
    through ``prepare`` if given, and prepared anyway when it changes a row."""
    if row is not None:
        change, extra = row.on_start()
        statement = queued.with_row_change(statement, change, granted)
        params = (*params, *extra)
        prepare = prepare or functools.partial(_prepared, cursor)
    if prepare is not None:
        statement = prepare(statement)
    cursor.execute(statement, params)


def _execute_end(
    cursor: Any,
    statement: str,
    params: tuple[Any, ...],
    row: queued.Queued | None,
    *,
    prepare: Prepare | None = None,
) -> None:
    """Send an unlock statement, with ``row``'s end change if it has one; prepared as
    in ``_execute``."""
    end = None if row is None else row.on_end()
    if end is not None:
        statement = queued.with_row_change(statement, end[0])
        params = (*params, *end[1])
        prepare = prepare or functools.partial(_prepared, cursor)
    if prepare is not None:
        statement = prepare(statement)
    cursor.execute(statement, params)


def _prepared(cursor: Any, statement: str) -> str:
    # A lock statement costs the server more to plan than to run: plan it once per
    # session (benchmarks/README.md, "Planning a lock statement").
    name = sql_text.name_for(statement)
    return sql_text.prepared(cursor.connection, cursor, name, statement)


def _try_named(
    cursor: Any,
    ids: tuple[int, ...],
    name: str | None,
    run_ids: tuple[int, ...] | None,
    transaction: bool = False,
    row: queued.Queued | None = None,
    *,
    prepare: Prepare | None = None,
) -> tuple[bool, bool]:
    """A try-lock that labels the session ``name``: (granted, run lock granted)."""
    if transaction:
        tries = (
            sql_text.TRY_LOCK_TRANSACTION_RUN
            if run_ids
            else sql_text.TRY_LOCK_TRANSACTION
        )
    else:
        tries = sql_text.TRY_LOCK_SESSION_RUN if run_ids else sql_text.TRY_LOCK_SESSION
    params = (*ids, name, *(run_ids or ()))
    _execute(cursor, tries[len(ids)], params, row, prepare=prepare)
    answer = cursor.fetchone()
    granted = answer is not None and answer[0] is not None
    return granted, granted and run_ids is not None and answer[0][1] == "true"


def _try_slots(
    cursor: Any,
    holds: list[Hold],
    named: bool,
    run_ids: tuple[int, ...] | None,
    transaction: bool = False,
    *,
    prepare: Prepare | None = None,
) -> tuple[Hold | None, bool]:
    """The one of ``holds`` its slot statement (sql_text.try_slots) granted, labelled with
    its ``holding_name`` if ``named``; and whether the run lock was granted."""
    statement = sql_text.try_slots(
        transaction=transaction, named=named, run=run_ids is not None
    )
    if prepare is not None:
        statement = prepare(statement)
    names = [hold.holding_name for hold in holds] if named else None
    ids = [hold.ids for hold in holds]
    cursor.execute(statement, sql_text.slot_params(ids, names, run_ids))
    row = cursor.fetchone()
    if row is None or row[0] is None:
        return None, False
    granted = holds[int(row[0][0]) - 1]
    return granted, run_ids is not None and row[0][-1] == "true"


def _lock(
    cursor: Any,
    key: LockKey,
    hold: Hold,
    transaction: bool,
    timeout_ms: int | None,
    bound: float,
    run_ids: tuple[int, ...] | None,
) -> tuple[bool, bool, bool]:
    """Try (``timeout_ms`` None) or wait: (granted, run lock granted, discard session)."""
    connection, arity, name = cursor.connection, len(key.ids), hold.holding_name
    if timeout_ms is None:
        with deadlines.bounded(connection, bound):
            granted = _try_named(cursor, key.ids, name, run_ids, transaction, hold.row)
            return (*granted, False)
    waits = (
        sql_text.WAIT_LOCK_TRANSACTION if transaction else sql_text.WAIT_LOCK_SESSION
    )
    try:
        # lock_timeout bounds the wait server-side; bound, a server that never answers.
        with deadlines.bounded(connection, timeout_ms / 1000 + bound):
            cursor.execute(waits[arity], (str(timeout_ms), name, *key.ids))
    except Exception as exc:
        code = driver_errors.sqlstate(exc)
        if code not in (sql_text.LOCK_NOT_AVAILABLE, sql_text.QUERY_CANCELED):
            raise
        if transaction:
            connection.rollback()  # ends the transaction and the wait
            return False, False, False
        if code == sql_text.QUERY_CANCELED:
            # A cancel may land after the grant, and a session lock outlives the BEGIN.
            return False, False, True
        # lock_timeout: nothing granted; psycopg2's rollback() is a no-op in autocommit.
        with deadlines.bounded(connection, bound):
            cursor.execute(sql_text.ROLLBACK)
        return False, False, False
    if run_ids is None and hold.row is None:
        return True, False, False
    # Granted: the row changes with the run lock (or alone, if there is none).
    statement = (
        sql_text.RUN_LOCK_TRANSACTION if transaction else sql_text.RUN_LOCK_SESSION
    )
    with deadlines.bounded(connection, bound):
        if run_ids is None:
            statement, run_ids = "SELECT false", ()
        _execute(cursor, statement, run_ids, hold.row, "true")
        row = cursor.fetchone()
    return True, bool(row and row[0]), False


_process: dict[sa.Engine, ProcessSession] = {}
#: Claims per engine; they outlive close_for() (a run keeps its key until its release).
_claims: weakref.WeakKeyDictionary[sa.Engine, Claims] = weakref.WeakKeyDictionary()
_registry_guard = threading.Lock()
#: A forked child's copies of its parent's sessions, kept so no finaliser writes to them.
_inherited: list[ProcessSession] = []
_per_lock_only = False


def for_lock(
    engine: sa.Engine, *, transaction: bool = False
) -> ProcessSession | PerLockSessions:
    session = _process.get(engine) or process_session(engine)
    return session.waits if transaction or _per_lock_only else session


def process_session(engine: sa.Engine) -> ProcessSession:
    with _registry_guard:
        session = _process.get(engine)
        if session is None:
            claims = _claims.setdefault(engine, Claims())
            session = _process[engine] = ProcessSession(engine, claims)
        return session


def open_process_session(engine: sa.Engine) -> ProcessSession | None:
    return _process.get(engine)


def use_per_lock_sessions(enabled: bool = True) -> None:
    """For tests: put each new lock of this process on a pinned connection of its own."""
    global _per_lock_only
    _per_lock_only = enabled


def close_all() -> None:
    for engine in list(_process):
        close_for(engine)


def close_for(engine: sa.Engine) -> None:
    """Close the session of ``engine``, which dispose() leaves alone (every lock is on it)."""
    with _registry_guard:
        session = _process.pop(engine, None)
    if session is not None:
        session.close()


def _after_fork_in_child() -> None:
    global _registry_guard
    _registry_guard = threading.Lock()  # another thread of the parent may have held it
    _inherited.extend(_process.values())
    _process.clear()
    _claims.clear()  # the parent's runs: none of them runs in this child


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
