"""SingletonTask: a Celery task whose body runs under a PostgreSQL advisory lock.

Where things happen, and why there (each line is a bug in an existing library):

- The lock is taken in ``__call__``, the task's own call path, not in ``task_prerun``:
  Celery swallows exceptions raised by signal receivers, so a receiver cannot stop a
  duplicate. Being worker-side, it also covers ``send_task``, beat without the task
  imported, and producers in other services.
- The lock is released by ``__call__`` itself, around the body, for every outcome
  (SUCCESS, FAILURE, RETRY, IGNORED, REJECTED) and *before* Celery stores the result and
  sends chain callbacks: a client that saw the result can send the next run at once.
  ``task_postrun`` (per execution, never by task id) and worker shutdown are idempotent
  safety nets (see ``_hooks.py``). A killed pool child needs no hook: its session ends
  and PostgreSQL frees the lock.
- ``self.retry()`` publishes the retry message only after the attempt has released its
  lock, so the retry never meets its own predecessor's lock (docs/guide/retries.md).
- A skipped run never runs its body and is not a success: its state is SKIPPED and
  ``Ignore`` keeps Celery from storing SUCCESS or running chain callbacks.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, ClassVar

import celery
from celery import states
from celery.exceptions import Ignore, Reject, Retry

from celery_pglock import (
    _binding,
    _hooks,
    config,
    context,
    db,
    exceptions,
    keys,
    signals,
)
from celery_pglock.config import LockScope, OnBusy
from celery_pglock.lock import AdvisoryLock

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence


logger = logging.getLogger(__name__)

#: The result state of a run that did not execute because its lock was held.
SKIPPED = "SKIPPED"


class SingletonTask(celery.Task):  # type: ignore[type-arg]
    """A Celery task that runs at most once at a time per lock key.

    Use it as a base: ``@app.task(base=SingletonTask, lock_args=("tenant_id",))``. Each
    option below may be a decorator keyword, a class attribute of a subclass, or (where
    noted) an app-wide default ``app.conf.pglock_<option without lock_>``.
    """

    #: Names of the task's parameters whose values form the key. None: one lock per task.
    lock_args: ClassVar[Sequence[str] | str | None] = None
    #: ``lock_key(*args, **kwargs)`` returns the key material, for keys that are not
    #: plain arguments. Exclusive with lock_args and lock_id.
    lock_key: ClassVar[Callable[..., object] | None] = None
    #: An explicit numeric key: one signed 64-bit int or two signed 32-bit ints.
    lock_id: ClassVar[int | tuple[int, int] | None] = None
    #: The name hashed into the key (default: the task name). Tasks that share a
    #: lock_name (and lock_args values) share one lock.
    lock_name: ClassVar[str | None] = None
    #: Mixed into every key; separates apps sharing a database. App: pglock_namespace.
    lock_namespace: ClassVar[str | None] = None
    #: skip (default), raise, retry or wait. App: pglock_on_busy.
    lock_on_busy: ClassVar[OnBusy | str | None] = None
    #: session (default) or transaction. App: pglock_scope.
    lock_scope: ClassVar[LockScope | str | None] = None
    #: Seconds before a lock_on_busy='retry' re-run (default 30). App: pglock_retry_delay.
    lock_retry_delay: ClassVar[float | None] = None
    #: Longest lock_on_busy='wait' wait, enforced server-side (default 10). App:
    #: pglock_wait_timeout.
    lock_wait_timeout: ClassVar[float | None] = None

    _pglock: ClassVar[_binding.Guard | None] = None

    @classmethod
    def on_bound(cls, app: celery.Celery) -> None:
        """Validate and freeze the lock options when Celery binds the task to ``app``."""
        super().on_bound(app)
        if cls.name:  # an abstract base has no name and no real run() yet
            cls._pglock = cls._build_guard(app)
        _hooks.connect()

    @classmethod
    def _build_guard(cls, app: celery.Celery) -> _binding.Guard:
        try:
            parameters = _binding.call_parameters(cls)
        except (TypeError, ValueError) as exc:
            raise exceptions.ConfigurationError(
                f"Task {cls.name!r}: cannot read its signature ({exc})."
            ) from exc
        options = config.resolve(
            task_name=cls.name,
            attributes=_binding.option_attributes(cls, _RESERVED),
            conf=app.conf,
            parameters=parameters,
        )
        return _binding.Guard(options, parameters, app.conf)

    @property
    def lock_config(self) -> config.LockConfig:
        """The resolved options of this task."""
        return self._guard().config

    def _guard(self) -> _binding.Guard:
        guard = type(self)._pglock
        if guard is None:
            guard = type(self)._pglock = type(self)._build_guard(self.app)
        return guard

    def lock_key_for(self, *args: Any, **kwargs: Any) -> keys.LockKey:
        """The key a call with these arguments would lock (no I/O): for docs and tools."""
        return self._guard().key(args, kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        guard = self._guard()
        options = guard.config
        request = self.request
        outer = context.current_execution()
        # A body calling its own task directly (recursion) sees the outer run's request
        # on the stack: treat it as the direct call it is, not as a run of that message.
        direct = request.called_directly or (
            outer is not None and outer.request is request
        )
        task_id: str | None = None if direct else request.id
        execution, token = context.begin(task_id, request)
        if not direct:
            # task_postrun finds this execution's lock on the tracer's request: per
            # execution and per thread, never by task id (see context.py).
            request._pglock_execution = execution  # type: ignore[attr-defined]
        try:
            key = guard.key(args, kwargs)
            lock = AdvisoryLock(
                engine=guard.engine(),
                key=key,
                scope=options.scope,
                label=options.task_name,
            )
            granted = lock.acquire(
                timeout=options.wait_timeout if options.on_busy is OnBusy.WAIT else None
            )
            if not granted:
                self._on_busy(lock, task_id, direct=direct)
            execution.lock = lock
            context.hold(lock)
            try:
                self._report_acquired(lock, task_id)
                # In a worker (and in apply()) Celery's tracer has already pushed this
                # request and task, so Task.__call__ would only push copies (~35 us per
                # task); a plain task gets the same shortcut from the tracer itself.
                # A direct call has no request yet and needs Task.__call__ to push one.
                body = super().__call__ if direct else self.run
                retval = body(*args, **kwargs)
            except BaseException as exc:
                self._finish(execution, lock, exc)
                raise
            self._finish(execution, lock, None)
            return retval
        finally:
            context.end(token)

    def retry(
        self,
        args: Any = None,
        kwargs: Any = None,
        exc: BaseException | None = None,
        throw: bool = True,
        eta: Any = None,
        countdown: Any = None,
        max_retries: int | None = None,
        **options: Any,
    ) -> Any:
        """Celery's retry, publishing the retry message only once the lock is released.

        The task_postrun hook publishes it, after the attempt has unwound, released its
        lock and had its RETRY state stored. When Celery would not publish (a direct
        call, no retries left) or the run is eager, this is Celery's retry unchanged and
        the lock is kept. Why, and what it means for callers: docs/guide/retries.md.
        """
        retry_options = {
            "args": args, "kwargs": kwargs, "exc": exc, "eta": eta,
            "countdown": countdown, "max_retries": max_retries, **options,
        }  # fmt: skip
        execution = context.current_execution()
        lock = execution.lock if execution is not None else None
        if (
            execution is None
            or lock is None
            or not lock.owned()
            or execution.task_id is None  # a direct (or recursive) call: Celery decides
            or self.request.is_eager
            or not self._retry_publishes(max_retries)
        ):
            return super().retry(throw=throw, **retry_options)
        execution.deferred_retry = retry_options
        retry = Retry(
            exc=exc if isinstance(exc, Exception) else None, when=eta or countdown
        )
        if throw:
            raise retry
        return retry

    def _retry_publishes(self, max_retries: int | None) -> bool:
        """Are retries left, so that Celery's retry() will publish? (Its own check; the
        direct-call case is ruled out by the caller.)"""
        limit = self.max_retries if max_retries is None else max_retries
        return limit is None or self.request.retries + 1 <= limit

    # -- outcomes -----------------------------------------------------------------------

    def _on_busy(
        self, lock: AdvisoryLock, task_id: str | None, *, direct: bool
    ) -> None:
        """Apply lock_on_busy to a run whose lock is held. Always raises."""
        options = self._guard().config
        key = lock.key
        request = self.request
        # A direct call has no message to skip or re-queue: whatever the policy, it raises.
        action = (
            OnBusy.RAISE
            if direct and options.on_busy is not OnBusy.WAIT
            else options.on_busy
        )
        if signals.lock_skipped.receivers:
            signals.lock_skipped.send(
                sender=self,
                task_id=task_id,
                task_name=self.name,
                key=key,
                wait_seconds=lock.wait_seconds,
                action=action.value,
            )
        waited = (
            f" after waiting {options.wait_timeout:g}s" if action is OnBusy.WAIT else ""
        )
        message = f"Lock {key.name!r} (key {key}) is held by another run{waited}; {self.name}[{task_id}] did not run."
        logger.info(
            "%s Policy: %s. Database: %s.",
            message,
            action.value,
            db.engine_info(lock.engine)["masked_url"],
            extra={
                **self._log_extra("lock_skipped", lock, task_id),
                "on_busy": action.value,
            },
        )
        busy = exceptions.LockBusy(message, key=str(key), name=key.name)
        if direct:
            raise busy
        if action is OnBusy.SKIP:
            if task_id is not None and not (
                self.ignore_result or request.ignore_result
            ):
                self.update_state(
                    task_id=task_id,
                    state=SKIPPED,
                    meta={
                        "reason": "lock_busy",
                        "lock": key.name,
                        "key": str(key),
                        "task": self.name,
                    },
                )
            raise Ignore(message)
        if action is OnBusy.RETRY:
            if request.is_eager and self.max_retries is None:
                raise busy  # eager retries run inline without the countdown: never spin
            raise self.retry(countdown=options.retry_delay, exc=busy)
        raise busy

    def _report_acquired(self, lock: AdvisoryLock, task_id: str | None) -> None:
        if signals.lock_acquired.receivers:
            signals.lock_acquired.send(
                sender=self, task_id=task_id, task_name=self.name, key=lock.key,
                wait_seconds=lock.wait_seconds,
            )  # fmt: skip
        # Skip building the message and its extras on the hot path unless DEBUG is on.
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug(
                "Acquired lock %s (key %s) for %s[%s] on %s",
                lock.key.name, lock.key, self.name, task_id, db.engine_info(lock.engine)["masked_url"],
                extra=self._log_extra("lock_acquired", lock, task_id),
            )  # fmt: skip

    def _log_extra(
        self, action: str, lock: AdvisoryLock, task_id: str | None
    ) -> dict[str, Any]:
        return {
            "action": action,
            "lock_key": str(lock.key),
            "lock_name": lock.key.name,
            "lock_namespace": self._guard().config.namespace,
            "task_id": task_id,
            "database": db.engine_info(lock.engine)["masked_url"],
        }

    def _finish(
        self,
        execution: context.Execution,
        lock: AdvisoryLock,
        exc: BaseException | None,
    ) -> None:
        """Release ``lock`` (if still held) and report the outcome of the run.

        A retry deferred by self.retry() is not published here but by the task_postrun
        hook: after this release, and after Celery has stored the attempt's RETRY state,
        so a fast retry attempt's own outcome (SUCCESS, SKIPPED) is never overwritten.
        """
        task_id = execution.task_id
        release_error: exceptions.PgLockError | None = None
        if lock.owned():
            release_error = self._release(lock, task_id, commit=exc is None)
        held = (lock.released_at or 0.0) - (lock.acquired_at or 0.0)
        # A session-scope release failure leaves the run's outcome as it was (the body's
        # work is done and the session is closed); lock_release_failed reports it. In
        # transaction scope it means the work was not committed under the lock: a failure.
        failed = exc is not None or (
            release_error is not None and lock.scope is LockScope.TRANSACTION
        )
        state = _state_of(exc) if failed else states.SUCCESS
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug(
                "Lock %s (key %s) of %s[%s]: %s after %.3fs held, on %s",
                lock.key.name, lock.key, self.name, task_id, state, held,
                db.engine_info(lock.engine)["masked_url"],
                extra={**self._log_extra("lock_failed" if failed else "lock_completed", lock, task_id), "state": state},
            )  # fmt: skip
        common = {
            "sender": self, "task_id": task_id, "task_name": self.name, "key": lock.key,
            "wait_seconds": lock.wait_seconds, "held_seconds": held, "state": state,
        }  # fmt: skip
        if not failed:
            if signals.lock_completed.receivers:
                signals.lock_completed.send(**common)
        elif signals.lock_failed.receivers:
            signals.lock_failed.send(exception=exc or release_error, **common)
        if failed and exc is None and release_error is not None:
            # Transaction scope: the body's work was not committed under the lock, so
            # the run must not succeed.
            raise release_error

    def _release(
        self, lock: AdvisoryLock, task_id: str | None, *, commit: bool
    ) -> exceptions.PgLockError | None:
        """Release ``lock``; report (not raise) a failure, which already closed the connection."""
        context.drop(lock)
        try:
            lock.release(commit=commit)
        except exceptions.PgLockError as error:
            logger.error(
                "Releasing lock %s (key %s) of %s[%s] failed: %s. The connection was closed, "
                "so PostgreSQL no longer holds the lock. Database: %s.",
                lock.key.name, lock.key, self.name, task_id, error, db.engine_info(lock.engine)["masked_url"],
                extra=self._log_extra("lock_release_failed", lock, task_id),
            )  # fmt: skip
            if signals.lock_release_failed.receivers:
                signals.lock_release_failed.send(
                    sender=self, task_id=task_id, task_name=self.name, key=lock.key,
                    wait_seconds=lock.wait_seconds, exception=error,
                )  # fmt: skip
            return error
        return None


def _state_of(exc: BaseException | None) -> str:
    if isinstance(exc, Retry):
        return states.RETRY
    if isinstance(exc, Ignore):
        return states.IGNORED
    if isinstance(exc, Reject):
        return states.REJECTED
    return states.FAILURE


#: SingletonTask's own lock_* members that are not options (lock_config, lock_key_for).
_RESERVED = {name for name in vars(SingletonTask) if name.startswith("lock_")} - set(
    config.TASK_OPTIONS
)
