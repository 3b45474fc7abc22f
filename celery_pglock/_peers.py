"""The per-task options of the Redis-based peers, refused on a SingletonTask with a fix.

A task migrated from celery-once, celery-singleton or celery-heimdall may keep its old
options. Left in place they would do nothing, and a task keyed per tenant through them
would silently run with one lock for all tenants; so each is refused at bind time with
the SingletonTask option to write instead (docs/migration.md).
"""

from __future__ import annotations

from celery_pglock import exceptions

#: Per-task option names of the Redis-based peers, refused on a SingletonTask. Left in
#: place after a migration they would do nothing, and a task keyed per tenant through them
#: would silently run with one lock for all tenants. Each maps to the library it comes from.
#: App-wide ``singleton_*``/``ONCE`` settings are not refused: during a migration the peer
#: may still run other tasks of the same app.
PEER_OPTIONS = {
    "once": "celery-once",
    "unique_on": "celery-singleton",
    "raise_on_duplicate": "celery-singleton",
    "lock_expiry": "celery-singleton",
    "heimdall": "celery-heimdall",
}
#: What to do with a TTL option (lock_expiry, once's timeout, heimdall's unique_timeout).
_NO_EXPIRY = (
    "remove it: the lock ends with the run, or with its database session when a worker "
    "dies, so there is no expiry to choose"
)


def refusal(
    task_name: str, option: str, value: object
) -> exceptions.ConfigurationError:
    """The error for a peer library's option, naming what to write instead."""
    return exceptions.ConfigurationError(
        f"Task {task_name!r}: {option!r} is a {PEER_OPTIONS[option]} option, which "
        "SingletonTask does not read (left in place, the task would run with one lock "
        f"for all argument values); {_equivalent(option, value)}. See the migration "
        "guide (docs/migration.md)."
    )


def _equivalent(option: str, value: object) -> str:
    def names(given: object) -> str:
        listed = [given] if isinstance(given, str) else given
        if isinstance(listed, (list, tuple)) and listed:
            return f"lock_args={tuple(listed)!r}"
        if isinstance(listed, (list, tuple)):
            return "no lock_args (one lock per task)"
        # celery-once without 'keys' locked on every argument
        return "lock_args naming every parameter"

    if option == "unique_on":
        return f"use {names(value)}"
    if option == "raise_on_duplicate":
        return "use lock_on_busy='raise', or leave the default lock_on_busy='skip'"
    if option == "lock_expiry":
        return _NO_EXPIRY
    if option == "once":
        keys_given = value.get("keys") if isinstance(value, dict) else None
        return (
            f"use {names(keys_given)} for its 'keys', lock_on_busy for 'graceful' "
            "('skip', the default, or 'raise'), and for 'timeout', " + _NO_EXPIRY
        )
    return (  # heimdall
        "use lock_args or lock_key for its 'key', lock_on_busy='raise' for "
        f"'unique_raises', and for 'unique_timeout', {_NO_EXPIRY}"
    )
