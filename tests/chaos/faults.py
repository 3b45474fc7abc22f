"""The faults of the chaos run's main phase, each recorded as a :class:`Fault`."""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tests.chaos.run import Chaos

PROCESS_TAG = re.compile(r":(\d+)")


@dataclasses.dataclass
class Fault:
    """One injected fault, for the loss and recovery figures."""

    kind: str
    began: float  #: time.time() before the fault.
    done: float  #: time.time() once it was injected (a restart: when the server was down).
    pids: set[int] = dataclasses.field(default_factory=set)  #: Processes it hit.
    detail: str = ""
    #: The task ids holding locks through a link when it froze.
    holders: set[str] = dataclasses.field(default_factory=set)
    after: str = ""  #: The proxied worker's first task after the link came back.
    #: A termination: the advisory locks its backend held, as pg_locks shows them. A
    #: process also has sessions the fault did not touch (a retry's bounded wait is
    #: granted on a connection of its own), so only these keys were surely lost.
    locks: set[tuple[int, int, int]] | None = None


def restart(chaos: Chaos) -> None:
    """Stop the lock server (fast) or crash it (immediate), alternately; start it again."""
    crash = sum(f.kind.startswith("restart") for f in chaos.faults) % 2 == 1
    began = time.time()
    if crash:
        chaos.lock_server.crash()
    else:
        chaos.lock_server.stop("fast")
    down = time.time()
    chaos.lock_server.start()
    kind = "restart (crash)" if crash else "restart (fast)"
    chaos.faults.append(
        Fault(kind, began, down, detail=f"down {time.time() - began:.2f}s")
    )
    print(f"{kind}: {time.time() - began:.2f}s", flush=True)


def terminate(chaos: Chaos) -> None:
    """pg_terminate_backend of a lock session holding a lock for a while."""
    # A lock held for longer than the watch interval: the watcher has a lock to check (a
    # shorter body learns of it at release, lock_release_failed). Held since when is
    # seen here, by polling: the session's state_change is no clue, since the watcher's
    # checks run on the lock session itself.
    sql = (
        "SELECT a.pid, a.application_name, l.classid, l.objid, l.objsubid "
        "FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid "
        "WHERE l.locktype = 'advisory' AND l.granted"
    )
    first_seen: dict[tuple[int, tuple[int, int, int]], float] = {}
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        now = time.monotonic()
        names = {
            (int(pid), (int(c), int(o), int(s))): name
            for pid, name, c, o, s in lock_query(chaos, sql)
        }
        first_seen = {held: first_seen.get(held, now) for held in names}
        long_held = sorted(held for held, t in first_seen.items() if now - t >= 0.8)
        if long_held:
            backend, key = chaos.rng.choice(long_held)
            tag = PROCESS_TAG.search(names[backend, key] or "")
            locks = {key for pid, key in names if pid == backend}
            began = time.time()
            lock_query(chaos, "SELECT pg_terminate_backend(%s)", (backend,))
            pids = {int(tag.group(1))} if tag else set()
            chaos.faults.append(
                Fault(
                    "terminate",
                    began,
                    time.time(),
                    pids,
                    f"backend {backend}",
                    locks=locks,
                )
            )
            return
        time.sleep(0.1)
    print("terminate: no lock held long enough within 5 s; not injected", flush=True)


def child_kill(chaos: Chaos) -> None:
    """SIGKILL a prefork pool child while it runs a body.

    Its message is then rejected and redelivered (acks_late + reject_on_worker_lost), which
    the run must show. A child seen busy a moment ago may have finished a short body since,
    so prefer one running a long body that started moments ago; if none does within 3 s (right
    after a restart every body has just been ended), send one on a key of its own and kill
    the child that runs it.
    """
    prefork = [w for w in chaos.main_workers if w.pool == "prefork" and w.running]
    if not any(worker.child_pids() for worker in prefork):
        return
    pid = _child_running_a_long_body(chaos, prefork, within=3.0)
    if pid is None:
        chaos._send("long", f"kill-{len(chaos.faults)}", 2.5, chaos.queue)
        pid = _child_running_a_long_body(chaos, prefork, within=10.0)
    if pid is None:
        print("child kill: no prefork child ran a long body within 13 s", flush=True)
        return
    began = time.time()
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return  # it had just exited (a time limit): not a fault of ours
    chaos.faults.append(Fault("SIGKILL pool child", began, time.time(), {pid}))


def _child_running_a_long_body(
    chaos: Chaos, prefork: list[Any], within: float
) -> int | None:
    """The pid of a prefork child running a "long" body begun under 0.5 s ago (one of at
    least 1 s, so still running when the kill lands) or a "hang" body; None after ``within`` s."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        children = {pid for worker in prefork for pid in worker.child_pids()}
        sent = list(chaos.sent.items())  # the sender thread adds to it
        long_ids = [i for i, kind in sent if kind in ("long", "hang")]
        with chaos.app.loss_app._events_cursor() as cursor:
            cursor.execute(
                f"SELECT pid FROM {chaos.app.recorder.table} WHERE run = %s"
                " AND task_id = ANY(%s)"
                " AND ended_at > clock_timestamp() - interval '0.3 seconds'"
                " AND started_at > clock_timestamp() - interval '0.5 seconds'",
                (f"{chaos.run_id}-main", long_ids),
            )
            busy = [row[0] for row in cursor.fetchall() if row[0] in children]
        if busy:
            return int(chaos.rng.choice(busy))
        time.sleep(0.05)
    return None


def worker_kill(chaos: Chaos) -> None:
    """SIGKILL a whole main worker and start a replacement."""
    victim = chaos.rng.choice([w for w in chaos.main_workers if w.running])
    pids = {victim.pid, *victim.child_pids()}
    began = time.time()
    victim.kill()
    fault = Fault(f"SIGKILL whole {victim.pool} worker", began, time.time(), pids)
    chaos.faults.append(fault)
    pool, concurrency, env, queues = chaos.specs[victim]
    replacement = chaos._worker(pool, concurrency, env, queues)
    chaos.main_workers[chaos.main_workers.index(victim)] = replacement
    replacement.start(timeout=120)
    fault.detail = f"replacement ready after {time.time() - began:.1f}s"


def lock_query(
    chaos: Chaos, sql: str, params: tuple[Any, ...] = ()
) -> list[tuple[Any, ...]]:
    """Run ``sql`` on the private lock server, on a connection of its own."""
    from celery_pglock.testing import _support

    connection = _support.connect(chaos.lock_server.url(), application_name="chaos")
    try:
        connection.autocommit = True
        with connection.cursor() as cursor:
            cursor.execute(sql, params)
            return list(cursor.fetchall()) if cursor.description else []
    finally:
        connection.close()


#: Fault kind (as scheduled by the main phase) -> how to inject it.
INJECT = {
    "restart": restart,
    "terminate": terminate,
    "child_kill": child_kill,
    "worker_kill": worker_kill,
}
