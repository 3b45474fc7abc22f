"""The lock watcher: one daemon thread per process finds running bodies' locks lost.
Hazard: it interrupts bodies from another thread. Why: docs/operations/lock-loss.md."""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import logging
import os
import select
import signal
import sys
import threading
import time
from typing import TYPE_CHECKING, Any

from celery_pglock import exceptions
from celery_pglock.config import OnLost
from celery_pglock.db import (
    engines,
    forks,
    redact,
    server_probe,
    sql_text,
    startup_options,
)
from celery_pglock.lock import sessions

if TYPE_CHECKING:
    from collections.abc import Callable

    from celery_pglock.config import LockConfig
    from celery_pglock.lock import AdvisoryLock

logger = logging.getLogger(__name__)

SIGNAL = signal.SIGUSR2  #: Ends main-thread bodies; SIGUSR1 is billiard's soft limit.
MIN_TICK = 0.05  #: The watcher's shortest sleep between ticks.
REPORT_WAIT = 2.0  #: Longest an ended body waits for its loss report.


@dataclasses.dataclass(slots=True, eq=False)
class Entry:
    lock: AdvisoryLock
    report: Callable[[str], None]  #: Called once with the cause when the loss is found.
    interval: float
    timeout: float
    terminate: bool
    thread_id: int  #: threading.get_ident() of the body's thread.
    in_main: bool  #: The body runs in the main thread (prefork, solo).
    checked_at: float  #: time.monotonic() when the lock was last known held.
    backend_pid: int | None  #: lock.backend_pid, or the real one behind PgBouncer.
    pid_confirmed: bool = False  #: backend_pid was seen holding the lock.
    server_start: str | None = None  #: pg_postmaster_start_time() at the first check.
    ended: bool = False  #: The body ended: never interrupt it any more.
    interrupted: bool = False
    reported: threading.Event | None = None  #: Found lost; set() once reported.


_entries: dict[int, Entry] = {}
_observers: dict[int, Observer] = {}
#: Guards _entries and every Entry. A body's thread takes the bare lock: an asynchronous
#: LockLostError can land inside Condition.__enter__ (Python), not inside Lock's (C).
_mutex = forks.safe_lock(_entries, _observers)
_cond = threading.Condition(_mutex)
_idle = False  #: The watcher waits for an entry (notify it on insert).
_thread: threading.Thread | None = None
_target: Entry | None = None  #: The main-thread body SIGNAL interrupts.
_handler: tuple[int, Any] | None = None  #: (pid, previous handler) once installed.
_green_warned = 0


def watch(
    lock: AdvisoryLock, report: Callable[[str], None], options: LockConfig
) -> None:
    """Watch ``lock`` while its body runs; ``report(cause)`` once if it is lost."""
    global _thread, _idle, _handler
    if not options.watch_interval:
        return
    thread_id = threading.get_ident()
    in_main = thread_id == threading.main_thread().ident
    terminate = options.on_lost is OnLost.TERMINATE and not _green()
    if terminate and in_main and (_handler is None or _handler[0] != os.getpid()):
        previous = signal.getsignal(SIGNAL)
        if previous is _on_signal:  # inherited across a fork: keep its predecessor
            previous = _handler[1] if _handler is not None else signal.SIG_DFL
        signal.signal(SIGNAL, _on_signal)  # main thread only
        _handler = (os.getpid(), previous)
    entry = Entry(
        lock,
        report,
        options.watch_interval,
        options.db_timeout,
        terminate,
        thread_id,
        in_main,
        lock.acquired_at or time.monotonic(),
        lock.backend_pid,
    )
    with _mutex:  # bare, as in unwatch(): an outer body's interrupt may land here
        if _thread is None:
            _idle = False
            # Set before start(): an interrupt after it must not start a second watcher.
            _thread = threading.Thread(
                target=_run, name="celery-pglock-watch", daemon=True
            )
            _thread.start()
        _entries[id(lock)] = entry
        if _idle:
            # _idle: cleared by the watcher; interrupted here, the next watch() notifies.
            _cond.notify()


def unwatch(lock: AdvisoryLock) -> None:
    """The body ended: stop watching; wait (bounded) for a loss report under way.
    A pending interrupt may land here as LockLostError, still registered: call again."""
    with _mutex:
        entry = _entries.pop(id(lock), None)
        if entry is None:
            return
        entry.ended = True
        if entry.interrupted and not entry.in_main:
            # Withdraw a still-pending async raise: its body has ended.
            ctypes.pythonapi.PyThreadState_SetAsyncExc(
                ctypes.c_ulong(entry.thread_id), None
            )
        reported = entry.reported
    if reported is not None:
        reported.wait(REPORT_WAIT)


def _run() -> None:
    global _thread, _idle
    try:
        while True:
            with _cond:
                if not _entries:
                    _idle = True
                    _cond.wait()
                    _idle = False
                entries = list(_entries.values())
            now = time.monotonic()
            due = [
                entry
                for entry in entries
                if entry.reported is None and now - entry.checked_at >= entry.interval
            ]
            if due:
                try:
                    _check(due)
                except Exception:  # the watcher must survive anything and keep watching
                    logger.exception("celery-pglock: the lock watcher failed a check")
            # Always sleep a tick: else each short task costs a thread switch (~30 us).
            tick = min((entry.interval for entry in entries), default=4 * MIN_TICK) / 4
            time.sleep(max(MIN_TICK, tick))
    finally:  # only if something unforeseen killed it: the next watch() restarts it
        if _thread is threading.current_thread():
            _thread = None


def _check(due: list[Entry]) -> None:
    groups: dict[int, list[Entry]] = {}
    for entry in due:
        groups.setdefault(id(entry.lock.engine), []).append(entry)
    for engine_id, entries in groups.items():
        engine = entries[0].lock.engine
        observer = _observers.setdefault(engine_id, Observer(engine))
        started = time.monotonic()
        timeout = min(entry.timeout for entry in entries)
        losses = observer.check(
            entries, started + timeout, sessions.open_process_session(engine)
        )
        for entry in entries:
            cause = losses.get(id(entry))
            if cause is None:
                entry.checked_at = started
            else:
                _lost(entry, cause)


def _lost(entry: Entry, cause: str) -> None:
    with _cond:
        if entry.ended or _entries.get(id(entry.lock)) is not entry:
            return  # the body ended meanwhile (a release is not a loss)
        if not entry.lock.mark_lost(cause):
            return
        # Stays registered until the body ends: unwatch() waits for this report.
        reported = entry.reported = threading.Event()
        if entry.terminate:
            _interrupt(entry)
    try:
        entry.report(cause)
    except Exception:
        logger.exception("celery-pglock: reporting a lost lock failed")
    finally:
        reported.set()


def _green() -> bool:
    """Patched by gevent/eventlet? Then 'terminate' acts as 'signal' (warns once)."""
    global _green_warned
    gevent, eventlet = map(sys.modules.get, ("gevent.monkey", "eventlet.patcher"))
    patched = bool(
        (gevent is not None and gevent.is_module_patched("threading"))
        or (eventlet is not None and eventlet.is_monkey_patched("thread"))
    )
    if patched and _green_warned != os.getpid():
        _green_warned = os.getpid()
        logger.warning(
            "celery-pglock: lock_on_lost='terminate' cannot end a gevent/eventlet body; "
            "a lost lock is reported (lock_lost, ensure_held()) but the body goes on "
            "(check ensure_held() before each effect, or use fencing tokens; "
            "lock_on_lost='signal' says that this is intended)",
            extra={"action": "lock_terminate_unsupported"},
        )
    return patched


def _on_signal(signum: int, frame: Any) -> None:
    global _target
    entry = _target
    if entry is not None and not entry.ended:
        _target = None
        raise entry.lock.lost_error()
    previous = _handler[1] if _handler is not None else None
    if callable(previous):
        previous(signum, frame)


def _interrupt(entry: Entry) -> None:
    """End the body of ``entry`` (call with _cond held, the body not ended)."""
    global _target
    entry.interrupted = True
    if entry.in_main:
        if _handler is None or _handler[0] != os.getpid():
            return  # no handler here: never send a signal that would kill the process
        _target = entry
        signal.pthread_kill(threading.main_thread().ident or 0, SIGNAL)
        return
    # At the body's next bytecode; a bare class: the task layer adds key and cause.
    ctypes.pythonapi.PyThreadState_SetAsyncExc(
        ctypes.c_ulong(entry.thread_id), ctypes.py_object(exceptions.LockLostError)
    )


@dataclasses.dataclass(eq=False)
class Observer:
    """The watcher's own asynchronous psycopg2 session to one lock database."""

    engine: Any
    connection: Any = None
    server_start: str | None = None

    def check(
        self,
        entries: list[Entry],
        deadline: float,
        session: sessions.ProcessSession | None = None,
    ) -> dict[int, str]:
        """{id(entry): cause} per lost lock (all if unverifiable), on ``session`` if
        given; connects itself only if that cannot answer, to tell why, then closes."""
        diagnosing = False
        if session is not None:
            timeout = entries[0].timeout
            try:
                rows = session.run_check(
                    sql_text.CHECK_HELD, _params(entries), deadline, least=timeout / 2
                )
            except sessions.SessionBusyError:
                # Busy (bounded lock statements): check here, with a budget of its own.
                diagnosing = True
                deadline = time.monotonic() + timeout
            except Exception:
                # Gone, or no answer in time: ask the server why, within what is left.
                diagnosing = True
            else:
                if rows is not None:
                    return self._evaluate(entries, rows)
        try:
            return self._check_here(entries, deadline)
        finally:
            if diagnosing:
                self.close()

    def _check_here(self, entries: list[Entry], deadline: float) -> dict[int, str]:
        # Until the deadline: a restarting server answers within it, and says so.
        tries = 0
        while True:
            tries += 1
            try:
                if self.connection is None:
                    self._connect(deadline)
                cursor = self.connection.cursor()
                cursor.execute(sql_text.CHECK_HELD, _params(entries))
                wait(self.connection, deadline)
                rows = cursor.fetchall()
                cursor.close()
                return self._evaluate(entries, rows)
            except Exception as error:  # no answer in time, or a dead session
                last_error = error
            self.close()
            if time.monotonic() + 0.1 >= deadline:
                break
            time.sleep(0.1)
        # libpq may echo connection options: scrub as the security layer does.
        text = redact.scrub_text(str(last_error), redact.secrets_of(self.engine.url))
        reason = " ".join(text.split()) or type(last_error).__name__
        budget = f"lock_db_timeout {entries[0].timeout:g}s"
        if isinstance(last_error, TimeoutError):  # wait(): nothing came back in time
            cause = f"unverifiable: the lock database did not answer within {budget}"
        else:  # refused or dropped: say so, and that it was tried for the whole budget
            cause = (
                f"unverifiable: the lock database could not be reached: {tries} "
                f"attempt(s) within {budget} failed, the last with: {reason}"
            )
        return {id(entry): cause for entry in entries}

    def _evaluate(
        self, entries: list[Entry], rows: list[tuple[Any, ...]]
    ) -> dict[int, str]:
        start, standby = rows[0][4], rows[0][5]
        restarted = self.server_start is not None and start != self.server_start
        self.server_start = start
        facts = server_probe.known_facts(self.engine)
        pids_invented = facts is None or not facts.reports_backend_pid
        losses: dict[int, str] = {}
        for entry, (_, holder, holder_name, alive, _, _) in zip(
            entries, rows, strict=True
        ):
            if entry.server_start is None:
                entry.server_start = start
            if standby:
                losses[id(entry)] = (
                    "the server is now a standby (pg_is_in_recovery()): the address "
                    "reaches a replica, not the primary that granted the lock"
                )
            elif holder is not None and holder == entry.backend_pid:
                entry.pid_confirmed = True
            elif (
                holder is not None
                and not entry.pid_confirmed
                and pids_invented
                and holder_name == getattr(entry.lock, "holding_name", None)
            ):
                # Invented pid (PgBouncer): the session with this lock's name is ours
                # (learnt once). Not with real pids: another of ours may have it by now.
                entry.backend_pid, entry.pid_confirmed = holder, True
            elif restarted or entry.server_start != start:
                losses[id(entry)] = (
                    "the server restarted or was replaced (pg_postmaster_start_time() "
                    "changed): a restart, a crash, or a failover to a promoted standby"
                )
            elif not alive:
                losses[id(entry)] = (
                    f"its session (backend {entry.backend_pid}) ended: "
                    "terminated, timed out or disconnected"
                )
            else:
                losses[id(entry)] = (
                    f"its session (backend {entry.backend_pid}) no longer holds "
                    "it (unlocked, or its transaction ended)"
                )
        return losses

    def _connect(self, deadline: float) -> None:
        import psycopg2  # a dependency, whatever driver the lock engine uses

        timeout = max(1, int(deadline - time.monotonic() + 0.999))
        params = engines.connect_params(self.engine)
        params["application_name"] = engines.application_name(
            engines.engine_info(self.engine)["application_name_prefix"],
            engines.process_tag(),
            "watch",
        )
        params["connect_timeout"] = timeout
        connection = psycopg2.connect(**params, async_=1)
        engines.adopt(connection)  # a forked child must not touch it either
        self.connection = connection
        fallback = startup_options.fallback_of(self.engine)
        try:
            wait(connection, deadline)
        except psycopg2.OperationalError as error:
            # Refused options: retry without the refused part, as the lock sessions do.
            if fallback is None or not fallback.learn(error):
                raise
            self.close()
            self._connect(deadline)
            return
        cursor = connection.cursor()
        # The server gives up too, so a slow check never lingers there.
        cursor.execute(sql_text.SET_STATEMENT_TIMEOUT, (f"{timeout}s",))
        wait(connection, deadline)
        if fallback is None or not fallback.carries_settings():
            # Idle between checks: never ended by a role's idle_session_timeout.
            cursor.execute(
                sql_text.APPLY_SESSION_SETTINGS,
                startup_options.SESSION_SETTINGS_PARAMS,
            )
            wait(connection, deadline)
        cursor.close()

    def close(self) -> None:
        connection, self.connection = self.connection, None
        if connection is not None:
            with contextlib.suppress(Exception):  # it is dead already, most often
                connection.close()


def _params(entries: list[Entry]) -> tuple[list[int], ...]:
    # CHECK_HELD's parameters: classids, objids, objsubids, pids.
    ids = zip(*(entry.lock.key.pg_locks_ids for entry in entries), strict=True)
    return (*map(list, ids), [entry.backend_pid or 0 for entry in entries])


def wait(connection: Any, deadline: float) -> None:
    """Drive an asynchronous psycopg2 connection until it is ready, or the deadline."""
    import psycopg2.extensions as ext

    while (state := connection.poll()) != ext.POLL_OK:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("no answer in time")
        reading, fd = state == ext.POLL_READ, connection.fileno()
        if hasattr(select, "poll"):  # select() refuses fd >= 1024; gevent removes poll
            poller = select.poll()
            poller.register(fd, select.POLLIN if reading else select.POLLOUT)
            poller.poll(remaining * 1000)
        else:
            select.select(
                [fd] if reading else [], [] if reading else [fd], [], remaining
            )


@forks.reset_in_child
def _forget_in_child() -> None:
    # A forked child watches nothing of its parent's (its sockets are neutered).
    global _thread, _target, _idle, _cond
    _thread = _target = None
    _idle = False
    _cond = threading.Condition(_mutex)  # its waiters were the parent's threads
