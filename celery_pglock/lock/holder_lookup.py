"""Who holds a lock (backend pid, worker ``host:pid``, task name), for the skip path;
never raises: not knowing the holder must never change how a skip ends. The
application_name formats: docs/operations/monitoring.md.
"""

from __future__ import annotations

import dataclasses
import re
import time
import weakref
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from celery_pglock.lock import AdvisoryLock

#: How long a holder found for a key is reused for further skips of that key.
RECENT_SECONDS = 1.0
_RECENT_MAX = 1024  # keys remembered per sessions object; cleared when full
#: Sessions object -> {key ids: (time.monotonic() of the lookup, its answer)} (not the
#: engine's URL: hashing a URL renders it, which costs more than a skip).
_recent: weakref.WeakKeyDictionary[
    object, dict[tuple[int, ...], tuple[float, Holder | None]]
] = weakref.WeakKeyDictionary()

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
    and ``"pglock web-1:4242 billing.settle"`` (a process's lock session, showing its
    latest task) both give ``("web-1:4242", "billing.settle")``; an idle session gives
    ``("web-1:4242", None)``; anything else ``(None, None)``.
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


def find(lock: AdvisoryLock) -> Holder | None:
    """The session holding ``lock``'s key, or None (released since, or unknown).

    Asked at most once per key and sessions object in RECENT_SECONDS: under full
    contention the lookup costs the server several times what the refused try did.
    """
    key, session = lock.key, lock.session
    remembered = _recent.setdefault(session, {})
    now = time.monotonic()
    recent = remembered.get(key.ids)
    if recent is not None and now - recent[0] < RECENT_SECONDS:
        return recent[1]
    text = session.holder_of(key, bound=lock.round_trip_timeout)
    holder = None
    if text is not None:  # "<backend pid> <application_name>" (sql_text.HOLDER)
        pid, _, application_name = text.partition(" ")
        holder = Holder(int(pid), *parse_application_name(application_name))
    if len(remembered) >= _RECENT_MAX:
        remembered.clear()
    remembered[key.ids] = (now, holder)
    return holder
