"""Fencing tokens: refuse the writes of a holder whose lock has already ended.

A lock can end while its body still runs (a GC pause, SIGSTOP, a cut network, a server
restart: docs/operations/failure-modes.md); no lock can prevent that. With
``lock_fencing=True`` every acquisition gets a token from PostgreSQL, strictly greater
than every token issued before for that key (``current_lock().fencing_token``). The
resource then keeps the highest token it has seen and refuses older ones:

    time  run A                          run B                      resource
    0     acquire, token 5
    1     (paused; its session dies)     acquire, token 6
    2                                    write(token 6)             applied, keeps 6
    3     write(token 5)                                            refused: 5 < 6

:func:`fenced_update` and :func:`fenced_upsert` are that check for a PostgreSQL table, in
one statement. docs/guide/fencing.md explains the rest.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

import sqlalchemy as sa

from celery_pglock import exceptions
from celery_pglock.cli import admin_sql
from celery_pglock.lock import fencing_sql
from celery_pglock.task import singleton_task

if TYPE_CHECKING:
    from collections.abc import Mapping

    from celery_pglock.lock import AdvisoryLock

#: The column a guarded table keeps the highest token in, unless told otherwise.
TOKEN_COLUMN = "fencing_token"  # noqa: S105 - a column name, not a secret

# A plain identifier: no quoting tricks, at most PostgreSQL's 63 bytes.
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_$]{0,62}")


def issue_token(lock: AdvisoryLock) -> int:
    """Issue the next fencing token to ``lock`` (held), set ``lock.fencing_token``, return it.

    SingletonTask does this itself under ``lock_fencing=True``; call it after
    ``AdvisoryLock.acquire()`` when using the lock directly. Costs one statement on the
    lock's own session (transaction scope: one there and one on a pooled connection),
    and once per process a check that the table exists.

    Raises:
        PgLockError: ``lock`` is not held.
        LockLostError: ``lock``'s session no longer held the key (it was lost since
            the grant): no token; the lock was released.
        DatabaseError: the token could not be issued; the lock was released.
    """
    return lock.issue_fencing_token()


def fenced_update(
    connection: sa.Connection,
    table: str,
    *,
    key: Mapping[str, object],
    values: Mapping[str, object],
    token: int | None,
    token_column: str = TOKEN_COLUMN,
) -> bool:
    """Update the row ``key`` identifies, unless it was written with a newer token.

    One statement: ``UPDATE table SET values..., token_column = :token WHERE key... AND
    (token_column IS NULL OR token_column <= :token)``. Runs in ``connection``'s current
    transaction; the caller commits.

    Args:
        connection: A SQLAlchemy connection to the database holding ``table``.
        table: ``name`` or ``schema.name`` (plain identifiers).
        key: Column -> value equalities that pick the row(s).
        values: Column -> new value.
        token: ``current_lock().fencing_token``. None only in a shadow-mode run that
            did not get the lock: the write is then applied unfenced, as without the
            library, and the stored token is left alone (docs/guide/fencing.md).
        token_column: The bigint column holding the highest token seen.

    Returns:
        True if the write was applied; False if the row holds a newer token (this holder
        is stale) or no row matched ``key``.
    """
    fenced = _check(token, key, values)
    target, token_col = _table(connection, table), _quote(connection, token_column)
    params, sets = _assignments(connection, "v", values)
    where = [f"{_quote(connection, c)} = :k{i}" for i, c in enumerate(key)]
    params.update({f"k{i}": v for i, v in enumerate(key.values())})
    if fenced:
        params["fencing_token"] = token
        sets.append(f"{token_col} = :fencing_token")
        where.append(f"({token_col} IS NULL OR {token_col} <= :fencing_token)")
    # An unfenced write of no values sets a key column to itself: still one statement
    # whose row count says whether the row exists.
    sets = sets or [f"{_quote(connection, next(iter(key)))} = :k0"]
    statement = sa.text(
        f"UPDATE {target} SET {', '.join(sets)} WHERE {' AND '.join(where)}"
    )
    return connection.execute(statement, params).rowcount > 0


def fenced_upsert(
    connection: sa.Connection,
    table: str,
    *,
    key: Mapping[str, object],
    values: Mapping[str, object],
    token: int | None,
    token_column: str = TOKEN_COLUMN,
) -> bool:
    """Insert the row, or update it unless it was written with a newer token.

    One statement: ``INSERT ... ON CONFLICT (key columns) DO UPDATE SET ... WHERE
    t.token_column IS NULL OR t.token_column <= excluded.token_column``. The key columns
    need a unique constraint (or be the primary key). Arguments as :func:`fenced_update`.

    Returns:
        True if a row was inserted or updated; False if the stored row holds a newer
        token (this holder is stale: nothing was written).
    """
    fenced = _check(token, key, values)
    target, token_col = _table(connection, table), _quote(connection, token_column)
    columns = [*key, *values]
    quoted = [_quote(connection, c) for c in columns]
    params: dict[str, object] = {
        f"c{i}": v for i, v in enumerate([*key.values(), *values.values()])
    }
    placeholders = [f":c{i}" for i in range(len(columns))]
    updates = [f"{q} = excluded.{q}" for q in quoted[len(key) :]]
    guard = ""
    if fenced:
        params["fencing_token"] = token
        quoted.append(token_col)
        placeholders.append(":fencing_token")
        updates.append(f"{token_col} = excluded.{token_col}")
        guard = f" WHERE t.{token_col} IS NULL OR t.{token_col} <= excluded.{token_col}"
    updates = updates or [f"{quoted[0]} = excluded.{quoted[0]}"]  # as in fenced_update
    statement = sa.text(
        f"INSERT INTO {target} AS t ({', '.join(quoted)}) "
        f"VALUES ({', '.join(placeholders)}) "
        f"ON CONFLICT ({', '.join(quoted[: len(key)])}) "
        f"DO UPDATE SET {', '.join(updates)}{guard}"
    )
    return connection.execute(statement, params).rowcount > 0


def last_token(connection: sa.Connection, lock: AdvisoryLock) -> int | None:
    """The last token issued for ``lock``'s key (committed), or None: for operators and tests."""
    row = connection.exec_driver_sql(fencing_sql.LAST, lock.key.pg_locks_ids).first()
    return None if row is None else int(row[0])


def create_sql(schema: str = "public") -> str:
    """The SQL that creates the fencing table and its sequence in ``schema``."""
    return fencing_sql.CREATE.format(schema=admin_sql.quote_identifier(schema) + ".")


def drop_sql(schema: str = "public") -> str:
    """The SQL that drops them."""
    return fencing_sql.DROP.format(schema=admin_sql.quote_identifier(schema) + ".")


def grant_sql(role: str, schema: str = "public") -> str:
    """The GRANTs a least-privilege lock role needs to use fencing."""
    return fencing_sql.GRANT.format(
        schema=admin_sql.quote_identifier(schema) + ".",
        role=admin_sql.quote_identifier(role),
    )


# -- checks -----------------------------------------------------------------------------


def _check(
    token: int | None, key: Mapping[str, object], values: Mapping[str, object]
) -> bool:
    """Validate a fenced write's arguments; False: write unfenced (a shadowed run)."""
    if token is None:
        if _in_shadowed_run():
            # Shadow mode runs this body as if the library were not there: its write is
            # applied as it would be without fencing, and leaves the stored token alone.
            _check_columns(key, values)
            return False
        raise exceptions.ConfigurationError(
            "token=None: this run has no fencing token; set lock_fencing=True on the task "
            "(or call celery_pglock.fencing.issue_token() after acquire)."
        )
    if isinstance(token, bool) or not isinstance(token, int):
        raise exceptions.ConfigurationError(
            f"token must be an int (current_lock().fencing_token), got a {type(token).__name__}."
        )
    _check_columns(key, values)
    return True


def _check_columns(key: Mapping[str, object], values: Mapping[str, object]) -> None:
    if not key:
        raise exceptions.ConfigurationError(
            "key must name at least one column: a fenced write without a key would touch every row."
        )
    overlap = set(key) & set(values)
    if overlap:
        raise exceptions.ConfigurationError(
            f"Columns {sorted(overlap)} are in both key and values; a column is one or the other."
        )


def _in_shadowed_run() -> bool:
    execution = singleton_task.current_execution()
    return (
        execution is not None and execution.lock is not None and execution.lock.shadowed
    )


def _quote(connection: sa.Connection, name: str) -> str:
    if not isinstance(name, str) or not _IDENTIFIER.fullmatch(name):
        raise exceptions.ConfigurationError(
            f"{name!r} is not a plain SQL identifier (letters, digits, _ and $, "
            "starting with a letter or _, at most 63 characters)."
        )
    return str(connection.dialect.identifier_preparer.quote(name))


def _table(connection: sa.Connection, table: str) -> str:
    parts = table.split(".") if isinstance(table, str) else [table]
    if len(parts) > 2:
        raise exceptions.ConfigurationError(
            f"table={table!r} is invalid; expected 'name' or 'schema.name'."
        )
    return ".".join(_quote(connection, part) for part in parts)


def _assignments(
    connection: sa.Connection, prefix: str, values: Mapping[str, object]
) -> tuple[dict[str, object], list[str]]:
    params = {f"{prefix}{i}": v for i, v in enumerate(values.values())}
    sets = [f"{_quote(connection, c)} = :{prefix}{i}" for i, c in enumerate(values)]
    return params, sets
