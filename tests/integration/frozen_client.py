"""The lock holder of tests/integration/db/test_frozen_client.py, run in a network namespace.

    python -m tests.integration.frozen_client URL NAMESPACE NAME [--listen] [--no-server-keepalives]

Takes the session-scope AdvisoryLock of ``keys.make_key(NAMESPACE, NAME)`` through the
library's own lock engine with its default settings (so the server keepalive startup
options are what the test measures), prints ``held`` and sleeps until it is killed.
``--listen`` then runs ``LISTEN pglock_frozen`` on the lock session, so that the test can
make the server send it data at will (a notification). ``--no-server-keepalives`` sets ``pglock_server_keepalives = False``, to show the test
fails without them.
"""

from __future__ import annotations

import sys
import time

from celery_pglock import AdvisoryLock, keys
from celery_pglock.db import engines
from celery_pglock.lock import sessions

#: The channel ``--listen`` listens on.
CHANNEL = "pglock_frozen"

#: Seconds the holder sleeps at most: the test kills it long before.
HOLD_SECONDS = 600


def main(argv: list[str]) -> int:
    url, namespace, name, *flags = argv
    conf = {"pglock_server_keepalives": "--no-server-keepalives" not in flags}
    engine = engines.create_engine(url, conf)
    lock = AdvisoryLock(engine=engine, key=keys.make_key(namespace, name))
    if not lock.acquire():
        print("busy", flush=True)
        return 1
    if "--listen" in flags:
        # On the lock's own session (the process session of the default session mode;
        # private, but this is a test's helper): the lock must be on the session whose
        # notification goes unacknowledged.
        connection = sessions.process_session(engine)._connection
        with connection.cursor() as cursor:
            cursor.execute(f"LISTEN {CHANNEL}")
    print("held", flush=True)
    time.sleep(HOLD_SECONDS)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
