"""Lock engines, one per URL per process, and their pool hooks: never share one with the app.
Why: docs/guide/pools.md ("The lock engine is the library's alone")."""

from __future__ import annotations

import contextlib
import importlib.metadata
import logging
import math
import os
import re
import socket
import threading
import time
import weakref
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeVar

import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import make_url

from celery_pglock import config, exceptions
from celery_pglock.db import (
    deadlines,
    driver_errors,
    forks,
    redact,
    sql_text,
    startup_options,
)

logger = logging.getLogger(__name__)

#: Keys of a pooled connection's ``info``: held keys (Counter), idle name, opened (monotonic).
HELD = "celery_pglock.held"
IDLE_NAME = "celery_pglock.idle_name"
OPENED = "celery_pglock.opened"

APPLICATION_NAME_MAX = 63  #: PostgreSQL truncates application_name to 63 bytes.
DEFAULT_APPLICATION_NAME = "pglock"
CLIENT_KEEPALIVES: dict[str, Any] = {
    "keepalives": 1,
    "keepalives_idle": 30,
    "keepalives_interval": 10,
    "keepalives_count": 3,
}
#: libpq's least connect_timeout (psycopg 3 keeps it): a shorter one waits this long.
CONNECT_TIMEOUT_MIN = 2
SUPPORTED_DRIVERS = driver_errors.DRIVER_MODULES  #: ``postgresql+<driver>://``
PSYCOPG_MIN = (3, 1, 8)  #: The oldest psycopg 3 that works (the extra's floor).

mask_url = redact.mask_url

_engines: dict[str, sa.Engine] = {}
_engines_pid = os.getpid()
_engines_lock = forks.safe_lock()
_labels = weakref.WeakKeyDictionary[sa.Engine, dict[str, str]]()
_connect_args = weakref.WeakKeyDictionary[sa.Engine, dict[str, Any]]()
_process_tag: tuple[int, str] = (0, "")
_connections: weakref.WeakSet[Any] = weakref.WeakSet()
_foreign: weakref.WeakSet[Any] = weakref.WeakSet()  #: The parent's, in a forked child.
#: Per engine: connections opened (monotonic) before this are retired at checkout.
_stale_before = weakref.WeakKeyDictionary[sa.Engine, float]()


def process_tag() -> str:
    global _process_tag
    pid = os.getpid()
    if _process_tag[0] != pid:
        _process_tag = (pid, f"{socket.gethostname().split('.')[0][:20]}:{pid}")
    return _process_tag[1]


def application_name(prefix: str, *parts: object) -> str:
    """Cut to 63 bytes from the left of the last part; names and numbers only (no arguments)."""
    text = " ".join(str(part) for part in (prefix, *parts))
    encoded = text.encode("ascii", "replace")
    if len(encoded) <= APPLICATION_NAME_MAX:
        return encoded.decode("ascii")
    head = " ".join(str(part) for part in (prefix, *parts[:-1]))
    room = APPLICATION_NAME_MAX - len(head.encode("ascii", "replace")) - 2
    tail = str(parts[-1]).encode("ascii", "replace")[-max(room, 0) :].decode("ascii")
    return f"{head} ~{tail}"[:APPLICATION_NAME_MAX]


def check_url(url: str) -> sa.URL:
    """ConfigurationError unless a PostgreSQL URL with a supported driver."""
    setting = config.DATABASE_URL_SETTING
    try:
        parsed = make_url(url)
    except (sa_exc.ArgumentError, ValueError):  # ValueError: a non-numeric port
        raise exceptions.ConfigurationError(
            f"{setting} is not a valid database URL: {mask_url(url)!r}."
        ) from None
    if redact.ambiguous_userinfo(url):
        raise exceptions.ConfigurationError(
            f"{setting} has more than one '@', so its user name and "
            "password cannot be told from the host: percent-encode every '@' but the "
            f"one before the host as %40 (p@ss -> p%40ss); got {mask_url(url)!r}."
        )
    if parsed.drivername in ("postgresql", "postgres"):
        # psycopg2 is a dependency; SQLAlchemy 2.1 would pick psycopg 3.
        parsed = parsed.set(drivername="postgresql+psycopg2")
    driver = parsed.get_driver_name()
    if parsed.get_backend_name() != "postgresql" or driver not in SUPPORTED_DRIVERS:
        raise exceptions.ConfigurationError(
            f"{setting} must be a PostgreSQL URL using psycopg2 or "
            "psycopg (3), such as postgresql+psycopg2://user:password@host/db or "
            f"postgresql+psycopg://user:password@host/db; got {mask_url(parsed)!r}."
        )
    if driver == "psycopg":
        installed = ""
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            installed = importlib.metadata.version("psycopg")
        release = re.findall(r"\d+", re.sub(r"[^\d.].*", "", installed))
        if tuple(map(int, release)) < PSYCOPG_MIN:
            found = f"psycopg {installed} is" if installed else "it is not"
            raise exceptions.ConfigurationError(
                f"{setting} is a postgresql+psycopg:// URL, which needs psycopg >= "
                f"{'.'.join(map(str, PSYCOPG_MIN))}, but {found} installed: pip "
                "install 'celery-pglock[psycopg]' (or use a postgresql+psycopg2:// URL)."
            )
    return parsed


def engine_for(conf: Mapping[str, Any]) -> sa.Engine:
    """The lock engine of this process for ``conf``, created on first use (never at import,
    never in the parent before a fork); ConfigurationError for a missing or invalid URL."""
    url = config.database_url(conf)
    engine = _engines.get(url)
    if engine is not None and _engines_pid == os.getpid():
        return engine
    with _engines_lock:
        _forget_engines_after_fork()
        engine = _engines.get(url)
        if engine is None:
            engine = _engines[url] = create_engine(url, conf)
        return engine


def create_engine(url: str, conf: Mapping[str, Any] | None = None) -> sa.Engine:
    """Create a lock engine: keepalives, session settings, an idle application_name and
    the check-in net; ``pglock_engine_options`` win (docs/reference/settings.md)."""
    conf = conf or {}
    connect_args: dict[str, Any] = {
        **CLIENT_KEEPALIVES,
        "connect_timeout": connect_timeout(conf),
        "application_name": application_name(_prefix(conf), process_tag(), "idle"),
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
        # Sized for transaction locks and waits (docs/guide/pools.md); NullPool refuses these.
        options.update(pool_size=10, max_overflow=20)
    options.update(extra)
    engine = sa.create_engine(check_url(url), **options)
    _labels[engine] = {
        "application_name_prefix": _prefix(conf),
        "masked_url": mask_url(engine.url),
    }
    if engine.url.get_driver_name() == "psycopg":
        # First: before any other listener runs a statement on the new connection.
        event.listen(engine, "connect", _bind_on_client, insert=True)
    given = connect_args.get("options")
    _install_hooks(engine, given if given == startup_options.SERVER_OPTIONS else None)
    _connect_args[engine] = dict(connect_args)
    return engine


def engine_info(engine: sa.Engine) -> dict[str, str]:
    """Labels (application_name prefix, masked URL); a caller's engine gets our hooks."""
    labels = _labels.get(engine)
    if labels is None:
        if not event.contains(engine, "checkin", _unlock_leftovers):
            _install_hooks(engine, None)
        labels = _labels[engine] = {
            "application_name_prefix": DEFAULT_APPLICATION_NAME,
            "masked_url": mask_url(engine.url),
        }
    return labels


def _install_hooks(engine: sa.Engine, ours: str | None) -> None:
    event.listen(engine, "checkin", _unlock_leftovers)
    event.listen(engine, "engine_disposed", _close_kept)
    event.listen(engine, "connect", adopt)

    def retire(dbapi_connection: Any, record: Any, proxy: Any) -> None:
        if record.info.get(OPENED, -math.inf) < _stale_before.get(engine, -math.inf):
            raise sa_exc.DisconnectionError(
                "opened before the lock database was last found dead"
            )

    # First: before any other checkout listener sees a stale connection.
    event.listen(engine, "checkout", retire, insert=True)
    startup_options.install_fallback(engine, mask_url(engine.url), ours)


def _prefix(conf: Mapping[str, Any]) -> str:
    return str(conf.get("pglock_application_name") or DEFAULT_APPLICATION_NAME)


def adopt(dbapi_connection: Any, record: Any = None) -> None:
    """Remember a lock connection, to neuter it after a fork."""
    _connections.add(dbapi_connection)
    if record is not None:
        record.info[OPENED] = time.monotonic()


def _bind_on_client(dbapi_connection: Any, record: Any) -> None:
    # psycopg 3 binds server-side, one statement per execute; ours send several at once.
    import psycopg

    dbapi_connection.cursor_factory = psycopg.ClientCursor


def connect(engine: sa.Engine) -> Any:
    """A DBAPI connection made as the pool makes them, outside it (no pool listener runs)."""
    cargs, params = engine.dialect.create_connect_args(engine.url)
    cparams = {**params, **_connect_args.get(engine, {})}
    fallback = startup_options.fallback_of(engine)
    if fallback is None:
        return engine.dialect.connect(*cargs, **cparams)
    return fallback(engine.dialect, None, list(cargs), cparams)


def connect_params(engine: sa.Engine) -> dict[str, Any]:
    """libpq keywords for psycopg2.connect(), as the server accepts them (secrets: never log)."""
    from psycopg2 import ProgrammingError
    from psycopg2.extensions import make_dsn

    _, params = engine.dialect.create_connect_args(engine.url)
    kept: dict[str, Any] = {}
    for key, value in {**params, **_connect_args.get(engine, {})}.items():
        # A driver's own keyword (``cursor_factory``, ``context``) is an invalid DSN.
        if isinstance(value, str | int | float):
            with contextlib.suppress(ProgrammingError):
                make_dsn(None, **{key: value})  # libpq's own parser
                kept[key] = value
    fallback = startup_options.fallback_of(engine)
    if fallback is not None and kept.get("options") == fallback.ours:
        fallback.apply(kept)
    return kept


def connect_timeout(conf: Mapping[str, Any]) -> int:
    """libpq's ``connect_timeout`` for ``pglock_db_timeout``: docs/reference/settings.md."""
    return max(CONNECT_TIMEOUT_MIN, math.ceil(config.app_seconds(conf, "db_timeout")))


def probe(conf: Mapping[str, Any]) -> str:
    """``server_version``, outside any pool: safe in a parent before it forks (no socket left).
    ConfigurationError: a bad URL; DatabaseError: it failed."""
    engine = create_engine(config.database_url(conf), conf)
    try:
        with (
            driver_errors.wrap_db_errors("connect to the lock database", engine),
            contextlib.closing(connect(engine)) as connection,
            connection.cursor() as cursor,
        ):
            cursor.execute(sql_text.SERVER_VERSION)
            (version,) = cursor.fetchone()
    finally:
        engine.dispose()
    # Distribution builds append text: "15.14 (Ubuntu 15.14-1.pgdg22.04+1)".
    return str(version).split()[0]


def held_keys(connection_info: dict[Any, Any]) -> Counter[tuple[int, ...]]:
    held: Counter[tuple[int, ...]] = connection_info.setdefault(HELD, Counter())
    return held


def _unlock_leftovers(dbapi_connection: Any, record: Any) -> None:
    """Check-in net: unlock all, or invalidate the connection (closing releases)."""
    held = record.info.get(HELD)
    if not held or dbapi_connection is None or dbapi_connection in _foreign:
        return  # a forked child's copy of its parent's session: not ours to unlock
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


def mark_pool_stale(engine: sa.Engine, pooled: Any) -> None:
    """``pooled`` (or None) was found dead: replace its older siblings at next checkout.
    Checked-out ones keep their locks (unlike dispose()); the caller invalidates ``pooled``."""
    before = _stale_before.get(engine)
    if pooled is None or before is None or before < pooled.info.get(OPENED, -math.inf):
        _stale_before[engine] = time.monotonic()


def _forget_engines_after_fork() -> None:
    global _engines_pid
    if _engines_pid == os.getpid():
        return
    for engine in _engines.values():
        engine.dispose(close=False)  # the parent still uses these sockets
    _engines.clear()
    _engines_pid = os.getpid()


def dispose_all() -> None:
    with _engines_lock:
        _forget_engines_after_fork()
        for engine in _engines.values():
            engine.dispose()
        _engines.clear()


@forks.reset_in_child
def _after_fork_in_child() -> None:
    # Sockets first, so that the disposal below finalises nothing on the parent's.
    connections = list(_connections)
    _connections.clear()
    null = os.open(os.devnull, os.O_RDWR) if connections else -1
    for connection in connections:
        with contextlib.suppress(Exception):  # a closed one: no descriptor to protect
            fd = connection.fileno()
            if fd >= 0:
                os.dup2(null, fd)
            _foreign.add(connection)
    if null >= 0:
        os.close(null)
    _forget_engines_after_fork()
    _kept.clear()  # the parent's, neutered above


@contextlib.contextmanager
def autocommit(engine: sa.Engine) -> Iterator[Any]:
    """A pooled DBAPI connection in autocommit; after an error invalidated, not pooled."""
    pooled: Any = engine.raw_connection()
    try:
        pooled.dbapi_connection.autocommit = True
        yield pooled.dbapi_connection
    except BaseException as exc:
        if driver_errors.is_disconnect(exc):
            mark_pool_stale(engine, pooled)
        pooled.invalidate()
        raise
    finally:
        pooled.close()


@contextlib.contextmanager
def autocommit_cursor(engine: sa.Engine, bound: float | None = None) -> Iterator[Any]:
    """A cursor on an :func:`autocommit` connection (``cursor.connection``), each round
    trip bounded by ``bound`` seconds (deadlines.bounded) if given."""
    with (
        autocommit(engine) as dbapi,
        contextlib.nullcontext() if bound is None else deadlines.bounded(dbapi, bound),
        dbapi.cursor() as cursor,
    ):
        yield cursor


class _Kept:
    """A connection kept out of the pool for one hot statement (the lock_enqueue claim):
    no checkout per call. Detached: never reset at check-in nor counted in the pool."""

    def __init__(self, engine: sa.Engine) -> None:
        self.pooled = engine.raw_connection()
        self.pooled.detach()
        dbapi: Any = self.pooled.dbapi_connection
        dbapi.autocommit = True
        self.dbapi, self.cursor = dbapi, dbapi.cursor()
        self.busy = threading.Lock()
        self.pid = os.getpid()


_kept = weakref.WeakKeyDictionary[sa.Engine, _Kept]()
_T = TypeVar("_T")


def _close_kept(engine: sa.Engine) -> None:
    """engine_disposed: close its kept connection with the pool's (never a parent's)."""
    kept = _kept.pop(engine, None)
    if kept is not None and kept.pid == os.getpid():
        with contextlib.suppress(Exception):
            kept.dbapi.close()


def on_kept(engine: sa.Engine, bound: float, work: Callable[[Any], _T]) -> _T:
    """``work(cursor)`` on the engine's kept autocommit connection, bounded; on a pooled
    one (:func:`autocommit_cursor`) while another thread uses it. An error closes it."""
    # Opened outside any lock (a dead server costs each thread its own bound only).
    kept = _kept.get(engine)
    if kept is None:
        fresh = _Kept(engine)
        kept = _kept.setdefault(engine, fresh)
        if kept is not fresh:  # a racing thread's (a row writer's) came first
            # Closed now: psycopg 3 warns of an open connection the GC deletes.
            with contextlib.suppress(Exception):
                fresh.dbapi.close()
    if not kept.busy.acquire(blocking=False):
        with autocommit_cursor(engine, bound) as cursor:
            return work(cursor)
    try:
        with deadlines.bounded(kept.dbapi, bound):
            return work(kept.cursor)
    except BaseException as exc:
        # As autocommit() invalidates a pooled one: the next call opens a fresh one.
        if _kept.get(engine) is kept:
            del _kept[engine]
        if driver_errors.is_disconnect(exc):
            mark_pool_stale(engine, kept.pooled)
        with contextlib.suppress(Exception):  # not the pool's close: it logs an ERROR
            kept.dbapi.close()
        raise
    finally:
        kept.busy.release()
