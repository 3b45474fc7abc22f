"""lock_enqueue: the publish-side check, and freeing the keys of messages that never run.
Why: docs/guide/enqueue.md."""

from __future__ import annotations

import datetime
import logging
import time
from typing import TYPE_CHECKING, Any

from celery.utils import uuid
from celery.utils.time import maybe_iso8601

from celery_pglock import celery_compat, config, exceptions
from celery_pglock.config import Enqueue, OnDuplicate, OnEnqueueError
from celery_pglock.db import engines
from celery_pglock.task import outcomes, queued, queued_writes, replacing

if TYPE_CHECKING:
    from collections.abc import Callable

    from celery_pglock.task.surface import LockedTask

logger = logging.getLogger(__name__)

#: Canvas options: deduplicated, such a send would never end (docs/guide/enqueue.md).
_CONTINUATIONS = ("link", "link_error", "chain", "chord", "group_id", "parent_id")
#: Seconds between WARNINGs per task for sends published unchecked.
_WARN_EVERY = 60.0
_warned: dict[tuple[str, str], float] = {}


def publish(
    task: LockedTask,
    send: Callable[..., Any],
    args: Any,
    kwargs: Any,
    task_id: str | None,
    options: dict[str, Any],
) -> Any:
    """Publish unless the key's message is already queued (or running): its AsyncResult."""
    settings = task.lock_config
    key = task.lock_key_for(*(args or ()), **(kwargs or {}))
    task_id = task_id or uuid()
    engine = task.locks_engine()
    finished = settings.enqueue is Enqueue.UNTIL_FINISHED
    headers = dict(options.pop("headers", None) or {})
    # A retry's request headers carry the old one: a checked message's retry, whose
    # parent_id (a send from another task's body) marks no canvas.
    checked = headers.pop(queued.HEADER, None) is not None
    # Told by Celery's retries count, never by a (reusable) id: docs/guide/enqueue.md.
    retry = celery_compat.is_retry_send(options)
    if settings.debounce is not None and not retry:
        _debounce(task, options)
    stale = _stale_after(task, options, settings.enqueue_lost_after)
    replace = settings.enqueue_on_duplicate is OnDuplicate.REPLACE
    if (
        replace
        and not (retry and checked)
        and any(options.get(name) for name in _CONTINUATIONS)
    ):
        # Never held in a row: its continuations would be lost (docs/guide/latest-wins.md).
        _unchecked(task, "canvas", f"it is part of a canvas ({key})", task_id, key)
        return send(args, kwargs, task_id, headers=headers, **options)
    try:
        if replace:
            replacing.TABLE.ensure(engine, settings.db_timeout)
        outcome, owner, *latest = queued.claim(
            engine,
            key=key,
            task_id=task_id,
            task_name=task.name,
            mode=queued.UNTIL_FINISHED if finished else queued.UNTIL_STARTED,
            # Provisional until the publish is confirmed (docs/guide/enqueue.md).
            stale=min(stale, queued.PUBLISH_GRACE),
            bound=settings.db_timeout,
            retry=retry,
            statement=(replacing.CLAIM_NAME, replacing.CLAIM)
            if replace
            else (queued.CLAIM_NAME, queued.CLAIM),
            more=replacing.pack(task, args, kwargs, {**options, "headers": headers})
            if replace
            else None,
            first=None
            if retry
            else (replacing.UPSERT_NAME, replacing.UPSERT)
            if replace
            else (queued.FIRST_NAME, queued.FIRST),
        )
    except exceptions.DatabaseError as error:
        # A retry is published anyway: refused, Celery's retry() would Reject it.
        if not retry and settings.enqueue_on_error is not OnEnqueueError.PUBLISH:
            raise exceptions.EnqueueUnavailable(
                f"{task.name}: could not check whether key {key} is already queued, so "
                f"nothing was published ({error}). Set lock_enqueue_on_error='publish' to "
                "publish unchecked when the lock database fails (the run lock still "
                "keeps runs single)."
            ) from error
        _unchecked(
            task, "db_error", f"the lock database failed ({error})", task_id, key
        )
        if retry:
            headers[queued.HEADER] = queued.header_of(key)
        return send(args, kwargs, task_id, headers=headers, **options)
    if outcome == "queued":
        if any(options.get(name) for name in _CONTINUATIONS):
            _unchecked(task, "canvas", f"it is part of a canvas ({key})", task_id, key)
            return send(args, kwargs, task_id, headers=headers, **options)
        outcomes.enqueued(task, "duplicate", task_id, key, owner)
        if settings.enqueue_on_duplicate is OnDuplicate.RAISE:
            raise exceptions.AlreadyQueued(
                f"{task.name}: key {key} already has message {owner} queued or "
                "running; nothing was published.",
                key=str(key),
                name=key.name,
                task_id=owner,
            )
        return task.AsyncResult(owner)
    if outcome == "replaced":  # latest wins: into the key's row, nothing published
        outcomes.enqueued(task, "replaced", task_id, key, owner)
        if owner != task_id:  # none if it is in the row already (replacing.CLAIM)
            replacing.tell_replaced(task, owner, task_id)
        return task.AsyncResult(task_id)
    if outcome in ("superseded", "hand_over"):  # a retry yields to a newer send
        outcomes.enqueued(task, outcome, task_id, key, owner)
        if outcome == "hand_over":  # it carried the newer send: publish that instead
            replacing.publish_latest(task, key, owner, *latest)
        replacing.tell_replaced(task, task_id, owner)
        raise replacing.replaced_error(task.name, task_id, owner)
    # A retry (or a replacing send's own row) is the key's waiting message now.
    if retry or outcome == "own":  # docs/guide/enqueue.md
        outcome = "new"
    elif outcome == "took_over":
        logger.info("%s: took over stale queued key %s from %s", task.name, key, owner)
        if replace:  # the row's latest send, not yet published, is this one now
            replacing.tell_replaced(task, owner, task_id)
    outcome = "published" if outcome == "new" else outcome
    outcomes.enqueued(
        task, outcome, task_id, key, None if outcome == "published" else owner
    )
    headers[queued.HEADER] = queued.header_of(key)
    try:
        result = send(args, kwargs, task_id, headers=headers, **options)
    except BaseException:
        queued.give_back(engine, key, task_id, settings.db_timeout)
        raise
    if stale > queued.PUBLISH_GRACE:
        queued_writes.write_later(
            task,
            (
                queued_writes.CONFIRM_MANY,
                key.pg_locks_ids,
                task_id,
                stale,
                time.monotonic(),
            ),
        )
    return result


def _debounce(task: LockedTask, options: dict[str, Any]) -> None:
    """A debounced send is due lock_debounce after it (docs/guide/debounce.md)."""
    for name in ("countdown", "eta"):
        if options.get(name) is not None:
            raise exceptions.ConfigurationError(
                f"{task.name}: {name}={options[name]!r} is invalid for a task with "
                f"lock_debounce; expected no {name}: the quiet time "
                f"({task.lock_config.debounce:g}s) decides when its run starts."
            )
    options["countdown"] = task.lock_config.debounce


def _stale_after(task: LockedTask, options: dict[str, Any], lost_after: float) -> float:
    """Seconds until a never-started message stops holding its key: lost_after past its
    due time, and never past its expiry (Celery drops an expired message)."""
    countdown = options.get("countdown")
    due = _seconds_until(options.get("eta")) if countdown is None else float(countdown)
    stale = max(0.0, due) + lost_after
    expires = options.get("expires", task.expires)
    if isinstance(expires, (int, float)):
        return min(stale, float(expires))
    return stale if expires is None else min(stale, _seconds_until(expires))


def _seconds_until(when: Any) -> float:
    if isinstance(when, str):
        when = maybe_iso8601(when)
    if not isinstance(when, datetime.datetime):
        return 0.0
    if when.tzinfo is None:  # Celery reads a naive eta in the app's timezone; UTC here
        when = when.replace(tzinfo=datetime.timezone.utc)
    return float((when - datetime.datetime.now(datetime.timezone.utc)).total_seconds())


def _unchecked(task: LockedTask, reason: str, why: str, task_id: str, key: Any) -> None:
    outcomes.enqueued(task, f"unchecked_{reason}", task_id, key)
    now = time.monotonic()
    if now - _warned.get((task.name, reason), -_WARN_EVERY) >= _WARN_EVERY:
        _warned[(task.name, reason)] = now
        logger.warning(
            "%s: published without the lock_enqueue check, because %s; its run is "
            "still locked (reported at most once a minute)",
            task.name,
            why,
            extra={"action": "enqueue_unchecked", "reason": reason},
        )


def _enqueues(task: object) -> bool:
    return getattr(getattr(task, "lock_config", None), "enqueue", None) is not None


def on_revoked(sender: Any = None, request: Any = None, **_: Any) -> None:
    """task_revoked (revoked or expired, in the worker's main process): free the key."""
    if request is None or not _enqueues(sender):
        return
    # The request is a Context built from the message (Celery 5.3 to 5.7): the header
    # is in its headers (tests/acceptance/test_enqueue_guards.py, with a real worker).
    headers = getattr(request, "headers", None) or {}
    row = queued.parse_header(headers.get(queued.HEADER))
    task_id = getattr(request, "id", None)
    if row is not None and task_id:
        queued_writes.free_later(sender, row, task_id)


def on_rejected(sender: Any = None, message: Any = None, **_: Any) -> None:
    """task_rejected / task_unknown: a message no worker will run frees its key. An
    unknown task has no options here: the app's lock database and defaults are used."""
    headers = getattr(message, "headers", None) or {}
    row = queued.parse_header(headers.get(queued.HEADER))
    app = getattr(sender, "app", None)
    task_id = headers.get("id")
    if row is None or app is None or not isinstance(task_id, str):
        return
    name = headers.get("task")
    task: Any = app.tasks.get(name) if isinstance(name, str) else None
    if _enqueues(task):
        queued_writes.free_later(task, row, task_id)
        return
    try:
        engine = engines.engine_for(app.conf)
    except exceptions.PgLockError:
        return  # no lock database here: its row frees itself once stale
    queued_writes.writer_for(
        engine,
        config.app_seconds(app.conf, "db_timeout"),
        config.app_seconds(app.conf, "enqueue_lost_after"),
    ).put((queued_writes.DELETE_MANY, row, task_id, 0.0, 0.0))
