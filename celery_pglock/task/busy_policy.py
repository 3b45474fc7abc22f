"""What a run whose lock is held becomes: ``lock_on_busy`` applied, and the skip record.

``task.py`` tries the lock; when it is busy, :func:`apply_policy` names the holder
(:func:`report`, one more round trip on this path only), reports the outcome and ends
the run as the policy and ``lock_skip_result`` say: ``LockSkipped`` (FAILURE), a skip
record (SUCCESS), the state ``SKIPPED``, ``LockBusy``, or Celery's retry. A redelivery
whose first delivery still runs stores nothing (``Ignore``), whatever the policy.
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

#: The result state of a skipped run under ``lock_skip_result='skipped'``.
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
    skip_result = options.skip_result if action is OnBusy.SKIP else None
    message, details = report(task, lock, task_id, action)
    first_delivery_runs = (
        not direct
        and bool((request.delivery_info or {}).get("redelivered"))
        and _first_delivery_runs(task, lock, task_id)
    )
    if first_delivery_runs:
        # This very message, redelivered (a broker visibility timeout, a lost
        # connection) while its first delivery still runs and holds the lock: whatever
        # the policy, storing anything under its id (a skip, LockBusy, a retry that
        # would run the body again) would end its caller's wait with the wrong outcome.
        # The first delivery will store the real one.
        message += (
            " The message was a redelivery whose first delivery is still running, "
            "so no result was stored."
        )
        skip_result = None
    outcomes.skipped(
        task,
        task_id,
        lock,
        action=action.value,
        message=message,
        details=details,
        # Celery's task line carries the message, except for a direct call (no
        # tracer) and a SKIPPED state (Celery only says "ignored").
        celery_logs=not direct
        and not first_delivery_runs
        and skip_result is not SkipResult.SKIPPED,
    )
    key = lock.key
    if direct:
        raise exceptions.LockBusy(message, key=str(key), name=key.name)
    if first_delivery_runs:
        raise Ignore(message)
    if skip_result is SkipResult.FAILURE:
        raise exceptions.LockSkipped(message, details)
    if skip_result is SkipResult.SUCCESS:
        # Not a real success: the next link of a chain and link callbacks must not
        # run with a skip record as their argument. A chord still counts the part.
        request.callbacks = None
        request.chain = None
        return {SKIP_MARKER: "skipped", **details}
    if skip_result is SkipResult.SKIPPED:
        if task_id is not None and not (task.ignore_result or request.ignore_result):
            task.update_state(task_id=task_id, state=SKIPPED, meta=details)
        raise Ignore(message)
    busy = exceptions.LockBusy(message, key=str(key), name=key.name)
    if action is OnBusy.RETRY:
        if request.is_eager and task.max_retries is None:
            raise busy  # eager retries run inline without the countdown: never spin
        raise task.retry(countdown=options.retry_delay, exc=busy)
    raise busy


def _first_delivery_runs(task: Any, lock: AdvisoryLock, task_id: str | None) -> bool:
    """Is the first delivery of this redelivered message still running?

    An acks_late run holds its run lock (keys.run_key) beside its key; any other
    message was acknowledged when it started, so a redelivery of it never ran. When
    the run lock cannot be checked, the answer is yes: storing nothing is what the
    library did before it could tell.
    """
    if task_id is None or not task.acks_late:
        return False
    alive = lock.run_alive(keys.run_key(task_id))
    return alive is not False


def report(
    task: Any, lock: AdvisoryLock, task_id: str | None, action: OnBusy
) -> tuple[str, dict[str, Any]]:
    """The sentence and the plain-data record of a busy run, naming its holder.

    Costs one more round trip (the holder lookup, see holder_lookup.find) on the busy
    path only. Carries names and numbers only, never argument values.
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
    else:
        details.update(holder.as_details())
        if holder.process is None:
            by = (
                f"PostgreSQL backend {holder.backend_pid} (not a celery-pglock session)"
            )
        else:
            running = f"{holder.task}, " if holder.task else ""
            by = f"{holder.process} ({running}backend {holder.backend_pid})"
    # The time it really waited, measured around the wait: a server setting, or a
    # cancel, may end a wait before lock_wait_timeout, and the message must not claim it.
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
    ``LockSkipped`` (``lock_skip_result='failure'``), a skip record dict (``'success'``,
    and the meta of a ``'skipped'`` state), or anything else (not a skip).
    """
    if isinstance(outcome, exceptions.LockSkipped):
        return dict(outcome.details)
    if isinstance(outcome, dict) and (
        outcome.get(SKIP_MARKER) == "skipped" or outcome.get("reason") == "lock_busy"
    ):
        return {k: v for k, v in outcome.items() if k != SKIP_MARKER}
    return None
