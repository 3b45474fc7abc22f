"""SingletonTask: a Celery task whose body runs under a PostgreSQL advisory lock.

Why each step of a run is where it is: docs/design.md, docs/guide/retries.md."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import inspect
import logging
import os
import time
from typing import TYPE_CHECKING, Any, ClassVar, NoReturn

import celery
from celery import states
from celery.exceptions import Ignore, Reject, Retry
from celery.utils.time import get_exponential_backoff_interval

from celery_pglock import config, exceptions, keys, metrics
from celery_pglock.config import Enqueue, LockScope, OnBusy, OnLost, SkipResult
from celery_pglock.db import driver_errors, engines
from celery_pglock.lock import AdvisoryLock, periods, queued
from celery_pglock.task import busy_policy, enqueue, outcomes
from celery_pglock.watch import loss_watcher

if TYPE_CHECKING:
    from collections.abc import Sequence

    import sqlalchemy as sa


logger = logging.getLogger(__name__)


@dataclasses.dataclass(slots=True, eq=False)
class Execution:
    """One run, in a ContextVar; never keyed by task id (docs/design.md, Decisions)."""

    task_id: str | None
    lock: AdvisoryLock | None = None
    release_at_postrun: bool = False  #: A retry was published: release at task_postrun.
    ended_with: BaseException | None = None  #: The body's exception (None: returned).


_current: contextvars.ContextVar[Execution | None] = contextvars.ContextVar(
    "celery_pglock_execution", default=None
)
_held: set[AdvisoryLock] = set()  #: Locks held here, for the worker-shutdown net.
_held_guard = engines.fork_safe_lock(_held)  # a child holds none of these


def current_lock() -> AdvisoryLock:
    """The lock of the SingletonTask body running in this thread or greenlet.

    In transaction scope, its ``connection`` is the transaction to do the body's work in.

    Raises:
        PgLockError: no SingletonTask body is running here.
    """
    execution = _current.get()
    if execution is None or execution.lock is None:
        raise exceptions.PgLockError(
            "current_lock() was called outside a running SingletonTask body."
        )
    return execution.lock


def current_execution() -> Execution | None:
    return _current.get()


def held_locks() -> list[AdvisoryLock]:
    with _held_guard:
        return list(_held)


class Binding:
    __slots__ = ("conf", "config", "custom_key", "engine_of_pid", "keys")

    def __init__(
        self,
        options: config.LockConfig,
        parameters: Sequence[inspect.Parameter],
        conf: Any,
        custom_key: bool,
    ) -> None:
        self.config = options
        self.conf = conf
        self.keys = keys.CallKeys(
            options.task_name,
            options.namespace,
            options.name,
            parameters,
            options.lock_args,
            options.fixed_key,
        )
        self.custom_key = custom_key  # a subclass overrides lock_key_for
        self.engine_of_pid: tuple[int, sa.Engine] | None = None

    def engine(self) -> sa.Engine:
        cached = self.engine_of_pid
        if cached is not None and cached[0] == os.getpid():
            return cached[1]
        engine = engines.engine_for(self.conf)
        self.engine_of_pid = (os.getpid(), engine)
        return engine


class SingletonTask(celery.Task):  # type: ignore[type-arg]
    """A Celery task that runs at most once at a time per lock key.

    Use it as a base: ``@app.task(base=SingletonTask, lock_args=("tenant_id",))``. Each
    option below may be a decorator keyword, a class attribute of a subclass, or (where
    noted) an app-wide default ``app.conf.pglock_<option without lock_>``. For keys that
    are not plain arguments, override :meth:`lock_key_for` in a subclass.
    """

    #: Parameters whose values form the key (None: one lock per task).
    lock_args: ClassVar[Sequence[str] | str | None] = None
    #: An explicit numeric key: a signed 64-bit int or two signed 32-bit ints.
    lock_id: ClassVar[int | tuple[int, int] | None] = None
    #: The name hashed into the key (default: the task name); shared, it shares a lock.
    lock_name: ClassVar[str | None] = None
    #: Runs of one key at once, 1 (default) to 64 (docs/guide/limits.md).
    lock_limit: ClassVar[int | None] = None
    #: Mixed into every key: separates apps sharing a database. App-wide: yes.
    lock_namespace: ClassVar[str | None] = None
    #: skip (default), raise, retry or wait. App-wide: yes.
    lock_on_busy: ClassVar[OnBusy | str | None] = None
    #: session (default) or transaction. App-wide: yes.
    lock_scope: ClassVar[LockScope | str | None] = None
    #: Seconds before a lock_on_busy='retry' re-run (30). App-wide: yes.
    lock_retry_delay: ClassVar[float | None] = None
    #: Longest lock_on_busy='wait' wait, server-side (10). App-wide: yes.
    lock_wait_timeout: ClassVar[float | None] = None
    #: How a skipped run ends: failure (default) or success. App-wide: yes.
    lock_skip_result: ClassVar[SkipResult | str | None] = None
    #: Shadow mode: try the lock, report, always run the body. App-wide: yes.
    lock_shadow: ClassVar[bool | None] = None
    #: A fencing token per run (docs/guide/fencing.md). App-wide: yes.
    lock_fencing: ClassVar[bool | None] = None
    #: At most one start per key per this many seconds (docs/guide/period.md). App-wide: no.
    lock_period: ClassVar[float | None] = None
    #: Lock lost under the body: terminate (default) or signal. App-wide: yes.
    lock_on_lost: ClassVar[OnLost | str | None] = None
    #: Seconds between checks that the lock is held (1; 0: none). App-wide: yes.
    lock_watch_interval: ClassVar[float | None] = None
    #: Longest one round trip to the lock database (5). App-wide: yes.
    lock_db_timeout: ClassVar[float | None] = None
    #: Keep a key's duplicates out of the queue: until_finished or until_started
    #: (docs/guide/enqueue.md). App-wide: yes.
    lock_enqueue: ClassVar[Enqueue | str | None] = None
    #: A duplicate send returns the queued AsyncResult (return) or raises. App-wide: yes.
    lock_enqueue_on_duplicate: ClassVar[str | None] = None
    #: Lock database down at a send: raise (default) or publish unchecked. App-wide: yes.
    lock_enqueue_on_error: ClassVar[str | None] = None
    #: Seconds past its due time a never-started message holds its key (3600). App-wide: yes.
    lock_enqueue_lost_after: ClassVar[float | None] = None

    _pglock: ClassVar[Binding | None] = None

    @classmethod
    def on_bound(cls, app: celery.Celery) -> None:
        """Validate and freeze the lock options when Celery binds the task to ``app``."""
        super().on_bound(app)
        if exceptions.LockSkipped not in cls.throws:
            # Expected, not an error: INFO without traceback, skipped by Sentry.
            cls.throws = (*cls.throws, exceptions.LockSkipped)
        if cls.name:  # an abstract base has no name and no real run() yet
            cls._pglock = cls._bind(app)
            _refuse_a_shared_queue(cls.name, cls._pglock, app)
            metrics.configure(app.conf)

    @classmethod
    def _bind(cls, app: celery.Celery) -> Binding:
        try:
            parameters = _call_parameters(cls)
        except (TypeError, ValueError) as exc:
            raise exceptions.ConfigurationError(
                f"Task {cls.name!r}: cannot read its signature ({exc})."
            ) from exc
        options = config.resolve(
            task_name=cls.name,
            attributes=_option_attributes(cls),
            conf=app.conf,
            parameters=parameters,
        )
        custom_key = cls.lock_key_for is not SingletonTask.lock_key_for
        return Binding(options, parameters, app.conf, custom_key)

    @property
    def lock_config(self) -> config.LockConfig:
        """The resolved options of this task."""
        return self._binding().config

    def _binding(self) -> Binding:
        binding = type(self)._pglock
        if binding is None:
            binding = type(self)._pglock = type(self)._bind(self.app)
        return binding

    def lock_key_for(self, *args: Any, **kwargs: Any) -> keys.LockKey:
        """The key a call with these arguments locks (no I/O).

        Override it in a subclass for keys that are not plain arguments, e.g.
        ``return celery_pglock.make_key(self.lock_config.namespace,
        self.lock_config.name, material)``; the workers and ``celery pglock key`` then
        both use it.
        """
        return self._binding().keys.key(args, kwargs)

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
        """Celery's apply_async; with lock_enqueue, a duplicate of a queued key returns
        the queued message's AsyncResult instead of publishing (docs/guide/enqueue.md)."""
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
        token = _current.set(execution)
        if not direct:
            request.pglock_execution = execution  # type: ignore[attr-defined]
        options = binding.config
        try:
            lock = self._new_lock(binding, execution, args, kwargs)
            throttle = None
            if self._acquire(options, lock, task_id, direct):
                if options.period is None:
                    return self._run(options, execution, lock, args, kwargs, direct)
                throttle = self._start_period(
                    options, options.period, lock, task_id, direct
                )
                if throttle is None:
                    return self._run(options, execution, lock, args, kwargs, direct)
            if options.shadow:
                return self._run_shadowed(
                    options, execution, lock, task_id, args, kwargs, throttle
                )
            return busy_policy.apply_policy(
                self, lock, task_id, direct=direct, throttle=throttle
            )
        finally:
            _current.reset(token)

    def _new_lock(
        self,
        binding: Binding,
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
        lock = AdvisoryLock(
            engine=binding.engine(),
            key=key,
            scope=options.scope,
            label=options.task_name,
        )
        lock.round_trip_timeout = options.db_timeout
        if options.limit > 1:
            lock.slots = keys.slot_keys(key, options.limit)
        # Before the grant: if a time limit lands before the body, task_postrun frees it.
        execution.lock = lock
        if execution.task_id is not None and self.acks_late:
            # Tells a redelivery of its message that this run goes on (busy_policy.py).
            lock.run_key = keys.run_key(execution.task_id)
        if (
            options.enqueue is not None
            and execution.task_id is not None
            and not self.request.is_eager
        ):
            # The queued row's liveness is this run lock (docs/guide/enqueue.md).
            lock.run_key = keys.run_key(execution.task_id)
            until_started = options.enqueue is Enqueue.UNTIL_STARTED
            lock.queued_row = queued.Queued(
                queued.UNTIL_STARTED if until_started else queued.UNTIL_FINISHED,
                key.pg_locks_ids,
                execution.task_id,
                # A killed run's message is requeued: its key waits for it.
                options.enqueue_lost_after
                if self.acks_late and self.reject_on_worker_lost
                else 0.0,
            )
        return lock

    def _acquire(
        self,
        options: config.LockConfig,
        lock: AdvisoryLock,
        task_id: str | None,
        direct: bool,
    ) -> bool:
        """Take the lock (and its fencing token); False when another run holds it."""
        request = self.request
        # A retry waits (bounded) for its predecessor's lock (docs/guide/retries.md).
        waits = options.on_busy is OnBusy.WAIT or (
            request.retries and not direct and not request.is_eager
        )
        try:
            granted = lock.acquire(
                timeout=options.wait_timeout if waits and not options.shadow else None
            )
            if granted and options.fencing:
                lock.issue_fencing_token()  # releases the lock if it cannot
        except exceptions.DatabaseError as error:
            self._on_database_error(error, direct=direct)
        except exceptions.LockLostError:
            # Lost between grant and token: reported; the run fails without its body.
            outcomes.lost(self, task_id, lock, lock.lost_cause or "unknown")
            raise
        return granted

    def _start_period(
        self,
        options: config.LockConfig,
        period: float,
        lock: AdvisoryLock,
        task_id: str | None,
        direct: bool,
    ) -> periods.Throttle | None:
        """Record this start (lock held); a refused one releases the lock, unless shadowed.
        Under 'wait', a period ending within lock_wait_timeout is waited out."""
        request = self.request
        # The same message going on (a retry, a redelivery), never a reused id sent anew.
        again = not direct and bool(
            request.retries or (request.delivery_info or {}).get("redelivered")
        )
        try:
            throttle = periods.start(lock, task_id, period, again=again)
            if throttle and options.on_busy is OnBusy.WAIT and not options.shadow:
                began = time.monotonic()
                # One budget for both waits: the lock's, then the period's.
                deadline = began + options.wait_timeout - (lock.wait_seconds or 0.0)
                while throttle and throttle.seconds_left <= deadline - time.monotonic():
                    time.sleep(throttle.seconds_left)
                    throttle = periods.start(lock, task_id, period, again=again)
                lock.wait_seconds = (
                    (lock.wait_seconds or 0.0) + time.monotonic() - began
                )
        except BaseException as error:
            self._release_unrun(lock, task_id)  # nothing runs without the check
            if isinstance(error, exceptions.DatabaseError):
                self._on_database_error(error, direct=direct)
            raise
        if throttle is not None and not options.shadow:
            self._release_unrun(lock, task_id)
        return throttle

    def _release_unrun(self, lock: AdvisoryLock, task_id: str | None) -> None:
        try:
            lock.release(commit=False)
        except exceptions.PgLockError as error:
            outcomes.release_failed(self, task_id, lock, error)

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
        with _held_guard:
            _held.add(lock)
        try:
            outcomes.acquired(self, task_id, lock)
            loss_watcher.watch(
                lock, functools.partial(outcomes.lost, self, task_id, lock), options
            )
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
        """Celery's retry, with this run's lock kept until Celery has stored RETRY.

        Published at once; its run waits (bounded) for this lock, freed at task_postrun
        (a direct, eager or last attempt releases as usual). See docs/guide/retries.md.
        """
        execution = _current.get()
        if (
            execution is not None
            and execution.lock is not None
            and execution.lock.owned()
            and execution.task_id is not None  # not a direct (or recursive) call
            and not self.request.is_eager
            and self._retry_publishes(max_retries)
        ):
            execution.release_at_postrun = True
            execution.lock.keep_queued_row()  # the retry is the key's message now
        return super().retry(
            args, kwargs, exc, throw, eta, countdown, max_retries, **options
        )

    def _on_database_error(
        self, error: exceptions.DatabaseError, *, direct: bool
    ) -> NoReturn:
        """Retry as Celery's autoretry_for would (docs/guide/retries.md), else raise: the
        message ends unrun, so its lock_enqueue row is freed, later if the database is down."""
        request = self.request
        if (
            direct
            or request.is_eager  # eager retries run inline, without the countdown
            or not isinstance(error, tuple(getattr(self, "autoretry_for", ())))
            or isinstance(error, tuple(getattr(self, "dont_autoretry_for", ())))
            or not driver_errors.is_transient(error.__cause__)
        ):
            self._free_queued_row_later()
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
            self._free_queued_row_later()
            raise error
        countdown = retry_kwargs.get("countdown", self.default_retry_delay)
        outcomes.database_error(self, request.id, error, countdown, limit)
        try:
            raise self.retry(exc=error, **retry_kwargs)
        finally:
            # retry() left its limit on the task, for later runs; Celery drops it too.
            vars(self).pop("override_max_retries", None)

    def _free_queued_row_later(self) -> None:
        execution = _current.get()
        row = (
            None
            if execution is None or execution.lock is None
            else execution.lock.queued_row
        )
        if row is not None:
            enqueue.free_later(self, row.row, row.task_id)

    def _retry_publishes(self, max_retries: int | None) -> bool:
        """Will Celery's retry() publish (retries left)? Celery's own check."""
        limit = self.max_retries if max_retries is None else max_retries
        return limit is None or self.request.retries + 1 <= limit

    def _body(self, direct: bool) -> Any:
        # A worker's tracer pushed request and task already: Task.__call__ adds ~35 us.
        return super().__call__ if direct else self.run

    def _run_shadowed(
        self,
        options: config.LockConfig,
        execution: Execution,
        lock: AdvisoryLock,
        task_id: str | None,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        throttle: periods.Throttle | None,
    ) -> Any:
        message, details = busy_policy.report(
            self, lock, task_id, options.on_busy, throttle
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
        if throttle is not None:  # the lock is held: only the period is shadowed
            return self._run(options, execution, lock, args, kwargs, task_id is None)
        lock.shadowed = True  # ensure_held() lets the body go on; fenced writes apply
        return self._body(task_id is None)(*args, **kwargs)

    def _end(
        self, execution: Execution, lock: AdvisoryLock, exc: BaseException | None
    ) -> None:
        """Finish now, or at task_postrun after a retry (docs/guide/retries.md)."""
        try:
            loss_watcher.unwatch(lock)  # first: no loss interrupts the body any more
        except exceptions.LockLostError as interrupted:
            # Interrupted as it returned: it ends as interrupted, lock released below.
            exc = exc if exc is not None else interrupted
            loss_watcher.unwatch(lock)
        if execution.release_at_postrun:
            execution.ended_with = exc
            return
        self._finish_run(execution, lock, exc)

    def _finish_run(
        self, execution: Execution, lock: AdvisoryLock, exc: BaseException | None
    ) -> None:
        if lock.owner_pid is not None and lock.owner_pid != os.getpid():
            return  # a forked child's copy of the run: lock and outcome are the parent's
        task_id = execution.task_id
        # Lost: fails the run; a body's own error is kept, a bare LockLostError replaced.
        lost_error: exceptions.LockLostError | None = None
        if lock.lost and (exc is None or type(exc) is exceptions.LockLostError):
            lost_error = lock.lost_error()
        release_error: exceptions.PgLockError | None = None
        if lock.owned():
            with _held_guard:
                _held.discard(lock)
            try:
                lock.release(commit=exc is None and not lock.lost)
            except exceptions.PgLockError as error:
                if not lock.lost:  # a lost lock's release fails; lock_lost said it all
                    outcomes.release_failed(self, task_id, lock, error)
                release_error = error
        # The outcome per scope: docs/operations/failure-modes.md (Release fails).
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
            raise release_error  # transaction scope: nothing was committed


def after_task(task: Any = None, retval: Any = None, **_: Any) -> None:
    """task_postrun: release a retried run's lock, or a leftover one (docs/design.md)."""
    if isinstance(retval, exceptions.LockSkipped):
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
    with _held_guard:
        _held.discard(lock)
    try:
        lock.release(commit=False)
    except exceptions.PgLockError:
        logger.exception(
            "Releasing leftover lock %s failed; PostgreSQL no longer holds it", lock.key
        )


def _refuse_a_shared_queue(name: str, binding: Binding, app: celery.Celery) -> None:
    """Two lock_enqueue tasks on one key would share its queued row: a send of one would
    return the other's message, and its own work would never run."""
    mine = binding.config
    if mine.enqueue is None or binding.custom_key:
        return
    # The registry itself: app.tasks would finalize the app (refused under autofinalize=False).
    registry: dict[str, Any] = getattr(app, "_tasks", None) or {}
    for other in list(registry.values()):
        theirs = getattr(type(other), "_pglock", None)
        if (
            not isinstance(theirs, Binding)
            or other.name == name
            or theirs.config.enqueue is None
            or theirs.custom_key
        ):
            continue
        if (theirs.config.namespace, theirs.config.name, theirs.config.fixed_key) == (
            mine.namespace,
            mine.name,
            mine.fixed_key,
        ):
            raise exceptions.ConfigurationError(
                f"Tasks {other.name!r} and {name!r} both use lock_enqueue on lock "
                f"{mine.name!r} (namespace {mine.namespace!r}): a send of one would "
                "return the other's queued message, and its own work would never run. "
                "Give each task its own lock_name, or set lock_enqueue on one of them "
                "only (docs/guide/enqueue.md)."
            )


def _option_attributes(cls: type) -> dict[str, Any]:
    """Set ``lock_*`` and peer options, unwrapped; config.resolve() refuses the peers'."""
    found: dict[str, Any] = {}
    for klass in reversed(cls.__mro__):
        for name in vars(klass):
            if (
                name.startswith("lock_")
                and (name in config.TASK_OPTIONS or name not in _RESERVED)
            ) or name in config.PEER_OPTIONS:
                value = inspect.getattr_static(cls, name)
                if isinstance(value, staticmethod):
                    value = value.__func__
                if value is not None:
                    found[name] = value
                else:
                    found.pop(name, None)
    return found


def _call_parameters(cls: type) -> list[inspect.Parameter]:
    run = inspect.getattr_static(cls, "run")
    if isinstance(run, staticmethod):  # @app.task without bind=True
        return list(inspect.signature(run.__func__).parameters.values())
    return list(inspect.signature(run).parameters.values())[1:]  # bind=True, a class


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
