"""The server probe: version, standby, or a pooling proxy that breaks advisory locks (refused).
Why: docs/operations/pgbouncer.md ("How a pooler is detected"). Once per engine, never per task."""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import logging
import os
import socket
import threading
import weakref
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa

from celery_pglock import exceptions
from celery_pglock.config import LockScope
from celery_pglock.db import driver_errors, engines, forks, sql_text

if TYPE_CHECKING:
    from collections.abc import Mapping

logger = logging.getLogger(__name__)

PROBE_TIMEOUT = 10.0  #: Seconds for the whole probe (connections, queries).
#: Alternating queries on two connections before concluding "no multiplexing".
PROBE_ROUNDS = 3


class Pooling(str, enum.Enum):
    NONE = "none"  #: One server session per client connection: both scopes work.
    TRANSACTION = "transaction"  #: Sessions change between transactions.
    STATEMENT = "statement"  #: Sessions change between statements: no scope works.


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ServerFacts:
    server_version: str  #: e.g. ``"15.10 (Debian 15.10-0+deb12u1)"``.
    server_version_num: int
    is_standby: bool  #: ``pg_is_in_recovery()``
    pooling: Pooling
    #: The server saw another client port than our socket's (proxy, NAT); None: unknown.
    proxied: bool | None
    evidence: str  #: What the pooling verdict rests on, in words (for messages).
    masked_url: str  #: The probed URL, password masked.
    #: libpq's backend pid is the server's (False behind PgBouncer, which invents it).
    reports_backend_pid: bool = True

    def refusal(self, scope: LockScope | str) -> str | None:
        """Why locks of ``scope`` cannot work here (a sentence naming the fix), or None."""
        scope = LockScope(scope)
        where = self.masked_url
        if self.is_standby:
            return (
                f"The lock database {where} is a standby in recovery (pg_is_in_recovery() "
                "is true): an advisory lock taken there is local to that standby and "
                "excludes nobody on the primary or on other standbys. Point "
                "pglock_database_url at the primary (with several hosts, add "
                "target_session_attrs=read-write to the URL)."
            )
        if self.pooling is Pooling.STATEMENT:
            return (
                f"The lock database URL {where} goes through a statement-pooling "
                f"connection pooler ({self.evidence}; PgBouncer pool_mode=statement or "
                "similar): it hands each statement to any server session and refuses "
                "multi-statement transactions, so neither lock scope can work. Point "
                "pglock_database_url at PostgreSQL directly or at a pool in session "
                "pooling mode (or transaction pooling, with lock_scope='transaction')."
            )
        if self.pooling is Pooling.TRANSACTION and scope is LockScope.SESSION:
            return (
                f"lock_scope='session' cannot work through the transaction-pooling "
                f"connection pooler at {where} ({self.evidence}; PgBouncer "
                "pool_mode=transaction or similar): between transactions the lock's "
                "server session serves other clients, and the unlock may run on another "
                "session, so the lock would exclude nobody. Use lock_scope='transaction' "
                "(per task, or app.conf.pglock_scope), or point pglock_database_url at "
                "PostgreSQL directly or at a pool in session pooling mode."
            )
        return None


def probe(
    target: sa.Engine | str,
    conf: Mapping[str, Any] | None = None,
    *,
    timeout: float = PROBE_TIMEOUT,
    action: str = "probe the lock database",
) -> ServerFacts:
    """Probe ``target`` (an engine, on two connections outside its pool, or a URL).
    DatabaseError "Could not <action> ...": unreachable or silent for ``timeout`` s."""
    engine = (
        target if isinstance(target, sa.Engine) else engines.create_engine(target, conf)
    )
    masked = engines.engine_info(engine)["masked_url"]
    opened: list[Any] = []
    outcome: list[ServerFacts | BaseException] = []

    def run() -> None:
        # Outside the pool: it could make the second wait for the first (or repeat it).
        try:
            opened.append(engines.connect(engine))
            opened.append(engines.connect(engine))
            first, second = opened
            first.autocommit = second.autocommit = True
            pid, version, version_num, in_recovery, client_port = _fetch(
                first, sql_text.PROBE_SERVER
            )
            proxied = None  # unknown: no port seen, or no socket to ask
            if client_port is not None:
                with contextlib.suppress(OSError):
                    with socket.socket(fileno=os.dup(first.fileno())) as sock:
                        local = sock.getsockname()
                    if isinstance(local, tuple):
                        proxied = bool(local[1] != client_port)
            pooling, evidence = _pooling(first, second, pid)
            outcome.append(
                ServerFacts(
                    server_version=str(version),
                    server_version_num=int(version_num),
                    is_standby=bool(in_recovery),
                    pooling=pooling,
                    proxied=proxied,
                    evidence=evidence,
                    masked_url=masked,
                    reports_backend_pid=first.info.backend_pid == pid,
                )
            )
        except BaseException as exc:  # handed to the caller's thread
            outcome.append(exc)
        finally:
            for connection in opened:
                with contextlib.suppress(Exception):
                    connection.close()

    thread = threading.Thread(target=run, name="celery-pglock-probe", daemon=True)
    thread.start()
    thread.join(timeout)
    if engine is not target:
        engine.dispose()  # its pool only: the probe's connections are outside it
    if thread.is_alive() or not outcome:
        for connection in list(opened):
            with contextlib.suppress(Exception):
                connection.cancel()  # the thread then fails and closes them
        # An outage and a failed connect (never a dead session), as connect_timeout is.
        error = exceptions.DatabaseError(
            f"Could not {action} on {masked}: the server probe had no answer within "
            f"{timeout:g} s."
        )
        error.pglock_connect_failed = True  # type: ignore[attr-defined]
        raise error from engine.dialect.loaded_dbapi.OperationalError(
            "the server probe timed out"
        )
    result = outcome[0]
    if isinstance(result, BaseException):
        with driver_errors.wrap_db_errors(action, engine, connecting=True):
            raise result
    return result


def _pooling(first: Any, second: Any, first_pid: int) -> tuple[Pooling, str]:
    seen: tuple[list[int], list[int]] = ([first_pid], [])
    for _ in range(PROBE_ROUNDS):
        for index, connection in ((1, second), (0, first)):
            seen[index].append(int(_fetch(connection, sql_text.BACKEND_PID)[0]))
            if shared := set(seen[0]) & set(seen[1]):
                evidence = f"two client connections were both served by backend pid {min(shared)}"
            elif len(set(seen[index])) > 1:
                pids = ", ".join(str(pid) for pid in dict.fromkeys(seen[index]))
                evidence = f"one client connection was served by backend pids {pids}"
            else:
                continue
            try:
                with second.cursor() as cursor:
                    cursor.execute(sql_text.BEGIN)
                    cursor.execute(sql_text.SELECT_ONE)
                    cursor.execute(sql_text.COMMIT)
            except driver_errors.errors_named("OperationalError", "InterfaceError"):
                # PgBouncer answers BEGIN in statement pooling by dropping the client.
                return Pooling.STATEMENT, evidence
            return Pooling.TRANSACTION, evidence
    return Pooling.NONE, (
        f"each of two client connections kept its backend over {PROBE_ROUNDS} queries"
    )


def _fetch(connection: Any, query: str) -> Any:
    with connection.cursor() as cursor:
        cursor.execute(query)
        return cursor.fetchone()


_facts: weakref.WeakKeyDictionary[sa.Engine, ServerFacts] = weakref.WeakKeyDictionary()
_probing = forks.safe_lock()


def facts_for(
    engine: sa.Engine, action: str = "probe the lock database"
) -> ServerFacts:
    """Probed at the first call and cached (a failed probe is not)."""
    if (facts := _facts.get(engine)) is not None:
        return facts
    with _probing:
        if (facts := _facts.get(engine)) is None:
            facts = _facts[engine] = probe(engine, action=action)
            logger.debug(
                "celery-pglock: lock database %s: PostgreSQL %s, standby=%s, pooling=%s",
                facts.masked_url,
                facts.server_version,
                facts.is_standby,
                facts.pooling.value,
                extra={"action": "lock_server_probed"},
            )
        return facts


def known_facts(engine: sa.Engine) -> ServerFacts | None:
    """No I/O: None unless a probe already ran."""
    return _facts.get(engine)


def check(engine: sa.Engine, scope: LockScope, lock_name: str = "") -> None:
    """ConfigurationError naming the fix if the server cannot honour ``scope``; the first
    call per engine probes (DatabaseError naming ``lock_name``), later ones do no I/O."""
    facts = _facts.get(engine) or facts_for(engine, f"acquire lock {lock_name!r}")
    if (message := facts.refusal(scope)) is not None:
        raise exceptions.ConfigurationError(message)
