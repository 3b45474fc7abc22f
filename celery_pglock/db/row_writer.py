"""Rows written off the caller's thread: one thread per engine and purpose gathers what is
put for BATCH_WAIT, writes it in one call on the engine's kept connection, and tries again
while the database fails, up to ``give_up_after`` seconds. Drained at exit."""

from __future__ import annotations

import atexit
import logging
import queue
import threading
import time
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from celery_pglock.db import engines, forks

if TYPE_CHECKING:
    from collections.abc import Callable

    import sqlalchemy as sa

logger = logging.getLogger(__name__)
ItemT = TypeVar("ItemT")


class Purpose(Generic[ItemT]):
    """What a writer is for: how it writes a batch, and how it tells of one it failed."""

    def __init__(
        self,
        name: str,
        write: Callable[[sa.Engine, Any, list[ItemT]], None],
        describe: Callable[[list[ItemT]], str],
        if_given_up: str,
        *,
        kept: bool = True,
    ) -> None:
        self.name, self.write, self.describe = name, write, describe
        #: Said when a batch is dropped, or left unwritten at exit.
        self.if_given_up = if_given_up
        #: Written on the engine's kept connection when free (engines.on_kept, which
        #: closes it on any error), else on a pooled one.
        self.kept = kept


class RowWriter(threading.Thread, Generic[ItemT]):
    """One engine's writer for one purpose."""

    BATCH_WAIT = 0.1  #: Seconds to gather a batch: one statement for a burst of puts.
    RETRY_EVERY = 1.0  #: Seconds between tries while the database fails.

    def __init__(
        self,
        engine: sa.Engine,
        purpose: Purpose[ItemT],
        bound: float,
        give_up_after: float,
    ) -> None:
        super().__init__(name=f"celery-pglock-{purpose.name}-writer", daemon=True)
        self.engine, self.purpose = engine, purpose
        self.bound, self.give_up_after = bound, give_up_after
        self.pending: queue.SimpleQueue[ItemT] = queue.SimpleQueue()
        self.unwritten = 0  #: Put and not yet written (or given up): see :meth:`drain`.
        self.written = threading.Condition()

    def put(self, item: ItemT) -> None:
        with self.written:
            self.unwritten += 1
        self.pending.put(item)

    def drain(self, timeout: float) -> bool:
        """Wait until every item put so far is written (at exit): False on timeout."""
        with self.written:
            return self.written.wait_for(lambda: self.unwritten == 0, timeout)

    def run(self) -> None:
        while True:
            batch = [self.pending.get()]
            time.sleep(self.BATCH_WAIT)
            while not self.pending.empty():
                batch.append(self.pending.get())
            self._write(batch)
            with self.written:
                self.unwritten -= len(batch)
                self.written.notify_all()

    def _write(self, batch: list[ItemT]) -> None:
        give_up = time.monotonic() + self.give_up_after
        write, what = self.purpose.write, f"{self.purpose.name} row change(s)"
        warned = False
        while True:
            try:
                if self.purpose.kept:  # a producer keeps one for its claims
                    engines.on_kept(
                        self.engine, self.bound, lambda c: write(self.engine, c, batch)
                    )
                else:
                    with engines.autocommit_cursor(self.engine, self.bound) as cursor:
                        write(self.engine, cursor, batch)
                if warned:
                    logger.info("Wrote %d %s after all", len(batch), what)
                return
            except Exception:
                if not warned or time.monotonic() >= give_up:
                    logger.warning(
                        "Could not write %d %s (%s); %s",
                        len(batch),
                        what,
                        self.purpose.describe(batch),
                        self.purpose.if_given_up
                        if warned
                        else "trying again until the lock database answers",
                        exc_info=not warned,
                        extra={"action": f"{self.purpose.name}_write_failed"},
                    )
                if time.monotonic() >= give_up:
                    return
                warned = True
                time.sleep(self.RETRY_EVERY)


_writers: dict[tuple[Any, str], RowWriter[Any]] = {}
_writers_guard = forks.safe_lock(_writers)  # a child has no writer thread


def writer_for(
    engine: sa.Engine, purpose: Purpose[ItemT], bound: float, give_up_after: float
) -> RowWriter[ItemT]:
    """``engine``'s writer for ``purpose``, started on first use in this process."""
    with _writers_guard:
        writer = _writers.get((engine, purpose.name))
        if writer is None or not writer.is_alive():
            writer = RowWriter(engine, purpose, bound, give_up_after)
            _writers[(engine, purpose.name)] = writer
            writer.start()
        return writer


@atexit.register
def drain_all() -> None:
    """At exit, write what is pending (each writer bounded by its round trip)."""
    with _writers_guard:
        writers = [writer for writer in _writers.values() if writer.is_alive()]
    for writer in writers:
        if not writer.drain(writer.BATCH_WAIT + writer.bound):
            logger.warning(
                "Exiting with %s row changes unwritten: %s",
                writer.purpose.name,
                writer.purpose.if_given_up,
            )
