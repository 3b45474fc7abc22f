"""The lock watcher: notices, while a body runs, that its lock is gone.

A session advisory lock lasts as long as its session. A server restart, a failover, a
``pg_terminate_backend``, an idle-session timeout or a cut link ends the session, and the
lock with it, while the body goes on; another worker may take the lock at once. Nothing
tells the holder until it releases. This module tells it within about one check interval.

How (docs/operations/lock-loss.md has the full story and the deadline arithmetic):

- One daemon thread per process, started the first time a SingletonTask body runs under a
  lock (and again in a forked child). It does not need the task's thread: a prefork
  child's body may sleep or sit in C code.
- Every lock older than its ``lock_watch_interval`` is checked, all of a database's locks
  in ONE query per tick, on the process's lock session when it has one (idle while bodies
  run: no second connection), else on the watcher's own session (never on a pooled lock
  connection: a transaction-scope body may be using it). The query (``sql_text.CHECK_HELD``)
  reads ``pg_locks`` for who holds each key now, plus the postmaster start time (a
  restart, or a failover to a promoted standby: the two look alike) and
  ``pg_is_in_recovery()`` (the address now reaches a standby). A body shorter than the
  interval costs one dict insert and one removal, and no query.
- The watcher's own session (``observer_session.py``) is asynchronous: every connect and query
  waits until the check's deadline (``lock_check_timeout``) at most, so a frozen link or a
  frozen server cannot block it; a check on the lock session is bounded the same way
  (``deadlines``), and one that gets no answer ends that session. A check that cannot complete in time means the lock can
  no longer be verified: it is reported as lost ("unverifiable"), because the server will
  free it through its keepalives soon anyway (see config.SERVER_KEEPALIVE_DEADLINE).
- On loss: ``lock.lost_cause`` is set (``current_lock().lost``, ``ensure_held()``), the loss
  is reported once (``outcomes.lost``: signal, ERROR log, metric) from this process, and
  with ``lock_on_lost='terminate'`` (the default) the body is interrupted: a signal
  (:data:`SIGNAL`) to the main thread for prefork and solo, whose handler raises
  LockLostError like Celery's soft time limit; an asynchronous exception at the next
  bytecode for a threads-pool body. A gevent/eventlet body cannot be interrupted: it goes
  on, as with ``'signal'``, but no other run of its process takes the key meanwhile
  (``base.Claims``).

The lock layer's side of the interface is small on purpose (the lock-session work may
change how locks hold their sessions): ``lock.key.pg_locks_ids``, ``lock.backend_pid``,
``lock.engine``, ``lock.acquired_at``, ``lock.owned()``, ``lock.mark_lost(cause)`` and,
optionally, ``lock.holding_name`` (the application_name the lock's session shows while
holding, used once to learn the real backend pid behind PgBouncer).
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import threading
import time
from typing import TYPE_CHECKING, Any

from celery_pglock import exceptions
from celery_pglock.config import OnLost
from celery_pglock.lock import sessions
from celery_pglock.watch import observer_session

if TYPE_CHECKING:
    from collections.abc import Callable

    from celery_pglock.config import LockConfig
    from celery_pglock.lock import AdvisoryLock

logger = logging.getLogger(__name__)

#: Delivers lock_on_lost='terminate' to a body in the main thread. Not SIGUSR1: billiard
#: uses it for the soft time limit. A handler someone else installed is chained.
SIGNAL = signal.SIGUSR2
#: The watcher wakes this often, at most (a fraction of the smallest interval).
MIN_TICK = 0.05
#: Longest a finished body waits for its loss to be reported (signal receivers run).
REPORT_WAIT = 2.0


class Entry:
    """One watched lock and what to do if it is lost.

    A plain class with slots: one is built per locked run, and a dataclass's keyword
    __init__ cost more than the rest of watch().
    """

    __slots__ = (
        "backend_pid",
        "checked_at",
        "ended",
        "in_main",
        "interrupted",
        "interval",
        "lock",
        "pid_confirmed",
        "report",
        "reported",
        "server_start",
        "terminate",
        "thread_id",
        "timeout",
    )

    def __init__(
        self,
        lock: AdvisoryLock,
        report: Callable[[str], None],
        options: LockConfig,
        terminate: bool,
        thread_id: int,
        in_main: bool,
    ) -> None:
        self.lock = lock
        self.report = report  #: Called once with the cause when the loss is found.
        self.interval: float = options.watch_interval
        self.timeout: float = options.check_timeout
        self.terminate = terminate
        self.thread_id = thread_id  #: threading.get_ident() of the body's thread.
        self.in_main = in_main  #: The body runs in the main thread (prefork, solo).
        #: time.monotonic() when the lock was last known held.
        self.checked_at: float = lock.acquired_at or time.monotonic()
        #: The holder's backend pid: lock.backend_pid, or the real one learnt at the
        #: first check when libpq's is a pooler's (PgBouncer invents the pid it reports).
        self.backend_pid: int | None = lock.backend_pid
        self.pid_confirmed = False  #: backend_pid was seen holding the lock.
        #: pg_postmaster_start_time() at the first check.
        self.server_start: str | None = None
        self.ended = False  #: The body ended: never interrupt it any more.
        self.interrupted = False
        #: Set once the lock was found lost; set() once the loss has been reported.
        self.reported: threading.Event | None = None


_entries: dict[int, Entry] = {}
#: Guards _entries and every Entry. A body's thread takes the bare lock (C code: an
#: asynchronous LockLostError cannot land between taking it and the with block that
#: gives it back, as it can inside Condition.__enter__, which is Python); the watcher
#: waits on _cond, the same lock.
_mutex = threading.Lock()
_cond = threading.Condition(_mutex)
_idle = False  #: The watcher waits for an entry (notify it on insert).
_thread: threading.Thread | None = None
_observers: dict[int, observer_session.Observer] = {}
#: The main-thread body to interrupt when SIGNAL arrives.
_target: Entry | None = None
_handler: tuple[int, Any] | None = None  #: (pid, previous handler) once installed.


def watch(
    lock: AdvisoryLock, report: Callable[[str], None], options: LockConfig
) -> None:
    """Watch ``lock`` while its body runs; ``report(cause)`` once if it is lost (no-op if
    checks are off)."""
    if not options.watch_interval:
        return
    thread_id = threading.get_ident()
    in_main = thread_id == threading.main_thread().ident
    terminate = options.on_lost is OnLost.TERMINATE and not _green()
    if terminate and in_main:
        _install_handler()
    entry = Entry(lock, report, options, terminate, thread_id, in_main)
    # The bare lock, as in unwatch(): an outer body's interrupt may land here too (a
    # terminate-mode body calling another SingletonTask).
    with _mutex:
        if _thread is None:
            _start_thread()
        _entries[id(lock)] = entry
        if _idle:
            # The watcher clears _idle itself once awake: an interrupt landing before
            # this notify() leaves it set, and the next watch() wakes the watcher.
            _cond.notify()


def unwatch(lock: AdvisoryLock) -> None:
    """The body of ``lock``'s run has ended: stop watching, never interrupt it now.

    If the lock was found lost, wait (bounded) until the loss has been reported, so
    ``lock_lost`` always comes before the run's own outcome.

    Under ``lock_on_lost='terminate'`` the interrupt may still land here, as the body
    returns (the watcher decided while this thread waited for the lock): it then raises
    LockLostError, with the entry still registered; call again to unwatch.
    """
    with _mutex:
        entry = _entries.pop(id(lock), None)
        if entry is None:
            return
        entry.ended = True
        if entry.interrupted and not entry.in_main:
            # The asynchronous exception may still be pending: withdraw it, the body
            # it was meant for has ended (the run still ends FAILURE: the lock is lost).
            ctypes.pythonapi.PyThreadState_SetAsyncExc(
                ctypes.c_ulong(entry.thread_id), None
            )
        reported = entry.reported
    if reported is not None:
        reported.wait(REPORT_WAIT)


# -- the watcher thread -------------------------------------------------------------------


def _start_thread() -> None:
    """Start the watcher in this process (call with _mutex held; a forked child starts
    its own, see _forget_in_child)."""
    global _thread, _idle
    _idle = False
    thread = threading.Thread(target=_run, name="celery-pglock-watch", daemon=True)
    # Recorded first: an interrupt landing after start() must not make the next
    # watch() start a second watcher.
    _thread = thread
    thread.start()


def _run() -> None:
    global _thread
    try:
        _watch_forever()
    finally:  # only if something unforeseen killed it: the next watch() restarts it
        if _thread is threading.current_thread():
            _thread = None


def _watch_forever() -> None:
    global _idle
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
        # Sleep a tick even when the body that woke us has already ended (the usual
        # case for short tasks): going back to the wait at once would let every task
        # wake this thread, a thread switch per task (~30 us measured) instead of at
        # most one per tick.
        tick = min((entry.interval for entry in entries), default=4 * MIN_TICK) / 4
        time.sleep(max(MIN_TICK, tick))


def _check(due: list[Entry]) -> None:
    """Check the due locks, one query per lock database; handle every loss found."""
    groups: dict[int, list[Entry]] = {}
    for entry in due:
        groups.setdefault(id(entry.lock.engine), []).append(entry)
    for entries in groups.values():
        engine = entries[0].lock.engine
        observer = _observers.get(id(engine))
        if observer is None:
            observer = _observers[id(engine)] = observer_session.Observer(engine)
        started = time.monotonic()
        timeout = min(entry.timeout for entry in entries)
        # On the process's own lock session when it has one (no second connection).
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
        # The entry stays registered (unchecked) until the body ends: unwatch() must
        # still see it, to never interrupt an ended body and to wait for this report.
        reported = entry.reported = threading.Event()
        if entry.terminate:
            _interrupt(entry)
    try:
        entry.report(cause)
    except Exception:
        logger.exception("celery-pglock: reporting a lost lock failed")
    finally:
        reported.set()


# -- lock_on_lost='terminate' -------------------------------------------------------------


def _green() -> bool:
    """gevent/eventlet monkey-patched: every body shares the main thread, so neither a
    signal nor an asynchronous exception would reach the right one. lock_on_lost then
    acts as 'signal' (said once per process)."""
    global _green_warned
    patched = False
    gevent_monkey = sys.modules.get("gevent.monkey")
    if gevent_monkey is not None:
        patched = bool(gevent_monkey.is_module_patched("threading"))
    eventlet_patcher = sys.modules.get("eventlet.patcher")
    if eventlet_patcher is not None:
        patched = patched or bool(eventlet_patcher.is_monkey_patched("thread"))
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


_green_warned = 0


def _install_handler() -> None:
    """Install the SIGNAL handler in this process (main thread only)."""
    global _handler
    pid = os.getpid()
    if _handler is not None and _handler[0] == pid:
        return
    previous = signal.getsignal(SIGNAL)
    if previous is _on_signal:  # inherited across a fork: keep its predecessor
        previous = _handler[1] if _handler is not None else signal.SIG_DFL
    signal.signal(SIGNAL, _on_signal)
    _handler = (pid, previous)


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
    # Raised in the body's thread at its next bytecode: a bare LockLostError (the API
    # takes a class); the run's final error carries the key and cause (task.finish).
    ctypes.pythonapi.PyThreadState_SetAsyncExc(
        ctypes.c_ulong(entry.thread_id), ctypes.py_object(exceptions.LockLostError)
    )


def _forget_in_child() -> None:
    """A forked child watches nothing of its parent's (its sockets are neutered)."""
    global _thread, _target, _idle, _cond, _mutex
    _entries.clear()
    _observers.clear()
    _thread = None
    _target = None
    _idle = False
    _mutex = threading.Lock()  # the parent's may be held
    _cond = threading.Condition(_mutex)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)
