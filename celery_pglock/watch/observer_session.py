"""The lock watcher's check of one lock database, and its own session there.

The check runs on the process's lock session when it has one
(``ProcessSession.run_check``), else on the observer's own asynchronous psycopg2 session,
which also names why a lock session stopped answering. Hazard: every connect and query
waits in ``poll()`` until the check's deadline, never longer; a check that cannot finish
in time answers "unverifiable" for each lock. See docs/operations/lock-loss.md.
"""

from __future__ import annotations

import contextlib
import select
import time
from typing import TYPE_CHECKING, Any

from celery_pglock.db import (
    engines,
    redact,
    server_probe,
    sql_text,
    startup_options,
)
from celery_pglock.lock import sessions

if TYPE_CHECKING:
    from celery_pglock.watch.loss_watcher import Entry

#: Statements run by observers in this process (tests prove short tasks run none).
checks_run = 0


class UnverifiableError(Exception):
    """A check had no answer by its deadline."""


class Observer:
    """The watcher's asynchronous session to one lock database."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.connection: Any = None
        self.server_start: str | None = None

    def check(
        self,
        entries: list[Entry],
        deadline: float,
        session: sessions.ProcessSession | None = None,
    ) -> dict[int, str]:
        """{id(entry): cause} for each lock found lost; every entry if unverifiable.

        On ``session`` (the process's open lock session) if given; only if it cannot
        answer does the check connect here, to tell why, and close again.
        """
        diagnosing = False
        if session is not None:
            timeout = entries[0].timeout
            try:
                rows = session.run_check(
                    sql_text.CHECK_HELD, _params(entries), deadline, least=timeout / 2
                )
            except sessions.SessionBusyError:
                # Busy with (bounded) lock statements: checked here instead, with a
                # budget of its own, so a busy session never looks unverifiable.
                diagnosing = True
                deadline = time.monotonic() + timeout
            except Exception:
                # Gone, or no answer in time: ask the server why, within what is left.
                diagnosing = True
            else:
                if rows is not None:
                    self._counted()
                    return self._evaluate(entries, rows)
        try:
            return self._check_here(entries, deadline)
        finally:
            if diagnosing:
                self.close()

    def _check_here(self, entries: list[Entry], deadline: float) -> dict[int, str]:
        """The check on the observer's own session (connected on demand, reconnected
        while time remains)."""
        last_error: BaseException | None = None
        while True:
            try:
                return self._check_once(entries, deadline)
            except Exception as error:  # no answer in time, or a dead session
                last_error = error
            self.close()
            if time.monotonic() + 0.1 >= deadline:
                break
            time.sleep(0.1)
        # libpq may echo connection options: scrub as the security layer does.
        text = redact.scrub_text(str(last_error), redact.secrets_of(self.engine.url))
        reason = " ".join(text.split()) or type(last_error).__name__
        cause = (
            "unverifiable: the lock database did not confirm it within "
            f"{entries[0].timeout:g}s ({reason})"
        )
        return {id(entry): cause for entry in entries}

    @staticmethod
    def _counted() -> None:
        global checks_run
        checks_run += 1

    def _check_once(self, entries: list[Entry], deadline: float) -> dict[int, str]:
        if self.connection is None:
            self._connect(deadline)
        cursor = self.connection.cursor()
        cursor.execute(sql_text.CHECK_HELD, _params(entries))
        self._counted()
        wait(self.connection, deadline)
        rows = cursor.fetchall()
        cursor.close()
        return self._evaluate(entries, rows)

    def _evaluate(
        self, entries: list[Entry], rows: list[tuple[Any, ...]]
    ) -> dict[int, str]:
        """{id(entry): cause} from the rows of CHECK_HELD for ``entries``."""
        start, standby = rows[0][4], rows[0][5]
        restarted = self.server_start is not None and start != self.server_start
        self.server_start = start
        losses: dict[int, str] = {}
        for entry, (_, holder, holder_name, alive, _, _) in zip(
            entries, rows, strict=True
        ):
            if entry.server_start is None:
                entry.server_start = start
            if standby:
                losses[id(entry)] = (
                    "the server is now a standby (pg_is_in_recovery()): the address "
                    "reaches a replica, not the primary that granted the lock"
                )
                continue
            if holder is not None and holder == entry.backend_pid:
                entry.pid_confirmed = True
                continue
            if (
                holder is not None
                and not entry.pid_confirmed
                and self._pids_invented()
                and holder_name == getattr(entry.lock, "holding_name", None)
            ):
                # Through PgBouncer libpq's backend pid is the pooler's invention: the
                # session showing this lock's own application_name is ours. Learnt once.
                # Never where libpq's pid is the real one: there another session of
                # this process (same name) may have taken the key after ours ended.
                entry.backend_pid, entry.pid_confirmed = holder, True
                continue
            if restarted or entry.server_start != start:
                # A promoted standby's postmaster started when the standby did: a
                # failover looks exactly like a restart from here.
                losses[id(entry)] = (
                    "the server restarted or was replaced (pg_postmaster_start_time() "
                    "changed): a restart, a crash, or a failover to a promoted standby"
                )
            elif not alive:
                losses[id(entry)] = (
                    f"its session (backend {entry.backend_pid}) ended: "
                    "terminated, timed out or disconnected"
                )
            else:
                losses[id(entry)] = (
                    f"its session (backend {entry.backend_pid}) no longer holds "
                    "it (unlocked, or its transaction ended)"
                )
        return losses

    def _pids_invented(self) -> bool:
        """May libpq's backend pids be a pooler's invention here? (Yes if unknown.)"""
        facts = server_probe.known_facts(self.engine)
        return facts is None or not facts.reports_backend_pid

    def _connect(self, deadline: float) -> None:
        import psycopg2  # a dependency, whatever driver the lock engine uses

        timeout = max(1, int(deadline - time.monotonic() + 0.999))
        params = engines.connect_params(self.engine)
        params["application_name"] = engines.application_name(
            engines.engine_info(self.engine)["application_name_prefix"],
            engines.process_tag(),
            "watch",
        )
        params["connect_timeout"] = timeout
        connection = psycopg2.connect(**params, async_=1)
        engines.adopt(connection)  # a forked child must not touch it either
        self.connection = connection
        fallback = startup_options.fallback_of(self.engine)
        try:
            wait(connection, deadline)
        except psycopg2.OperationalError as error:
            # Refused options: retry without the refused part, as the lock sessions do.
            if fallback is None or not fallback.learn(error):
                raise
            self.close()
            self._connect(deadline)
            return
        cursor = connection.cursor()
        # The server gives up too, so a slow check never lingers there.
        cursor.execute(
            "SELECT set_config('statement_timeout', %s, false)", (f"{timeout}s",)
        )
        wait(connection, deadline)
        if fallback is None or not fallback.carries_settings():
            # Idle between checks: never ended by a role's idle_session_timeout.
            cursor.execute(
                startup_options.APPLY_SESSION_SETTINGS,
                startup_options.SESSION_SETTINGS_PARAMS,
            )
            wait(connection, deadline)
        cursor.close()

    def close(self) -> None:
        connection, self.connection = self.connection, None
        if connection is not None:
            with contextlib.suppress(Exception):  # it is dead already, most often
                connection.close()


def _params(entries: list[Entry]) -> tuple[list[int], ...]:
    """CHECK_HELD's parameters for ``entries``: classids, objids, objsubids, pids."""
    ids = zip(*(entry.lock.key.pg_locks_ids for entry in entries), strict=True)
    return (*map(list, ids), [entry.backend_pid or 0 for entry in entries])


def wait(connection: Any, deadline: float) -> None:
    """Drive an asynchronous psycopg2 connection until it is ready, or the deadline."""
    import psycopg2.extensions as ext

    while (state := connection.poll()) != ext.POLL_OK:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise UnverifiableError("no answer in time")
        reading, fd = state == ext.POLL_READ, connection.fileno()
        if hasattr(select, "poll"):  # select() refuses fd >= 1024; gevent removes poll
            poller = select.poll()
            poller.register(fd, select.POLLIN if reading else select.POLLOUT)
            poller.poll(remaining * 1000)
        else:
            select.select(
                [fd] if reading else [], [] if reading else [fd], [], remaining
            )
