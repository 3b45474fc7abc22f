"""lock_group: at most lock_group_limit runs at once of every task naming the group, beside
each key's own limit. The group's slots are advisory keys like lock_limit's, taken in the
key's own statement where its session can (the key's companions), else after it on a lock
of their own. Why: docs/guide/limits.md ("Limits across keys")."""

from __future__ import annotations

import functools
import time
from typing import TYPE_CHECKING, Any

from celery_pglock import celery_compat, exceptions, keys
from celery_pglock.config import OnBusy
from celery_pglock.lock import AdvisoryLock
from celery_pglock.task import outcomes, retries, runs
from celery_pglock.watch import loss_watcher

if TYPE_CHECKING:
    import celery

    from celery_pglock import config
    from celery_pglock.task.singleton_task import Execution, SingletonTask

#: Hashed with the namespace into a group's key: no task's lock_name is a group's.
_GROUP_NAME = "celery_pglock.group:{}"


def group_key(namespace: str, group: str) -> keys.LockKey:
    """The group's key (its slot 0); the same in every task and process naming it."""
    return keys.make_key(namespace, _GROUP_NAME.format(group))


def companions(options: config.LockConfig, limit: int) -> tuple[keys.LockKey, ...]:
    """The group's slots, to take with a run's key in its statement (not beside
    lock_limit's slots: those are polled, a statement per try)."""
    if options.group is None or limit > 1:
        return ()
    return _slots(options.namespace, options.group, options.group_limit)


@functools.lru_cache(maxsize=256)
def _slots(namespace: str, group: str, limit: int) -> tuple[keys.LockKey, ...]:
    slots = keys.slot_keys(group_key(namespace, group), limit)
    # Companions are bigint keys (the lock's statement takes them as one bigint[]).
    return slots if all(len(slot.ids) == 1 for slot in slots) else ()


def take(
    task: SingletonTask,
    options: config.LockConfig,
    execution: Execution,
    key_lock: AdvisoryLock,
    direct: bool,
) -> AdvisoryLock | None:
    """None once a slot of the group is held beside the run's key (its companion, or
    ``execution.group_lock``); else the group's lock, every slot taken, and the key
    released unless shadowed. Only lock_on_busy='wait' waits, within one budget,
    lock_wait_timeout, with the key's."""
    taken = key_lock.companion_taken
    if taken:
        return None  # in the key's statement; released with the key
    key = group_key(options.namespace, options.group or "")  # set: a lock_group run
    lock = AdvisoryLock(
        engine=key_lock.engine, key=key, scope=options.scope, label=options.task_name
    )
    lock.round_trip_timeout = options.db_timeout
    lock.slots = keys.slot_keys(key, options.group_limit)
    request = task.request
    # A retry waits for its predecessor's slot, kept until task_postrun as its key is
    # (docs/guide/retries.md); under 'retry' a full group re-queues it instead.
    retried = bool(request.retries) and not direct and not request.is_eager
    waits = not options.shadow and (
        options.on_busy is OnBusy.WAIT
        or (retried and options.on_busy is not OnBusy.RETRY)
    )
    if taken is not None and not waits:  # full, as the key's statement just found
        if not options.shadow:
            runs.release_unrun(task, key_lock, execution.task_id)
        return lock
    # Recorded first: a time limit landing after the grant finds it (release_leftover).
    execution.group_lock = lock
    timeout = None
    if waits:
        left = options.wait_timeout - (key_lock.wait_seconds or 0.0)
        timeout = left if left > 0 else None
    began = time.monotonic()
    try:
        granted = lock.acquire(timeout=timeout)
    except BaseException as error:
        release(task, execution)
        runs.release_unrun(task, key_lock, execution.task_id)
        if isinstance(error, exceptions.DatabaseError):
            retries.on_database_error(task, error, direct=direct)
        raise
    key_lock.wait_seconds = (key_lock.wait_seconds or 0.0) + time.monotonic() - began
    if granted:
        with runs.held_guard:  # the worker's shutdown net releases it too
            runs.held.add(lock)
        return None
    execution.group_lock = None
    if not options.shadow:
        runs.release_unrun(task, key_lock, execution.task_id)
    return lock


def watch(
    task: SingletonTask,
    execution: Execution,
    key_lock: AdvisoryLock,
    options: config.LockConfig,
) -> None:
    """A slot on a session of its own (per-lock sessions, transaction scope) is watched
    as its key is: lost mid-body, it ends the run the same way."""
    lock = execution.group_lock
    if lock is not None and lock.backend_pid != key_lock.backend_pid:
        lost = functools.partial(outcomes.lost, task, execution.task_id, lock)
        loss_watcher.watch(lock, lost, options)


def release(task: SingletonTask, execution: Execution) -> None:
    """Give the run's group slot back (a failure is reported, never raised)."""
    lock = execution.group_lock
    if lock is None:
        return
    with runs.held_guard:
        runs.held.discard(lock)
    if lock.owned():
        runs.release_unrun(task, lock, execution.task_id)
    execution.group_lock = None  # last: interrupted, task_postrun releases it


def release_unrun(task: SingletonTask, execution: Execution) -> None:
    """The run's slot given back if its key no longer is held: its start was refused (a
    full rate) or failed. A run going on (its body, or a retry kept to task_postrun) keeps it."""
    key = execution.lock
    if key is None or not key.owned():
        release(task, execution)


def release_leftover(execution: Execution) -> None:
    """task_postrun's net: a group slot still held where its run ended, released loudly."""
    lock, execution.group_lock = execution.group_lock, None
    if lock is not None and lock.owned():
        runs.release_leftover(lock, f"task_postrun of {execution.task_id}")


def refuse_another_limit(
    name: str, options: config.LockConfig, app: celery.Celery
) -> None:
    """Refuse two tasks of ``app`` naming one group with two limits (ConfigurationError):
    each would count the slots up to its own limit, and the smaller would not hold."""
    if options.group is None:
        return
    for other in list(celery_compat.task_registry(app).values()):
        theirs: Any = getattr(type(other), "_pglock", None)
        config_of = getattr(theirs, "config", None)
        if (
            other.name != name
            and config_of is not None
            and config_of.group == options.group
            and config_of.namespace == options.namespace
            and config_of.group_limit != options.group_limit
        ):
            raise exceptions.ConfigurationError(
                f"Tasks {other.name!r} and {name!r} both use lock_group "
                f"{options.group!r} with lock_group_limit {config_of.group_limit} and "
                f"{options.group_limit}: a group has one limit. Give both the same "
                "lock_group_limit (docs/guide/limits.md)."
            )
