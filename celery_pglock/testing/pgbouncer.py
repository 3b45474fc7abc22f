"""PgBouncer: a real PgBouncer on 127.0.0.1 in front of a test database, in any pool mode.

It runs the ``pgbouncer`` binary of the system (Debian: ``apt-get install pgbouncer``) in
the foreground, with its configuration, user list, pid file and log in a temporary
directory, listening on a free loopback port and on no Unix socket. Clients connect with
the same user, password and database name as the database URL it fronts; PgBouncer itself
authenticates nobody (``auth_type = trust``) and logs in to PostgreSQL with the URL's
credentials, which is what the tests need and never what production should do.

Root hazard: PgBouncer refuses to run as root. When this process is root, PgBouncer runs
as the embedded PostgreSQL's existing unprivileged user (``nobody`` unless
``CELERY_PGLOCK_POSTGRES_USER`` names another; no user is created, no directory
loosened), and the temporary directory is handed to that user: it must be able to enter
the temporary directory's parents (``TMPDIR``). The directory holds the database password
in plain text (the ``[databases]`` line), readable by that user only.

Every wait is bounded; failures raise :class:`ServiceError` with the tail of the log.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from sqlalchemy.engine import make_url

from celery_pglock.testing import _root, _support
from celery_pglock.testing._support import ServiceError

if TYPE_CHECKING:
    import pwd
    from types import TracebackType

    from typing_extensions import Self

#: PgBouncer's ``pool_mode`` values.
POOL_MODES = ("session", "transaction", "statement")
#: Environment variable naming the pgbouncer binary, when it is not on PATH.
BINARY_ENV = "CELERY_PGLOCK_PGBOUNCER"
#: Where Debian and most distributions install it (often off a non-root user's PATH).
_SBIN = (Path("/usr/sbin/pgbouncer"), Path("/usr/local/sbin/pgbouncer"))
#: How often a start is retried with a new port when the chosen one was taken meanwhile.
PORT_ATTEMPTS = 3


def find_binary() -> Path | None:
    """The pgbouncer binary: ``$CELERY_PGLOCK_PGBOUNCER``, PATH, then the sbin dirs.

    None if there is none, or if the variable names something that cannot run.
    """
    configured = os.environ.get(BINARY_ENV)
    if configured:
        return Path(configured) if os.access(configured, os.X_OK) else None
    found = shutil.which("pgbouncer")
    if found:
        return Path(found)
    return next((path for path in _SBIN if os.access(path, os.X_OK)), None)


def _quote(value: str) -> str:
    """A value inside a PgBouncer connection string (libpq style, single quotes)."""
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


class PgBouncer:
    """A PgBouncer of its own on 127.0.0.1, in front of ``database_url``.

    Args:
        database_url: SQLAlchemy URL of the PostgreSQL database to front (TCP host).
        pool_mode: ``"session"``, ``"transaction"`` or ``"statement"``.
        settings: More ``[pgbouncer]`` settings (e.g. ``{"default_pool_size": "5"}``);
            they win over the defaults here.
        port: The TCP port; by default a free one, chosen at start.

    Use :meth:`url` to connect through it. Not thread-safe.
    """

    def __init__(
        self,
        database_url: str,
        *,
        pool_mode: str = "transaction",
        settings: dict[str, str] | None = None,
        port: int | None = None,
    ) -> None:
        if pool_mode not in POOL_MODES:
            raise ValueError(
                f"pool_mode must be one of {', '.join(POOL_MODES)}; got {pool_mode!r}."
            )
        self.database_url = database_url
        self.pool_mode = pool_mode
        self._settings = dict(settings or {})
        self._port = port
        self._port_fixed = port is not None
        self._process: subprocess.Popen[bytes] | None = None
        self._root: Path | None = None
        self._user: pwd.struct_passwd | None = None

    # -- public API -------------------------------------------------------------------

    @property
    def port(self) -> int:
        """PgBouncer's TCP port (chosen at start)."""
        if self._port is None:
            raise ServiceError("PgBouncer has no port yet: call start() first.")
        return self._port

    @property
    def log_path(self) -> Path | None:
        """PgBouncer's log file, once started."""
        return None if self._root is None else self._root / "pgbouncer.log"

    @property
    def running(self) -> bool:
        """Whether the pgbouncer process is alive."""
        return self._process is not None and self._process.poll() is None

    def url(self) -> str:
        """The database URL with PgBouncer's host and port: connect through the pooler."""
        parsed = make_url(self.database_url).set(host=_support.HOST, port=self.port)
        return parsed.render_as_string(hide_password=False)

    def start(self, *, timeout: float = 30.0) -> Self:
        """Write the configuration, start pgbouncer, wait until a query passes through it.

        Raises:
            ServiceError: no pgbouncer binary, or it did not come up within ``timeout``.
        """
        if self.running:
            return self
        binary = find_binary()
        if binary is None:
            raise ServiceError(
                "PgBouncer needs the pgbouncer binary: apt-get install pgbouncer (or set "
                f"{BINARY_ENV} to its path)."
            )
        if self._root is None:
            self._root = Path(tempfile.mkdtemp(prefix="celery-pglock-pgbouncer-"))
            if _root.is_root():
                self._user = _root.server_user()
                _root.require_reachable(self._user, self._root, "TMPDIR")
        for attempt in range(1, PORT_ATTEMPTS + 1):
            if self._port is None or (attempt > 1 and not self._port_fixed):
                self._port = _support.free_port()
            self._write_config()
            log_path = self.log_path
            assert log_path is not None  # noqa: S101 - set with _root above
            offset = log_path.stat().st_size
            self._process = subprocess.Popen(
                [str(binary), str(self._root / "pgbouncer.ini")],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,  # everything goes to the logfile
                cwd=self._root,
                env=_support.clean_env(),
                start_new_session=True,  # a Ctrl-C aimed at pytest must not kill it first
                **_root.run_as(self._user),
            )
            if _support.wait_until(
                self._answers, timeout=timeout, interval=0.1, give_up=self._exited
            ):
                atexit.register(self.stop)
                return self
            self._kill()
            port_taken = "Address already in use" in self._log_since(offset)
            if port_taken and not self._port_fixed and attempt < PORT_ATTEMPTS:
                continue
            break
        raise ServiceError(
            _support.with_log(
                f"PgBouncer ({self.pool_mode} pooling) on port {self._port} did not "
                f"answer within {timeout:g} s.",
                self.log_path,
            )
        )

    def stop(self, *, timeout: float = 10.0) -> None:
        """Stop pgbouncer (SIGTERM: immediate shutdown) and delete its directory."""
        atexit.unregister(self.stop)
        self._kill(timeout=timeout)
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
        return f"<PgBouncer {self.pool_mode} port={self._port} running={self.running}>"

    # -- internals --------------------------------------------------------------------

    def _write_config(self) -> None:
        root = self._root
        assert root is not None  # noqa: S101 - start() created it
        target = make_url(self.database_url)
        if not target.database:
            raise ServiceError(
                f"PgBouncer needs a database name in the URL: {target!r}."
            )
        user = target.username or "postgres"
        server = {
            "host": target.host or _support.HOST,
            "port": str(target.port or 5432),
            "dbname": target.database,
            "user": user,
        }
        if target.password:
            server["password"] = str(target.password)
        line = " ".join(f"{name}={_quote(value)}" for name, value in server.items())
        settings = {
            "listen_addr": _support.HOST,
            "listen_port": str(self.port),
            "unix_socket_dir": "",
            "auth_type": "trust",
            "auth_file": str(root / "userlist.txt"),
            "pool_mode": self.pool_mode,
            "max_client_conn": "500",
            "logfile": str(root / "pgbouncer.log"),
            "pidfile": str(root / "pgbouncer.pid"),
            **self._settings,
        }
        config = "\n".join(
            [
                "[databases]",
                f"{target.database} = {line}",
                "[pgbouncer]",
                *(f"{name} = {value}" for name, value in settings.items()),
                "",
            ]
        )
        files = {
            "pgbouncer.ini": config,
            "userlist.txt": f'"{user}" ""\n',
            "pgbouncer.log": "",
        }
        for name, text in files.items():
            path = root / name
            if name != "pgbouncer.log" or not path.exists():
                path.write_text(text, encoding="utf-8")
            path.chmod(0o600)
        if self._user is not None:
            _root.hand_over(self._user, root, *(root / name for name in files))

    def _answers(self) -> bool:
        """Whether a query passes through PgBouncer to PostgreSQL (one bounded try)."""
        try:
            connection = _support.connect(
                self.url(),
                application_name="celery_pglock tests pgbouncer-check",
                connect_timeout=2,
            )
        except Exception:
            return False
        try:
            with connection.cursor() as cursor:
                cursor.execute("SELECT 1")
                return bool(cursor.fetchone() == (1,))
        except Exception:
            return False
        finally:
            connection.close()

    def _exited(self) -> bool:
        return self._process is None or self._process.poll() is not None

    def _kill(self, *, timeout: float = 10.0) -> None:
        process, self._process = self._process, None
        if process is None:
            return
        if process.poll() is None:
            # SIGTERM: immediate shutdown (SIGINT would wait for clients to go away).
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout)

    def _log_since(self, offset: int) -> str:
        path = self.log_path
        if path is None:
            return ""
        try:
            with path.open("rb") as handle:
                handle.seek(offset)
                return handle.read().decode("utf-8", "replace")
        except OSError:
            return ""
