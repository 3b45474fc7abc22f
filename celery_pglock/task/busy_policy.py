"""What a run whose lock is held becomes: ``lock_on_busy`` applied, and the skip record.

:func:`apply_policy` names the holder (one more round trip, on this path only), reports
the outcome and ends the run: ``LockSkipped`` (FAILURE), a skip record (SUCCESS),
``LockBusy`` or Celery's retry (docs/guide/policies.md, docs/guide/skipped-results.md).
:func:`skip_info` reads a skip back from a result.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from celery.exceptions import Ignore

from celery_pglock import exceptions, keys
from celery_pglock.config import OnBusy, SkipResult
from celery_pglock.lock import holder_lookup
from celery_pglock.task import outcomes

if TYPE_CHECKING:
    from celery_pglock.lock import AdvisoryLock

#: What ``pglock_final_states`` calls a skipped run, whatever ``lock_skip_result`` stored.
SKIPPED = "SKIPPED"
#: The key marking a skip record (the result value under ``lock_skip_result='success'``).
SKIP_MARKER = "celery_pglock"


def apply_policy(
    task: Any, lock: AdvisoryLock, task_id: str | None, *, direct: bool
) -> Any:
    """Apply lock_on_busy to a run whose lock is held.

    Raises (LockSkipped, LockBusy, Retry or Ignore), except under
    ``lock_skip_result='success'``, where it returns the skip record as the value.
    """
    options = task.lock_config
    request = task.request
    # A direct call has no message to skip or re-queue: whatever the policy, it raises.
    action = (
        OnBusy.RAISE
        if direct and options.on_busy is not OnBusy.WAIT
        else options.on_busy
    )
    message, details = report(task, lock, task_id, action)
    # This very message, redelivered (visibility timeout, lost connection) while its
    # first delivery still runs: anything stored under its id would end its caller's
    # wait with the wrong outcome; the first delivery stores the real one.
    first_delivery_runs = (
        not direct
        and bool((request.delivery_info or {}).get("redelivered"))
        and _first_delivery_runs(task, lock, task_id)
    )
    if first_delivery_runs:
        message += (
            " The message was a redelivery whose first delivery is still running, "
            "so no result was stored."
        )
    # Celery's task line carries the message, except for a direct call (no tracer).
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
    if direct:
        raise busy
    if first_delivery_runs:
        raise Ignore(message)
    if action is OnBusy.SKIP and options.skip_result is SkipResult.SUCCESS:
        # Not a real success: the next link of a chain and link callbacks must not
        # run with a skip record as their argument. A chord still counts the part.
        request.callbacks = None
        request.chain = None
        return {SKIP_MARKER: "skipped", **details}
    if action is OnBusy.SKIP:
        raise exceptions.LockSkipped(message, details)
    if action is OnBusy.RETRY:
        if request.is_eager and task.max_retries is None:
            raise busy  # eager retries run inline without the countdown: never spin
        raise task.retry(countdown=options.retry_delay, exc=busy)
    raise busy


def _first_delivery_runs(task: Any, lock: AdvisoryLock, task_id: str | None) -> bool:
    """Is the first delivery of this redelivered message still running?

    An acks_late run holds its run lock (keys.run_key) beside its key; any other message
    was acknowledged when it started, so its redelivery never ran. Unknown counts as yes.
    """
    if task_id is None or not task.acks_late:
        return False
    return lock.run_alive(keys.run_key(task_id)) is not False


def report(
    task: Any, lock: AdvisoryLock, task_id: str | None, action: OnBusy
) -> tuple[str, dict[str, Any]]:
    """The sentence and the plain-data record of a busy run, naming its holder.

    Carries names and numbers only, never argument values.
    """
    options = task.lock_config
    key = lock.key
    holder = holder_lookup.find(lock)
    details: dict[str, Any] = {
        "reason": "lock_busy",
        "task": task.name,
        "lock": key.name,
        "key": str(key),
        "policy": action.value,
        "holder": None,
        "holder_pid": None,
        "holder_task": None,
    }
    if holder is None:
        by = "another session"
    elif holder.process is None:
        details.update(holder.as_details())
        by = f"PostgreSQL backend {holder.backend_pid} (not a celery-pglock session)"
    else:
        details.update(holder.as_details())
        running = f"{holder.task}, " if holder.task else ""
        by = f"{holder.process} ({running}backend {holder.backend_pid})"
    # The time it really waited: a server setting or a cancel may end a wait early.
    waited = (
        f" after waiting {lock.wait_seconds or 0.0:.1f}s"
        f" (lock_wait_timeout {options.wait_timeout:g}s)"
        if action is OnBusy.WAIT and not options.shadow
        else ""
    )
    message = (
        f"Lock {key.name!r} (key {key}) is held by {by}{waited}; "
        f"{task.name}[{task_id}] did not run."
    )
    return message, details


def skip_info(outcome: object) -> dict[str, Any] | None:
    """The skip record if ``outcome`` is a skipped run's result, else None.

    ``outcome`` is what ``AsyncResult.get(propagate=False)`` or ``.result`` gives: a
    ``LockSkipped`` (``lock_skip_result='failure'``), a skip record dict (``'success'``),
    or anything else (not a skip).
    """
    if isinstance(outcome, exceptions.LockSkipped):
        return dict(outcome.details)
    if isinstance(outcome, dict) and outcome.get(SKIP_MARKER) == "skipped":
        return {k: v for k, v in outcome.items() if k != SKIP_MARKER}
    return None
