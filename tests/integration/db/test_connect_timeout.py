"""A connect to a server that accepts TCP but never answers ends within lock_db_timeout:
the lock engine's connect_timeout is pglock_db_timeout in whole seconds (at least libpq's
2 s), not a fixed 10 s (docs/reference/settings.md#connection-settings).

The silent server is a listening socket that never accepts: the kernel completes the
handshake, and libpq then waits for an answer to its first packet that never comes.
"""

from __future__ import annotations

import socket
import time
from typing import TYPE_CHECKING

import pytest

from celery_pglock import AdvisoryLock, DatabaseError, EnqueueUnavailable, keys
from celery_pglock.db import engines
from celery_pglock.testing import _support
from tests.integration.task_support import define

if TYPE_CHECKING:
    from collections.abc import Iterator


@pytest.fixture
def silent_url() -> Iterator[str]:
    """The URL of a server that completes the TCP handshake and then says nothing."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        listener.bind((_support.HOST, 0))
        listener.listen(16)
        port = listener.getsockname()[1]
        yield f"postgresql+{_support.driver()}://app:secret@{_support.HOST}:{port}/locks"


def test_a_send_to_a_silent_server_ends_within_lock_db_timeout(app, silent_url):
    """A lock_enqueue send raises EnqueueUnavailable after about pglock_db_timeout (2 s
    here), not after a fixed connect timeout."""
    app.conf.pglock_database_url = silent_url
    app.conf.pglock_db_timeout = 2

    def enqueue_silent(tenant):
        return None

    task = define(
        app, enqueue_silent, lock_args=("tenant",), lock_enqueue="until_finished"
    )
    started = time.monotonic()
    with pytest.raises(EnqueueUnavailable) as raised:
        task.delay(1)
    took = time.monotonic() - started
    assert 1.5 <= took < 4, f"the send ended after {took:.1f} s"
    assert "secret" not in str(raised.value)


@pytest.mark.parametrize(
    ("db_timeout", "expected"),
    [(3, 3.0), (2.2, 3.0), (0.5, 2.0)],
    ids=["whole", "rounded-up", "libpq-minimum"],
)
def test_an_acquire_on_a_silent_server_ends_within_the_connect_timeout(
    silent_url, db_timeout, expected
):
    """An acquire's connect waits pglock_db_timeout rounded up to whole seconds, and at
    least 2 s (libpq's minimum, which psycopg 3 keeps), then raises DatabaseError."""
    engine = engines.create_engine(silent_url, {"pglock_db_timeout": db_timeout})
    lock = AdvisoryLock(engine=engine, key=keys.make_key("silent", "connect"))
    try:
        started = time.monotonic()
        with pytest.raises(DatabaseError) as raised:
            lock.acquire()
        took = time.monotonic() - started
    finally:
        engine.dispose()
    assert expected - 0.5 <= took < expected + 1.5, f"the acquire took {took:.1f} s"
    assert "secret" not in str(raised.value)


def test_connect_timeout_follows_pglock_db_timeout():
    """The engine's connect_timeout: ceil(pglock_db_timeout), at least 2, 5 when unset,
    and a connect_timeout given in pglock_engine_options wins."""
    assert 5 == engines.connect_timeout({})
    assert 3 == engines.connect_timeout({"pglock_db_timeout": 2.5})
    assert 2 == engines.connect_timeout({"pglock_db_timeout": 0.1})
    url = "postgresql+psycopg2://app@127.0.0.1:1/locks"
    engine = engines.create_engine(
        url,
        {
            "pglock_db_timeout": 3,
            "pglock_engine_options": {"connect_args": {"connect_timeout": 7}},
        },
    )
    try:
        assert 7 == engines.connect_params(engine)["connect_timeout"]
    finally:
        engine.dispose()
