"""The lock connections' startup options: what is left out where a server refuses it.

A real older PostgreSQL or PgBouncer is not needed to tell what is sent: a fake dialect
records every connect and refuses as those servers do.
"""

from __future__ import annotations

import threading

import psycopg2
import pytest

from celery_pglock.db import startup_options


class FakeConnection:
    def __init__(self, log: list[str]) -> None:
        self.log = log
        self.autocommit = False

    def cursor(self) -> FakeConnection:
        return self

    def __enter__(self) -> FakeConnection:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def execute(self, statement: str, params: object = None) -> None:
        self.log.append("SET" if "set_config" in statement else statement)

    def commit(self) -> None:
        pass


class FakeDialect:
    """Refuses any options naming a setting in ``unknown``, or every options."""

    loaded_dbapi = psycopg2  # the driver whose errors the fallback catches

    def __init__(self, unknown: set[str], refuse_options: bool = False) -> None:
        self.unknown = unknown
        self.refuse_options = refuse_options
        self.connects: list[str | None] = []
        self.log: list[str] = []

    def connect(self, *cargs: object, **cparams: object) -> FakeConnection:
        options = cparams.get("options")
        self.connects.append(options)  # type: ignore[arg-type]
        if options is not None and self.refuse_options:
            raise psycopg2.OperationalError("unsupported startup parameter: options")
        for name in self.unknown:
            if options is not None and f"-c {name}=" in str(options):
                raise psycopg2.OperationalError(
                    f'FATAL:  unrecognized configuration parameter "{name}"'
                )
        return FakeConnection(self.log)


def _connect(fallback: startup_options.OptionsFallback, dialect: FakeDialect) -> None:
    fallback(dialect, None, [], {"options": fallback.ours})


def test_an_older_server_gets_the_options_it_knows_and_the_rest_by_statement():
    """PostgreSQL 13 (no idle_session_timeout) and 11 (no tcp_user_timeout either): each
    unknown setting is dropped once, then never sent again; no statement is needed for a
    setting the server does not have (the statement filters on pg_settings anyway)."""
    fallback = startup_options.OptionsFallback("db", startup_options.SERVER_OPTIONS)
    dialect = FakeDialect({"idle_session_timeout", "tcp_user_timeout"})
    _connect(fallback, dialect)
    assert 3 == len(dialect.connects)
    final = dialect.connects[-1]
    assert final is not None
    assert "tcp_keepalives_idle=30" in final
    assert "idle_session_timeout" not in final
    assert "tcp_user_timeout" not in final
    assert [] == dialect.log  # nothing left to set: the server has none of them
    _connect(fallback, dialect)
    assert final == dialect.connects[-1]
    assert 4 == len(dialect.connects)  # learnt: one connect, no refusal


def test_a_pooler_refusing_options_gets_the_settings_by_statement():
    fallback = startup_options.OptionsFallback("db", startup_options.SERVER_OPTIONS)
    dialect = FakeDialect(set(), refuse_options=True)
    _connect(fallback, dialect)
    assert [startup_options.SERVER_OPTIONS, None] == dialect.connects
    assert ["SET"] == dialect.log
    _connect(fallback, dialect)
    assert [startup_options.SERVER_OPTIONS, None, None] == dialect.connects


def test_accepted_options_need_no_statement():
    fallback = startup_options.OptionsFallback("db", startup_options.SERVER_OPTIONS)
    dialect = FakeDialect(set())
    _connect(fallback, dialect)
    assert [startup_options.SERVER_OPTIONS] == dialect.connects
    assert [] == dialect.log


def test_the_users_own_options_are_never_dropped():
    fallback = startup_options.OptionsFallback("db", startup_options.SERVER_OPTIONS)
    dialect = FakeDialect({"work_mem"})
    with pytest.raises(psycopg2.OperationalError, match="work_mem"):
        fallback(dialect, None, [], {"options": "-c work_mem=8MB"})
    assert ["-c work_mem=8MB"] == dialect.connects


def test_two_connects_refused_at_once_both_retry():
    """Two threads' first connects meet the same refusal before either has learnt from
    it: the second to learn finds the setting already dropped and retries too."""
    fallback = startup_options.OptionsFallback("db", startup_options.SERVER_OPTIONS)
    refused = threading.Barrier(2, timeout=10)

    class RefusingTogether(FakeDialect):
        def connect(self, *cargs: object, **cparams: object) -> FakeConnection:
            try:
                return super().connect(*cargs, **cparams)
            except psycopg2.OperationalError:
                refused.wait()  # both refused before either learns
                raise

    dialect = RefusingTogether({"idle_session_timeout"})
    errors: list[BaseException] = []

    def connect() -> None:
        try:
            _connect(fallback, dialect)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=connect) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=10)
    assert [] == errors
    assert 4 == len(dialect.connects)  # two refused, two retried without the setting
    assert all("idle_session_timeout" not in str(sent) for sent in dialect.connects[2:])
