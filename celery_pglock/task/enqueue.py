"""lock_enqueue: the publish-side check, and freeing the keys of messages that never run.
Why: docs/guide/enqueue.md."""

from __future__ import annotations

import datetime
import logging
import queue
import threading
import time
from typing import TYPE_CHECKING, Any

from celery.utils import uuid
from celery.utils.time import maybe_iso8601

from celery_pglock import exceptions, keys
from celery_pglock.config import Enqueue, OnDuplicate, OnEnqueueError
from celery_pglock.db import deadlines, engines
from celery_pglock.lock import queued
from celery_pglock.task import outcomes

if TYPE_CHECKING:
    from collections.abc import Callable

    import sqlalchemy as sa

logger = logging.getLogger(__name__)

#: Options of canvas sends: a callback, or a result id frozen by the caller (a group's
#: GroupResult, a chain's links). Deduplicated, those would never complete.
_CONTINUATIONS = ("link", "link_error", "chain", "chord", "group_id", "parent_id")
#: Seconds between WARNINGs per task for sends published unchecked.
_WARN_EVERY = 60.0
_warned: dict[tuple[str, str], float] = {}


def publish(
    task: Any,
    send: Callable[..., Any],
    args: Any,
    kwargs: Any,
    task_id: str | None,
    options: dict[str, Any],
) -> Any:
    """Publish unless the key's message is already queued (or running): its AsyncResult."""
    config = task.lock_config
    key = task.lock_key_for(*(args or ()), **(kwargs or {}))
    task_id = task_id or uuid()
    engine = task._binding().engine()
    mode = queued.UNTIL_STARTED
    if config.enqueue is Enqueue.UNTIL_FINISHED:
        mode = queued.UNTIL_FINISHED
    headers = dict(options.pop("headers", None) or {})
    headers.pop(queued.HEADER, None)  # a retry's request headers carry the old one
    try:
        outcome, owner = queued.claim(
            engine,
            key=key,
            task_id=task_id,
            task_name=task.name,
            mode=mode,
            stale=_stale_after(task, options, config.enqueue_lost_after),
            bound=config.db_timeout,
        )
    except exceptions.DatabaseError as error:
        if config.enqueue_on_error is OnEnqueueError.PUBLISH:
            _unchecked(task, "db_error", f"the lock database failed ({error})")
            return send(args, kwargs, task_id, headers=headers, **options)
        raise exceptions.EnqueueUnavailable(
            f"{task.name}: could not check whether key {key} is already queued, so "
            f"nothing was published ({error}). Set lock_enqueue_on_error='publish' to "
            "publish unchecked when the lock database fails (the run lock still "
            "keeps runs single)."
        ) from error
    if outcome == "queued":
        if options.get("retries") is not None:
            # A retry is the same message going on: always published (docs/guide/enqueue.md).
            return send(args, kwargs, task_id, headers=headers, **options)
        if any(options.get(name) for name in _CONTINUATIONS):
            _unchecked(task, "canvas", f"it is part of a canvas ({key})")
            return send(args, kwargs, task_id, headers=headers, **options)
        outcomes.enqueued(task, "duplicate")
        if config.enqueue_on_duplicate is OnDuplicate.RAISE:
            raise exceptions.AlreadyQueued(
                f"{task.name}: key {key} already has message {owner} queued or "
                "running; nothing was published.",
                key=str(key),
                name=key.name,
                task_id=owner,
            )
        return task.AsyncResult(owner)
    if outcome == "took_over" and owner != task_id:
        logger.info("%s: took over stale queued key %s from %s", task.name, key, owner)
    outcomes.enqueued(
        task, "published" if outcome == "new" or owner == task_id else outcome
    )
    headers[queued.HEADER] = queued.header_of(key)
    try:
        return send(args, kwargs, task_id, headers=headers, **options)
    except BaseException:
        queued.give_back(engine, key, task_id, config.db_timeout)
        raise


def _stale_after(task: Any, options: dict[str, Any], lost_after: float) -> float:
    """Seconds until a never-started message stops holding its key: lost_after past its
    due time, and never past its expiry (Celery drops an expired message)."""
    now = datetime.datetime.now(datetime.timezone.utc)
    due = 0.0
    countdown, eta = options.get("countdown"), options.get("eta")
    if countdown is not None:
        due = float(countdown)
    elif eta is not None:
        due = _seconds_until(maybe_iso8601(eta) if isinstance(eta, str) else eta, now)
    stale = max(0.0, due) + lost_after
    expires = options.get("expires", task.expires)
    if isinstance(expires, (int, float)):
        stale = min(stale, float(expires))
    elif expires is not None:
        when = maybe_iso8601(expires) if isinstance(expires, str) else expires
        stale = min(stale, _seconds_until(when, now))
    return stale


def _seconds_until(when: Any, now: datetime.datetime) -> float:
    if isinstance(when, datetime.datetime):
        if (
            when.tzinfo is None
        ):  # Celery reads a naive eta in the app's timezone; UTC here
            when = when.replace(tzinfo=datetime.timezone.utc)
        return float((when - now).total_seconds())
    return 0.0


def _unchecked(task: Any, reason: str, why: str) -> None:
    outcomes.enqueued(task, f"unchecked_{reason}")
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


class _Freer(threading.Thread):
    """Deletes the rows of messages a worker dropped, off the consumer's thread."""

    BATCH_WAIT = (
        0.1  #: Seconds to gather a batch: one statement for a burst of revokes.
    )

    def __init__(self, engine: sa.Engine, bound: float) -> None:
        super().__init__(name="celery-pglock-queued-freer", daemon=True)
        self.engine, self.bound = engine, bound
        self.pending: queue.SimpleQueue[tuple[tuple[int, int, int], str]] = (
            queue.SimpleQueue()
        )

    def run(self) -> None:
        while True:
            batch = [self.pending.get()]
            time.sleep(self.BATCH_WAIT)
            while not self.pending.empty():
                batch.append(self.pending.get())
            for attempt in (1, 2):
                try:
                    self._delete(batch)
                    break
                except Exception:
                    if attempt == 2:
                        logger.warning(
                            "Could not free %d queued key(s) of dropped messages (%s); "
                            "each frees itself once stale, or clear it with "
                            "`celery pglock queued clear <task id>`",
                            len(batch),
                            ", ".join(task_id for _, task_id in batch),
                            exc_info=True,
                            extra={"action": "enqueue_free_failed"},
                        )
                    else:
                        time.sleep(1.0)

    def _delete(self, batch: list[tuple[tuple[int, int, int], str]]) -> None:
        columns = list(zip(*((*row, task_id) for row, task_id in batch), strict=True))
        with (
            engines.autocommit(self.engine) as dbapi,
            deadlines.bounded(dbapi, self.bound),
            dbapi.cursor() as cursor,
        ):
            cursor.execute(queued.DELETE_MANY, [list(column) for column in columns])


_freers: dict[Any, _Freer] = {}
_freers_guard = engines.fork_safe_lock(_freers)  # a child has no freer thread


def free_later(task: Any, row: tuple[int, int, int], task_id: str) -> None:
    """Queue the delete of ``task_id``'s row (a no-op if a newer message has the key)."""
    engine = task._binding().engine()
    with _freers_guard:
        freer = _freers.get(engine)
        if freer is None or not freer.is_alive():
            freer = _freers[engine] = _Freer(engine, task.lock_config.db_timeout)
            freer.start()
    freer.pending.put((row, task_id))


def _enqueue_task(app: Any, name: object) -> Any:
    task = app.tasks.get(name) if isinstance(name, str) else None
    config = getattr(task, "lock_config", None)
    return task if config is not None and config.enqueue is not None else None


def on_revoked(sender: Any = None, request: Any = None, **_: Any) -> None:
    """task_revoked (revoked or expired, in the worker's main process): free the key."""
    task = sender if getattr(sender, "lock_config", None) is not None else None
    if task is None or task.lock_config.enqueue is None or request is None:
        return
    headers = getattr(request, "headers", None) or {}
    row = queued.parse_header(headers.get(queued.HEADER))
    if row is None:
        row = queued.parse_header(getattr(request, queued.HEADER, None))
    task_id = getattr(request, "id", None)
    if row is not None and task_id:
        free_later(task, row, task_id)


def on_rejected(sender: Any = None, message: Any = None, **_: Any) -> None:
    """task_rejected / task_unknown: a message no worker will run frees its key."""
    headers = getattr(message, "headers", None) or {}
    row = queued.parse_header(headers.get(queued.HEADER))
    app = getattr(sender, "app", None)
    if row is None or app is None:
        return
    task = _enqueue_task(app, headers.get("task"))
    task_id = headers.get("id")
    if task is not None and isinstance(task_id, str):
        free_later(task, row, task_id)


def give_back(task: Any, key: keys.LockKey, task_id: str) -> None:
    """A message ending without its run (skipped, raised): free its key now."""
    queued.give_back(
        task._binding().engine(), key, task_id, task.lock_config.db_timeout
    )
