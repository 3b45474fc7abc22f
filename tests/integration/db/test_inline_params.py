"""sql_text.inline writes a prepared statement's simple params into its EXECUTE text. The
server must read every value exactly as it reads the driver's own adaptation of it."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from celery_pglock.db import engines, sql_text

TYPES = ("bigint", "oid", "smallint", "float8", "boolean", "text", "bytea")
STATEMENT = "SELECT " + ", ".join(
    f"%({name})s::{kind}::text" for name, kind in zip("abcdefg", TYPES, strict=True)
)


def maybe(values: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.one_of(st.none(), values)


ROWS = st.fixed_dictionaries(
    {
        "a": maybe(st.integers(-(2**63), 2**63 - 1)),
        "b": maybe(st.integers(0, 2**32 - 1)),
        "c": maybe(st.integers(-(2**15), 2**15 - 1)),
        "d": maybe(st.floats()),  # NaN and the infinities too: the driver's then
        "e": maybe(st.booleans()),
        "f": maybe(
            st.text(st.characters(blacklist_categories=("Cs",), min_codepoint=1))
        ),
        "g": maybe(st.binary()),
    }
)


@pytest.fixture(params=["on", "off"])
def cursor(database_url: str, request: pytest.FixtureRequest) -> Any:
    engine = engines.create_engine(database_url)  # the driver's cursor as the lock's
    with engines.autocommit_cursor(engine, 5.0) as cursor:
        # Off: a backslash in a plain literal is an escape (a role or server may say so).
        cursor.execute("SET standard_conforming_strings = " + request.param)
        yield cursor
    engine.dispose()


@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(row=ROWS)
def test_inlined_params_read_as_the_drivers(cursor: Any, row: dict[str, Any]) -> None:
    execute = sql_text.prepared(
        cursor.connection,
        cursor,
        sql_text.versioned("inline_test", STATEMENT),
        STATEMENT,
    )
    cursor.execute(execute, row)
    by_driver = cursor.fetchone()
    text, rest = sql_text.inline(execute, row)
    assert "%(" not in text  # the named params are gone, the rest positional
    cursor.execute(text, rest)
    assert by_driver == cursor.fetchone()


def test_only_an_execute_of_placeholders_is_rewritten() -> None:
    assert ("SELECT %s", (1,)) == sql_text.inline("SELECT %s", (1,))
    assert ("EXECUTE x(%s, 'a')", (1,)) == sql_text.inline("EXECUTE x(%s, 'a')", (1,))
    assert ("EXECUTE x(1, -2, NULL, true, 0.5, %s)", ("it's",)) == sql_text.inline(
        "EXECUTE x(%s, %s, %s, %s, %s, %s)", (1, -2, None, True, 0.5, "it's")
    )
    assert ("EXECUTE x(7)", None) == sql_text.inline("EXECUTE x(%(n)s)", {"n": 7})
    # Plain ASCII text and bytes are written too; text to escape is the driver's.
    assert ("EXECUTE x('a.b-1', decode('00ff', 'hex'))", None) == sql_text.inline(
        "EXECUTE x(%s, %s)", ("a.b-1", b"\x00\xff")
    )
    for kept in ("it's", "a\\b", "100%", "é", "a\nb", "\x00"):
        assert ("EXECUTE x(%s)", (kept,)) == sql_text.inline("EXECUTE x(%s)", (kept,))
