"""What a busy run becomes. Why: docs/guide/policies.md, docs/guide/skipped-results.md."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from celery.exceptions import Ignore, Retry

from celery_pglock import celery_compat, config, exceptions, keys
from celery_pglock.config import Enqueue, OnBusy, SkipResult
from celery_pglock.lock import holder_lookup
from celery_pglock.task import outcomes, queued

if TYPE_CHECKING:
    from celery_pglock.config import LockConfig
    from celery_pglock.lock import AdvisoryLock
    from celery_pglock.task.periods import Throttle
    from celery_pglock.task.surface import LockedTask

#: What ``pglock_final_states`` calls a skipped run, whatever ``lock_skip_result`` stored.
SKIPPED = "SKIPPED"
#: The key marking a skip record (the result value under ``lock_skip_result='success'``).
SKIP_MARKER = "celery_pglock"
#: What a busy redelivery that stored nothing adds to its INFO line.
REDELIVERY_IGNORED = (
    " The message was a redelivery whose first delivery is still running, "
    "so no result was stored."
)
#: Seconds before a held run lock is looked at again: a worker that lost its child (SIGKILL,
#: OOM) re-queues the message at once, and the redelivery can arrive before PostgreSQL has
#: seen the child's connection close and freed its locks.
KILLED_HOLDER_GRACE = 0.25


def apply_policy(
    task: LockedTask,
    lock: AdvisoryLock,
    task_id: str | None,
    *,
    direct: bool,
    throttle: Throttle | None = None,
    group: AdvisoryLock | None = None,
) -> Any:
    """Raise a busy (or throttled, or group-full) run's outcome, or return its skip
    record. ``lock`` is the run's key; ``group``, its group's lock when that was full."""
    options = task.lock_config
    request = task.request
    action = busy_action(options, direct=direct)
    message, details = report(task, lock, task_id, action, throttle, group)
    # Its first delivery may still run: store nothing (docs/guide/skipped-results.md).
    first_delivery_runs = (
        throttle is None
        and group is None
        and task_id is not None
        and _acks_late_redelivery(task, direct)
        and lock.run_alive(keys.run_key(task_id)) is not False
    )
    if first_delivery_runs:
        message += REDELIVERY_IGNORED
    outcomes.skipped(
        task,
        task_id,
        lock,
        action=action.value,
        message=message,
        details=details,
        celery_logs=not direct and not first_delivery_runs,
    )
    busy = exceptions.LockBusy(message, key=str(lock.key), name=lock.key.name)
    if first_delivery_runs:
        raise Ignore(message)
    if action is OnBusy.WAIT:
        action = after_wait(options, direct=direct)
    if (row := queued.row_of(lock)) is not None and action is not OnBusy.RETRY:
        # It ends unrun (a retry keeps the row): free its key now.
        queued.give_back(task.locks_engine(), lock.key, row.task_id, options.db_timeout)
    if action is OnBusy.SKIP and options.skip_result is SkipResult.SUCCESS:
        # No chain link or callback gets a skip record: docs/guide/skipped-results.md.
        celery_compat.drop_continuations(request)
        return {SKIP_MARKER: "skipped", **details}
    if action is OnBusy.SKIP:
        raise exceptions.LockSkipped(message, details)
    if action is OnBusy.RETRY:
        if request.is_eager and task.max_retries is None:
            raise busy  # eager retries run inline without the countdown: never spin
        countdown = options.retry_delay if throttle is None else throttle.seconds_left
        try:
            raise task.retry(countdown=countdown, exc=busy)
        except Retry:
            raise
        except BaseException:
            # No retry was published (max_retries reached, or its publish failed): the
            # message ends unrun, and its key's row would wait for it until stale.
            if row is not None:
                engine = task.locks_engine()
                queued.give_back(engine, lock.key, row.task_id, options.db_timeout)
            raise
    raise busy


def first_delivery_ended(
    task: LockedTask, lock: AdvisoryLock, task_id: str | None, *, direct: bool
) -> bool:
    """A busy redelivery: did its first delivery end just now? It may have held the key
    itself, so the key is worth one more try. Its run lock, held or unknown at first, is
    looked at again: after KILLED_HOLDER_GRACE if held, for up to ``lock_db_timeout`` if
    the lookup failed (a database restart)."""
    if task_id is None or not _acks_late_redelivery(task, direct):
        return False
    run = keys.run_key(task_id)
    alive = lock.run_alive(run)
    if alive is False:
        return False
    give_up = time.monotonic() + task.lock_config.db_timeout
    pause = 0.1
    while alive is None and time.monotonic() + pause < give_up:
        time.sleep(pause)
        pause = min(pause * 2, 1.0)
        alive = lock.run_alive(run)
    if alive:
        time.sleep(KILLED_HOLDER_GRACE)
        alive = lock.run_alive(run)
    return alive is False


def first_delivery_runs(
    task: LockedTask, lock: AdvisoryLock, task_id: str | None, direct: bool, waits: bool
) -> bool:
    """Before a redelivery takes a free lock_limit slot, or waits for its key: is its
    first delivery still running (its run lock held, looked at again after
    KILLED_HOLDER_GRACE)? Then the key counts as busy, and apply_policy stores nothing."""
    if (
        task_id is None
        or not (len(lock.slots) > 1 or (waits and not task.request.retries))
        or not _acks_late_redelivery(task, direct)
    ):
        return False
    run = keys.run_key(task_id)
    if lock.run_alive(run) is not True:
        return False
    time.sleep(KILLED_HOLDER_GRACE)
    return lock.run_alive(run) is True


def _acks_late_redelivery(task: LockedTask, direct: bool) -> bool:
    """A worker's run of an ``acks_late`` message the broker delivered before: its first
    delivery holds a run lock while it runs (docs/guide/skipped-results.md)."""
    return not direct and task.acks_late and celery_compat.redelivered(task.request)


def busy_action(options: LockConfig, *, direct: bool) -> OnBusy:
    """A busy run's policy: docs/reference/options.md, "What a busy run becomes"."""
    if direct and options.on_busy is not OnBusy.WAIT:
        return OnBusy.RAISE
    return options.on_busy


def after_wait(options: LockConfig, *, direct: bool) -> OnBusy:
    """What a 'wait' that ran out ends as: docs/reference/options.md, as busy_action."""
    if options.enqueue is Enqueue.UNTIL_STARTED and not direct:
        return OnBusy.RETRY
    return OnBusy.RAISE


def silent_changes(options: LockConfig) -> list[str]:
    """Each way a busy run departs from its lock_on_busy, and why (pglock check)."""
    on_busy = options.on_busy
    if options.shadow:
        return [
            f"lock_on_busy={on_busy.value!r} is only reported: lock_shadow=True runs "
            "a busy run's body anyway"
        ]
    changes = []
    if options.on_busy_implied and options.enqueue is not None:
        changes.append(
            f"lock_on_busy={config.DEFAULT_ON_BUSY.value!r} (the default) runs as "
            f"{on_busy.value!r} because lock_enqueue={options.enqueue.value!r} (a "
            "skipped follow-up would be lost)"
        )
    direct = busy_action(options, direct=True)
    if direct is not on_busy:
        changes.append(
            f"a direct call (task(...), not through a worker) runs {on_busy.value!r} "
            f"as {direct.value!r} (no message to skip or re-queue)"
        )
    waits = busy_action(options, direct=False) is OnBusy.WAIT
    ended = after_wait(options, direct=False)
    if waits and ended is not OnBusy.RAISE and options.enqueue is not None:
        changes.append(
            f"a 'wait' that runs out (lock_wait_timeout {options.wait_timeout:g}s) "
            f"runs as {ended.value!r} (lock_retry_delay {options.retry_delay:g}s), not "
            f"'raise', because lock_enqueue={options.enqueue.value!r}"
        )
    if options.debounce is not None:  # resolution sets it: docs/guide/debounce.md
        changes.append(
            "a send of a queued key replaces it (lock_enqueue_on_duplicate='replace'), "
            f"because lock_debounce={options.debounce:g}"
        )
    return changes


def report(
    task: LockedTask,
    lock: AdvisoryLock,
    task_id: str | None,
    action: OnBusy,
    throttle: Throttle | None = None,
    group: AdvisoryLock | None = None,
) -> tuple[str, dict[str, Any]]:
    """The sentence and the record (names and numbers, never arguments) of a busy run."""
    options = task.lock_config
    key = lock.key
    details: dict[str, Any] = {
        "reason": "group" if group is not None else _reason(options, throttle),
        "task": task.name,
        "lock": key.name,
        "key": str(key),
        "policy": action.value,
    }
    if throttle is not None:
        left = throttle.seconds_left
        too_long = (
            f" (more than lock_wait_timeout {options.wait_timeout:g}s)"
            if action is OnBusy.WAIT
            else ""
        )
        # The row records starts, not holders: those runs may have ended long ago.
        last = throttle.last_task_id
        rate = options.rate or config.Rate(1, 0.0)  # set: a throttle is lock_rate's
        if rate.period:
            what = (
                f"run {last} started"
                if last
                else "a run started (a direct call, or one whose id is unknown)"
            ) + f" less than lock_period {rate.window:g}s ago"
        else:
            earliest = f"run {last}" if last else "one whose id is unknown"
            runs = "1 run" if rate.starts == 1 else f"{rate.starts} runs"
            what = f"{runs} started within lock_rate {rate}, the earliest {earliest}"
        message = (
            f"Lock {key.name!r} (key {key}): {what}, {left:.1f}s left{too_long}; "
            f"{outcomes.run_name(task, task_id)} did not run."
        )
        return message, {**details, "seconds_left": left, "last_task": last}
    holder = holder_lookup.find(group or lock)
    details.update(holder=None, holder_pid=None, holder_task=None)
    by = "another session"
    if holder is not None:
        details.update(
            holder=holder.process,
            holder_pid=holder.backend_pid,
            holder_task=holder.task,
        )
        by = f"PostgreSQL backend {holder.backend_pid} (not a celery-pglock session)"
    if holder is not None and holder.process is not None:
        running = f"{holder.task}, " if holder.task else ""
        by = f"{holder.process} ({running}backend {holder.backend_pid})"
    waited = (
        f" after waiting {lock.wait_seconds or 0.0:.1f}s"
        f" (lock_wait_timeout {options.wait_timeout:g}s)"
        if action is OnBusy.WAIT and not options.shadow
        else ""
    )
    held = f"is held by {by}"
    if len(lock.slots) > 1:
        held = f"has all {len(lock.slots)} slots (lock_limit) held, one by {by}"
    what = f"Lock {key.name!r} (key {key})"
    if group is not None:
        details["group"] = options.group
        held = (
            f"is free, but its group {options.group!r} has all {len(group.slots)} "
            f"slots (lock_group_limit) held, one by {by}"
        )
    message = f"{what} {held}{waited}; {outcomes.run_name(task, task_id)} did not run."
    return message, details


def _reason(options: LockConfig, throttle: Throttle | None) -> str:
    """The skip's reason label: lock_period keeps its own ("period")."""
    if throttle is None:
        return "lock_busy"
    return "period" if options.rate is None or options.rate.period else "rate"


def skip_info(outcome: object) -> dict[str, Any] | None:
    """The skip record if ``outcome`` (``AsyncResult.result``, or ``get(propagate=False)``)
    is a skipped run's: a ``LockSkipped`` or a ``lock_skip_result='success'`` record."""
    if isinstance(outcome, exceptions.LockSkipped):
        return dict(outcome.details)
    if isinstance(outcome, dict) and outcome.get(SKIP_MARKER) == "skipped":
        return {k: v for k, v in outcome.items() if k != SKIP_MARKER}
    return None
