"""What a lock_period start's statement costs PostgreSQL, against its floor's upsert.

    .venv/bin/python benchmarks/period_statements.py [--sends N] [--reps R]

Issue 35 judges the start against compare.py's floor row, one upsert of the key's last
start sent by hand. The forms here run on the library's own table and the same params
(prepared, written by sql_text.inline, as claim_statements.py sends them), so that only
the statement differs:

- ``floor``: the floor's upsert (its row kept if the window has not passed);
- ``floor + settings``: the same, after the CTE of the library's statement that makes the
  commit durable and bounds a wait on a locked row (``synchronous_commit``,
  ``lock_timeout``);
- ``floor + settings + read``: the same, with the library's read of the row for a
  refused start (skipped once a start is recorded);
- ``library - read``: the library's statement without that read;
- ``library``: the start lock_period sends (``periods._START``, one start per window),
  which also keeps lock_rate's earlier starts, lets a retry run again and reads the row
  for a refusal.

Cases: a new key per start (the insert), and one key whose window (0 s) has always
passed (the update). PostgreSQL backend and client CPU as in claim_statements.py.
"""

from __future__ import annotations

import uuid
from typing import Any

from claim_statements import arguments, connection, measure, report

from celery_pglock import keys
from celery_pglock.db import sql_text
from celery_pglock.lock import identity
from celery_pglock.task import periods

_UPSERT = """
  INSERT INTO celery_pglock_periods AS t (classid, objid, objsubid, started_at, task_id)
  SELECT %(classid)s::oid, %(objid)s::oid, %(objsubid)s::smallint, now(), %(task_id)s
  {source}
  ON CONFLICT (classid, objid, objsubid) DO UPDATE
  SET (started_at, task_id) = (EXCLUDED.started_at, EXCLUDED.task_id)
  WHERE t.started_at <= EXCLUDED.started_at - make_interval(secs => %(window)s)
  RETURNING 1"""
_SETTINGS = """WITH bounded AS MATERIALIZED (
  SELECT set_config('synchronous_commit', 'on', true) AS durable,
         set_config('lock_timeout', %(lock_timeout)s, true) AS waits),
started AS ({upsert})
SELECT 1 FROM started"""
#: The library's statement: its upsert, its answer for a recorded start, then the read
#: that says when a refused start's window opens (a branch skipped once a start is made).
_STARTED = "SELECT true, NULL::float8, NULL::text FROM started"
_LIBRARY_UPSERT, _REFUSAL_READ = periods._START.split(_STARTED)
_FLOOR_WITH_SETTINGS = _SETTINGS.format(upsert=_UPSERT.format(source="FROM bounded"))
FORMS = {
    "floor": _UPSERT.format(source=""),
    "floor + settings": _FLOOR_WITH_SETTINGS,
    "floor + settings + read": _FLOOR_WITH_SETTINGS.replace(
        "SELECT 1 FROM started", _STARTED + _REFUSAL_READ
    ),
    "library - read": _LIBRARY_UPSERT + _STARTED,
    "library": periods._START,
}


def main() -> int:
    args = arguments(__doc__.split("\n", 1)[0])
    run = uuid.uuid4().hex[:8]
    with connection(periods.TABLE) as (dbapi, cursor, backend):

        def params(material: str) -> dict[str, Any]:
            key = keys.make_key("bench-period", run, material)
            return {
                **identity.key_params(key),
                "task_id": f"{run}-{uuid.uuid4()}",
                "window": 0.0,
                "starts": 1,
                "again": False,
                "lock_timeout": "2500ms",
            }

        def send(form: str, values: dict[str, Any]) -> None:
            text = FORMS[form]
            execute = sql_text.prepared(dbapi, cursor, sql_text.name_for(text), text)
            cursor.execute(*sql_text.inline(execute, values))
            cursor.fetchall()

        results = measure(
            send, backend, FORMS, ("new key", "same key"), params, args.sends, args.reps
        )
        cursor.execute(
            "DELETE FROM celery_pglock_periods WHERE task_id LIKE %s", (f"{run}-%",)
        )
    report(results, args.sends, args.reps)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
