"""Who holds a key, as PostgreSQL names the session (and transaction): what a later
statement checks to know the holder is still the same one (fencing tokens)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from celery_pglock.db import sql_text

if TYPE_CHECKING:
    import datetime

    from celery_pglock.keys import LockKey


@dataclasses.dataclass(frozen=True, slots=True)
class Identity:
    """A holding session: a pid is reused, a backend start with it is not (across a
    server restart, the postmaster's start tells them apart)."""

    pid: int
    started: datetime.datetime
    postmaster: datetime.datetime
    vxid: str | None = None  #: Transaction scope: the virtual transaction id.


def of_session(cursor: Any) -> Identity:
    """Ask the lock's own session who it is (once per session: it never changes)."""
    cursor.execute(sql_text.SESSION_IDENTITY)
    return Identity(*cursor.fetchone())


def of_transaction(cursor: Any, key: LockKey) -> Identity | None:
    """Ask the lock's connection, in its transaction, which one holds ``key`` (or None)."""
    cursor.execute(sql_text.TRANSACTION_IDENTITY, key_params(key))
    row = cursor.fetchone()
    return None if row is None else Identity(*row)


def key_params(key: LockKey) -> dict[str, Any]:
    """``key``'s pg_locks ids as sql_text.KEY_IS's named params."""
    return dict(zip(("classid", "objid", "objsubid"), key.pg_locks_ids, strict=True))
