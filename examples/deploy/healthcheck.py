"""docker-compose.yml's worker health check: healthy only while the worker can lock.

    python -m examples.deploy.healthcheck http://127.0.0.1:9808/metrics

Two checks, each bounded by a few seconds, exit status 1 and one line on stderr if either
fails:

1. The worker serves ``/metrics``. It starts serving at ``worker_init``, after its start-up
   checks: a lock database that refuses the worker (a wrong password, a missing database)
   has stopped it by then (``pglock_on_misconfigured_database='stop'``, the default).
2. The lock database answers a query on the URL the worker uses
   (``$CELERY_PGLOCK_DATABASE_URL``), from this container. An outage after the worker
   started, or a server that was not up yet at its start (which does not stop it: waiting
   may fix that), makes the worker unhealthy until the database answers again; its
   SingletonTasks fail meanwhile.
"""

from __future__ import annotations

import os
import sys
import urllib.request

import sqlalchemy as sa

TIMEOUT = 3  #: Seconds for each check (compose's own timeout is 5 s).


def main(argv: list[str]) -> int:
    (metrics_url,) = argv
    try:
        # A literal http:// URL from the compose file (S310 warns of file: and others).
        with urllib.request.urlopen(metrics_url, timeout=TIMEOUT) as response:  # noqa: S310
            response.read()
    except OSError as exc:
        print(f"unhealthy: the worker serves no {metrics_url} ({exc})", file=sys.stderr)
        return 1
    url = sa.make_url(os.environ["CELERY_PGLOCK_DATABASE_URL"])
    engine = sa.create_engine(
        url, poolclass=sa.NullPool, connect_args={"connect_timeout": TIMEOUT}
    )
    try:
        with engine.connect() as connection:
            connection.execute(sa.text("SELECT 1"))
    except sa.exc.SQLAlchemyError as exc:
        reason = str(getattr(exc, "orig", exc)).strip().splitlines()[0]
        if url.password:  # never print it, even echoed back by libpq
            reason = reason.replace(str(url.password), "***")
        where = url.render_as_string(hide_password=True)
        print(f"unhealthy: the lock database {where}: {reason}", file=sys.stderr)
        return 1
    finally:
        engine.dispose()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
