"""Every SQL example in README.md and docs/ runs on PostgreSQL, unless marked as a template.

Each ```sql block runs as written, in a transaction that is rolled back. A block with a
placeholder (``<key text>``, ``k``) or one that changes server state opts out with
``<!-- docs-test: skip (why) -->`` on the line before it.
"""

from __future__ import annotations

import pytest
import sqlalchemy as sa
from sqlalchemy.pool import NullPool

from ..unit.test_docs_examples import PAGES, ROOT, fenced_blocks

SQL_BLOCKS = [block for page in PAGES for block in fenced_blocks(page, "sql")]


def test_sql_opt_outs_say_why():
    """Every SQL block that is not run says why."""
    for block in SQL_BLOCKS:
        if block.mode != "run":
            assert "skip" == block.mode
            assert block.reason, f"{block.page}:{block.line}: say why it is not run"


@pytest.mark.parametrize(
    "block",
    [block for block in SQL_BLOCKS if block.mode == "run"],
    ids=lambda block: f"{block.page.relative_to(ROOT)}:{block.line}",
)
def test_sql_example_runs(database_url, block):
    """The query is valid SQL for the server under test (it may return no rows)."""
    engine = sa.create_engine(database_url, poolclass=NullPool)
    try:
        with engine.connect() as connection:
            connection.exec_driver_sql(block.code)
            connection.rollback()
    finally:
        engine.dispose()
