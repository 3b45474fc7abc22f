"""What both session strategies share: the hold, the acquire request, the claims, the
acquire routine and the lock statements. Why: docs/design.md (Layers, Decisions)."""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import os
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any, NamedTuple, NoReturn, TypeGuard

from celery_pglock.db import deadlines, driver_errors, engines, sql_text
from celery_pglock.lock import rider as riders

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    import sqlalchemy as sa

    from celery_pglock.keys import LockKey
    from celery_pglock.lock.sessions.per_lock import PerLockSessions
    from celery_pglock.lock.sessions.process import ProcessSession

    #: A statement run on a holder's own session: (DBAPI connection, cursor) -> its row.
    Work = Callable[[Any, Any], tuple[Any, ...]]
    #: A statement -> the EXECUTE of it prepared on the session that will send it.
    Prepare = Callable[[str], str]

logger = logging.getLogger(__name__)

DEFAULT_ROUND_TRIP_TIMEOUT = 5.0  #: AdvisoryLock.round_trip_timeout's, in seconds.


class RearmedBound(deadlines.Bound):
    """The process session's deadline, armed in __enter__ (an interrupt there: not armed)."""

    __slots__ = ("seconds",)
    rearmed = True

    def __call__(self, seconds: float) -> RearmedBound:
        self.seconds = seconds
        return self

    def __enter__(self) -> RearmedBound:
        self.fired = False
        self.deadline = time.monotonic() + self.seconds
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *rest: object) -> None:
        with deadlines.guard:
            self.deadline = math.inf
        if self.fired and exc_type is None:
            # The answer came after the socket was shut down: the session is ending.
            raise driver_errors.operational_error(self.connection)(deadlines.NO_ANSWER)


class AcquireRequest(NamedTuple):
    """One acquire, as AdvisoryLock asks it of a session strategy. Immutable; a
    NamedTuple because a frozen dataclass costs ~11k instructions to build, per run."""

    #: The key, or lock_limit's slot keys (keys.slot_keys): the first free one is taken.
    slots: tuple[LockKey, ...]
    label: str  #: Shown in application_name while held.
    timeout_ms: int | None  #: None: try once; else wait (lock_timeout), one key only.
    transaction: bool  #: Transaction scope: the lock ends with its transaction.
    bound: float  #: Seconds a round trip may take before its socket is shut.
    run: LockKey | None = None  #: acks_late: the run lock taken beside the key.
    #: A feature's statement sent with the grant and release.
    rider: riders.Rider | None = None
    #: Gets the hold once recorded: a soft time limit then cannot orphan it.
    on_granted: Callable[[Hold], None] | None = None
    #: Keys (bigint) of which one more is taken with the key, in its statement, where the
    #: strategy can (the process session's try): lock_group's slots. Hold.companion: which.
    companions: tuple[LockKey, ...] = ()


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
    rider: riders.Rider | None = None  # sent with the grant and the release
    slot: int = 0  # lock_limit: which of the key's slots (keys.slot_keys) ids is
    companions_tried: bool = False  # the request's companions were tried with the key
    companion: Hold | None = None  # the one of them taken, released with the key
    thread: int = dataclasses.field(default_factory=threading.get_ident)  # its acquirer
    in_flight: bool = True  # its acquire has not ended: granted or not, it will say


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

    def claim(
        self, hold: Hold, deadline: float | None = None, settle: float | None = None
    ) -> bool:
        """False if another run still holds ``hold.ids`` at monotonic ``deadline``
        (None: at once), or at ``settle`` if another thread's acquire in flight claimed
        it (slots: it takes one and gives the others back). Blocks; pair with release."""
        ids = hold.ids
        with self._mutex:
            while _taken(holder := self._holder(ids)):
                until = deadline
                if (
                    settle is not None
                    and holder.in_flight
                    and holder.connection is None
                ):
                    until = max(deadline or 0.0, settle)
                remaining = 0.0 if until is None else until - time.monotonic()
                if remaining <= 0:
                    return False
                self._waiting += 1
                try:
                    self._cond.wait(min(remaining, self.POLL))
                finally:
                    self._waiting -= 1
            self._held[ids] = weakref.ref(hold)
            return True

    def release(self, hold: Hold, companion: Hold | None = None) -> None:
        """Both claims given back with no Python call or loop between (no interrupt)."""
        with self._mutex:
            ref = self._held.get(hold.ids)
            if ref is not None and ref() is hold:
                del self._held[hold.ids]
            ref = None if companion is None else self._held.get(companion.ids)
            if ref is not None and ref() is companion:
                del self._held[companion.ids]  # type: ignore[union-attr]
            if self._waiting:
                self._cond.notify_all()

    def wake(self) -> None:
        """An acquire ended: a claim waiting for it looks again."""
        if self._waiting:
            with self._mutex:
                self._cond.notify_all()

    def claim_free(self, keys: Sequence[LockKey], hold: Hold) -> list[LockKey]:
        """Those of ``keys`` no run of the process holds, claimed for ``hold`` at once
        (one mutex for them all: a group has up to 64 slots). Pair with release_all."""
        ref = weakref.ref(hold)
        with self._mutex:
            free = [key for key in keys if not _taken(self._holder(key.ids))]
            for key in free:
                self._held[key.ids] = ref
        return free

    def release_all(
        self, keys: Sequence[LockKey], hold: Hold, keep: Hold | None = None
    ) -> None:
        """Give back ``hold``'s claims of ``keys``, but hand ``keep.ids`` to ``keep``."""
        with self._mutex:
            for key in keys:
                if self._holder(key.ids) is hold:
                    del self._held[key.ids]
            if keep is not None:
                self._held[keep.ids] = weakref.ref(keep)
            if self._waiting:
                self._cond.notify_all()

    def _holder(self, ids: tuple[int, ...]) -> Hold | None:
        ref = self._held.get(ids)
        return None if ref is None else ref()


def _taken(holder: Hold | None) -> TypeGuard[Hold]:
    """Claimed, unless by this thread's ended acquire, ungranted (docs/design.md)."""
    return holder is not None and (
        holder.connection is not None or holder.thread != threading.get_ident()
    )


class LockSessions:
    """A strategy's base: :meth:`acquire` claims, its ``_take`` takes (docs/design.md)."""

    #: A bounded wait also waits for a claim held by another run of the process.
    _claims_wait = False

    def __init__(self, engine: sa.Engine, claims: Claims) -> None:
        self.engine = engine
        self.claims = claims  #: Shared by both strategies of ``engine``.
        self.pid = os.getpid()
        self._prefix = engines.engine_info(engine)["application_name_prefix"]
        self._names: dict[tuple[str, ...], str] = {}

    def acquire(self, request: AcquireRequest) -> Hold | None:
        """The hold of the key (or of the first free slot), or None if busy."""
        slots, claims = request.slots, self.claims
        if len(slots) == 1:  # the everyday case, without the slots' lists
            holds: Sequence[Hold] = (Hold(self, slots[0].ids, rider=request.rider),)  # type: ignore[arg-type]
        else:
            holds = [
                Hold(self, key.ids, rider=request.rider, slot=slot)  # type: ignore[arg-type]
                for slot, key in enumerate(slots)
            ]
        deadline = None  # monotonic: until when a claim of another run is waited for
        if self._claims_wait and request.timeout_ms is not None:
            deadline = time.monotonic() + request.timeout_ms / 1000
        # Slots: another thread's acquire claims every free one for its statement and
        # takes one; wait (a round trip at most) for it to say which.
        settle = time.monotonic() + request.bound if len(slots) > 1 else None
        granted = None
        try:
            # In the try: a soft time limit after a claim must not orphan the key.
            free = [hold for hold in holds if claims.claim(hold, deadline, settle)]
            if free:  # else all are claimed here: busy without a round trip
                granted = self._take(request, free, deadline)
        finally:
            for hold in holds:
                hold.in_flight = False
            claims.wake()
            for hold in holds:
                if hold is not granted and not self._recorded(hold):
                    claims.release(hold)  # a no-op if its claim was refused
        return granted

    def _take(
        self, request: AcquireRequest, free: list[Hold], deadline: float | None
    ) -> Hold | None:
        """The granted one of the claimed ``free`` holds, recorded and handed to
        ``request.on_granted``; None if busy."""
        raise NotImplementedError

    def _recorded(self, hold: Hold) -> bool:
        """``hold`` was granted and recorded, even if ``_take`` did not return it."""
        return False

    def still_holds(self, hold: Hold) -> bool:
        """After an interrupted release: the key is still held for ``hold``, to release
        again. False here: a strategy that ends the session of an interrupted release."""
        return False

    def holder_of(self, key: LockKey, *, bound: float) -> str | None:
        """``"<backend pid> <application_name>"`` of ``key``'s holder; None if unknown."""
        what = f"looking up the holder of {key.name!r}"
        row = self._one_row(what, sql_text.HOLDER, key.pg_locks_ids, bound)
        return None if row is None else row[0]

    def run_alive(self, run: LockKey, *, bound: float) -> bool | None:
        what = f"checking run lock {run}"
        row = self._one_row(what, sql_text.RUN_ALIVE, (*run.ids, *run.ids), bound)
        return None if row is None else bool(row[0])

    def _one_row(
        self, what: str, statement: str, params: tuple[Any, ...], bound: float
    ) -> tuple[Any, ...] | None:
        """The row; None on failure (DEBUG log: a lookup adds detail, never decides)."""
        try:
            with engines.autocommit_cursor(self.engine, bound) as cursor:
                cursor.execute(statement, params)
                row: tuple[Any, ...] | None = cursor.fetchone()
        except Exception:
            logger.debug("%s failed", what, exc_info=True)
            return None
        return row

    def _retire_if_dead(self, pooled: Any, exc: BaseException) -> None:
        if driver_errors.is_disconnect(exc):
            engines.mark_pool_stale(self.engine, pooled)

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


# -- the lock statements both strategies send, each with a rider in the same round trip.


def execute(
    cursor: Any,
    statement: str,
    params: tuple[Any, ...],
    rider: riders.Rider | None,
    granted: str = "l.g IS NOT NULL",
    *,
    prepare: Prepare | None = None,
    end: bool = False,
) -> tuple[Any, ...] | None:
    """Send a lock statement with ``rider``'s grant change applied where ``granted``, or
    (``end``) an unlock with its release change if any; through ``prepare`` if given,
    and prepared anyway when a change comes with it. Its row; a grant change's count of
    changed rows (its last column) goes to the rider."""
    change = None if rider is None else rider.on_release() if end else rider.on_grant()
    if change is not None:
        statement = riders.riding(statement, change[0], "true" if end else granted)
        params = (*params, *change[1])
        prepare = prepare or functools.partial(prepared, cursor)
    if prepare is not None:
        statement = prepare(statement)
    if statement.startswith(sql_text.PLAN_GUARD):
        # A rider's table. Tested here so that a bare lock statement runs no sql_text code.
        sql_text.run(cursor, statement, params)
    else:
        cursor.execute(statement, params)
    row: tuple[Any, ...] | None = cursor.fetchone()
    if change is not None and not end and row is not None:
        rider.on_reply(row[-1])  # type: ignore[union-attr]
    return row


def prepared(cursor: Any, statement: str) -> str:
    # A lock statement costs the server more to plan than to run: plan it once per
    # session (benchmarks/README.md, "Planning a lock statement").
    name = sql_text.name_for(statement)
    return sql_text.prepared(cursor.connection, cursor, name, statement)


def try_named(
    cursor: Any,
    ids: tuple[int, ...],
    name: str | None,
    run_ids: tuple[int, ...] | None,
    transaction: bool = False,
    rider: riders.Rider | None = None,
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
    answer = execute(cursor, tries[len(ids)], params, rider, prepare=prepare)
    if answer is None or answer[0] is None:
        return False, False
    return True, run_ids is not None and answer[0][1] == "true"


def try_with_companion(
    cursor: Any,
    ids: tuple[int, ...],
    companions: Sequence[LockKey],
    name: str | None,
    run_ids: tuple[int, ...] | None,
    rider: riders.Rider | None,
    *,
    prepare: Prepare | None = None,
) -> tuple[bool, bool, LockKey | None]:
    """The key (labelled ``name`` unless None) and the first free of ``companions``:
    (granted, run lock granted, the companion taken or None)."""
    statement = sql_text.try_with_companion(
        arity=len(ids), named=name is not None, run=run_ids is not None
    )
    array = sql_text.companion_array(tuple(key.ids for key in companions))
    params = (*ids, array, *(() if name is None else (name,)), *(run_ids or ()))
    row = execute(cursor, statement, params, rider, prepare=prepare)
    if row is None or row[0] is None:
        return False, False, None
    position = int(row[0][0])
    companion = companions[position - 1] if position else None
    return True, run_ids is not None and row[0][-1] == "true", companion


def try_slots(
    cursor: Any,
    holds: Sequence[Hold],
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
