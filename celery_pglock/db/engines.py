"""The lock database: one SQLAlchemy engine per URL per process, and its pool hooks.

Fork hazard: a pooled connection must never be used by two processes, so engines are
keyed by process id and forgotten in a forked child (``dispose(close=False)``: no
Terminate on the parent's sockets). Celery's prefork pool forks after the app is
imported, so this is the normal path. See docs/design.md.

Locks use this engine, never the application's: the pool's ``checkin`` hook below assumes
every connection in it is a lock connection.
"""

from __future__ import annotations

import importlib.metadata
import itertools
import logging
import os
import socket
import threading
import time
import weakref
from collections import Counter
from collections.abc import Mapping
from typing import Any

import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import make_url

# _forks first: its after-fork hook must run before ours (see fork_safety.py).
from celery_pglock import config, exceptions
from celery_pglock.db import (
    driver_errors,
    fork_safety,
    redact,
    sql_text,
    startup_options,
)

logger = logging.getLogger(__name__)

#: Keys in a pooled connection's ``info`` dict: a Counter of the advisory keys it holds,
#: and the application_name it shows when idle.
HELD = "celery_pglock.held"
IDLE_NAME = "celery_pglock.idle_name"
#: Key in a pooled connection's ``info`` dict: when (``time.monotonic()``) its DBAPI
#: connection was opened, for :func:`mark_pool_stale`.
OPENED = "celery_pglock.opened"

#: PostgreSQL truncates application_name to NAMEDATALEN - 1 bytes.
APPLICATION_NAME_MAX = 63
DEFAULT_APPLICATION_NAME = "pglock"

#: Client-side libpq keepalives: the worker notices a vanished server in bounded time.
CLIENT_KEEPALIVES: dict[str, Any] = {
    "keepalives": 1,
    "keepalives_idle": 30,
    "keepalives_interval": 10,
    "keepalives_count": 3,
}


#: Seconds a new lock connection may take (libpq ``connect_timeout``), unless
#: ``pglock_engine_options`` sets ``connect_args={"connect_timeout": ...}``.
CONNECT_TIMEOUT = 10
#: ``postgresql+<driver>://``: psycopg2 (a dependency, and what ``postgresql://`` means
#: here) or psycopg (3; the ``psycopg`` extra installs it).
SUPPORTED_DRIVERS = ("psycopg2", "psycopg")
#: Seconds the start-up probe (:func:`probe`) may spend connecting.
PROBE_CONNECT_TIMEOUT = 10

_engines: dict[str, sa.Engine] = {}
_labels: weakref.WeakKeyDictionary[sa.Engine, dict[str, str]] = (
    weakref.WeakKeyDictionary()
)
#: The connect_args each lock engine was made with (for the lock watcher's own session).
_connect_args: weakref.WeakKeyDictionary[sa.Engine, dict[str, Any]] = (
    weakref.WeakKeyDictionary()
)
_engines_pid = os.getpid()
_engines_lock = threading.Lock()


def mask_url(url: str | sa.URL) -> str:
    """Render a database URL with every secret replaced by ``***``: safe to log.

    Masks the password, every query value that is not a known-harmless libpq option
    (``?password=``, ``?sslpassword=``, ``?dsn=...``, ``?options=...``), and any part a
    malformed URL makes ambiguous (an unescaped ``@`` in the password). See
    :mod:`celery_pglock.db.redact`.
    """
    return redact.mask_url(url)


_process_tag: tuple[int, str] = (0, "")


def process_tag() -> str:
    """``host:pid`` of this process, for application_name (cached per pid: hot path)."""
    global _process_tag
    pid = os.getpid()
    if _process_tag[0] != pid:
        _process_tag = (pid, f"{socket.gethostname().split('.')[0][:20]}:{pid}")
    return _process_tag[1]


def application_name(prefix: str, *parts: object) -> str:
    """Build an application_name within PostgreSQL's 63-byte limit.

    The tail (normally the task name) is cut from the left so its most specific part
    survives. Only names and numbers go in: never argument values, which may be personal
    data.
    """
    text = " ".join(str(part) for part in (prefix, *parts))
    encoded = text.encode("ascii", "replace")
    if len(encoded) <= APPLICATION_NAME_MAX:
        return encoded.decode("ascii")
    head = " ".join(str(part) for part in (prefix, *parts[:-1]))
    room = APPLICATION_NAME_MAX - len(head.encode("ascii", "replace")) - 2
    tail = str(parts[-1]).encode("ascii", "replace")[-max(room, 0) :].decode("ascii")
    return f"{head} ~{tail}"[:APPLICATION_NAME_MAX]


def check_url(url: str) -> sa.URL:
    """Parse and check a lock database URL.

    Raises:
        ConfigurationError: not a PostgreSQL URL with a supported driver.
    """
    try:
        parsed = make_url(url)
    except (sa_exc.ArgumentError, ValueError):  # ValueError: a non-numeric port
        raise exceptions.ConfigurationError(
            f"{config.DATABASE_URL_SETTING} is not a valid database URL: {mask_url(url)!r}."
        ) from None
    if redact.ambiguous_userinfo(url):
        # SQLAlchemy and libpq split at the first "@", so the rest of the password
        # would be taken for the host: a wrong host, and a password in its errors.
        raise exceptions.ConfigurationError(
            f"{config.DATABASE_URL_SETTING} has more than one '@', so its user name and "
            "password cannot be told from the host: percent-encode every '@' but the "
            "one before the host as %40 (p@ss -> p%40ss); got "
            f"{mask_url(url)!r}."
        )
    if parsed.drivername in ("postgresql", "postgres"):
        # No driver named: SQLAlchemy 2.1 would pick psycopg 3, which may not be
        # installed; psycopg2 always is (a dependency), so the choice never depends on
        # the SQLAlchemy version.
        parsed = parsed.set(drivername="postgresql+psycopg2")
    driver = parsed.get_driver_name()
    if parsed.get_backend_name() != "postgresql" or driver not in SUPPORTED_DRIVERS:
        raise exceptions.ConfigurationError(
            f"{config.DATABASE_URL_SETTING} must be a PostgreSQL URL using psycopg2 or "
            "psycopg (3), such as postgresql+psycopg2://user:password@host/db or "
            f"postgresql+psycopg://user:password@host/db; got {mask_url(parsed)!r}."
        )
    if driver == "psycopg":
        _check_psycopg_installed()
    return parsed


#: The oldest psycopg 3 that works (the ``psycopg`` extra's floor; see CHANGELOG).
PSYCOPG_MIN = (3, 1, 8)


def _check_psycopg_installed() -> None:
    """A postgresql+psycopg:// URL needs psycopg 3, at least PSYCOPG_MIN: say so now, not
    as a ModuleNotFoundError at the first lock or a driver error at the first connect."""
    try:
        installed = importlib.metadata.version("psycopg")
    except importlib.metadata.PackageNotFoundError:
        installed = None
    floor = ".".join(map(str, PSYCOPG_MIN))
    if installed is None or _release(installed) < PSYCOPG_MIN:
        found = (
            f"psycopg {installed} is installed" if installed else "it is not installed"
        )
        raise exceptions.ConfigurationError(
            f"{config.DATABASE_URL_SETTING} is a postgresql+psycopg:// URL, which needs "
            f"psycopg >= {floor}, but {found}: pip install 'celery-pglock[psycopg]' "
            "(or use a postgresql+psycopg2:// URL)."
        )


def _release(version: str) -> tuple[int, ...]:
    """The leading numbers of a version string ("3.2.1.dev0" -> (3, 2, 1))."""
    numbers = []
    for part in version.split("."):
        digits = "".join(itertools.takewhile(str.isdigit, part))
        if not digits:
            break
        numbers.append(int(digits))
    return tuple(numbers)


def engine_for(conf: Mapping[str, Any]) -> sa.Engine:
    """The lock engine of this process for the app configuration ``conf``.

    Created on first use (never at import, never in the parent before a fork), then cached.

    Raises:
        ConfigurationError: no database URL, or an invalid one.
    """
    url = config.database_url(conf)
    cache_key = url
    engine = _engines.get(cache_key)
    if engine is not None and _engines_pid == os.getpid():
        return engine
    with _engines_lock:
        _forget_engines_after_fork()
        engine = _engines.get(cache_key)
        if engine is None:
            engine = create_engine(url, conf)
            _engines[cache_key] = engine
        return engine


def create_engine(url: str, conf: Mapping[str, Any] | None = None) -> sa.Engine:
    """Create a lock engine: keepalives and session settings, an idle application_name
    and the check-in net.

    ``app.conf.pglock_engine_options`` (a dict) is passed to ``sqlalchemy.create_engine``
    and wins over our defaults; ``pglock_server_keepalives = False`` drops the startup
    options (startup_options.SESSION_SETTINGS are then set by a statement at connect). A pooler that
    refuses them (PgBouncer) gets a second connect without them (see ``startup_options``).
    """
    conf = conf or {}
    parsed = check_url(url)
    options = _engine_options(conf)
    engine = sa.create_engine(parsed, **options)
    _labels[engine] = {
        "application_name_prefix": str(
            conf.get("pglock_application_name") or DEFAULT_APPLICATION_NAME
        ),
        "masked_url": mask_url(parsed),
    }
    if driver_of(engine) == "psycopg":
        # First, before any listener runs a statement on the new connection.
        event.listen(engine, "connect", _bind_on_client, insert=True)
    event.listen(engine, "checkin", _unlock_leftovers)
    _track_staleness(engine)
    _drop_options_if_refused(engine, options)
    # Lock sessions: a forked child must never touch them (see fork_safety.py).
    event.listen(engine, "connect", _adopt)
    _connect_args[engine] = dict(options["connect_args"])
    return engine


def _adopt(dbapi_connection: Any, record: Any) -> None:
    fork_safety.adopt(dbapi_connection)


def driver_of(engine: sa.Engine) -> str:
    """The DBAPI driver of a lock engine: one of SUPPORTED_DRIVERS."""
    return str(engine.url.get_driver_name())


def _bind_on_client(dbapi_connection: Any, record: Any) -> None:
    """psycopg 3 binds parameters on the server by default, which allows one statement
    per execute; the lock statements are several in one round trip (``sql_text.py``). A
    ClientCursor binds them as psycopg2 does."""
    import psycopg  # only a psycopg engine gets here

    dbapi_connection.cursor_factory = psycopg.ClientCursor


def connect_params(engine: sa.Engine) -> dict[str, Any]:
    """The libpq keywords of ``engine``'s connections, for psycopg2.connect() (with
    secrets: never log)."""
    _, params = engine.dialect.create_connect_args(engine.url)
    return _libpq_only({**params, **_connect_args.get(engine, {})})


def _libpq_only(params: Mapping[str, Any]) -> dict[str, Any]:
    """``params`` without the drivers' own keywords, which the watcher's psycopg2 connect
    would refuse as an invalid DSN (every check then unverifiable: locks taken for lost).
    Those are the psycopg 3 dialect's adapters ``context`` and what users pass for psycopg 3
    (``prepare_threshold``, ``autocommit``) or psycopg2 (``cursor_factory``)."""
    from psycopg2 import ProgrammingError
    from psycopg2.extensions import make_dsn

    kept = {}
    for key, value in params.items():
        if value is None or not isinstance(value, str | int | float):
            continue
        keyword: dict[str, Any] = {key: value}
        try:
            make_dsn(None, **keyword)  # libpq's own parser: refuses unknown keywords
        except ProgrammingError:
            continue
        kept[key] = value
    return kept


def _drop_options_if_refused(engine: sa.Engine, options: Mapping[str, Any]) -> None:
    """Let ``engine`` connect without our ``options`` where they are refused (a pooler, an
    older server), and apply our session settings another way then (see ``startup_options``)."""

    given = options["connect_args"].get("options")
    ours = given if given == startup_options.SERVER_OPTIONS else None
    startup_options.install_fallback(engine, mask_url(engine.url), ours)


def _engine_options(conf: Mapping[str, Any]) -> dict[str, Any]:
    """``sqlalchemy.create_engine`` keywords for a lock engine of ``conf``."""
    prefix = str(conf.get("pglock_application_name") or DEFAULT_APPLICATION_NAME)
    connect_args: dict[str, Any] = {
        **CLIENT_KEEPALIVES,
        # libpq waits for a silent host as long as the kernel lets it: bound it.
        "connect_timeout": CONNECT_TIMEOUT,
        "application_name": application_name(prefix, process_tag(), "idle"),
    }
    if conf.get("pglock_server_keepalives", True):
        connect_args["options"] = startup_options.SERVER_OPTIONS
    extra = conf.get("pglock_engine_options") or {}
    if not isinstance(extra, Mapping):
        raise exceptions.ConfigurationError(
            "pglock_engine_options must be a dict of sqlalchemy.create_engine options, "
            f"got a {type(extra).__name__}."  # never its text: it may hold a DSN
        )
    extra = dict(extra)
    connect_args.update(extra.pop("connect_args", {}))
    options: dict[str, Any] = {"pool_pre_ping": False, "connect_args": connect_args}
    if "poolclass" not in extra:
        # Transaction-scope locks and bounded waits pin one pooled connection per
        # held lock, and threads/gevent pools run several at
        # once in one process. Idle connections are kept so those never connect per
        # task. (A custom poolclass, e.g. NullPool, may not take these arguments.)
        options.update(pool_size=10, max_overflow=20)
    options.update(extra)
    return options


def probe(conf: Mapping[str, Any]) -> str:
    """Connect once to the lock database of ``conf`` and return its ``server_version``.

    The connection is made as lock connections are (same connect arguments, so a
    PgBouncer setup is probed as it is used), but on a throwaway engine without a pool:
    a worker's main process runs this before or between forks, and must leave no socket
    behind for its children to inherit. libpq waits for a silent host as long as the
    kernel lets it, so the probe bounds its connect to :data:`PROBE_CONNECT_TIMEOUT`
    seconds unless ``pglock_engine_options`` sets ``connect_timeout``.

    Raises:
        ConfigurationError: no database URL, or an invalid one.
        DatabaseError: the connection or the query failed (masked URL in the message).
    """
    parsed = check_url(config.database_url(conf))
    options = _engine_options(conf)
    for pool_only in ("pool_size", "max_overflow", "pool_recycle", "pool_timeout"):
        options.pop(pool_only, None)
    options["poolclass"] = sa.NullPool
    options["connect_args"].setdefault("connect_timeout", PROBE_CONNECT_TIMEOUT)
    engine = sa.create_engine(parsed, **options)
    _drop_options_if_refused(engine, options)
    try:
        # raw_connection(): the driver's own error text, without SQLAlchemy's wrapping.
        with driver_errors.wrap_db_errors("connect to the lock database", engine):
            connection: Any = engine.raw_connection()
            try:
                with connection.cursor() as cursor:
                    cursor.execute("SHOW server_version")
                    (version,) = cursor.fetchone()
            finally:
                connection.close()
    finally:
        engine.dispose()
    # Distribution builds append their own text: "15.14 (Ubuntu 15.14-1.pgdg22.04+1)".
    return str(version).split()[0]


def engine_info(engine: sa.Engine) -> dict[str, str]:
    """The labels create_engine attached: application_name prefix, masked URL."""
    labels = _labels.get(engine)
    if labels is None:
        # An engine the caller made: label it and add the check-in net on first sight.
        if not event.contains(engine, "checkin", _unlock_leftovers):
            event.listen(engine, "checkin", _unlock_leftovers)
            event.listen(engine, "connect", _adopt)
            _track_staleness(engine)

            # No startup options of ours: the session settings by a statement at connect.
            startup_options.install_fallback(engine, mask_url(engine.url), None)
        labels = _labels[engine] = {
            "application_name_prefix": DEFAULT_APPLICATION_NAME,
            "masked_url": mask_url(engine.url),
        }
    return labels


def held_keys(connection_info: dict[Any, Any]) -> Counter[tuple[int, ...]]:
    """The Counter of advisory keys a pooled connection holds (created on first use)."""
    held: Counter[tuple[int, ...]] | None = connection_info.get(HELD)
    if held is None:
        held = connection_info[HELD] = Counter()
    return held


def _unlock_leftovers(dbapi_connection: Any, record: Any) -> None:
    """Pool check-in safety net: a connection never goes back to the pool holding a lock.

    Normal releases leave the Counter empty, so this costs nothing on the hot path; it
    only runs SQL when some path returned a connection without releasing (a bug, or an
    exception between acquire and bookkeeping). If even that fails, the connection is
    invalidated: closing the session is the one release PostgreSQL always honours.
    """
    held = record.info.get(HELD)
    if not held or dbapi_connection is None or fork_safety.is_foreign(dbapi_connection):
        return  # (a forked child's copy of its parent's lock session: not ours to unlock)
    logger.warning(
        "A lock connection came back to the pool still holding advisory keys %s; unlocking them all",
        sorted(held),
        extra={"action": "lock_checkin_unlock_all"},
    )
    try:
        if not dbapi_connection.autocommit:
            dbapi_connection.rollback()
        with dbapi_connection.cursor() as cursor:
            cursor.execute(
                sql_text.UNLOCK_ALL,
                (record.info.get(IDLE_NAME, DEFAULT_APPLICATION_NAME),),
            )
        held.clear()
    except Exception:
        logger.exception(
            "Could not unlock a returning lock connection; closing it instead"
        )
        record.invalidate()


#: Public (``celery_pglock.db.engines.is_transient``): does an error's cause say the lock database
#: is unavailable for now (worth retrying later) rather than that the caller is wrong?
is_transient = driver_errors.is_transient
#: Public (``celery_pglock.db.engines.is_connect_failure``): does an error look like a failure to
#: open a connection (refused, unknown host, authentication, too many clients)?
is_connect_failure = driver_errors.is_connect_failure


def mark_pool_stale(
    engine: sa.Engine, pooled: Any, exc: BaseException | None = None
) -> None:
    """``pooled`` (a connection of ``engine``'s pool, or None) was found dead: retire its
    siblings.

    A server restart ends every session, so every connection of the pool opened before
    now is replaced at its next checkout (a ``checkout`` listener raises
    ``DisconnectionError`` for it, and the pool reconnects it). Connections checked out
    now keep their sessions, and so their locks, until they are given back; none leaves
    the pool's books, unlike with ``engine.dispose()``, which orphans them. Once per
    death: a ``pooled`` opened before the last mark does not move it again (many tasks
    finding one restart's corpses retire the pool once). ``pooled`` itself is not
    invalidated here: the caller does that (and gives it back).
    """
    staleness = _staleness.get(engine) or _track_staleness(engine)
    opened = float("-inf") if pooled is None else pooled.info.get(OPENED, float("-inf"))
    if pooled is None or staleness.before is None or staleness.before < opened:
        staleness.before = time.monotonic()


class _Staleness:
    """Pool listeners of one engine: stamp each new connection, and retire at checkout
    those opened before :attr:`before` (the last :func:`mark_pool_stale`)."""

    def __init__(self) -> None:
        self.before: float | None = None

    def stamp(self, dbapi_connection: Any, record: Any) -> None:
        record.info[OPENED] = time.monotonic()

    def retire(self, dbapi_connection: Any, record: Any, proxy: Any) -> None:
        before = self.before
        if before is not None and record.info.get(OPENED, float("-inf")) < before:
            raise sa_exc.DisconnectionError(
                "opened before the lock database was last found dead"
            )


_staleness: weakref.WeakKeyDictionary[sa.Engine, _Staleness] = (
    weakref.WeakKeyDictionary()
)
_staleness_lock = threading.Lock()  # not _engines_lock: engine_for holds that one


def _track_staleness(engine: sa.Engine) -> _Staleness:
    """Install :class:`_Staleness` on ``engine`` (once)."""
    with _staleness_lock:
        staleness = _staleness.get(engine)
        if staleness is None:
            staleness = _staleness[engine] = _Staleness()
            event.listen(engine, "connect", staleness.stamp)
            # First: before any other checkout listener sees a stale connection.
            event.listen(engine, "checkout", staleness.retire, insert=True)
    return staleness


def _forget_engines_after_fork() -> None:
    global _engines_pid
    if _engines_pid == os.getpid():
        return
    for engine in _engines.values():
        # close=False: drop the parent's pooled sockets without closing them, because the
        # parent is still using them.
        engine.dispose(close=False)
    _engines.clear()
    _engines_pid = os.getpid()


def dispose_all() -> None:
    """Close every lock engine of this process (worker shutdown, tests)."""
    with _engines_lock:
        _forget_engines_after_fork()
        for engine in _engines.values():
            engine.dispose()
        _engines.clear()


def _after_fork_in_child() -> None:
    global _engines_lock, _staleness_lock
    _engines_lock = threading.Lock()  # another thread of the parent may have held it
    _staleness_lock = threading.Lock()
    _forget_engines_after_fork()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
