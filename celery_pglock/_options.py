"""Startup options a pooler refuses: connect again without ours, and say so once.

The lock engine sends server keepalive settings as the ``options`` startup parameter
(``db.SERVER_KEEPALIVE_OPTIONS``), so that PostgreSQL frees a vanished worker's locks in
about a minute. PgBouncer refuses that parameter, which would fail every connection. A
``do_connect`` hook catches that one refusal and connects without the options from then
on: the defaults work through PgBouncer without hand-tuning.

Hazard: only the library's own options are ever dropped. Options a user set in
``pglock_engine_options["connect_args"]`` fail loudly, as they should.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from sqlalchemy import event

from celery_pglock import db

if TYPE_CHECKING:
    import sqlalchemy as sa

logger = logging.getLogger(__name__)

#: PgBouncer's answers when it refuses the ``options`` startup parameter (before 1.20:
#: any ``options``; from 1.20: settings it does not track, such as tcp_keepalives_*).
OPTIONS_REJECTED = (
    "unsupported startup parameter: options",
    "unsupported options startup parameter",
)


class OptionsFallback:
    """``do_connect`` hook: when a pooler refuses our keepalive ``options``, drop them.

    Only the library's own :data:`db.SERVER_KEEPALIVE_OPTIONS` are dropped, never
    options the user set. After the first refusal the engine connects without them
    straight away, and says so once at INFO.
    """

    def __init__(self, masked_url: str) -> None:
        self.masked_url = masked_url
        self.dropped = False

    def __call__(
        self, dialect: Any, record: Any, cargs: list[Any], cparams: dict[str, Any]
    ) -> Any:
        if cparams.get("options") != db.SERVER_KEEPALIVE_OPTIONS:
            return None
        if self.dropped:
            del cparams["options"]
            return None
        import psycopg2  # the only supported driver

        try:
            return dialect.connect(*cargs, **cparams)
        except psycopg2.OperationalError as exc:
            if not any(text in str(exc) for text in OPTIONS_REJECTED):
                raise
        self.dropped = True
        del cparams["options"]
        logger.info(
            "celery-pglock: %s refused the server keepalive settings sent as the options "
            "startup parameter (PgBouncer does); connecting without them. Set "
            "tcp_keepalives_* on the PostgreSQL server and the pooler's tcp_keep* "
            "settings instead, or pglock_server_keepalives = False to skip this try.",
            self.masked_url,
            extra={"action": "lock_options_dropped"},
        )
        return dialect.connect(*cargs, **cparams)


def install_fallback(engine: sa.Engine, masked_url: str) -> None:
    """Add :class:`OptionsFallback` to a lock engine (db.create_engine calls this)."""
    event.listen(engine, "do_connect", OptionsFallback(masked_url))
