"""A real PgBouncer on loopback in front of the test PostgreSQL (tests marked pgbouncer).

Needs the ``pgbouncer`` binary (Debian package ``pgbouncer``); a missing binary is an
error, never a skip. PgBouncer refuses to run as root, so as root it runs as the
embedded server's unprivileged user (``nobody`` unless CELERY_PGLOCK_POSTGRES_USER).
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

import sqlalchemy as sa

from celery_pglock.testing import _root, _support

if TYPE_CHECKING:
    from collections.abc import Iterator

BINARY = shutil.which("pgbouncer") or "/usr/sbin/pgbouncer"


@contextlib.contextmanager
def pgbouncer(
    database_url: str, *, pool_mode: str, ignore_startup_parameters: str = ""
) -> Iterator[str]:
    """Run PgBouncer in ``pool_mode`` in front of ``database_url``; yield its URL."""
    if not Path(BINARY).exists():
        raise RuntimeError(
            "The pgbouncer binary is missing: apt-get install -y pgbouncer "
            "(tests marked 'pgbouncer' need it)."
        )
    target = sa.make_url(database_url)
    root = Path(tempfile.mkdtemp(prefix="celery-pglock-pgbouncer-"))
    port = _support.free_port()
    (root / "users.txt").write_text(f'"{target.username}" ""\n')
    ignore = ",".join(filter(None, ["extra_float_digits", ignore_startup_parameters]))
    (root / "pgbouncer.ini").write_text(
        "[databases]\n"
        f"{target.database} = host={target.host} port={target.port or 5432} "
        f"dbname={target.database} user={target.username}\n"
        "[pgbouncer]\n"
        f"listen_addr = 127.0.0.1\nlisten_port = {port}\nunix_socket_dir =\n"
        f"auth_type = trust\nauth_file = {root / 'users.txt'}\n"
        f"pool_mode = {pool_mode}\nignore_startup_parameters = {ignore}\n"
        "max_client_conn = 50\ndefault_pool_size = 5\n"
        f"logfile = {root / 'pgbouncer.log'}\npidfile = {root / 'pgbouncer.pid'}\n"
    )
    user = _root.server_user() if _root.is_root() else None
    if user is not None:
        _root.require_reachable(user, root, "TMPDIR")
        _root.hand_over(user, root, *root.iterdir())
    process = subprocess.Popen(
        [BINARY, str(root / "pgbouncer.ini")],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
        **_root.run_as(user),
    )
    url = target.set(port=port).render_as_string(hide_password=False)
    try:
        deadline = time.monotonic() + 15
        while True:
            try:
                _support.connect(
                    url, application_name="pgbouncer probe", connect_timeout=2
                ).close()
                break
            except Exception:
                if process.poll() is not None or time.monotonic() > deadline:
                    log = _support.tail(root / "pgbouncer.log")
                    raise RuntimeError(f"PgBouncer did not start:\n{log}") from None
                time.sleep(0.1)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
        shutil.rmtree(root, ignore_errors=True)
