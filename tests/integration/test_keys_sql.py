"""The key algorithm's SQL twin computes the same keys inside PostgreSQL."""

from __future__ import annotations

import pytest

from celery_pglock import keys

from ..unit.test_keys import VECTORS


@pytest.mark.parametrize(("namespace", "name", "material", "text", "key"), VECTORS)
def test_sql_twin_matches_python(lock_engine, namespace, name, material, text, key):
    """KEY_SQL over the key text gives the Python key, for every vector."""
    with lock_engine.connect() as connection:
        assert (
            key
            == connection.exec_driver_sql(f"SELECT {keys.KEY_SQL}", (text,)).scalar()
        )


def test_sql_twin_on_unicode_and_large_text(lock_engine):
    """Non-ASCII and long texts agree too (UTF-8 on both sides; a text longer than
    keys.TEXT_MAX is hashed as a stream in Python, and must still agree)."""
    for material in [
        "Zu\u0308rich",
        "東京",
        "x" * 100_000,
        'é"\n' * 40_000,
        {"emoji": "\U0001f600"},
    ]:
        lock_key = keys.make_key("ns", "t", material)
        text = keys.key_text("ns", "t", keys.canonical(material))
        with lock_engine.connect() as connection:
            assert (
                lock_key.ids[0]
                == connection.exec_driver_sql(
                    f"SELECT {keys.KEY_SQL}", (text,)
                ).scalar()
            )
