"""SingletonTask: a Celery task whose body runs under a PostgreSQL advisory lock.

Where things happen, and why there (each line is a bug in an existing library):

- The lock is taken in ``__call__``, the task's own call path, not in ``task_prerun``:
  Celery swallows exceptions raised by signal receivers, so a receiver cannot stop a
  duplicate. Being worker-side, it also covers ``send_task``, beat without the task
  imported, and producers in other services.
- The lock is released by ``__call__`` itself, around the body, for every outcome
  (SUCCESS, FAILURE, IGNORED, REJECTED) and *before* Celery stores the result and sends
  chain callbacks: a client that saw the result can send the next run at once.
  ``task_postrun`` (per execution, never by task id) and worker shutdown are idempotent
  safety nets (see ``worker_hooks.py``). A killed pool child needs no hook: its session ends
  and PostgreSQL frees the lock.
- ``self.retry()`` publishes the retry at once; the attempt keeps its lock until
  ``task_postrun``, after Celery stored RETRY, and the retry's run waits for it, bounded
  (see :meth:`SingletonTask.retry` and docs/guide/retries.md).
- A skipped run never runs its body and ends at once for its caller, as
  ``lock_skip_result`` says: by default FAILURE with ``LockSkipped`` (listed in the
  task's ``throws``: logged at INFO without a traceback, ignored by error trackers), so
  ``get()`` returns, monitors get a terminal event and chains and chords end. See
  docs/guide/skipped-results.md for the alternatives and their effect on canvases.
- Outcomes are reported (signals, log, metrics) by ``outcomes.py``; this module (and
  ``busy_policy.py``, for a run whose lock is held) only decides them.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from typing import TYPE_CHECKING, Any, ClassVar, NoReturn

import celery
from celery import states
from celery.exceptions import Ignore, Reject, Retry
from celery.utils.time import get_exponential_backoff_interval

from celery_pglock import config, exceptions, keys, metrics
from celery_pglock.config import LockScope, OnBusy, SkipResult
from celery_pglock.db import driver_errors
from celery_pglock.lock import AdvisoryLock
from celery_pglock.task import binding, busy_policy, context, outcomes
from celery_pglock.watch import loss_watcher

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence


logger = logging.getLogger(__name__)


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
    #: How a skipped run ends: failure (default) or success. App: pglock_skip_result.
    #: See docs/guide/skipped-results.md.
    lock_skip_result: ClassVar[SkipResult | str | None] = None
    #: Shadow mode: try the lock and report every outcome, but always run the body.
    #: App: pglock_shadow.
    lock_shadow: ClassVar[bool | None] = None
    #: Give each run a fencing token (current_lock().fencing_token), one statement more
    #: per acquisition. App: pglock_fencing. See docs/guide/fencing.md.
    lock_fencing: ClassVar[bool | None] = None

    _pglock: ClassVar[binding.Guard | None] = None

    @classmethod
    def on_bound(cls, app: celery.Celery) -> None:
        """Validate and freeze the lock options when Celery binds the task to ``app``."""
        super().on_bound(app)
        if exceptions.LockSkipped not in cls.throws:
            # An expected outcome, not an error: Celery logs it at INFO without a
            # traceback, and error trackers (Sentry's Celery integration) skip it.
            cls.throws = (*cls.throws, exceptions.LockSkipped)
        if cls.name:  # an abstract base has no name and no real run() yet
            cls._pglock = cls._build_guard(app)
            metrics.configure(app.conf)

    @classmethod
    def _build_guard(cls, app: celery.Celery) -> binding.Guard:
        try:
            parameters = binding.call_parameters(cls)
        except (TypeError, ValueError) as exc:
            raise exceptions.ConfigurationError(
                f"Task {cls.name!r}: cannot read its signature ({exc})."
            ) from exc
        options = config.resolve(
            task_name=cls.name,
            attributes=binding.option_attributes(cls, _RESERVED),
            conf=app.conf,
            parameters=parameters,
        )
        return binding.Guard(options, parameters, app.conf)

    @property
    def lock_config(self) -> config.LockConfig:
        """The resolved options of this task."""
        return self._guard().config

    def _guard(self) -> binding.Guard:
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
        # A body calling its own task directly, itself or through other tasks' direct
        # calls, finds the running message's request on the task's stack, already
        # carrying that run's execution: it is the direct call it looks like, not a
        # second run of that message (which would take over its request).
        direct = (
            request.called_directly
            or getattr(request, "pglock_execution", None) is not None
        )
        task_id: str | None = None if direct else request.id
        execution, token = context.begin(task_id)
        if not direct:
            # task_postrun finds this execution's lock on the tracer's request: per
            # execution and per thread, never by task id (see context.py).
            request.pglock_execution = execution  # type: ignore[attr-defined]
        try:
            key = guard.key(args, kwargs)
            lock = AdvisoryLock(
                engine=guard.engine(),
                key=key,
                scope=options.scope,
                label=options.task_name,
            )
            lock.round_trip_timeout = options.db_timeout
            # Known to the execution before it is granted: if an exception (a soft time
            # limit) lands between the grant and the body, task_postrun still finds the
            # lock owned and releases it.
            execution.lock = lock
            if task_id is not None and self.acks_late:
                # Its message may be redelivered while this run goes on: the run lock
                # tells that redelivery so (see busy_policy.py).
                lock.run_key = keys.run_key(task_id)
            # A retry's run may find its predecessor still unwinding (it keeps its lock
            # until Celery stored RETRY, see retry()): it waits for it, bounded. An
            # eager retry's predecessor released its lock before retrying: no wait.
            waits = options.on_busy is OnBusy.WAIT or (
                request.retries and not direct and not request.is_eager
            )
            try:
                granted = lock.acquire(
                    timeout=options.wait_timeout
                    if waits and not options.shadow
                    else None
                )
                if granted and options.fencing:
                    lock.issue_fencing_token()  # releases the lock if it cannot
            except exceptions.DatabaseError as error:
                return self._on_database_error(error, direct=direct)
            except exceptions.LockLostError:
                # Lost between the grant and the token: reported like any loss, and the
                # run fails without its body (another run may hold the key now).
                outcomes.lost(self, task_id, lock, lock.lost_cause or "unknown")
                raise
            if not granted:
                if options.shadow:
                    return self._run_shadowed(execution, lock, task_id, args, kwargs)
                return busy_policy.apply_policy(self, lock, task_id, direct=direct)
            context.hold(lock)
            try:
                outcomes.acquired(self, task_id, lock)
                # Lock loss: watched while the body runs (loss_watcher.py); no-op if disabled.
                loss_watcher.watch(
                    lock,
                    functools.partial(outcomes.lost, self, task_id, lock),
                    options,
                )
                # In a worker (and in apply()) Celery's tracer has already pushed this
                # request and task, so Task.__call__ would only push copies (~35 us per
                # task); a plain task gets the same shortcut from the tracer itself.
                # A direct call has no request yet and needs Task.__call__ to push one.
                body = super().__call__ if direct else self.run
                retval = body(*args, **kwargs)
            except BaseException as exc:
                self._end(execution, lock, exc)
                raise
            self._end(execution, lock, None)
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
        """Celery's retry, with this run's lock kept until Celery has stored RETRY.

        The retry message is published at once, as Celery does, so a worker killed
        after ``self.retry()`` loses no retry. This run then keeps its lock until the
        task_postrun hook, after Celery has stored the attempt's RETRY state, and the
        retry's run waits (up to ``lock_wait_timeout``) for it rather than being
        skipped by its own predecessor. When Celery would not publish (a direct call,
        no retries left) or the run is eager, the lock is released as usual, once the
        body has handled the exception. Why, and what it means for callers:
        docs/guide/retries.md.
        """
        retry_options = {
            "args": args,
            "kwargs": kwargs,
            "exc": exc,
            "eta": eta,
            "countdown": countdown,
            "max_retries": max_retries,
            **options,
        }
        execution = context.current_execution()
        lock = execution.lock if execution is not None else None
        if (
            execution is not None
            and lock is not None
            and lock.owned()
            and execution.task_id is not None  # not a direct (or recursive) call
            and not self.request.is_eager
            and self._retry_publishes(max_retries)
        ):
            execution.release_at_postrun = True
        return super().retry(throw=throw, **retry_options)

    def _on_database_error(
        self, error: exceptions.DatabaseError, *, direct: bool
    ) -> NoReturn:
        """The lock database failed at acquire: retry as Celery's autoretry_for would
        retry the body (docs/guide/retries.md), else fail. The body never ran."""
        request = self.request
        # Celery's autoretry wraps run(); the acquire is in __call__, before run(), so
        # its rule (celery/app/autoretry.py) is applied here. A misconfiguration (a
        # wrong password) is not an outage: never retried, as its message says.
        if (
            direct
            or request.is_eager  # eager retries run inline, without the countdown
            or not isinstance(error, tuple(getattr(self, "autoretry_for", ())))
            or isinstance(error, tuple(getattr(self, "dont_autoretry_for", ())))
            or not driver_errors.is_transient(error.__cause__)
        ):
            raise error
        retry_kwargs = dict(getattr(self, "retry_kwargs", {}))
        backoff = float(getattr(self, "retry_backoff", False))
        if backoff:
            retry_kwargs["countdown"] = get_exponential_backoff_interval(
                factor=int(max(1.0, backoff)),
                retries=request.retries,
                maximum=int(getattr(self, "retry_backoff_max", 600)),
                full_jitter=getattr(self, "retry_jitter", True),
            )
        limit = retry_kwargs.get("max_retries", self.max_retries)
        if not self._retry_publishes(limit):
            raise error
        countdown = retry_kwargs.get("countdown", self.default_retry_delay)
        outcomes.database_error(self, request.id, error, countdown, limit)
        try:
            raise self.retry(exc=error, **retry_kwargs)
        finally:
            # retry(max_retries=...) leaves the limit on the task object, where it
            # would apply to every later run in this process (Celery drops it too).
            vars(self).pop("override_max_retries", None)

    def _retry_publishes(self, max_retries: int | None) -> bool:
        """Are retries left, so that Celery's retry() will publish? (Its own check; the
        direct-call case is ruled out by the caller.)"""
        limit = self.max_retries if max_retries is None else max_retries
        return limit is None or self.request.retries + 1 <= limit

    def _run_shadowed(
        self,
        execution: context.Execution,
        lock: AdvisoryLock,
        task_id: str | None,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        """Shadow mode, lock busy: report the would-be outcome, then run the body unlocked."""
        action = self._guard().config.on_busy
        message, details = busy_policy.report(self, lock, task_id, action)
        outcomes.skipped(
            self,
            task_id,
            lock,
            action=action.value,
            message=message,
            details=details,
            celery_logs=False,
            shadow=True,
        )
        # current_lock() answers with the lock that was tried: owned() is False.
        lock.shadowed = True  # ensure_held() lets the body go on; fenced writes apply
        execution.lock = lock
        body = super().__call__ if execution.task_id is None else self.run
        return body(*args, **kwargs)

    def _end(
        self,
        execution: context.Execution,
        lock: AdvisoryLock,
        exc: BaseException | None,
    ) -> None:
        """The body has ended: finish now, or at task_postrun if it published a retry.

        A run that published a retry keeps its lock until Celery has stored its RETRY
        state, so the retry's own outcome can never be overwritten by it; the
        task_postrun hook then calls :meth:`_finish_run`.
        """
        try:
            # First: a loss found from now on never interrupts the body.
            loss_watcher.unwatch(lock)
        except exceptions.LockLostError as interrupted:
            # lock_on_lost='terminate' interrupted the body just as it returned: the run
            # ends as an interrupted one, and its lock is still released below.
            exc = exc if exc is not None else interrupted
            loss_watcher.unwatch(lock)
        if execution.release_at_postrun:
            execution.ended_with = exc
            return
        self._finish_run(execution, lock, exc)

    def _finish_run(
        self,
        execution: context.Execution,
        lock: AdvisoryLock,
        exc: BaseException | None,
    ) -> None:
        """Release ``lock`` (if still held) and report the outcome of the run.

        Internal: called when the body ends, or by the task_postrun hook (see _end).
        """
        if lock.owner_pid is not None and lock.owner_pid != os.getpid():
            return  # a forked child's copy of the run: lock and outcome are the parent's
        task_id = execution.task_id
        # A lost lock (lock_lost was reported) fails a run that would otherwise succeed
        # or that ended with lock_on_lost='terminate''s bare LockLostError; the body's
        # own exception, if any, is kept. Its transaction is rolled back, not committed.
        lost_error: exceptions.LockLostError | None = None
        if lock.lost and (exc is None or type(exc) is exceptions.LockLostError):
            lost_error = lock.lost_error()
        release_error: exceptions.PgLockError | None = None
        if lock.owned():
            release_error = self._release(
                lock, task_id, commit=exc is None and not lock.lost
            )
        # A session-scope release failure leaves the run's outcome as it was: the body's
        # work is done, and the lock is gone either way (a failed round trip ended its
        # session; an unlock PostgreSQL refused held nothing); lock_release_failed
        # reports it. In
        # transaction scope it means the work was not committed under the lock: a failure.
        failed = (
            exc is not None
            or lost_error is not None
            or (release_error is not None and lock.scope is LockScope.TRANSACTION)
        )
        state = _state_of(exc) if failed else states.SUCCESS
        outcomes.released(
            self,
            task_id,
            lock,
            state=state,
            failed=failed,
            exception=lost_error or exc or release_error,
        )
        if lost_error is not None:
            raise lost_error from exc
        if failed and exc is None and release_error is not None:
            # Transaction scope: the body's work was not committed under the lock, so
            # the run must not succeed.
            raise release_error

    def _release(
        self, lock: AdvisoryLock, task_id: str | None, *, commit: bool
    ) -> exceptions.PgLockError | None:
        """Release ``lock``; a failure is reported (lock_release_failed) and returned."""
        context.drop(lock)
        try:
            lock.release(commit=commit)
        except exceptions.PgLockError as error:
            if not lock.lost:  # a lost lock's release fails; lock_lost said it all
                outcomes.release_failed(self, task_id, lock, error)
            return error
        return None


def after_task(task: Any = None, retval: Any = None, **_: Any) -> None:
    """task_postrun: release a retried run's lock now that Celery stored RETRY, or a
    leftover one (docs/guide/retries.md)."""
    if isinstance(retval, exceptions.LockSkipped):
        # Celery breaks the cycle between a failure and the tracer's frame (which holds
        # it) by clearing the frames of exc.__traceback__; a skip answers that with its
        # fixed frame, so the frames it unwound are dropped here, or each skip would
        # leave ~30 objects (its lock, execution, frames) to the cyclic collector.
        retval.__traceback__ = None
    request: Any = getattr(task, "request", None)
    execution = getattr(request, "pglock_execution", None)
    if execution is None:
        return
    # The request is done with: a nested call can no longer be mistaken for this run.
    request.pglock_execution = None
    lock = execution.lock
    if execution.release_at_postrun and lock is not None:
        # The run published a retry; Celery has now stored its RETRY state.
        execution.release_at_postrun = False
        # A release failure is reported as lock_release_failed; a signal receiver
        # cannot fail the task any more.
        with contextlib.suppress(exceptions.PgLockError):
            task._finish_run(execution, lock, execution.ended_with)
        return
    if lock is not None and lock.owned():
        release_leftover(lock, f"task_postrun of {execution.task_id}")


def release_leftover(lock: AdvisoryLock, where: str) -> None:
    """A lock still held where its run has ended (a safety net): release it, loudly."""
    logger.warning(
        "Lock %s (key %s) was still held at %s; releasing it",
        lock.key.name,
        lock.key,
        where,
        extra={"action": "lock_leftover_released", "lock_key": str(lock.key)},
    )
    context.drop(lock)
    try:
        lock.release(commit=False)
    except exceptions.PgLockError:
        logger.exception(
            "Releasing leftover lock %s failed; its connection was closed", lock.key
        )


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
