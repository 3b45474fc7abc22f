"""Fencing tokens: refuse the writes of a holder whose lock has already ended.

How, when and why: docs/guide/fencing.md."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

import sqlalchemy as sa

from celery_pglock import exceptions
from celery_pglock.fencing import tokens
from celery_pglock.lock import identity

if TYPE_CHECKING:
    from collections.abc import Mapping

    from celery_pglock.lock import AdvisoryLock

#: The column a guarded table keeps the highest token in, unless told otherwise.
TOKEN_COLUMN = "fencing_token"  # noqa: S105 - a column name, not a secret

# A plain identifier: no quoting tricks, at most PostgreSQL's 63 bytes.
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_$]{0,62}")


def issue_token(lock: AdvisoryLock) -> int:
    """Issue the next fencing token to ``lock`` (held), set ``lock.fencing_token``, return it.

    SingletonTask does this under ``lock_fencing=True``; else call it after ``acquire()``.

    Raises:
        PgLockError: ``lock`` is not held.
        LockLostError: the key was lost since the grant; the lock was released.
        DatabaseError: the token could not be issued; the lock was released.
    """
    return tokens.issue_token(lock)


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

    One statement (its SQL: docs/guide/fencing.md) in ``connection``'s current
    transaction; the caller commits.

    Args:
        connection: A SQLAlchemy connection to the database holding ``table``.
        table: ``name`` or ``schema.name`` (plain identifiers).
        key: Column -> value equalities that pick the row(s).
        values: Column -> new value.
        token: ``current_lock().fencing_token``. None only in a shadowed run without the
            lock: the write is applied unfenced and the stored token left alone.
        token_column: The bigint column holding the highest token seen.

    Returns:
        True if applied; False if the row holds a newer token or none matched ``key``.
    """
    target, token_col, keys, cols, params = _prepare(
        connection, table, key, values, token, token_column
    )
    sets = [f"{c} = :v{i}" for i, c in enumerate(cols)]
    where = [f"{c} = :k{i}" for i, c in enumerate(keys)]
    if token_col:
        sets.append(f"{token_col} = :fencing_token")
        where.append(f"({token_col} IS NULL OR {token_col} <= :fencing_token)")
    # No values, unfenced: set a key column to itself, so the row count still tells.
    sets = sets or [f"{keys[0]} = :k0"]
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

    One statement, as :func:`fenced_update`, with the same arguments; the key columns need
    a unique constraint.

    Returns:
        True if a row was written; False if the stored row holds a newer token.
    """
    target, token_col, keys, cols, params = _prepare(
        connection, table, key, values, token, token_column
    )
    columns = [*keys, *cols]
    updates = [f"{c} = excluded.{c}" for c in cols]
    guard = ""
    if token_col:
        columns.append(token_col)
        updates.append(f"{token_col} = excluded.{token_col}")
        guard = f" WHERE t.{token_col} IS NULL OR t.{token_col} <= excluded.{token_col}"
    updates = updates or [f"{keys[0]} = excluded.{keys[0]}"]  # as in fenced_update
    statement = sa.text(
        f"INSERT INTO {target} AS t ({', '.join(columns)}) "
        f"VALUES ({', '.join(':' + name for name in params)}) "  # k0.., v0.., token
        f"ON CONFLICT ({', '.join(keys)}) DO UPDATE SET {', '.join(updates)}{guard}"
    )
    return connection.execute(statement, params).rowcount > 0


def last_token(connection: sa.Connection, lock: AdvisoryLock) -> int | None:
    """The last token issued for ``lock``'s key (committed), or None: for operators and tests."""
    params = identity.key_params(lock.key)
    row = connection.exec_driver_sql(tokens.LAST, params).first()
    return None if row is None else int(row[0])


def create_sql(schema: str = "public") -> str:
    """The SQL that creates the fencing table and its sequence in ``schema``."""
    return tokens.CREATE.format(schema=quote_identifier(schema) + ".")


def drop_sql(schema: str = "public") -> str:
    """The SQL that drops them."""
    return tokens.DROP.format(schema=quote_identifier(schema) + ".")


def grant_sql(role: str, schema: str = "public") -> str:
    """The GRANTs a least-privilege lock role needs to use fencing."""
    return tokens.GRANT.format(
        schema=quote_identifier(schema) + ".", role=quote_identifier(role)
    )


def quote_identifier(name: str) -> str:
    """``name`` as a double-quoted PostgreSQL identifier, for operator SQL text."""
    return '"' + name.replace('"', '""') + '"'


def _prepare(
    connection: sa.Connection,
    table: str,
    key: Mapping[str, object],
    values: Mapping[str, object],
    token: int | None,
    token_column: str,
) -> tuple[str, str | None, list[str], list[str], dict[str, object]]:
    """Check and quote a write's names; token column None: unfenced (a shadowed run)."""
    if token is None:
        if not tokens.unfenced.get():
            raise exceptions.ConfigurationError(
                "token=None: this run has no fencing token; set lock_fencing=True on the "
                "task (or call celery_pglock.fencing.issue_token() after acquire)."
            )
    elif isinstance(token, bool) or not isinstance(token, int):
        raise exceptions.ConfigurationError(
            f"token must be an int (current_lock().fencing_token), got a {type(token).__name__}."
        )
    if not key:
        raise exceptions.ConfigurationError(
            "key must name at least one column: a fenced write without a key would touch every row."
        )
    if overlap := set(key) & set(values):
        raise exceptions.ConfigurationError(
            f"Columns {sorted(overlap)} are in both key and values; a column is one or the other."
        )
    parts = table.split(".") if isinstance(table, str) else [table]
    if len(parts) > 2:
        raise exceptions.ConfigurationError(
            f"table={table!r} is invalid; expected 'name' or 'schema.name'."
        )

    def quote(name: str) -> str:
        if not isinstance(name, str) or not _IDENTIFIER.fullmatch(name):
            raise exceptions.ConfigurationError(
                f"{name!r} is not a plain SQL identifier (letters, digits, _ and $, "
                "starting with a letter or _, at most 63 characters)."
            )
        return str(connection.dialect.identifier_preparer.quote(name))

    params = {f"k{i}": v for i, v in enumerate(key.values())}
    params.update({f"v{i}": v for i, v in enumerate(values.values())})
    if token is not None:
        params["fencing_token"] = token
    target = ".".join(map(quote, parts))
    token_col = quote(token_column)  # checked even if unused
    keys, cols = [quote(name) for name in key], [quote(name) for name in values]
    return target, None if token is None else token_col, keys, cols, params
