"""The server frees a vanished client's lock within the bound the docs give (issue 16).

The holder runs on a client host of its own (a network namespace, tests/integration/netns.py)
and the link is cut, so what the server sends goes unanswered, as when a worker host loses
power. On loopback the server's probes are always answered, which is why this needs a
namespace. docs/operations/lock-loss.md#the-deadline-arithmetic: freed at the latest
tcp_keepalives_idle + interval x count = 60 s after the link breaks, whether the session was
idle (the keepalives end it) or the server had just sent it something (an answer, here a
notification: keepalives do not probe while data waits for an acknowledgement, so
tcp_user_timeout ends it, where the kernel alone would retransmit for some 15 minutes).
"""

from __future__ import annotations

import contextlib
import os
import selectors
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psycopg2
import pytest

from celery_pglock import keys
from celery_pglock.db import startup_options
from celery_pglock.testing import _support
from celery_pglock.testing.postgres import EmbeddedPostgres
from tests.integration import frozen_client, netns
from tests.integration.loss_support import dsn

pytestmark = pytest.mark.netns

REPO = Path(__file__).resolve().parents[3]
KEEPALIVES = dict(startup_options.SERVER_KEEPALIVES)
#: The documented latest: idle + interval x count (tcp_user_timeout equals it).
BOUND = int(KEEPALIVES["tcp_keepalives_idle"]) + int(
    KEEPALIVES["tcp_keepalives_interval"]
) * int(KEEPALIVES["tcp_keepalives_count"])
#: Polling, scheduling on a busy machine.
SLACK = 15
#: Sooner than this is not the keepalives (the soonest is interval x count = 30 s, and the
#: link is cut right after the grant, so about BOUND is expected), nor tcp_user_timeout.
NOT_BEFORE = 20
#: Seconds the client may take to connect and print "held".
HELD_TIMEOUT = 30.0
POLL = 0.5
#: What the server logs when its socket to the client timed out (ETIMEDOUT).
TIMED_OUT = "could not receive data from client: Connection timed out"

HELD_SQL = """
    SELECT host(a.client_addr) FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
    WHERE l.locktype = 'advisory' AND l.granted
      AND l.classid = %s::oid AND l.objid = %s::oid AND l.objsubid = %s::int2
"""


@pytest.fixture
def link():
    missing = netns.missing()
    # Only with netns.REQUIRE_ENV=1: conftest deselects this test otherwise.
    if missing:
        pytest.fail(f"This test needs {', '.join(missing)}.")
    created = netns.create("frozen")
    try:
        yield created
    finally:
        netns.remove(created)


@pytest.fixture
def server(link):
    """A private PostgreSQL that also listens on the pair's host end and trusts the client."""
    listen = f"{_support.HOST},{link.host_address}"
    postgres = EmbeddedPostgres(settings={"listen_addresses": listen})
    try:
        postgres.start()
        with (postgres.data_dir / "pg_hba.conf").open("a") as hba:
            hba.write(f"host all all {link.client_address}/32 trust\n")
        _execute(postgres.url(), "SELECT pg_reload_conf()")
        yield postgres
    finally:
        postgres.cleanup()


def test_the_server_frees_a_vanished_clients_lock_within_the_keepalive_bound(
    link, server, namespace, record_property
):
    """Both cases on one cut link, at once (one wait of about BOUND, not two): an idle
    holder, and one the server has just sent a notification (answer in flight)."""
    keys_by_traffic = {
        traffic: keys.make_key(namespace, f"frozen-{traffic}")
        for traffic in ("idle", "answer_in_flight")
    }
    client_url = server.url().replace(_support.HOST, link.host_address, 1)
    with (
        _holder(link, client_url, namespace, "frozen-idle") as idle,
        _holder(
            link, client_url, namespace, "frozen-answer_in_flight", "--listen"
        ) as listening,
    ):
        for key in keys_by_traffic.values():
            assert _holder_address(server.url(), key) == link.client_address
        for holder in (idle, listening):
            os.kill(holder.pid, signal.SIGSTOP)  # nothing the client does matters now
        link.cut()
        _execute(server.url(), f"NOTIFY {frozen_client.CHANNEL}")  # only one listens
        freed_after = _wait_until_free(server.url(), keys_by_traffic, BOUND + SLACK)
    for traffic, after in freed_after.items():
        assert after is not None, (
            f"{traffic}: the server still held the vanished client's lock "
            f"{BOUND + SLACK} s after the link was cut (bound {BOUND} s: "
            f"{startup_options.SERVER_OPTIONS})"
        )
        assert after >= NOT_BEFORE, (
            f"{traffic}: freed {after:.1f} s after the cut: sooner than any keepalive, "
            "so something else ended the session"
        )
        record_property(f"freed_after_s_{traffic}", round(after, 1))
        print(
            f"{traffic}: lock freed {after:.1f} s after the link was cut (bound {BOUND} s)"
        )
    # Timeouts, not errors: the keepalives (or tcp_user_timeout) gave up on each peer.
    assert 2 <= server.log_path.read_text(errors="replace").count(TIMED_OUT)


@contextlib.contextmanager
def _holder(link, url, namespace, name, *flags):
    """The client process holding ``name`` inside the namespace, once it printed "held";
    killed after."""
    argv = [sys.executable, "-m", "tests.integration.frozen_client", url, namespace]
    with tempfile.TemporaryFile("w+") as errors:
        holder = subprocess.Popen(
            link.exec_argv(*argv, name, *flags),
            cwd=REPO,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=errors,
            text=True,
        )
        try:
            line = _read_line(holder, HELD_TIMEOUT)
            if line != "held":
                errors.seek(0)
                pytest.fail(
                    f"the client in {link.namespace} printed {line!r}, not 'held' "
                    f"within {HELD_TIMEOUT:g} s; its stderr:\n{errors.read()[-3000:]}"
                )
            yield holder
        finally:
            with contextlib.suppress(ProcessLookupError):
                holder.kill()  # SIGKILL ends a stopped process too
            holder.wait(timeout=10)
            holder.stdout.close()


def _read_line(process, timeout):
    with selectors.DefaultSelector() as selector:
        selector.register(process.stdout, selectors.EVENT_READ)
        if not selector.select(timeout):
            return None
    return process.stdout.readline().strip()


def _wait_until_free(url, keys_by_name, timeout):
    """Seconds until no session holds each key (by name); None for one still held at
    ``timeout``."""
    started = time.monotonic()
    freed = dict.fromkeys(keys_by_name)
    while time.monotonic() - started < timeout:
        for name, key in keys_by_name.items():
            if freed[name] is None and _holder_address(url, key) is None:
                freed[name] = time.monotonic() - started
        if all(after is not None for after in freed.values()):
            break
        time.sleep(POLL)
    return freed


def _holder_address(url, key):
    connection = psycopg2.connect(dsn(url), connect_timeout=5)
    try:
        with connection.cursor() as cursor:
            cursor.execute(HELD_SQL, key.pg_locks_ids)
            row = cursor.fetchone()
    finally:
        connection.close()
    return None if row is None else row[0]


def _execute(url, sql):
    connection = psycopg2.connect(dsn(url), connect_timeout=5)
    connection.autocommit = True
    try:
        with connection.cursor() as cursor:
            cursor.execute(sql)
    finally:
        connection.close()
