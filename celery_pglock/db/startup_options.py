"""Lock session settings: the ``options`` startup parameter, else a statement at connect.
Why: docs/operations/pgbouncer.md ("Connection options through PgBouncer")."""

from __future__ import annotations

import logging
import re
import weakref
from typing import Any

import sqlalchemy as sa
from sqlalchemy import event

from celery_pglock.db import forks, sql_text

#: The server frees a vanished worker's locks in 30-60 s: docs/operations/lock-loss.md.
SERVER_KEEPALIVES: tuple[tuple[str, str], ...] = (
    ("tcp_keepalives_idle", "30"),
    ("tcp_keepalives_interval", "10"),
    ("tcp_keepalives_count", "3"),
    ("tcp_user_timeout", "60000"),
)
#: Whatever the role says: a lock session idles while a body runs.
SESSION_SETTINGS: tuple[tuple[str, str], ...] = (("idle_session_timeout", "0"),)
SERVER_OPTIONS = " ".join(
    f"-c {name}={value}" for name, value in (*SERVER_KEEPALIVES, *SESSION_SETTINGS)
)
#: (names, values), for APPLY_SESSION_SETTINGS.
SESSION_SETTINGS_PARAMS = tuple(map(list, zip(*SESSION_SETTINGS, strict=True)))

logger = logging.getLogger(__name__)

#: PgBouncer refusing ``options`` (before 1.20: any; from 1.20: untracked settings).
OPTIONS_REJECTED = (
    "unsupported startup parameter: options",
    "unsupported options startup parameter",
)
_UNKNOWN = re.compile(r'unrecognized configuration parameter "([a-z_]+)"')
_SETTING = re.compile(r"-c ([a-z_]+)=(\S+)")


def apply_session_settings(dbapi_connection: Any) -> None:
    previous = dbapi_connection.autocommit
    # Autocommit: a statement pooler refuses the BEGIN the driver would send first.
    dbapi_connection.autocommit = True
    try:
        with dbapi_connection.cursor() as cursor:
            cursor.execute(sql_text.APPLY_SESSION_SETTINGS, SESSION_SETTINGS_PARAMS)
    finally:
        dbapi_connection.autocommit = previous


class OptionsFallback:
    """``do_connect`` hook: our ``options`` (SERVER_OPTIONS or None) less what the server
    refuses; the user's own are sent as asked. Every session gets SESSION_SETTINGS."""

    def __init__(self, masked_url: str, ours: str | None) -> None:
        self.masked_url = masked_url
        self.ours = ours
        #: Those of ours the server takes: less what it does not know, none if a pooler
        #: refused the options parameter itself.
        self.kept: list[tuple[str, str]] = _SETTING.findall(ours or "")
        self._learning = forks.safe_lock()  # a forked child finds it free

    def current(self) -> str | None:
        return " ".join(f"-c {name}={value}" for name, value in self.kept) or None

    def apply(self, params: dict[str, Any]) -> None:
        options = self.current()
        if options is None:
            params.pop("options", None)
        else:
            params["options"] = options

    def carries_settings(self) -> bool:
        # ``ours`` holds them all; current() drops only the unknown ones.
        return self.current() is not None

    def learn(self, error: BaseException, sent: str | None = None) -> bool:
        """Remember what ``error`` refused; True if a retry without it may succeed.
        ``sent``: the options of ours the refused connect sent, if known."""
        with self._learning:
            if sent is not None and sent != self.current():
                return True  # another connect learnt meanwhile: retry with what it left
            return self._learn(error)

    def _learn(self, error: BaseException) -> bool:
        if self.current() is None:
            return False
        text = str(error)
        if any(refused in text for refused in OPTIONS_REJECTED):
            self.kept = []
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
        if match is None or match.group(1) not in dict(self.kept):
            return False
        self.kept = [(name, value) for name, value in self.kept if name != match[1]]
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
        ours = cparams.get("options") == self.ours  # else the user's own: as asked
        while True:  # ends: each learn() drops one more setting, or all of them
            if ours:
                self.apply(cparams)
            try:
                connection = dialect.connect(*cargs, **cparams)
            except dialect.loaded_dbapi.OperationalError as exc:
                if ours and self.learn(exc, cparams.get("options")):
                    continue
                raise
            if not (ours and self.carries_settings()):
                apply_session_settings(connection)
            return connection


_fallbacks = weakref.WeakKeyDictionary[sa.Engine, OptionsFallback]()


def install_fallback(engine: sa.Engine, masked_url: str, ours: str | None) -> None:
    fallback = _fallbacks[engine] = OptionsFallback(masked_url, ours)
    event.listen(engine, "do_connect", fallback)


def fallback_of(engine: sa.Engine) -> OptionsFallback | None:
    return _fallbacks.get(engine)
