"""The celery-pglock error tree (docs/reference/exceptions.md); imports nothing of the
package. Each class's docstring is its default message."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Mapping
    from types import TracebackType


class PgLockError(Exception):
    """A celery-pglock operation failed."""

    def __init__(self, message: str | None = None) -> None:
        super().__init__(message or (self.__doc__ or "").strip())

    @property
    def message(self) -> str:
        """The human-readable sentence this error was raised with."""
        return str(self.args[0]) if self.args else ""

    def __str__(self) -> str:
        return self.message


class ConfigurationError(PgLockError, ValueError):
    """A celery-pglock setting or task option is missing or invalid."""

    def __init__(
        self,
        message: str | None = None,
        *,
        unknown: str | None = None,
        suggestion: str | None = None,
    ) -> None:
        super().__init__(message)  # pickled with the instance __dict__, as LockError's
        #: An option or setting name that does not exist, as it was spelled.
        self.unknown = unknown
        #: The valid name closest to ``unknown``, if one is close.
        self.suggestion = suggestion


class LockKeyError(PgLockError, TypeError):
    """A task argument cannot be turned into a stable lock key."""


class DatabaseError(PgLockError):
    """The lock database could not be reached or answered with an error."""


class LockError(PgLockError):
    """A lock operation failed; ``key`` and ``name`` say which lock."""

    def __init__(
        self,
        message: str | None = None,
        *,
        key: str | None = None,
        name: str | None = None,
    ) -> None:
        super().__init__(message)  # key and name are pickled with the instance __dict__
        #: The advisory key as PostgreSQL sees it, e.g. ``"-4311986427365126397"`` or ``"42,1001"``.
        self.key = key
        #: The lock's name: the task name unless ``lock_name`` overrides it.
        self.name = name


class LockBusy(LockError):  # noqa: N818 - the public name users asked for
    """The lock is held by another holder."""


class _NothingRan:
    """A failure whose body never ran: its traceback is one fixed frame of no source
    (why: docs/design.md, Decisions); settable."""

    @property
    def __traceback__(self) -> TracebackType | None:
        return _SKIP_TRACEBACK

    @__traceback__.setter
    def __traceback__(self, value: TracebackType | None) -> None:
        _BASE_TRACEBACK.__set__(self, value)


class LockSkipped(_NothingRan, LockBusy):
    """The run did not execute its body because another run held its lock.

    How a skip ends by default; ``details`` is the skip as JSON-safe data, never argument
    values (docs/guide/skipped-results.md).
    """

    def __init__(
        self, message: str | None = None, details: Mapping[str, Any] | None = None
    ) -> None:
        info = dict(details or {})
        super().__init__(message, key=info.get("key"), name=info.get("lock"))
        self.details = info  #: The skip as plain data.
        self.args = (self.message, info)

    def __reduce__(self) -> tuple[Any, ...]:
        # Celery pickles every failure it stores: two fields, not the instance dict too.
        return (type(self), (self.message, self.details))

    @property
    def holder(self) -> str | None:
        """``host:pid`` of the worker process that held the lock, if known."""
        value = self.details.get("holder")
        return None if value is None else str(value)

    def __repr__(self) -> str:
        # Celery logs and sends repr(exc) in the task-failed event: keep it one sentence.
        return f"{type(self).__name__}({self.message!r})"


class AlreadyQueued(LockError):  # noqa: N818 - celery-once's name, for migrations
    """A send of a ``lock_enqueue`` task found its key's message already queued or running
    (``lock_enqueue_on_duplicate='raise'``); ``task_id`` is that message's id."""

    def __init__(
        self,
        message: str | None = None,
        *,
        key: str | None = None,
        name: str | None = None,
        task_id: str | None = None,
    ) -> None:
        super().__init__(message, key=key, name=name)
        self.task_id = task_id  #: The queued (or running) message of the key.


class TaskReplaced(_NothingRan, LockError):  # noqa: N818 - what a caller reads: the task was replaced
    """Latest wins (``lock_enqueue_on_duplicate='replace'``): a later send of the key
    replaced this message before it started; its body never runs. ``replaced_by`` is that
    send's task id (which may itself be replaced: follow it, or ``pglock why`` it)."""

    def __init__(
        self, message: str | None = None, replaced_by: str | None = None
    ) -> None:
        super().__init__(message)
        self.replaced_by = replaced_by  #: The task id of the send that replaced it.
        self.args = (self.message, replaced_by)

    def __reduce__(self) -> tuple[Any, ...]:
        # Stored by Celery as its args (JSON or pickle): the message and the id.
        return (type(self), (self.message, self.replaced_by))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.message!r})"


class EnqueueUnavailable(DatabaseError):  # noqa: N818
    """A ``lock_enqueue`` send could not ask the lock database; nothing was published."""


class LockNotOwnedError(LockError):
    """Cannot release a lock that is not owned by this holder."""


class LockLostError(LockError):
    """The lock ended before the protected work finished."""


#: BaseException's own ``__traceback__`` slot, which LockSkipped's property shadows.
_BASE_TRACEBACK: Any = BaseException.__dict__["__traceback__"]


def _skipped_run() -> TracebackType | None:
    # A frame whose "file" says why and has no source: formatting it reads no file.
    def raise_skipped() -> None:
        raise LockSkipped

    raise_skipped.__code__ = raise_skipped.__code__.replace(
        co_filename="<a skipped or replaced run: nothing ran, so there is no traceback>"
    )
    try:
        raise_skipped()
    except LockSkipped as skip:
        traceback: TracebackType = _BASE_TRACEBACK.__get__(skip)
    return traceback.tb_next  # without this function's own frame


_SKIP_TRACEBACK = _skipped_run()
