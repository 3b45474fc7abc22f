"""Who holds a lock: the holder's backend pid, worker ``host:pid`` and task name.

Read from ``pg_locks`` joined with ``pg_stat_activity`` on the skip path only (one extra
round trip when a run is skipped, none on a run that gets its lock). The worker's
``host:pid`` and task name come from the holding session's ``application_name``, which
celery-pglock sessions set to ``<prefix> <host>:<pid> <task name>`` (a process's lock
session) or ``<prefix> <host>:<pid> <key> <task name>`` (a per-lock connection); a session of some other program shows what it set, and only
its backend pid is certain. The answer is a snapshot: the holder may have released since.

Never raises: not knowing the holder must never change how a skip ends.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from typing import TYPE_CHECKING, Any

from celery_pglock import _sql

if TYPE_CHECKING:
    import sqlalchemy as sa

    from celery_pglock.keys import LockKey

logger = logging.getLogger(__name__)

#: "host:pid" as db.process_tag() writes it.
_PROCESS_TAG = re.compile(r"^[^\s:]+:\d+$")
#: The key as LockKey.__str__ writes it: "-123" or "42,1001".
_KEY = re.compile(r"^-?\d+(,-?\d+)?$")


@dataclasses.dataclass(frozen=True, slots=True)
class Holder:
    """The session holding a lock, as far as PostgreSQL can say."""

    #: The holding session's backend pid (``pg_stat_activity.pid``).
    backend_pid: int
    #: ``host:pid`` of the worker process, or None for a session not opened by
    #: celery-pglock (or whose application_name was changed).
    process: str | None = None
    #: The holder's task (lock label) name, if its application_name carries one.
    task: str | None = None

    def as_details(self) -> dict[str, Any]:
        """The holder fields of a skip record (see ``LockSkipped.details``)."""
        return {
            "holder": self.process,
            "holder_pid": self.backend_pid,
            "holder_task": self.task,
        }


def parse_application_name(
    application_name: str | None,
) -> tuple[str | None, str | None]:
    """``(host:pid, task name)`` from a lock session's application_name, where present.

    ``"pglock web-1:4242 -4311986427365126397 billing.settle"`` (a per-lock connection)
    and ``"pglock web-1:4242 billing.settle"`` (a process's lock session) both give
    ``("web-1:4242", "billing.settle")``; an idle session (``... web-1:4242 idle``) gives
    ``("web-1:4242", None)``; anything else ``(None, None)``. A process's lock session
    shows the last task that took a lock on it: exact for a prefork child (one task at a
    time), the latest of several for a threads or gevent worker.
    """
    if not application_name:
        return None, None
    words = application_name.split(" ")
    for index, word in enumerate(words):
        if _PROCESS_TAG.match(word):
            rest = words[index + 1 :]
            if rest and _KEY.match(rest[0]):  # a per-lock connection: the key first
                rest = rest[1:]
            if not rest or rest == ["idle"]:
                return word, None
            return word, " ".join(rest)
    return None, None


def find(engine: sa.Engine, key: LockKey) -> Holder | None:
    """The session holding ``key`` in ``engine``'s database, or None (released, or unknown).

    Uses one pooled connection from the lock engine for one statement; any error is
    logged at DEBUG and answered with None.
    """
    try:
        pooled = engine.raw_connection()
    except Exception:
        logger.debug("Could not look up the holder of %s", key, exc_info=True)
        return None
    try:
        dbapi: Any = pooled.dbapi_connection
        dbapi.autocommit = True
        with dbapi.cursor() as cursor:
            cursor.execute(_sql.HOLDER, key.pg_locks_ids)
            row = cursor.fetchone()
    except Exception:
        logger.debug("Could not look up the holder of %s", key, exc_info=True)
        pooled.invalidate()
        return None
    finally:
        pooled.close()
    if row is None:
        return None
    process, task = parse_application_name(row[1])
    return Holder(backend_pid=int(row[0]), process=process, task=task)
