"""What compare.py measures: the contenders, the workloads and one drain's figures."""

from __future__ import annotations

import dataclasses

import bench_app

TENANTS = 50
SLOW_BODY = 0.002


@dataclasses.dataclass(frozen=True)
class Contender:
    worker: str  #: BENCH_CONTENDER of its worker
    task: str  #: task name
    locks_at_publish: bool = False  #: the peers lock when a message is published


#: A skip that ends SUCCESS (lock_skip_result="success") instead of FAILURE: what Celery's
#: failure path costs a skip. Drained with the hot key only.
SKIP_SUCCESS_ROW = "SingletonTask session, skips end SUCCESS"
#: Not a library mode: the release's reply read later (unsafe; see bench_app).
UNAWAITED_ROW = "SingletonTask session (release not awaited; measured only)"
#: SingletonTask session run by another checkout of celery-pglock (compare.py --baseline):
#: the same harness, the previous code, in the same run.
BASELINE_ROW = "SingletonTask session, baseline code"
CONTENDERS = {
    "plain": Contender("plain", bench_app.PLAIN),
    "plain + 2 round trips": Contender("plain", bench_app.PLAIN_ROUND_TRIPS),
    "SingletonTask session": Contender("pglock", bench_app.SESSION),
    "SingletonTask transaction": Contender("pglock", bench_app.TRANSACTION),
    SKIP_SUCCESS_ROW: Contender("pglock", bench_app.SKIP_SUCCESS),
    UNAWAITED_ROW: Contender(bench_app.UNAWAITED, bench_app.SESSION),
    BASELINE_ROW: Contender(bench_app.BASELINE, bench_app.SESSION),
    "celery-once 3.0.1": Contender("once", bench_app.ONCE, True),
    "celery-singleton 0.3.1": Contender("singleton", bench_app.SINGLETON, True),
}


@dataclasses.dataclass(frozen=True)
class Workload:
    keys: str  #: "distinct", "hot" (held by another session throughout) or "tenants"
    body: float = 0.0  #: seconds each body sleeps


WORKLOADS = {
    "distinct keys": Workload("distinct"),
    "one hot key": Workload("hot"),
    "per-tenant mix": Workload("tenants"),
    "slow body 2 ms": Workload("distinct", SLOW_BODY),
}
#: The threads-64 run: bodies long enough for 64 locks to be held at once.
THREADS = Workload("distinct", 0.1)
SESSION, PLAIN, ROUND_TRIPS = "SingletonTask session", "plain", "plain + 2 round trips"


@dataclasses.dataclass
class Sample:
    queued: int
    dropped: int  #: refused at publish (peers)
    peak: int = 0  #: most bodies running at the same instant
    ran: int = 0
    skipped: int = 0
    rate: float | None = None  #: messages handled per second
    worker_us: float | None = None  #: worker CPU per handled message
    worker_sys_us: float | None = None  #: the kernel's share of it
    pg_us: float | None = None  #: lock-session backends' CPU per handled message
    connections: int = 0
    rss: float | None = None  #: MiB, largest task process, after the worker's drains
