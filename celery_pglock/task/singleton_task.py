"""SingletonTask: a Celery task whose body runs under a PostgreSQL advisory lock.

Why each step of a run is where it is: docs/design.md, docs/guide/retries.md."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
from typing import TYPE_CHECKING, Any, ClassVar

import celery

from celery_pglock import celery_compat, config, exceptions, keys
from celery_pglock.config import Enqueue, LockScope, OnBusy, OnLost, SkipResult
from celery_pglock.fencing import tokens as fencing_tokens
from celery_pglock.lock import AdvisoryLock
from celery_pglock.task import (
    bindings,
    busy_policy,
    enqueue,
    groups,
    outcomes,
    periods,
    queued,
    replacing,
    retries,
    runs,
)
from celery_pglock.watch import loss_watcher

if TYPE_CHECKING:
    from collections.abc import Sequence

    import sqlalchemy as sa


logger = logging.getLogger(__name__)


@dataclasses.dataclass(slots=True, eq=False)
class Execution:
    """One run of a SingletonTask, in runs.current (a ContextVar)."""

    task_id: str | None
    lock: AdvisoryLock | None = None
    group_lock: AdvisoryLock | None = None  #: lock_group: the group's slot, held.
    release_at_postrun: bool = False  #: A retry was published: release at task_postrun.
    ended_with: BaseException | None = None  #: The body's exception (None: returned).


class SingletonTask(celery.Task):  # type: ignore[type-arg]
    """A Celery task that runs at most once at a time per lock key.

    Use it as a base: ``@app.task(base=SingletonTask, lock_args=("tenant_id",))``. Each
    ``lock_*`` option below is a decorator keyword or a class attribute of a subclass;
    its meaning, default and app-wide setting: docs/reference/options.md.
    """

    lock_args: ClassVar[Sequence[str] | str | None] = None
    lock_id: ClassVar[int | tuple[int, int] | None] = None
    lock_name: ClassVar[str | None] = None
    lock_limit: ClassVar[int | None] = None
    lock_namespace: ClassVar[str | None] = None
    lock_on_busy: ClassVar[OnBusy | str | None] = None
    lock_scope: ClassVar[LockScope | str | None] = None
    lock_retry_delay: ClassVar[float | None] = None
    lock_wait_timeout: ClassVar[float | None] = None
    lock_skip_result: ClassVar[SkipResult | str | None] = None
    lock_shadow: ClassVar[bool | None] = None
    lock_fencing: ClassVar[bool | None] = None
    lock_period: ClassVar[float | None] = None
    lock_rate: ClassVar[str | tuple[int, float] | None] = None
    lock_group: ClassVar[str | None] = None
    lock_group_limit: ClassVar[int | None] = None
    lock_debounce: ClassVar[float | None] = None
    lock_debounce_max: ClassVar[float | None] = None
    lock_on_lost: ClassVar[OnLost | str | None] = None
    lock_watch_interval: ClassVar[float | None] = None
    lock_db_timeout: ClassVar[float | None] = None
    lock_enqueue: ClassVar[Enqueue | str | None] = None
    lock_enqueue_on_duplicate: ClassVar[str | None] = None
    lock_enqueue_on_error: ClassVar[str | None] = None
    lock_enqueue_lost_after: ClassVar[float | None] = None

    _pglock: ClassVar[bindings.Binding | None] = None

    @classmethod
    def on_bound(cls, app: celery.Celery) -> None:
        """Validate and freeze the lock options when Celery binds the task to ``app``."""
        super().on_bound(app)
        # Expected, not errors: INFO without traceback, skipped by Sentry.
        expected = (exceptions.LockSkipped, exceptions.TaskReplaced)
        cls.throws = (*cls.throws, *(e for e in expected if e not in cls.throws))
        if cls.name:  # an abstract base has no name and no real run() yet
            cls._pglock = cls._bind(app)
            bindings.settle(cls.name, cls._pglock, app)

    @classmethod
    def _bind(cls, app: celery.Celery) -> bindings.Binding:
        return bindings.bind(
            cls,
            app,
            custom_key=cls.lock_key_for is not SingletonTask.lock_key_for,
            custom_limit=cls.lock_limit_for is not SingletonTask.lock_limit_for,
            reserved=_RESERVED,
        )

    @property
    def lock_config(self) -> config.LockConfig:
        """The resolved options of this task."""
        return self._binding().config

    def locks_engine(self) -> sa.Engine:
        """This process's engine for its locks (not ``lock_*``: those are options)."""
        return self._binding().engine()

    def _binding(self) -> bindings.Binding:
        binding = type(self)._pglock
        if binding is None:
            binding = type(self)._pglock = type(self)._bind(self.app)
        return binding

    def lock_key_for(self, *args: Any, **kwargs: Any) -> keys.LockKey:
        """The key a call with these arguments locks (no I/O); override it for keys that
        are not plain arguments (docs/guide/keys.md)."""
        return self._binding().keys.key(args, kwargs)

    def lock_limit_for(self, *args: Any, **kwargs: Any) -> int:
        """How many runs of the call's key may run at once (no I/O): ``lock_limit``;
        override it for limits that differ per key, such as tiers (docs/guide/limits.md)."""
        return self.lock_config.limit

    def apply_async(
        self,
        args: Any = None,
        kwargs: Any = None,
        task_id: str | None = None,
        producer: Any = None,
        link: Any = None,
        link_error: Any = None,
        shadow: str | None = None,
        **options: Any,
    ) -> Any:
        """Celery's apply_async, checked by lock_enqueue first (docs/guide/enqueue.md)."""
        options.update(
            producer=producer, link=link, link_error=link_error, shadow=shadow
        )
        if self._binding().config.enqueue is None or self.app.conf.task_always_eager:
            return super().apply_async(args, kwargs, task_id, **options)
        send = super().apply_async
        return enqueue.publish(self, send, args, kwargs, task_id, options)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        binding = self._binding()
        request = self.request
        # Already a run on this request: the body called its own task (a direct call).
        direct = (
            request.called_directly
            or getattr(request, "pglock_execution", None) is not None
        )
        task_id = None if direct else request.id
        execution = Execution(task_id)
        token = runs.current.set(execution)
        unfenced = fencing_tokens.unfenced
        outer_unfenced = unfenced.get()  # True in a shadowed body: a run in it fences
        if outer_unfenced:
            unfenced.set(False)
        if not direct:
            request.pglock_execution = execution  # type: ignore[attr-defined]
        options = binding.config
        try:
            lock = self._new_lock(binding, execution, args, kwargs)
            throttle = group = None
            # A retry waits (bounded) for its predecessor's lock (docs/guide/retries.md).
            waits = not options.shadow and bool(
                options.on_busy is OnBusy.WAIT
                or (request.retries and not direct and not request.is_eager)
            )
            # A redelivery beside its running first delivery is busy (busy_policy.py).
            granted = not (
                self.acks_late
                and (waits or len(lock.slots) > 1)
                and busy_policy.first_delivery_runs(self, lock, task_id, direct, waits)
            ) and self._acquire(options, lock, task_id, direct, waits)
            # A wait gave a killed first delivery's key time to be freed; a try did not.
            if (
                not granted
                and not waits
                and busy_policy.first_delivery_ended(self, lock, task_id, direct=direct)
            ):
                granted = self._acquire(options, lock, task_id, direct, waits)
            if granted:
                if options.group is not None:  # first: a full group records no start
                    group = groups.take(self, options, execution, lock, direct)
                if group is None and options.rate is not None:
                    throttle = periods.start_run(self, options, lock, task_id, direct)
                if throttle is None and group is None:
                    if options.rate is not None or options.group is not None:
                        queued.start_deferred(self, lock)  # kept through their checks
                    return self._run(options, execution, lock, args, kwargs, direct)
            if not options.shadow:
                return busy_policy.apply_policy(
                    self, lock, task_id, direct=direct, throttle=throttle, group=group
                )
            message, details = busy_policy.report(
                self, lock, task_id, options.on_busy, throttle, group
            )
            outcomes.skipped(
                self,
                task_id,
                lock,
                action=options.on_busy.value,
                message=message,
                details=details,
                celery_logs=False,
                shadow=True,
            )
            if throttle or group:  # the key is held: only the rate or group is shadowed
                return self._run(
                    options, execution, lock, args, kwargs, task_id is None
                )
            lock.shadowed = True  # ensure_held() lets the body go on
            unfenced.set(True)  # its fenced writes apply, token=None
            return self._body(task_id is None)(*args, **kwargs)
        finally:
            if direct:  # no task_postrun of its own: its net is here
                runs.release_direct_leftover(execution)
            if execution.group_lock is not None:  # its run may not have started
                groups.release_unrun(self, execution)
            if unfenced.get() is not outer_unfenced:
                unfenced.set(outer_unfenced)
            runs.current.reset(token)

    def _new_lock(
        self,
        binding: bindings.Binding,
        execution: Execution,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> AdvisoryLock:
        options = binding.config
        key = (
            self.lock_key_for(*args, **kwargs)
            if binding.custom_key
            else binding.keys.key(args, kwargs)
        )
        cached = binding.engine_of_pid  # its engine, made once per process
        lock = AdvisoryLock(
            engine=cached[1]
            if cached and cached[0] == os.getpid()
            else binding.engine(),
            key=key,
            scope=options.scope,
            label=options.task_name,
        )
        lock.round_trip_timeout = options.db_timeout
        limit = options.limit
        if binding.custom_limit:
            limit = bindings.limit_of(self, options, args, kwargs)
        if limit > 1:
            lock.slots = keys.slot_keys(key, limit)
        if options.group is not None:
            lock.companions = groups.companions(options, limit)
        # Before the grant: if a time limit lands before the body, task_postrun frees it.
        execution.lock = lock
        if (task_id := execution.task_id) is not None:
            enqueues = options.enqueue is not None and not self.request.is_eager
            if self.acks_late or enqueues or limit > 1:
                # Says this run goes on: to a redelivery, the queued row, a retry of a
                # lock_limit key waiting for it (busy_policy.py, retries.py).
                lock.run_key = keys.run_key(task_id)
            if enqueues:
                requeued = bool(self.acks_late and self.reject_on_worker_lost)
                lock.rider = queued.rider_for(options, key, task_id, requeued=requeued)
        return lock

    def _acquire(
        self,
        options: config.LockConfig,
        lock: AdvisoryLock,
        task_id: str | None,
        direct: bool,
        waits: bool,
    ) -> bool:
        """Take the lock (a carrier: hand over), waiting if ``waits``; False if held."""
        timeout = options.wait_timeout if waits else None
        if timeout is not None and task_id is not None and self.request.retries:
            timeout = retries.wait_for_predecessor(lock, timeout)
        try:
            granted = lock.acquire(timeout=timeout)
            if granted and options.enqueue_on_duplicate is config.OnDuplicate.REPLACE:
                replacing.end_if_replaced(self, lock, task_id)
            if granted and options.fencing:
                fencing_tokens.issue_token(lock)  # releases the lock if it cannot
        except exceptions.DatabaseError as error:
            retries.on_database_error(self, error, direct=direct)
        except exceptions.LockLostError:
            # Lost between grant and token: reported; the run fails without its body.
            outcomes.lost(self, task_id, lock, lock.lost_cause or "unknown")
            raise
        return granted

    def _run(
        self,
        options: config.LockConfig,
        execution: Execution,
        lock: AdvisoryLock,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        direct: bool,
    ) -> Any:
        task_id = execution.task_id
        with runs.held_guard:
            runs.held.add(lock)
        try:
            outcomes.acquired(self, task_id, lock)
            loss_watcher.watch(
                lock, functools.partial(outcomes.lost, self, task_id, lock), options
            )
            if execution.group_lock is not None:
                groups.watch(self, execution, lock, options)
            retval = self._body(direct)(*args, **kwargs)
        except BaseException as exc:
            self._end(execution, lock, exc)
            raise
        self._end(execution, lock, None)
        return retval

    def retry(
        self,
        args: Any = None,
        kwargs: Any = None,
        exc: Exception | None = None,
        throw: bool = True,
        eta: Any = None,
        countdown: Any = None,
        max_retries: int | None = None,
        **options: Any,
    ) -> Any:
        """Celery's retry, published at once, with this run's lock kept until Celery has
        stored RETRY (docs/guide/retries.md)."""
        retries.keep_lock_for_the_retry(self, max_retries)
        return super().retry(
            args, kwargs, exc, throw, eta, countdown, max_retries, **options
        )

    def _body(self, direct: bool) -> Any:
        if direct or not celery_compat.TRACER_KEEPS_REQUEST:
            return super().__call__
        return self.run

    def _end(
        self,
        execution: Execution,
        lock: AdvisoryLock,
        exc: BaseException | None,
    ) -> None:
        """Finish now, or at task_postrun after a retry (docs/guide/retries.md)."""
        for watched in filter(None, (lock, execution.group_lock)):
            try:
                loss_watcher.unwatch(watched)  # first: no loss interrupts the body now
            except exceptions.LockLostError as interrupted:
                exc = exc or interrupted  # interrupted as it returned: released below
                loss_watcher.unwatch(watched)
        if execution.release_at_postrun:
            execution.ended_with = exc
            return
        self._finish_run(execution, lock, exc)

    def _finish_run(
        self,
        execution: Execution,
        lock: AdvisoryLock,
        exc: BaseException | None,
    ) -> None:
        if lock.owner_pid is not None and lock.owner_pid != os.getpid():
            return  # a forked child's copy of the run: lock and outcome are the parent's
        task_id = execution.task_id
        # Lost: fails the run; a body's own error is kept, a bare LockLostError replaced.
        lost_error: exceptions.LockLostError | None = None
        group = execution.group_lock
        lost = (
            lock if lock.lost else group if group is not None and group.lost else None
        )
        if lost is not None and (exc is None or type(exc) is exceptions.LockLostError):
            lost_error = lost.lost_error()
        release_error: exceptions.PgLockError | None = None
        if lock.owned():
            with runs.held_guard:
                runs.held.discard(lock)
            try:
                lock.release(commit=exc is None and lost is None)
            except exceptions.PgLockError as error:
                if not lock.lost:  # a lost lock's release fails; lock_lost said it all
                    outcomes.release_failed(self, task_id, lock, error)
                release_error = error
        if group is not None:
            groups.release(self, execution)
        # The outcome per scope: docs/operations/failure-modes.md (Release fails).
        failed = (
            exc is not None
            or lost_error is not None
            or (release_error is not None and lock.scope is LockScope.TRANSACTION)
        )
        outcomes.released(
            self,
            task_id,
            lock,
            failed=failed,
            exception=lost_error or exc or release_error,
        )
        if lost_error is not None:
            raise lost_error from exc
        if failed and exc is None and release_error is not None:
            raise release_error  # transaction scope: nothing was committed


#: SingletonTask's own lock_* members that are not options (lock_config, lock_key_for).
_RESERVED = {name for name in vars(SingletonTask) if name.startswith("lock_")} - set(
    config.TASK_OPTIONS
)


def after_task(task: Any = None, retval: Any = None, **_: Any) -> None:
    """task_postrun: release a retried run's lock, or a leftover one (docs/design.md)."""
    if isinstance(retval, (exceptions.LockSkipped, exceptions.TaskReplaced)):
        # Celery's frame clearing misses a skip's fixed frame: ~30 objects left per skip.
        retval.__traceback__ = None
    request: Any = getattr(task, "request", None)
    execution = getattr(request, "pglock_execution", None)
    if execution is None:
        return
    # The request is done with: a nested call can no longer be mistaken for this run.
    request.pglock_execution = None
    lock = execution.lock
    if execution.release_at_postrun and lock is not None:
        execution.release_at_postrun = False
        # Reported as lock_release_failed; a signal receiver cannot fail the task.
        with contextlib.suppress(exceptions.PgLockError):
            task._finish_run(execution, lock, execution.ended_with)
    elif lock is not None and lock.owned():
        # An interrupt ended the run before _end could stop watching and release.
        for watched in filter(None, (lock, execution.group_lock)):
            loss_watcher.unwatch(watched)
        runs.release_leftover(lock, f"task_postrun of {execution.task_id}")
    if execution.group_lock is not None:
        groups.release_leftover(execution)
