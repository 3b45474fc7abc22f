"""Operator SQL: what the ``pglock`` command runs and installs. Never on a task's path.

Kept apart from ``db/sql_text.py`` (the hot-path statements) because none of it runs while a
task holds or asks for a lock. Parameters are DBAPI ``%s`` placeholders; the only text
spliced in is a schema name quoted by :func:`install_sql`.
"""

from __future__ import annotations

from celery_pglock import keys

#: Every advisory lock of the current database, held or awaited, with its session. The
#: key is rebuilt from (classid, objid, objsubid) as LockKey.__str__ writes it. "since"
#: (docs/operations/cli.md): when the transaction began, else when the session last ran a
#: statement (a lower bound: the lock watcher checks on the lock session); for a waiter,
#: pg_locks.waitstart (PostgreSQL >= 14). Run locks (the task-id locks an acks_late run
#: holds beside its key, keys.run_key) are left out.
LOCKS = f"""
SELECT
  CASE WHEN l.objsubid = 1
       THEN ((l.classid::bigint << 32) | l.objid::bigint)::text
       ELSE (CASE WHEN l.classid::bigint > 2147483647 THEN l.classid::bigint - 4294967296
                  ELSE l.classid::bigint END)::text
            || ',' ||
            (CASE WHEN l.objid::bigint > 2147483647 THEN l.objid::bigint - 4294967296
                  ELSE l.objid::bigint END)::text
  END AS key,
  l.pid AS backend_pid,
  l.granted,
  l.mode,
  a.application_name,
  host(a.client_addr) AS client_addr,
  a.state,
  CASE WHEN l.granted
       THEN COALESCE(a.xact_start, a.state_change, a.backend_start)
       ELSE l.waitstart END AS since,
  now() AS now
FROM pg_locks l
LEFT JOIN pg_stat_activity a ON a.pid = l.pid
WHERE l.locktype = 'advisory'
  AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
  AND l.pid <> pg_backend_pid()
  AND NOT (l.objsubid = 2 AND l.classid = {keys.RUN_NAMESPACE})
ORDER BY key, l.granted DESC, since
"""

#: Facts ``pglock check`` needs in one round trip.
SERVER_FACTS = """
SELECT current_setting('server_version_num')::int,
       current_setting('server_version'),
       pg_is_in_recovery(),
       current_setting('max_connections')::int,
       current_setting('superuser_reserved_connections')::int,
       (SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'client backend'),
       inet_server_port(),
       current_user,
       has_function_privilege('pg_try_advisory_lock(bigint)', 'execute'),
       has_function_privilege('pg_try_advisory_xact_lock(bigint)', 'execute')
"""

#: The SQL twin of keys.make_key, and a view of advisory locks, for people in psql.
#: ``{schema}`` is replaced by a quoted identifier. celery_pglock_canonical() writes
#: jsonb as Python's json.dumps(sort_keys=True, separators=(",", ":"),
#: ensure_ascii=False) does: exact for strings, integers, booleans, null, arrays and
#: objects; a float only when its decimal text is Python's repr of it.
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
    + LOCKS.replace("ORDER BY key, l.granted DESC, since", "").rstrip()
    + ";\n"
)

#: Removes what INSTALL creates.
UNINSTALL = """
DROP VIEW IF EXISTS {schema}.celery_pglock_locks;
DROP FUNCTION IF EXISTS {schema}.celery_pglock_key(text, text, jsonb);
DROP FUNCTION IF EXISTS {schema}.celery_pglock_canonical(jsonb);
"""


def quote_identifier(name: str) -> str:
    """A PostgreSQL identifier, double-quoted (the schema name is the only spliced text)."""
    return '"' + name.replace('"', '""') + '"'


def install_sql(schema: str = "public") -> str:
    """The CREATE statements for ``schema``."""
    return INSTALL.format(schema=quote_identifier(schema))


def uninstall_sql(schema: str = "public") -> str:
    """The DROP statements for ``schema``."""
    return UNINSTALL.format(schema=quote_identifier(schema))
