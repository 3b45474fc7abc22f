"""The tables the library creates on first use (the features' rows), checked once per engine.
Why created lazily, and the least-privilege path: docs/operations/security.md."""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

from celery_pglock import exceptions
from celery_pglock.db import driver_errors, engines, forks, sql_text

if TYPE_CHECKING:
    import sqlalchemy as sa


class OwnTable:
    """A table a feature creates on first use, once per engine; its ``create`` text
    serialises itself (IF NOT EXISTS races itself)."""

    def __init__(self, what: str, exists: str, create: str, fix: str) -> None:
        self.what, self.exists, self.create, self.fix = what, exists, create, fix
        self._ready: weakref.WeakSet[sa.Engine] = weakref.WeakSet()
        self._guard = forks.safe_lock()

    def ensure(self, engine: sa.Engine, bound: float | None = None) -> None:
        if engine in self._ready:
            return
        with self._guard:
            if engine in self._ready:
                return
            with (
                driver_errors.wrap_db_errors(f"set up the {self.what}", engine),
                engines.autocommit_cursor(engine, bound) as cursor,
            ):
                if not self.present(cursor):
                    try:
                        cursor.execute(self.create.format(schema=""))
                    except Exception as exc:
                        code = driver_errors.sqlstate(exc)
                        if code != sql_text.INSUFFICIENT_PRIVILEGE:
                            raise
                        cursor.execute(sql_text.ROLLBACK)  # autocommit: end the BEGIN
                        raise exceptions.DatabaseError(
                            f"The {self.what} does not exist on "
                            f"{engines.engine_info(engine)['masked_url']} (or an older "
                            "version made it without what this one needs) and this role "
                            f"may not create or update it; {self.fix}."
                        ) from exc
            self._ready.add(engine)

    def present(self, cursor: Any) -> bool:
        """Whether the table (and what it needs) exists, seen from ``cursor``."""
        cursor.execute(self.exists)
        return all(cursor.fetchone())

    def forget(self, engine: sa.Engine) -> None:
        """Check the table again at its next use (it was dropped, or its grant revoked)."""
        with self._guard:
            self._ready.discard(engine)
