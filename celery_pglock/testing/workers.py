"""WorkerProcess: a real ``celery worker`` subprocess for acceptance tests.

Cross-process exclusion can only be proven with real processes: Celery's ``celery_worker``
fixture runs the worker in a thread of the test process, where a lock held by "another
worker" is held by the same process. Each WorkerProcess is ``python -m celery -A <app>
worker`` in a process group of its own, writing to a log file that the test can read.

Signal semantics (Celery's): SIGTERM is a warm shutdown (running tasks finish), SIGQUIT
a cold one, SIGKILL of the whole group is a crash: the pool children die with the main
process and PostgreSQL ends their sessions, which is what releases their locks.

Hazard: a worker that outlives its test keeps consuming the broker's queue and can run
another test's tasks. Every wait here is bounded, :meth:`WorkerProcess.stop` kills what
a warm shutdown leaves behind, and an ``atexit`` hook kills any worker still running.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

from celery.utils.nodenames import default_nodename, host_format

from celery_pglock.testing import _support
from celery_pglock.testing._support import ServiceError

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence
    from types import TracebackType

    from typing_extensions import Self

#: Log levels at which Celery logs "<hostname> ready.", which start() waits for.
READY_LOGLEVELS = ("DEBUG", "INFO")
#: Seconds to wait for processes that were sent SIGKILL to disappear.
KILL_WAIT = 10.0

_running: set[WorkerProcess] = set()
_temporary_logs: list[Path] = []


class WorkerProcess:
    """One ``celery -A app worker`` subprocess.

    Args:
        app: The ``-A`` argument: an importable module (``tests.acceptance.app``) or
            ``module:attribute``; the subprocess must be able to import it (PYTHONPATH).
        env: Variables added to this process's environment for the worker.
        pool: ``prefork``, ``threads``, ``solo``, ``gevent`` or ``eventlet``.
        concurrency: Pool size.
        hostname: Node name; ``%h`` and friends are expanded as Celery does. By default
            a unique ``pglock-test-<hex>@<host>``.
        queues: Queues to consume (``-Q``); by default Celery's default queue.
        loglevel: ``DEBUG`` or ``INFO``: start() waits for Celery's INFO line
            ``"<hostname> ready."``.
        extra_args: Appended to the command line (after :attr:`default_args`).
        log_path: Where stdout and stderr go; by default a new temporary file, kept
            until this Python process exits so that a failing test can still read it.
    """

    #: Skip mingle (a one-second wait for replies from other workers at startup) and
    #: gossip (worker-to-worker events): neither matters to locking, both slow tests.
    default_args: tuple[str, ...] = ("--without-mingle", "--without-gossip")

    def __init__(
        self,
        app: str,
        *,
        env: Mapping[str, str] | None = None,
        pool: str = "prefork",
        concurrency: int = 2,
        hostname: str | None = None,
        queues: Sequence[str] = (),
        loglevel: str = "INFO",
        extra_args: Sequence[str] = (),
        log_path: Path | None = None,
    ) -> None:
        if loglevel.upper() not in READY_LOGLEVELS:
            raise ValueError(
                f"loglevel must be DEBUG or INFO, so that start() can see Celery's "
                f"'ready.' line; got {loglevel!r}."
            )
        if concurrency < 1:
            raise ValueError(f"concurrency must be at least 1; got {concurrency!r}.")
        self.app = app
        #: The expanded node name, as the worker reports it.
        self.hostname: str = host_format(
            default_nodename(hostname or f"pglock-test-{uuid.uuid4().hex[:8]}@%h")
        )
        self.env: dict[str, str] = {
            **os.environ,
            "PYTHONUNBUFFERED": "1",
            **(env or {}),
        }
        self.pool = pool
        self.concurrency = concurrency
        self.queues = tuple(queues)
        self.loglevel = loglevel.upper()
        self.extra_args = tuple(extra_args)
        self._log_path = log_path
        self._process: subprocess.Popen[bytes] | None = None
        self._log_start = 0

    # -- state --------------------------------------------------------------------------

    @property
    def command(self) -> list[str]:
        """The worker's command line."""
        args = [sys.executable, "-m", "celery", "-A", self.app, "worker"]
        args += ["--pool", self.pool, "--concurrency", str(self.concurrency)]
        args += ["--hostname", self.hostname, "--loglevel", self.loglevel]
        if self.queues:
            args += ["--queues", ",".join(self.queues)]
        return [*args, *self.default_args, *self.extra_args]

    @property
    def pid(self) -> int:
        """Process id of the worker's main process (also its process group id)."""
        return self._started().pid

    @property
    def log_path(self) -> Path:
        """The worker's log file (created by start())."""
        if self._log_path is None:
            raise ServiceError(
                f"Worker {self.hostname} has no log yet: call start() first."
            )
        return self._log_path

    @property
    def running(self) -> bool:
        """Whether the main process is alive."""
        return self._process is not None and self._process.poll() is None

    @property
    def returncode(self) -> int | None:
        """The main process's exit code (negative: killed by that signal), or None."""
        return None if self._process is None else self._process.poll()

    def child_pids(self) -> list[int]:
        """Process ids of the pool children (and their children); empty once stopped."""
        import psutil  # type: ignore[import-untyped, unused-ignore]  # no stubs shipped

        if not self.running:
            return []
        try:
            children = psutil.Process(self.pid).children(recursive=True)
        except psutil.Error:
            return []
        return [child.pid for child in children if _support.pid_alive(child.pid)]

    def log_text(self) -> str:
        """Everything this worker has written so far (not what the file held before)."""
        try:
            with self.log_path.open("rb") as handle:
                handle.seek(self._log_start)
                return handle.read().decode("utf-8", "replace")
        except OSError:
            return ""

    # -- lifecycle ----------------------------------------------------------------------

    def start(self, timeout: float = 60.0) -> Self:
        """Start the worker and wait until it logs ``"<hostname> ready."``.

        Raises:
            ServiceError: it exited, or was not ready within ``timeout`` seconds; the
                worker is killed and the message carries its log tail.
        """
        if self._process is not None:
            raise ServiceError(f"Worker {self.hostname} was already started.")
        if self._log_path is None:
            handle, name = tempfile.mkstemp(
                prefix=f"celery-pglock-worker-{self.hostname.split('@')[0]}-",
                suffix=".log",
            )
            os.close(handle)
            self._log_path = Path(name)
            _temporary_logs.append(self._log_path)
        with self._log_path.open("ab") as log:
            self._log_start = log.tell()  # a reused log file may hold an old "ready."
            self._process = subprocess.Popen(
                self.command,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env,
                start_new_session=True,  # own process group: kill() reaches the pool too
            )
        _running.add(self)
        try:
            self.wait_for_log(f"{self.hostname} ready.", timeout=timeout)
        except ServiceError:
            self.kill()
            raise
        return self

    def wait_for_log(self, text: str, *, timeout: float = 30.0) -> None:
        """Wait until ``text`` appears in the log.

        Raises:
            ServiceError: the worker exited first, or ``timeout`` seconds passed.
        """
        process = self._started()
        if _support.wait_until(
            lambda: text in self.log_text(),
            timeout=timeout,
            interval=0.05,
            give_up=lambda: process.poll() is not None,
        ):
            return
        # One last look: the worker may have written the line and then exited.
        if text in self.log_text():
            return
        code = process.poll()
        state = (
            f"exited with code {code}"
            if code is not None
            else f"still running after {timeout:g} s"
        )
        raise ServiceError(
            _support.with_log(
                f"Worker {self.hostname} ({self.app}) never logged {text!r}: {state}.",
                self._log_path,
            )
        )

    def stop(self, timeout: float = 30.0) -> int | None:
        """Warm shutdown: SIGTERM, running tasks finish; SIGKILL the group after ``timeout``.

        Returns:
            The exit code (negative: the signal that ended it), or None if never started.
        """
        process = self._process
        if process is None:
            return None
        if process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout)
            except subprocess.TimeoutExpired:
                self._kill_group(process)
        self._kill_leftovers(process.pid)
        _running.discard(self)
        return process.returncode

    def kill(self) -> int | None:
        """Crash the worker: SIGKILL its whole process group, main process and pool.

        Returns:
            The exit code (``-9``), or None if never started.
        """
        process = self._process
        if process is None:
            return None
        if process.poll() is None:
            self._kill_group(process)
        self._kill_leftovers(process.pid)
        _running.discard(self)
        return process.returncode

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        pid = None if self._process is None else self._process.pid
        return f"<WorkerProcess {self.hostname} app={self.app} pid={pid} running={self.running}>"

    # -- internals ----------------------------------------------------------------------

    def _started(self) -> subprocess.Popen[bytes]:
        if self._process is None:
            raise ServiceError(f"Worker {self.hostname} is not started.")
        return self._process

    @staticmethod
    def _kill_group(process: subprocess.Popen[bytes]) -> None:
        # Safe while the main process is unreaped: its pid, hence the group id, cannot be
        # reused yet.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        try:
            process.wait(KILL_WAIT)
        except subprocess.TimeoutExpired:
            raise ServiceError(
                f"Worker pid {process.pid} survived SIGKILL for {KILL_WAIT:g} s."
            ) from None

    @staticmethod
    def _kill_leftovers(group: int) -> None:
        """SIGKILL what is left of process group ``group`` and wait until it is gone.

        After the main process has been reaped, its group id may only be signalled
        while members remain, so members are found and killed one by one (psutil
        checks each process's identity, which guards against pid reuse).
        """
        import psutil  # type: ignore[import-untyped, unused-ignore]  # no stubs shipped

        members: list[Any] = []
        for candidate in psutil.process_iter():
            with contextlib.suppress(psutil.Error, OSError):
                if (
                    os.getpgid(candidate.pid) == group
                    and candidate.status() != psutil.STATUS_ZOMBIE
                ):
                    members.append(candidate)
        for member in members:
            with contextlib.suppress(psutil.Error):
                member.kill()
        _gone, alive = psutil.wait_procs(members, timeout=KILL_WAIT)
        alive = [member for member in alive if _support.pid_alive(member.pid)]
        if alive:
            raise ServiceError(
                f"Processes {[member.pid for member in alive]} of worker group {group} survived SIGKILL."
            )


@atexit.register
def _kill_running_workers() -> None:
    """Never leave a worker behind: it would keep consuming the test broker's queues."""
    for worker in list(_running):
        with contextlib.suppress(Exception):
            worker.kill()
    for path in _temporary_logs:
        path.unlink(missing_ok=True)
