"""The lock sessions' own settings: sent as the ``options`` startup parameter
(``SERVER_OPTIONS``), or applied by a statement at connect where that is refused.

A ``do_connect`` hook (:class:`OptionsFallback`) retries without what a pooler (PgBouncer
refuses the parameter) or an older PostgreSQL (an unknown setting) refuses, and remembers
it; the lock watcher's own session connects with the same knowledge
(``OptionsFallback.current`` and ``learn``). Why: docs/operations/pgbouncer.md
("Connection options through PgBouncer") and docs/operations/lock-loss.md.

Hazard: only the library's own options are ever dropped. Options a user set in
``pglock_engine_options["connect_args"]`` fail loudly, as they should; the session
settings are then applied by the statement at connect.
"""

from __future__ import annotations

import logging
import re
import weakref
from typing import Any

import sqlalchemy as sa
from sqlalchemy import event

#: Server-side TCP settings, so that PostgreSQL notices a vanished worker host (power loss,
#: partition) and frees its locks within 30 to 60 s of the link breaking, instead of after
#: the kernel defaults (two hours idle; some 15 minutes of retransmissions for an answer
#: sent into the void). Idle, the session is probed after 30 s, then 3 times 10 s apart;
#: ``tcp_user_timeout`` (60 s = idle + interval x count, so it never shortens that) bounds
#: unacknowledged data, which keepalives do not cover. See docs/operations/lock-loss.md.
SERVER_KEEPALIVES: tuple[tuple[str, str], ...] = (
    ("tcp_keepalives_idle", "30"),
    ("tcp_keepalives_interval", "10"),
    ("tcp_keepalives_count", "3"),
    ("tcp_user_timeout", "60000"),
)
#: Settings every lock session needs whatever the role or database says: a lock session
#: sits idle while its body runs, by design, so ``idle_session_timeout`` (PostgreSQL 14+)
#: must never end it. Transaction scope sets ``idle_in_transaction_session_timeout``, and
#: a bounded wait ``statement_timeout``, in their own statements instead (transaction-local:
#: a task body's own statements keep the role's bounds; see sql_text.py).
SESSION_SETTINGS: tuple[tuple[str, str], ...] = (("idle_session_timeout", "0"),)
#: The ``options`` startup parameter of a lock connection: our settings, which cost no
#: round trip this way. Without it (``pglock_server_keepalives = False``, a pooler that
#: refuses it, the user's own), SESSION_SETTINGS are set by a statement at connect.
SERVER_OPTIONS = " ".join(
    f"-c {name}={value}" for name, value in (*SERVER_KEEPALIVES, *SESSION_SETTINGS)
)

logger = logging.getLogger(__name__)

#: PgBouncer's answers when it refuses the ``options`` startup parameter (before 1.20:
#: any ``options``; from 1.20: settings it does not track, such as tcp_keepalives_*).
OPTIONS_REJECTED = (
    "unsupported startup parameter: options",
    "unsupported options startup parameter",
)
#: PostgreSQL's answer to a setting it does not know (an older server).
_UNKNOWN = re.compile(r'unrecognized configuration parameter "([a-z_]+)"')
#: One ``-c name=value`` of an options string the library built.
_SETTING = re.compile(r"-c ([a-z_]+)=(\S+)")

#: Applies SESSION_SETTINGS on a connection made without them, in one statement.
#: pg_settings filters out what the server does not know (idle_session_timeout < 14).
#: Params: names (text[]), values (text[]).
APPLY_SESSION_SETTINGS = (
    "SELECT count(set_config(s.name, w.value, false)) "
    "FROM unnest(%s::text[], %s::text[]) AS w(name, value) "
    "JOIN pg_settings s ON s.name = w.name"
)


def apply_session_settings(dbapi_connection: Any) -> None:
    """Set SESSION_SETTINGS on a lock connection (one round trip, outside any
    transaction): a session whose startup options went without them."""
    names = [name for name, _ in SESSION_SETTINGS]
    values = [value for _, value in SESSION_SETTINGS]
    previous = dbapi_connection.autocommit
    # Autocommit: a statement pooler refuses the BEGIN the driver would send first.
    dbapi_connection.autocommit = True
    try:
        with dbapi_connection.cursor() as cursor:
            cursor.execute(APPLY_SESSION_SETTINGS, (names, values))
    finally:
        dbapi_connection.autocommit = previous


class OptionsFallback:
    """``do_connect`` hook: connect with our ``options`` where accepted, else without the
    refused part, and make sure every lock session carries SESSION_SETTINGS.

    ``ours`` is the ``options`` value the library set (None if none): a connection
    asked for with another value (the user's own) is made as asked, then given the
    session settings by a statement.
    """

    def __init__(self, masked_url: str, ours: str | None) -> None:
        self.masked_url = masked_url
        self.ours = ours
        self.dropped = False  #: A pooler refused the options parameter itself.
        self.unknown: set[str] = set()  #: Settings the server does not know.

    def current(self) -> str | None:
        """Our options as this server accepts them (None: send none)."""
        if self.dropped or self.ours is None:
            return None
        kept = [
            f"-c {name}={value}"
            for name, value in _SETTING.findall(self.ours)
            if name not in self.unknown
        ]
        return " ".join(kept) or None

    def carries_settings(self) -> bool:
        """Does a connection made with :meth:`current` carry every session setting the
        server knows?"""
        current = self.current()
        return current is not None and all(
            f"-c {name}={value}" in current or name in self.unknown
            for name, value in SESSION_SETTINGS
        )

    def learn(self, error: BaseException) -> bool:
        """A connect with :meth:`current` failed with ``error``: True if a retry without
        the refused part may succeed (and remember it), False if the error is another."""
        text = str(error)
        if self.current() is None:
            return False
        if any(refused in text for refused in OPTIONS_REJECTED):
            self.dropped = True
            logger.info(
                "celery-pglock: %s refused the server keepalive settings sent as the options "
                "startup parameter (PgBouncer does); connecting without them, and setting "
                "idle_session_timeout=0 by a statement on each new connection. Set "
                "tcp_keepalives_* on the PostgreSQL server and the pooler's tcp_keep* "
                "settings instead, or pglock_server_keepalives = False to skip this try.",
                self.masked_url,
                extra={"action": "lock_options_dropped"},
            )
            return True
        match = _UNKNOWN.search(text)
        if match is None or match.group(1) in self.unknown:
            return False
        if f"-c {match.group(1)}=" not in (self.current() or ""):
            return False
        self.unknown.add(match.group(1))
        logger.info(
            "celery-pglock: %s does not know the setting %s (an older PostgreSQL); "
            "lock connections go without it",
            self.masked_url,
            match.group(1),
            extra={"action": "lock_option_unknown"},
        )
        return True

    def __call__(
        self, dialect: Any, record: Any, cargs: list[Any], cparams: dict[str, Any]
    ) -> Any:
        if cparams.get("options") != self.ours:
            connection = dialect.connect(*cargs, **cparams)  # the user's own: as asked
            apply_session_settings(connection)
            return connection
        # Bounded: each retry drops one more setting (or all of them).
        for _ in range(len(SERVER_KEEPALIVES) + len(SESSION_SETTINGS) + 1):
            options = self.current()
            if options is None:
                cparams.pop("options", None)
            else:
                cparams["options"] = options
            try:
                connection = dialect.connect(*cargs, **cparams)
            except dialect.loaded_dbapi.OperationalError as exc:
                if not self.learn(exc):
                    raise
                continue
            if not self.carries_settings():
                apply_session_settings(connection)
            return connection
        raise AssertionError(
            "unreachable: every option was dropped"
        )  # pragma: no cover


def install_fallback(engine: sa.Engine, masked_url: str, ours: str | None) -> None:
    """Add :class:`OptionsFallback` to a lock engine (engines.create_engine calls this)."""
    fallback = _fallbacks[engine] = OptionsFallback(masked_url, ours)
    event.listen(engine, "do_connect", fallback)


_fallbacks: weakref.WeakKeyDictionary[sa.Engine, OptionsFallback] = (
    weakref.WeakKeyDictionary()
)


def fallback_of(engine: sa.Engine) -> OptionsFallback | None:
    """The engine's :class:`OptionsFallback` (what its server accepts), if it has one."""
    return _fallbacks.get(engine)
