"""The process session: one connection for every session-scope try-lock of the process,
under a mutex; and the registry that gives each engine its one (:func:`for_lock`). Why: docs/design.md ("One lock session per process")."""

from __future__ import annotations

import logging
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any

from celery_pglock import exceptions
from celery_pglock.config import LockScope
from celery_pglock.db import (
    deadlines,
    driver_errors,
    engines,
    forks,
    server_probe,
    sql_text,
)
from celery_pglock.lock import identity
from celery_pglock.lock.sessions import base
from celery_pglock.lock.sessions.per_lock import PerLockSessions

if TYPE_CHECKING:
    import sqlalchemy as sa

    from celery_pglock.keys import LockKey
    from celery_pglock.lock.rider import Rider

logger = logging.getLogger(__name__)


class SessionBusyError(Exception):
    """The lock session was kept busy by other statements until a check's deadline."""


class ProcessSession(base.LockSessions):
    """One connection for all session-scope try-locks, under a mutex; a wait or
    transaction scope goes to ``waits`` (docs/design.md, "One lock session per process")."""

    def __init__(self, engine: sa.Engine, claims: base.Claims) -> None:
        super().__init__(engine, claims)
        self.waits = PerLockSessions(engine, claims)
        self._mutex = threading.Lock()
        self._pooled: Any = None  # the detached pool proxy owning the connection
        self._connection: Any = None
        self._cursor: Any = None
        self._bound: Any = None  # a base.RearmedBound while connected
        self._identity: identity.Identity | None = None  # asked once per connection
        self._shown: str | None = None  # the application_name the session shows
        self._since = 0  # the epoch second it shows: when it last began to hold keys
        #: key ids -> hold on the current connection (a lost hold leaves; its claim stays).
        self._owners: dict[tuple[int, ...], base.Hold] = {}
        self._runs: dict[tuple[int, ...], base.Hold] = {}  #: run lock ids -> its hold.
        #: Statement -> the EXECUTE of it prepared on the current connection.
        self._executes: dict[str, str] = {}

    def acquire(self, request: base.AcquireRequest) -> base.Hold | None:
        if request.transaction:
            return self.waits.acquire(request)
        hold = super().acquire(request)
        if hold is not None or request.timeout_ms is None:
            return hold
        return self.waits.acquire(request)  # busy: wait on a connection of its own

    def _recorded(self, hold: base.Hold) -> bool:
        return self._owners.get(hold.ids) is hold

    def _take(
        self,
        request: base.AcquireRequest,
        free: list[base.Hold],
        deadline: float | None,
    ) -> base.Hold | None:
        key = request.slots[0]
        with self._mutex:
            # A run lock already held here (one task id twice) is not re-entered, so
            # this run's release ends no other run's.
            run = request.run
            run_ids = None if run is None or run.ids in self._runs else run.ids
            if self._cursor is None:
                self._connect(key)
            # The epoch second of the keys already held, else now (docs/operations/
            # monitoring.md, application_name); whole: a run within it needs no relabel.
            since = self._since if self._owners else int(time.time())
            name = self._name(f"@{since}", request.label)
            try:
                # Bounded: a frozen link would stall every lock statement here.
                with self._bound(request.bound):
                    if len(request.slots) == 1 and request.companions:
                        granted, run_granted = self._try_with_companions(
                            free[0], request.companions, name, run_ids, request.rider
                        )
                        chosen = free[0] if granted else None
                    elif len(request.slots) == 1:
                        granted, run_granted = self._try(
                            free[0].ids, name, run_ids, request.rider
                        )
                        chosen = free[0] if granted else None
                    else:
                        for hold in free:
                            hold.holding_name = name
                        chosen, run_granted = base.try_slots(
                            self._cursor,
                            free,
                            name != self._shown,
                            run_ids,
                            prepare=self._ready,
                        )
                if chosen is not None:  # recorded inside the try, for the same reason
                    self._shown = chosen.holding_name = name
                    self._since = since
                    chosen.connection = self._connection
                    self._owners[chosen.ids] = chosen
                    if chosen.companion is not None:
                        chosen.companion.connection = self._connection
                        self._owners[chosen.companion.ids] = chosen.companion
                    if run_granted and run_ids is not None:
                        chosen.run_ids = run_ids
                        self._runs[run_ids] = chosen
                    if request.on_granted is not None:
                        request.on_granted(chosen)
            except BaseException as exc:
                self._fail(f"acquiring lock {key.name!r} failed: {exc!r}", exc)
                self._raise(exc, f"acquire lock {key.name!r}")
            return chosen

    def _try_with_companions(
        self,
        hold: base.Hold,
        companions: tuple[LockKey, ...],
        name: str,
        run_ids: tuple[int, ...] | None,
        rider: Rider | None,
    ) -> tuple[bool, bool]:
        """Under the mutex: the key and, in its statement, the first of ``companions``
        free here (claimed first, as slots are: this session would re-enter a companion
        another run of the process holds) and in PostgreSQL; ``hold.companion``: which."""
        claims, pending = self.claims, base.Hold(self, ())
        free = claims.claim_free(companions, pending)
        hold.companions_tried = True
        taken: LockKey | None = None
        try:
            if not free:  # every one held by runs of this process
                return self._try(hold.ids, name, run_ids, rider)
            label = None if name == self._shown else name
            granted, run_granted, taken = base.try_with_companion(
                self._cursor, hold.ids, free, label, run_ids, rider, prepare=self._ready
            )
            if taken is not None:
                hold.companion = base.Hold(self, taken.ids)
            return granted, run_granted
        finally:
            claims.release_all(free, pending, keep=hold.companion)

    def _try(
        self,
        ids: tuple[int, ...],
        name: str,
        run_ids: tuple[int, ...] | None,
        rider: Rider | None,
    ) -> tuple[bool, bool]:
        cursor, ready = self._cursor, self._ready
        if name != self._shown:  # a relabel costs about what the lock does
            return base.try_named(
                cursor, ids, name, run_ids, False, rider, prepare=ready
            )
        # Already labelled ``name``: a bare try-lock leaves the label as it is.
        if run_ids is None:
            statement = sql_text.TRY_LOCK_SESSION_BARE[len(ids)]
            row = base.execute(cursor, statement, ids, rider, "l.g", prepare=ready)
            return row is not None and row[0] is True, False
        statement = sql_text.TRY_LOCK_SESSION_BARE_RUN[len(ids)]
        row = base.execute(cursor, statement, (*ids, *run_ids), rider, prepare=ready)
        return row is not None and row[0] is not None, bool(row and row[0])

    def release(
        self, hold: base.Hold, key: LockKey, commit: bool, timeout: float
    ) -> None:
        """Unlock, then forget the hold (raises as AdvisoryLock.release). Interrupted
        before the unlock, the hold is still recorded: see still_holds."""
        ids, run_ids, companion = hold.ids, hold.run_ids, hold.companion
        with self._mutex:
            # Under the mutex: no try-lock of the process runs before the unlock below.
            if self._owners.get(ids) is not hold:
                self._forget(hold)
                raise exceptions.LockNotOwnedError(
                    f"The process's lock session ended while lock {key.name!r} (key {key}) was "
                    f"held ({hold.lost or 'closed'}), so PostgreSQL had already freed the lock.",
                    key=str(key),
                    name=key.name,
                )
            if run_ids is None:
                unlock, args = sql_text.UNLOCK_SESSION_KEEP_NAME[len(ids)], ids
            else:
                unlock = sql_text.UNLOCK_SESSION_KEEP_NAME_RUN[len(ids)]
                args = (*ids, *run_ids)
            if companion is not None:  # released in the key's statement
                unlock = sql_text.unlock_with_companion(
                    arity=len(ids),
                    run=run_ids is not None,
                )
                args = (*args, *companion.ids)
            bound, cursor = self._bound, self._cursor
            try:
                with bound(timeout):
                    row = base.execute(
                        cursor, unlock, args, hold.rider, prepare=self._ready, end=True
                    )
            except BaseException as exc:
                self._forget(hold)
                self._fail(f"releasing lock {key.name!r} failed: {exc!r}", exc)
                why = deadlines.explain(bound)
                self._raise(exc, f"release lock {key.name!r}{why}")
            self._forget(hold)
        if not (row and row[0]):
            # Unlocked behind our back; closing the session would free every other lock.
            raise exceptions.LockNotOwnedError(
                f"PostgreSQL says the process's lock session no longer held lock {key.name!r} "
                f"(key {key}) at release; the session is kept for its other locks.",
                key=str(key),
                name=key.name,
            )

    def _forget(self, hold: base.Hold) -> None:
        """Under the mutex: the hold and its companion leave; their claims go back. One
        call, then neither call nor loop: an interrupt lands before it (the hold is still
        recorded: released again at task_postrun) or not at all."""
        companion, owners = hold.companion, self._owners
        self.claims.release(hold, companion)
        if owners.get(hold.ids) is hold:
            del owners[hold.ids]
        if companion is not None and owners.get(companion.ids) is companion:
            del owners[companion.ids]
        if hold.run_ids is not None and self._runs.get(hold.run_ids) is hold:
            del self._runs[hold.run_ids]

    def still_holds(self, hold: base.Hold) -> bool:
        with self._mutex:
            return self._still_holds(hold)

    def identity(
        self, hold: base.Hold, key: LockKey, *, bound: float
    ) -> identity.Identity | None:
        with self._mutex:
            if not self._still_holds(hold):
                return None  # the session that was granted the key has ended
            if self._identity is None:
                try:
                    with self._bound(bound):
                        self._identity = identity.of_session(self._cursor)
                except BaseException as exc:
                    if self._ended(f"naming the session failed: {exc!r}", exc):
                        return None
                    self._raise(exc, f"issue a fencing token for lock {key.name!r}")
            return self._identity

    def on_holder(
        self, hold: base.Hold, action: str, bound: float, work: base.Work
    ) -> tuple[Any, ...] | None:
        """As AdvisoryLock.on_holding_session, under the mutex."""
        with self._mutex:
            if not self._still_holds(hold):
                return None
            try:
                with self._bound(bound):
                    return work(self._connection, self._cursor)
            except BaseException as exc:
                self._ended(f"{action} failed: {exc!r}", exc)
                raise

    def _still_holds(self, hold: base.Hold) -> bool:
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

    def lose(self, cause: str) -> list[base.Hold]:
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
        self._bound = base.RearmedBound(dbapi)
        deadlines.watch(self._bound)
        self._shown = None
        self._executes = {}

    def _ready(self, statement: str) -> str:
        """Under the mutex: ``statement`` as an EXECUTE, prepared on first use (see
        base.prepared); every statement this session sends goes through here."""
        execute = self._executes.get(statement)
        if execute is None:
            execute = self._executes[statement] = base.prepared(self._cursor, statement)
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
            engines.mark_pool_stale(self.engine, None)

    def _close(self, cause: str) -> list[base.Hold]:
        """Under the mutex: end the session; its holds are lost but stay claimed."""
        connection, self._connection = self._connection, None
        if self._bound is not None:
            deadlines.unwatch(self._bound)
        self._pooled = self._cursor = self._identity = self._bound = None
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


# -- the registry: one process session per engine, made on first use, forgotten at fork.

_process: dict[sa.Engine, ProcessSession] = {}
#: Claims per engine; they outlive close_for() (a run keeps its key until its release).
_claims: weakref.WeakKeyDictionary[sa.Engine, base.Claims] = weakref.WeakKeyDictionary()
_registry_guard = forks.safe_lock()
#: A forked child's copies of its parent's sessions, kept so no finaliser writes to them.
_inherited: list[ProcessSession] = []


def for_lock(
    engine: sa.Engine, *, transaction: bool = False
) -> ProcessSession | PerLockSessions:
    session = _process.get(engine) or process_session(engine)
    return session.waits if transaction else session


def process_session(engine: sa.Engine) -> ProcessSession:
    with _registry_guard:
        session = _process.get(engine)
        if session is None:
            claims = _claims.setdefault(engine, base.Claims())
            session = _process[engine] = ProcessSession(engine, claims)
        return session


def open_process_session(engine: sa.Engine) -> ProcessSession | None:
    return _process.get(engine)


def close_all() -> None:
    for engine in list(_process):
        close_for(engine)


def close_for(engine: sa.Engine) -> None:
    """Close the session of ``engine``, which dispose() leaves alone (every lock is on it)."""
    with _registry_guard:
        session = _process.pop(engine, None)
    if session is not None:
        session.close()


@forks.reset_in_child
def _after_fork_in_child() -> None:
    _inherited.extend(_process.values())
    _process.clear()
    _claims.clear()  # the parent's runs: none of them runs in this child
