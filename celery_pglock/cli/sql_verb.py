"""``pglock sql``; only a quoted schema name is spliced in (docs/operations/cli.md)."""

from __future__ import annotations

import click

from celery_pglock import fencing
from celery_pglock.cli import shared
from celery_pglock.db import engines
from celery_pglock.task import history, periods, queued, replacing

# celery_pglock_canonical() writes jsonb as the key format does: docs/operations/cli.md.
INSTALL = (
    """
CREATE OR REPLACE FUNCTION {schema}.celery_pglock_canonical(value jsonb)
RETURNS text LANGUAGE plpgsql IMMUTABLE STRICT AS $$
BEGIN
  IF jsonb_typeof(value) = 'object' THEN
    RETURN '{{' || COALESCE((
      SELECT string_agg(to_json(k)::text || ':' || {schema}.celery_pglock_canonical(v),
                        ',' ORDER BY k COLLATE "C")
      FROM jsonb_each(value) AS e(k, v)), '') || '}}';
  ELSIF jsonb_typeof(value) = 'array' THEN
    RETURN '[' || COALESCE((
      SELECT string_agg({schema}.celery_pglock_canonical(v), ',' ORDER BY i)
      FROM jsonb_array_elements(value) WITH ORDINALITY AS a(v, i)), '') || ']';
  END IF;
  RETURN value::text;
END $$;

COMMENT ON FUNCTION {schema}.celery_pglock_canonical(jsonb) IS
  'celery-pglock: jsonb as the canonical key text (compact, keys sorted by code point)';

CREATE OR REPLACE FUNCTION {schema}.celery_pglock_key(
  namespace text, name text, material jsonb DEFAULT 'null')
RETURNS bigint LANGUAGE sql IMMUTABLE AS $$
  SELECT ('x' || left(encode(sha256(convert_to(
    '["celery_pglock/1",' || to_json(namespace)::text || ',' || to_json(name)::text
    || ',' || COALESCE({schema}.celery_pglock_canonical(material), 'null') || ']',
    'UTF8')), 'hex'), 16))::bit(64)::bigint
$$;

COMMENT ON FUNCTION {schema}.celery_pglock_key(text, text, jsonb) IS
  'celery-pglock key format 1: the advisory key of (namespace, lock name, material); '
  'material is {{"<lock_args name>": value, ...}}, null for a task without lock_args';

CREATE OR REPLACE VIEW {schema}.celery_pglock_locks AS
"""
    + shared.LOCKS.replace("ORDER BY key, l.granted DESC, since", "").rstrip()
    + ";\n"
)

UNINSTALL = """
DROP VIEW IF EXISTS {schema}.celery_pglock_locks;
DROP FUNCTION IF EXISTS {schema}.celery_pglock_key(text, text, jsonb);
DROP FUNCTION IF EXISTS {schema}.celery_pglock_canonical(jsonb);
"""


@click.command(
    help="Print (or --apply) the SQL key function celery_pglock_key() and the view "
    "celery_pglock_locks; with --fencing, the fencing-token table instead; with "
    "--periods, the lock_period table; with --history, pglock_history's."
)
@click.option("--apply", "apply_", is_flag=True, help="Run it on the lock database.")
@click.option("--uninstall", is_flag=True, help="The DROP statements instead.")
@click.option(
    "--schema", default="public", show_default=True, help="Schema to create them in."
)
@click.option(
    "--fencing",
    "fencing_",
    is_flag=True,
    help="The table and sequence of lock_fencing (run as their owner; see the GRANTs printed).",
)
@click.option(
    "--enqueue",
    "enqueue_",
    is_flag=True,
    help="The tables of lock_enqueue (run as its owner; see the GRANTs printed).",
)
@click.option(
    "--periods",
    "periods_",
    is_flag=True,
    help="The table of lock_period (run as its owner; see the GRANT printed).",
)
@click.option(
    "--history",
    "history_",
    is_flag=True,
    help="The table of pglock_history (run as its owner; see the GRANT printed).",
)
@click.pass_obj
def sql(
    target: shared.Target,
    apply_: bool,
    uninstall: bool,
    schema: str,
    fencing_: bool,
    periods_: bool,
    enqueue_: bool,
    history_: bool,
) -> None:
    if sum((fencing_, periods_, enqueue_, history_)) > 1:
        raise click.UsageError(
            "Give one of --fencing, --periods, --enqueue and --history."
        )
    quoted = fencing.quote_identifier(schema)
    prefix = quoted + "."
    done = "Dropped" if uninstall else "Created (if missing)"
    if periods_:
        text = (periods.DROP if uninstall else periods.CREATE).format(schema=prefix)
        grants = periods.GRANT.format(schema=prefix, role='"<lock role>"')
        action, made = "set up the lock_period table", f"{schema}.celery_pglock_periods"
    elif history_:
        text = (history.DROP if uninstall else history.CREATE).format(schema=prefix)
        grants = history.GRANT.format(schema=prefix, role='"<lock role>"')
        action, made = "set up the history table", f"{schema}.celery_pglock_history"
    elif enqueue_:
        # Latest wins' tombstones too: lock_enqueue_on_duplicate='replace' (one feature).
        tables = (queued, replacing)
        text = "".join((t.DROP if uninstall else t.CREATE) for t in tables)
        text = text.format(schema=prefix)
        grants = "".join(t.GRANT for t in tables).format(
            schema=prefix, role="<lock role>"
        )
        action = "set up the queued-keys tables"
        made = f"{schema}.celery_pglock_queued and {schema}.celery_pglock_replaced"
    elif fencing_:
        text = fencing.drop_sql(schema) if uninstall else fencing.create_sql(schema)
        grants = fencing.grant_sql("<lock role>", schema)
        action = "set up the fencing table"
        made = f"{schema}.celery_pglock_fencing and {schema}.celery_pglock_fencing_token_seq"
    else:
        text = (UNINSTALL if uninstall else INSTALL).format(schema=quoted)
        action, grants = "install the SQL functions", ""
        done = "Dropped" if uninstall else "Created"
        made = f"{schema}.celery_pglock_key(), {schema}.celery_pglock_canonical() and the view {schema}.celery_pglock_locks"
    if not apply_:
        click.echo(text)
        if grants and not uninstall:
            click.echo("-- A lock role without CREATE needs:")
            click.echo("\n".join(f"-- {line}" for line in grants.strip().splitlines()))
        return
    # Autocommit: one simple query is one transaction unless it has BEGIN/COMMIT (fencing's).
    with (
        target.database(action) as engine,
        engines.autocommit_cursor(engine) as cursor,
    ):
        cursor.execute(text)
    click.echo(f"{done} {made}.")
