"""lock_limit's slots on a real PostgreSQL: one statement takes at most one slot, the
process's claims keep its session from re-entering a slot, and waits poll, bounded."""

from __future__ import annotations

import threading
import time
import zlib

import pytest

from celery_pglock import AdvisoryLock, LockLostError, keys
from celery_pglock.db import engines, sql_text
from celery_pglock.lock import holder_lookup, sessions
from celery_pglock.testing import _support

from ...unit.test_limit import VECTORS

#: Advisory locks a backend holds among some keys (pg_locks).
HELD = (
    "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted "
    "AND pid = %s AND (classid, objid, objsubid) IN "
    "(SELECT * FROM unnest(%s::oid[], %s::oid[], %s::int2[]))"
)


def held(cursor, pid, slots):
    columns = [list(ids) for ids in zip(*(k.pg_locks_ids for k in slots), strict=True)]
    cursor.execute(HELD, (pid, *columns))
    return cursor.fetchone()[0]


@pytest.fixture
def slots(namespace):
    return keys.slot_keys(keys.make_key(namespace, "it.limit"), 3)


@pytest.fixture
def connections(database_url):
    opened = []

    def connect():
        connection = _support.connect(database_url, application_name="it limit")
        connection.autocommit = True
        opened.append(connection)
        return connection

    yield connect
    for connection in opened:
        connection.close()


@pytest.fixture
def engine_factory(database_url, session_mode):
    made = []

    def make():
        engine = engines.create_engine(database_url)
        made.append(engine)
        return engine

    yield make
    for engine in made:
        sessions.close_for(engine)
        engine.dispose()


def slotted(engine, slots, **options):
    lock = AdvisoryLock(engine=engine, key=slots[0], **options)
    lock.slots = slots
    return lock


def test_five_sessions_on_three_slots_get_0_1_2_then_busy(connections, slots):
    """The slot statement, sent by five sessions in turn: slots 0, 1, 2, then no row
    twice, and each session holds exactly one lock of the key (none when busy)."""
    statement = sql_text.try_slots(transaction=False, named=False, run=False)
    params = sql_text.slot_params([key.ids for key in slots], None, None)
    observer = connections().cursor()
    got = []
    for _ in range(5):
        connection = connections()
        with connection.cursor() as cursor:
            cursor.execute(statement, params)
            row = cursor.fetchone()
            got.append(None if row is None else int(row[0][0]) - 1)
            assert (0 if row is None else 1) == held(
                observer, connection.info.backend_pid, slots
            )
    assert [0, 1, 2, None, None] == got


def test_a_set_form_would_take_every_slot(connections, slots):
    """Why the statement is a CASE: a filter over the slots with an ORDER BY evaluates
    pg_try_advisory_lock for every row, and holds all of them for one answer."""
    connection = connections()
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT i FROM unnest(%s::bigint[]) WITH ORDINALITY s(k, i) "
            "WHERE pg_try_advisory_lock(k) ORDER BY k DESC LIMIT 1",
            ([key.ids[0] for key in slots],),
        )
        assert 1 == len(cursor.fetchall())
        assert 3 == held(cursor, connection.info.backend_pid, slots)
        cursor.execute("SELECT pg_advisory_unlock_all()")


#: Which of five slots another session holds, per execution: every pattern of 5 bits
#: once (none, all, gaps), then a few again; 36 executions, well past the 5 custom plans
#: after which PostgreSQL may switch a prepared statement to its generic plan.
HELD_PATTERNS = [(i * 11) % 32 for i in range(36)]


@pytest.mark.parametrize("plan", ["force_generic_plan", "force_custom_plan"])
@pytest.mark.parametrize(("named", "run"), [(False, False), (True, True)])
def test_the_prepared_slot_statement_takes_the_first_free_slot_only(
    connections, namespace, plan, named, run
):
    """One prepared slot statement on one session, executed 36 times under either plan,
    with 0 to 5 of the 5 slots (an (int, int) slot 0 and bigint ones) held by another
    session in every pattern: each time it takes exactly the first free slot, and only
    that one (with the run lock if asked), or nothing when all are held."""
    slot0 = (zlib.crc32(namespace.encode()) - 2**31, 7)
    slots = keys.slot_keys(keys.LockKey(name="it.generic", ids=slot0), 5)
    run_key = keys.run_key(namespace)
    session, other = connections(), connections()
    statement = sql_text.try_slots(transaction=False, named=named, run=run)
    names = [f"it slot {slot}" for slot in range(5)] if named else None
    params = sql_text.slot_params(
        [key.ids for key in slots], names, run_key.ids if run else None
    )
    pid = session.info.backend_pid
    taken = []
    with session.cursor() as cursor, other.cursor() as holder:
        cursor.execute(f"SET plan_cache_mode = {plan}")
        name = sql_text.name_for(statement)
        execute = sql_text.prepared(session, cursor, name, statement)
        for pattern in HELD_PATTERNS:
            busy = [key for slot, key in enumerate(slots) if pattern >> slot & 1]
            for key in busy:
                holder.execute(
                    f"SELECT pg_advisory_lock({', '.join(['%s'] * len(key.ids))})",
                    key.ids,
                )
            free = [slot for slot in range(5) if not pattern >> slot & 1]
            cursor.execute(execute, params)
            row = cursor.fetchone()
            got = None if row is None else int(row[0][0]) - 1
            taken.append(
                (
                    got,
                    held(holder, pid, slots),
                    held(holder, pid, [run_key]),
                    row[0][1] if row is not None and named else None,
                )
            )
            assert (
                free[0] if free else None,
                1 if free else 0,
                1 if free and run else 0,
                f"it slot {free[0]}" if free and named else None,
            ) == taken[-1], f"pattern {pattern:05b}"
            cursor.execute("SELECT pg_advisory_unlock_all()")
            holder.execute("SELECT pg_advisory_unlock_all()")
        cursor.execute(
            "SELECT generic_plans, custom_plans FROM pg_prepared_statements "
            "WHERE name = %s",
            (name,),
        )
        generic, custom = cursor.fetchone()
    assert 36 == (generic if plan == "force_generic_plan" else custom)


def test_a_session_prepares_one_slot_statement_whatever_the_free_slots(
    database_url, namespace
):
    """The process session tries every set of free slots of a lock_limit=4 key (its own
    runs hold the others): PREPAREd statements stay one per form, not one per set."""
    slots = keys.slot_keys(keys.make_key(namespace, "it.prepared"), 4)
    engine = engines.create_engine(database_url)
    try:
        for mine in range(15):  # which slots this process's runs hold: never all four
            runs = [slotted(engine, slots) for _ in range(4)]
            assert all(lock.acquire() for lock in runs)
            for slot, lock in enumerate(runs):
                if not mine >> slot & 1:
                    lock.release()
            extra = slotted(engine, slots)
            assert extra.acquire()
            first_free = next(slot for slot in range(4) if not mine >> slot & 1)
            assert slots[first_free] == extra.key
            extra.release()
            for slot, lock in enumerate(runs):
                if mine >> slot & 1:
                    lock.release()
        with sessions.process_session(engine)._connection.cursor() as cursor:
            cursor.execute("SELECT name FROM pg_prepared_statements")
            prepared = {name for (name,) in cursor.fetchall()}
    finally:
        sessions.close_for(engine)
        engine.dispose()
    forms = {
        sql_text.name_for(sql_text.try_slots(transaction=False, named=named, run=False))
        for named in (False, True)
    }
    unlocks = {sql_text.name_for(sql_text.UNLOCK_SESSION_KEEP_NAME[1])}
    assert forms | unlocks == prepared


def test_locks_of_five_processes_take_three_slots(engine_factory, slots, connections):
    """AdvisoryLocks on five engines (five processes' sessions): slots 0, 1, 2, then
    busy; the held key is the granted slot's, and its release frees that slot."""
    locks = [slotted(engine_factory(), slots) for _ in range(5)]
    assert [True, True, True, False, False] == [lock.acquire() for lock in locks]
    assert [slots[0], slots[1], slots[2]] == [lock.key for lock in locks[:3]]
    observer = connections().cursor()
    for lock in locks[:3]:
        assert 1 == held(observer, lock.backend_pid, slots)
    locks[1].release()
    assert locks[3].acquire()
    assert slots[1] == locks[3].key
    for lock in (locks[0], locks[2], locks[3]):
        lock.release()
    assert 0 == held(observer, locks[0].backend_pid, slots)


def test_runs_of_one_process_never_reenter_a_slot(
    engine_factory, slots, connections, monkeypatch
):
    """One engine (one process): its three runs get three different slots, although a
    session lock would re-enter on the shared session; the fourth is busy at once, without
    a statement, while the process claims every slot."""
    engine = engine_factory()
    locks = [slotted(engine, slots) for _ in range(3)]
    assert all(lock.acquire() for lock in locks)
    assert list(slots) == [lock.key for lock in locks]
    observer = connections().cursor()
    backends = {lock.backend_pid for lock in locks}
    assert 3 == sum(held(observer, pid, slots) for pid in backends)
    sent = []
    real = sessions.base.try_slots
    monkeypatch.setattr(
        sessions.base, "try_slots", lambda *a, **k: sent.append(a) or real(*a, **k)
    )
    fourth = slotted(engine, slots)
    assert not fourth.acquire()
    assert [] == sent
    locks[2].release()
    assert fourth.acquire()
    assert slots[2] == fourth.key
    assert 1 == len(sent)
    assert [2] == [hold.slot for hold in sent[0][1]]  # only the free slot was tried
    for lock in (*locks[:2], fourth):
        lock.release()


def test_a_wait_polls_the_slots_and_times_out_bounded(
    engine_factory, slots, monkeypatch
):
    """lock_on_busy='wait' cannot block on 'any of N': it polls, pausing 50 ms, then
    twice as long each time, until its timeout, then gives up (bounded); a slot freed
    during the wait is taken."""
    holders = [slotted(engine_factory(), slots) for _ in range(3)]
    assert all(lock.acquire() for lock in holders)
    waiter = slotted(engine_factory(), slots)
    tries = []
    real = sessions.base.try_slots
    monkeypatch.setattr(
        sessions.base, "try_slots", lambda *a, **k: tries.append(a) or real(*a, **k)
    )
    started = time.monotonic()
    assert not waiter.acquire(timeout=0.6)
    waited = time.monotonic() - started
    assert 0.6 <= waited < 1.2
    assert 4 <= len(tries) <= 6  # at 0, 0.05, 0.15, 0.35 and 0.6 s
    releaser = threading.Timer(0.3, holders[1].release)
    releaser.start()
    started = time.monotonic()
    try:
        assert waiter.acquire(timeout=5)
    finally:
        releaser.join()
    assert 0.3 <= time.monotonic() - started < 1.5
    assert slots[1] == waiter.key
    for lock in (holders[0], holders[2], waiter):
        lock.release()


def test_transaction_scope_takes_a_slot_in_its_transaction(engine_factory, slots):
    """Transaction scope: the slot is a transaction lock (it ends with the transaction,
    here committed by the body), and release commits and frees it."""
    engine = engine_factory()
    locks = [slotted(engine, slots, scope="transaction") for _ in range(4)]
    assert [True, True, True, False] == [lock.acquire() for lock in locks]
    assert list(slots) == [lock.key for lock in locks[:3]]
    locks[1].connection.commit()  # ends the transaction: slot 1 is free at once
    other = slotted(engine_factory(), slots)
    assert other.acquire()
    assert slots[1] == other.key
    with pytest.raises(LockLostError, match="ended early"):
        locks[1].release()
    locks[0].release()
    assert locks[3].acquire()
    assert slots[0] == locks[3].key
    for lock in (locks[2], locks[3], other):
        lock.release()


def test_the_holder_of_a_full_key_is_named(engine_factory, slots):
    """A run finding every slot taken names the holder of slot 0, the first it tried."""
    holders = [slotted(engine_factory(), slots) for _ in range(3)]
    assert all(lock.acquire() for lock in holders)
    busy = slotted(engine_factory(), slots)
    assert not busy.acquire()
    holder = holder_lookup.find(busy)
    for lock in holders:
        lock.release()
    assert holder is not None
    assert holders[0].backend_pid == holder.backend_pid


@pytest.mark.parametrize(("ids", "limit", "expected"), VECTORS)
def test_the_slot_keys_sql_twin_matches_python(lock_engine, ids, limit, expected):
    key = keys.LockKey(name="it", ids=ids)
    with lock_engine.connect() as connection:
        for slot in range(1, limit):
            assert (
                expected[slot][0]
                == connection.exec_driver_sql(
                    f"SELECT {keys.SLOT_KEY_SQL}", (str(key), slot)
                ).scalar()
            )
