"""A SingletonTask's options: values, defaults, checks, and ``LockConfig``, the frozen
set a task resolves to at bind (resolution.py). Each: docs/reference/options.md."""

from __future__ import annotations

import dataclasses
import enum
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Callable

    from celery_pglock import keys


class OnBusy(str, enum.Enum):
    """What a SingletonTask does when its lock is already held."""

    SKIP = "skip"  #: Do not run the body; the run ends as lock_skip_result says.
    RAISE = "raise"  #: Raise LockBusy; the task fails.
    RETRY = "retry"  #: Re-queue with Celery's retry after lock_retry_delay seconds.
    WAIT = "wait"  #: Block at most lock_wait_timeout seconds, then raise LockBusy.


class SkipResult(str, enum.Enum):
    """How a run skipped by ``lock_on_busy='skip'`` ends (docs/guide/skipped-results.md)."""

    FAILURE = "failure"  #: FAILURE with ``LockSkipped`` (in ``throws``). The default.
    SUCCESS = "success"  #: SUCCESS with a skip record; links and the chain's rest skip.


class OnLost(str, enum.Enum):
    """What a SingletonTask does on losing its lock mid-body (the run ends FAILURE either way)."""

    SIGNAL = "signal"  #: Report it; the body goes on until it checks ensure_held().
    TERMINATE = "terminate"  #: Also raise LockLostError in the body. The default.


class Enqueue(str, enum.Enum):
    """How long a message keeps a key's other sends from being published (lock_enqueue)."""

    UNTIL_FINISHED = "until_finished"  #: From publish until its run ends.
    UNTIL_STARTED = "until_started"  #: From publish until its run starts.


class OnDuplicate(str, enum.Enum):
    """What a send of a key already queued returns (lock_enqueue_on_duplicate)."""

    RETURN = "return"  #: The queued message's AsyncResult (its task id). The default.
    RAISE = "raise"  #: AlreadyQueued, carrying the queued message's task id.
    #: Latest wins: the send replaces the queued one's arguments in its key's row.
    REPLACE = "replace"


class OnEnqueueError(str, enum.Enum):
    """What a send does when the lock database cannot be asked (lock_enqueue_on_error)."""

    RAISE = "raise"  #: EnqueueUnavailable; nothing is published. The default.
    PUBLISH = "publish"  #: Publish unchecked (WARNING, metric); the run lock guards.


class LockScope(str, enum.Enum):
    """How long a SingletonTask's lock lives."""

    SESSION = "session"  #: Held on its own session for the whole run.
    TRANSACTION = "transaction"  #: In one transaction the body can use; commit ends it.


DEFAULT_ON_BUSY = OnBusy.SKIP  #: lock_on_busy unless set or implied (implied_on_busy).


def implied_on_busy(enqueue: Enqueue | None) -> OnBusy | None:
    """The lock_on_busy a lock_enqueue implies when none is set: 'wait' for
    'until_started', whose follow-up a skip would lose (docs/guide/enqueue.md)."""
    return OnBusy.WAIT if enqueue is Enqueue.UNTIL_STARTED else None


def seconds(value: object) -> float:
    """``value`` as seconds, or ValueError saying what was expected."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError("a positive number of seconds")
    if value == float("inf"):
        raise ValueError("a finite number of seconds (waits are always bounded)")
    return float(value)


@dataclasses.dataclass(frozen=True, slots=True)
class Rate:
    """At most ``starts`` starts of a key in any ``window`` seconds (lock_rate)."""

    starts: int
    window: float
    #: Set as lock_period: refusals say "period", as they always did.
    period: bool = dataclasses.field(default=False, compare=False)

    def __str__(self) -> str:
        return f"{self.starts}/{self.window:g}s"


RATE_MAX = 1000  #: Starts per window: a key's row keeps its last N starts.
#: lock_rate's units: "10/m" is 10 per minute, "3/10s" 3 per 10 seconds.
_RATE_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_RATE_EXPECTED = (
    "'N/unit' (unit s, m, h or d, optionally with a count: '10/m', '3/10s') or a pair "
    "(N starts, window seconds), N an int from 1 to 1000"
)


def rate(value: object) -> Rate:
    """``value`` ("10/m", "3/10s" or (3, 10.0)) as a Rate, or ValueError."""
    starts: object
    if isinstance(value, str):
        count, _, per = value.replace(" ", "").partition("/")
        unit = _RATE_UNITS.get(per[-1:])
        digits = count + (per[:-1] or "1")
        if unit is None or not (digits.isascii() and digits.isdigit() and count):
            raise ValueError(_RATE_EXPECTED)
        starts, window = int(count), int(per[:-1] or "1") * unit
    elif isinstance(value, (tuple, list)) and len(value) == 2:
        starts, window = value
    else:
        raise ValueError(_RATE_EXPECTED)
    if type(starts) is not int or not 1 <= starts <= RATE_MAX:
        raise ValueError(_RATE_EXPECTED)
    try:
        return Rate(starts, seconds(window))
    except ValueError as exc:
        raise ValueError(f"{_RATE_EXPECTED}; the window: {exc}") from None


def choice(enum_cls: type[enum.Enum]) -> Callable[[object], Any]:
    """A check that turns a value into a member of ``enum_cls``, or ValueError listing them."""

    def check(value: object) -> Any:
        try:
            return enum_cls(value)
        except ValueError:
            allowed = ", ".join(repr(member.value) for member in enum_cls)
            raise ValueError(f"one of {allowed}") from None

    return check


def _expect(test: Callable[[Any], object], expected: str) -> Callable[[object], Any]:
    def check(value: object) -> object:
        if not test(value):
            raise ValueError(expected)
        return value

    return check


_flag = _expect(lambda value: isinstance(value, bool), "True or False")
_text = _expect(lambda value: isinstance(value, str) and value, "a non-empty string")


def _optional(check: Callable[[object], Any]) -> Callable[[object], Any]:
    return lambda value: None if value is None else check(value)


def _interval(value: object) -> float:
    return 0.0 if type(value) in (int, float) and value == 0 else seconds(value)


#: LockConfig field -> its check: lock_<field>, or pglock_<field> unless PER_TASK.
CHECKS: dict[str, Callable[[object], Any]] = {
    "namespace": _text,
    "on_busy": choice(OnBusy),
    "scope": choice(LockScope),
    "retry_delay": seconds,
    "wait_timeout": seconds,
    "skip_result": choice(SkipResult),
    "shadow": _flag,
    "on_lost": choice(OnLost),
    "watch_interval": _interval,
    "db_timeout": seconds,
    "fencing": _flag,
    "enqueue": _optional(choice(Enqueue)),
    "enqueue_on_duplicate": choice(OnDuplicate),
    "enqueue_on_error": choice(OnEnqueueError),
    "enqueue_lost_after": seconds,
    "rate": _optional(rate),
    "group": _optional(_text),
    "debounce": _optional(seconds),
    "debounce_max": _optional(seconds),
}


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class LockConfig:
    """The resolved locking options of one task (docs/reference/options.md)."""

    task_name: str  #: The Celery task name, for messages.
    name: str  #: The lock name hashed into the key: lock_name or the task name.
    namespace: str = "default"  #: Mixed into every key.
    on_busy: OnBusy = DEFAULT_ON_BUSY  #: What to do when the lock is held.
    on_busy_implied: bool = False  #: on_busy implied by lock_enqueue (implied_on_busy).
    scope: LockScope = LockScope.SESSION  #: Session or transaction lifetime.
    retry_delay: float = 30.0  #: Seconds before a lock_on_busy='retry' re-run.
    wait_timeout: float = 10.0  #: Seconds a lock_on_busy='wait' may block.
    skip_result: SkipResult = SkipResult.FAILURE  #: How a skipped run ends.
    shadow: bool = False  #: Try the lock and report, but always run the body.
    on_lost: OnLost = OnLost.TERMINATE  #: What to do when the lock is lost.
    watch_interval: float = 1.0  #: Seconds between lock checks; 0: none.
    db_timeout: float = 5.0  #: Longest one round trip to the lock database may take.
    fencing: bool = False  #: Issue a fencing token to each acquisition.
    enqueue: Enqueue | None = None  #: Keep duplicates out of the queue; None: off.
    enqueue_on_duplicate: OnDuplicate = OnDuplicate.RETURN  #: A duplicate's answer.
    enqueue_on_error: OnEnqueueError = OnEnqueueError.RAISE  #: Database down at send.
    enqueue_lost_after: float = 3600.0  #: A never-started message's hold past due (s).
    limit: int = 1  #: Runs of one key at once (lock_limit): its slots.
    rate: Rate | None = None  #: At most N starts per key per window (lock_period: N=1).
    group: str | None = None  #: lock_group: a limit shared by every task naming it.
    group_limit: int = 1  #: Runs of the whole group at once (lock_group_limit).
    debounce: float | None = None  #: Seconds a key must be quiet before its run starts.
    debounce_max: float | None = None  #: Longest wait after a burst's first send.
    lock_args: tuple[str, ...] = ()  #: Parameter names whose values form the key.
    fixed_key: keys.LockKey | None = None  #: The key when it never varies per call.


DEFAULTS = LockConfig(task_name="", name="")  #: Each option's default, by field.
#: Options without an app-wide setting -> why (lock_rate: per key, not per app).
PER_TASK = {
    "rate": "a rate of its own for each task that needs one",
    "period": "a period of its own for each task that needs one",
    "group": "each task says which group it belongs to",
    "debounce": "a quiet time of its own for each task that needs one",
    "debounce_max": "a longest wait of its own for each task that needs one",
}
APP_SETTINGS = {f"lock_{f}": f"pglock_{f}" for f in CHECKS if f not in PER_TASK}
TASK_OPTIONS = (
    "lock_args",
    "lock_id",
    "lock_limit",
    "lock_name",
    "lock_period",
    "lock_rate",
    "lock_group",
    "lock_group_limit",
    "lock_debounce",
    "lock_debounce_max",
    *APP_SETTINGS,
)
