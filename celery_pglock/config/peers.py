"""Other libraries' per-task options (celery-once, celery-singleton, celery-heimdall),
refused at bind with what to use instead (docs/migration.md)."""

from __future__ import annotations

from celery_pglock import exceptions

#: Peers' per-task options -> (library, what it would do left in place, what instead).
#: Their app-wide settings are not refused: a peer may still run other tasks.
_UNKEYED = (
    "its key names would not pick the lock, which follows lock_args (without them, one "
    "lock covers every argument value)"
)
PEER_OPTIONS = {
    "once": (
        "celery-once",
        f"{_UNKEYED}, and no other part of it would do anything",
        "use lock_enqueue='until_finished' with {keys} for its 'keys', "
        "lock_enqueue_on_duplicate for 'graceful' ('return', the default, or 'raise'), "
        "lock_enqueue='until_started' for 'unlock_before_run', and for 'timeout', "
        "{no_expiry}",
    ),
    "unique_on": (
        "celery-singleton",
        _UNKEYED,
        "use lock_enqueue='until_finished' with {keys}",
    ),
    "raise_on_duplicate": (
        "celery-singleton",
        "a duplicate would not raise",
        "use lock_enqueue_on_duplicate='raise' with lock_enqueue='until_finished'",
    ),
    "lock_expiry": (
        "celery-singleton",
        "it would set no expiry, and none is needed",
        "{no_expiry}",
    ),
    "heimdall": (
        "celery-heimdall",
        "its 'key' would not pick the lock, which follows lock_args, and its other "
        "parts would do nothing",
        "use lock_args (or override lock_key_for) for its 'key', lock_on_busy='raise' for "
        "'unique_raises', and for 'unique_timeout', {no_expiry}",
    ),
}


def peer_refusal(
    task_name: str, option: str, value: object
) -> exceptions.ConfigurationError:
    names = value  # unique_on, or celery-once's 'keys' (without them: every argument)
    if option != "unique_on":
        names = value.get("keys", ...) if isinstance(value, dict) else ...
    names = [names] if isinstance(names, str) else names
    library, left_in_place, instead = PEER_OPTIONS[option]
    instead = instead.format(
        keys=f"lock_args={tuple(names)!r}"
        if isinstance(names, (list, tuple)) and names
        else "no lock_args (one lock per task)"
        if isinstance(names, (list, tuple))
        else "lock_args naming every parameter",
        no_expiry="remove it: the lock ends with the run, or with its database "
        "session when a worker dies, so there is no expiry to choose "
        "(lock_enqueue_lost_after bounds only a message that never starts)",
    )
    return exceptions.ConfigurationError(
        f"Task {task_name!r}: {option!r} is a {library} option, which SingletonTask "
        f"does not read (left in place, {left_in_place}); {instead}. See the "
        "migration guide (docs/migration.md)."
    )
