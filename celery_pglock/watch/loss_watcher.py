"""The lock watcher: one daemon thread per process notices, while a body runs, that its
lock is gone, reports it once, and with ``lock_on_lost='terminate'`` ends the body.

Hazard: it interrupts bodies from another thread (:data:`SIGNAL` to the main thread, an
asynchronous exception to a pool thread) and is forgotten in a forked child. How locks are
checked, the deadlines and what a loss does: docs/operations/lock-loss.md.

From the lock layer it uses ``lock.engine``, ``lock.key.pg_locks_ids``,
``lock.backend_pid``, ``lock.acquired_at``, ``lock.holding_name``, ``lock.mark_lost()``,
``lock.lost_error()`` and ``sessions.open_process_session()``; the query itself is
``observer_session.py``'s.
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
    """One watched lock and what to do if it is lost (slots, no dataclass: one per run)."""

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
        self.timeout: float = options.db_timeout
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
#: Guards _entries and every Entry. A body's thread takes the bare lock: an asynchronous
#: LockLostError can land inside Condition.__enter__ (Python), not inside Lock's (C).
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

    If the lock was found lost, wait (bounded) for the report, so ``lock_lost`` comes
    before the run's outcome. A pending interrupt may still land here as LockLostError,
    with the entry still registered: call again to unwatch.
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


def _start_thread() -> None:
    """Start the watcher in this process (call with _mutex held)."""
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
        # Sleep a tick even when the body that woke us has ended: else every short task
        # would cost a thread switch (~30 us measured), not one per tick.
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
    """gevent/eventlet monkey-patched? Then no interrupt can reach the right body, and
    'terminate' acts as 'signal' (said once per process)."""
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
    # Raised at the body's next bytecode: a bare LockLostError (the API takes a class);
    # the task layer ends the run with one that names the key and cause.
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
