"""Who holds a lock, for the skip path: never raises (it must not change how a skip
ends). The application_name formats: docs/operations/monitoring.md (application_name)."""

from __future__ import annotations

import dataclasses
import itertools
import re
import time
import weakref
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from celery_pglock.lock import AdvisoryLock

RECENT_SECONDS = 1.0  #: How long a key's holder, once found, answers its next skips.
_RECENT_MAX = 1024  # keys remembered per sessions object; cleared when full
#: Keyed by sessions object, not by URL: hashing a URL renders it, dearer than a skip.
_recent: weakref.WeakKeyDictionary[
    object, dict[tuple[int, ...], tuple[float, Holder | None]]
] = weakref.WeakKeyDictionary()

_PROCESS_TAG = re.compile(r"^[^\s:]+:\d+$")  # "host:pid" (engines.process_tag)
_KEY = re.compile(r"^-?\d+(,-?\d+)?$")  # str(LockKey): "-123" or "42,1001"
_SINCE = re.compile(r"^@(\d+)$")  # the process session's "held since" epoch second


@dataclasses.dataclass(frozen=True, slots=True)
class Holder:
    backend_pid: int  #: ``pg_stat_activity.pid``
    process: str | None = None  #: The worker's ``host:pid``; None if not our session.
    task: str | None = None  #: Its task (lock label), if application_name shows one.


def parse_application_name(
    application_name: str | None,
) -> tuple[str | None, str | None]:
    """``(host:pid, task)`` from application_name: task None if idle, both if not ours."""
    if not application_name:
        return None, None
    words = application_name.split(" ")
    for index, word in enumerate(words):
        if _PROCESS_TAG.match(word):
            rest = words[index + 1 :]
            if rest and (_KEY.match(rest[0]) or _SINCE.match(rest[0])):
                rest = rest[1:]  # a per-lock connection's key, or the held-since second
            if not rest or rest == ["idle"]:
                return word, None
            return word, " ".join(rest)
    return None, None


def held_since(application_name: str | None) -> int | None:
    """The epoch second a process lock session shows it began to hold its keys; None if
    it shows none (another kind of session, or not ours)."""
    words = (application_name or "").split(" ")
    for word, after in itertools.pairwise(words):
        if _PROCESS_TAG.match(word):
            match = _SINCE.match(after)
            return int(match.group(1)) if match else None
    return None


def find(lock: AdvisoryLock) -> Holder | None:
    """``lock``'s holder, or None (released since, or unknown). Asked once per key in
    RECENT_SECONDS: under contention it costs the server more than the refused try."""
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
