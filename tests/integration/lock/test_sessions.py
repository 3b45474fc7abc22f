"""The per-process lock session: fork safety, and what one session carries.

Fork safety is tested in a separate Python process (so that forking never copies pytest):
it takes a lock (in each session mode), forks, and the child tries everything a forked
copy of a task's frames might do (release the inherited lock, drop it, take locks of its
own) before exiting by each of return, raise, ``sys.exit`` and ``os._exit``. The parent's
lock must stay held on the parent's session, which must still work afterwards, and the
child must exit as its case says (0, or 1 and 3 for raise and sys.exit).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from celery_pglock import AdvisoryLock, keys
from celery_pglock.db import engines as db_module
from celery_pglock.db import sql_text
from celery_pglock.lock import sessions
from celery_pglock.testing import lock_state

FORK_SCRIPT = textwrap.dedent(
    """
    import gc, json, os, sys
    from celery_pglock import AdvisoryLock, LockNotOwnedError, keys
    from celery_pglock.testing import lock_state
    from celery_pglock.db import engines
    from celery_pglock.lock import sessions
    from celery_pglock.testing import strategies

    database_url, namespace, mode, how = sys.argv[1:5]
    strategies.use_per_lock_sessions(mode == "per_lock")
    engine = engines.create_engine(database_url)
    lock = AdvisoryLock(engine=engine, key=keys.make_key(namespace, "it.fork"))
    assert lock.acquire()
    parent_backend = lock_state.holding_connection(lock).info.backend_pid
    read_end, write_end = os.pipe()
    child = os.fork()
    if child == 0:
        os.close(read_end)
        report = {}
        try:
            lock.release()
        except LockNotOwnedError as error:
            report["release"] = "refused: " + str(error)
        own = AdvisoryLock(engine=engines.create_engine(database_url), key=keys.make_key(namespace, "it.child"))
        report["child_acquired"] = own.acquire()
        report["child_backend"] = lock_state.holding_connection(own).info.backend_pid
        own.release()
        os.write(write_end, json.dumps(report).encode())
        os.close(write_end)
        del lock, own
        gc.collect()
        if how == "os._exit":
            os._exit(0)
        if how == "sys.exit":
            sys.exit(3)
        if how == "raise":
            raise RuntimeError("the child fails")
        # "return": fall off the end of the script, running every finaliser
    else:
        os.close(write_end)
        _, status = os.waitpid(child, 0)
        with os.fdopen(read_end) as pipe:
            report = json.loads(pipe.read() or "{}")
        report["child_exit"] = os.waitstatus_to_exitcode(status)
        report["parent_backend"] = parent_backend
        report["parent_still_owned"] = lock.owned()
        # The parent's session still answers, and still holds its lock.
        with lock_state.holding_connection(lock).cursor() as cursor:
            cursor.execute(
                "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = pg_backend_pid() AND granted"
            )
            report["parent_locks_on_session"] = cursor.fetchone()[0]
        lock.release()
        report["parent_released"] = True
        print(json.dumps(report), flush=True)
    """
)


#: How each child ends, and the exit code that shows it got there (and no further).
CHILD_EXITS = {"return": 0, "raise": 1, "sys.exit": 3, "os._exit": 0}


@pytest.mark.parametrize("how", list(CHILD_EXITS))
def test_a_forked_child_never_touches_the_parents_lock_session(
    database_url, namespace, session_mode, how
):
    """Both session modes. The child's exit code is its own: a child that died of an
    unexpected error would exit 1 (or, for "raise", leave no report)."""
    completed = subprocess.run(
        [sys.executable, "-c", FORK_SCRIPT, database_url, namespace, session_mode, how],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert 0 == completed.returncode, completed.stderr
    report = json.loads(completed.stdout.strip().splitlines()[-1])
    assert CHILD_EXITS[how] == report["child_exit"], completed.stderr
    assert report["release"].startswith("refused: "), report
    assert "belongs to process" in report["release"]
    assert report["child_acquired"]
    assert report["child_backend"] != report["parent_backend"]  # a session of its own
    assert report["parent_still_owned"]
    assert 1 == report["parent_locks_on_session"]  # the child left it alone
    assert report["parent_released"]


def test_one_session_carries_many_locks_and_excludes_each_key_once(
    database_url, namespace
):
    """per_process: locks of one process share one backend; a key is held once."""
    engine = db_module.create_engine(database_url)
    try:
        locks = [
            AdvisoryLock(engine=engine, key=keys.make_key(namespace, "it.many", i))
            for i in range(5)
        ]
        assert all(lock.acquire() for lock in locks)
        assert 1 == len(
            {lock_state.holding_connection(lock).info.backend_pid for lock in locks}
        )
        twin = AdvisoryLock(engine=engine, key=locks[0].key)
        assert not twin.acquire()  # re-entrant in PostgreSQL, refused in the process
        for lock in locks:
            lock.release()
        assert twin.acquire()
        twin.release()
        assert [] == lock_state.process_held_keys(engine)
    finally:
        sessions.close_for(engine)
        engine.dispose()


def test_the_process_session_plans_each_lock_statement_once(database_url, namespace):
    """per_process: the try-locks (lock_limit's too) and the unlock are prepared on the
    session and executed after that (planning them cost the server more than running
    them)."""
    engine = db_module.create_engine(database_url)
    try:
        for i in range(3):
            lock = AdvisoryLock(
                engine=engine, key=keys.make_key(namespace, "it.plan", i)
            )
            assert lock.acquire()
            lock.release()
        arity = len(lock.key.ids)
        # lock_limit=3: one statement tries the three slots.
        limited = AdvisoryLock(
            engine=engine, key=keys.make_key(namespace, "it.plan", 3)
        )
        limited.slots = keys.slot_keys(limited.key, 3)
        assert limited.acquire()
        limited.release()
        with sessions.process_session(engine)._connection.cursor() as cursor:
            cursor.execute(
                "SELECT name, generic_plans + custom_plans FROM pg_prepared_statements"
            )
            executions = dict(cursor.fetchall())
    finally:
        sessions.close_for(engine)
        engine.dispose()
    named = sql_text.name_for(sql_text.TRY_LOCK_SESSION[arity])
    tries = {named, sql_text.name_for(sql_text.TRY_LOCK_SESSION_BARE[arity])}
    slots = {
        sql_text.name_for(sql_text.try_slots(transaction=False, named=form, run=False))
        for form in (False, True)
    }
    unlock = sql_text.name_for(sql_text.UNLOCK_SESSION_KEEP_NAME[arity])
    # One entry per statement: each prepared once. A try in a new second relabels the
    # session (application_name's epoch second): it takes the named form, so both count.
    assert set(executions) <= {*tries, *slots, unlock}, executions
    assert executions[named] >= 1  # the first labels the session
    assert 3 == sum(executions.get(name, 0) for name in tries)
    assert 1 == sum(executions.get(name, 0) for name in slots)
    assert 4 == executions[unlock]


def test_a_statement_an_earlier_client_prepared_is_used(database_url):
    """A pooler that hands a server session over without DISCARD ALL leaves our prepared
    statements behind: in autocommit, the lock session uses them as they are. Inside a
    transaction the failed PREPARE has aborted it, so it is raised."""
    engine = db_module.create_engine(database_url)
    statement = sql_text.TRY_LOCK_SESSION_BARE[1]
    name = sql_text.name_for(statement)
    pooled = engine.raw_connection()
    try:
        dbapi = pooled.dbapi_connection
        dbapi.autocommit = True
        with dbapi.cursor() as cursor:
            cursor.execute(sql_text._prepare_and_execute(name, statement)[0])
            sql_text.forget_prepared(dbapi)  # a new client: it knows of none
            execute = sql_text.prepared(dbapi, cursor, name, statement)
            cursor.execute(execute, (4242,))
            assert (True,) == cursor.fetchone()
            cursor.execute("SELECT pg_advisory_unlock_all()")
            sql_text.forget_prepared(dbapi)
            dbapi.autocommit = False
            with pytest.raises(Exception, match="already exists"):
                sql_text.prepared(dbapi, cursor, name, statement)
            dbapi.rollback()
    finally:
        pooled.invalidate()
        engine.dispose()
