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
    enqueue: bool = False  #: SingletonTask with lock_enqueue: checks at publish too


#: A skip that ends SUCCESS (lock_skip_result="success") instead of FAILURE: what Celery's
#: failure path costs a skip. Drained with the hot key only.
SKIP_SUCCESS_ROW = "SingletonTask session, skips end SUCCESS"
#: Not a library mode: the release's reply read later (unsafe; see bench_app).
UNAWAITED_ROW = "SingletonTask session (release not awaited; measured only)"
#: SingletonTask session run by another checkout of celery-pglock (compare.py --baseline):
#: the same harness, the previous code, in the same run.
BASELINE_ROW = "SingletonTask session, baseline code"
#: SingletonTask session with lock_enqueue (issue 18): the producer's apply_async takes the
#: key's queued row, so duplicates are dropped at publish, as the peers drop them.
UNTIL_FINISHED_ROW = "SingletonTask session + until_finished"
UNTIL_STARTED_ROW = "SingletonTask session + until_started"
ENQUEUE_ROWS = (UNTIL_FINISHED_ROW, UNTIL_STARTED_ROW)
#: Latest wins (issue 34): a replacing send is written into its key's row (counted as
#: dropped at publish); the key's carrier publishes the latest send when taken (one more
#: message to drain). Debounce: the same, each key's first message due after 0.1 s.
#: Compared with until_started on the same workload.
LATEST_ROW = "SingletonTask session + until_started + replace"
DEBOUNCE_ROW = "SingletonTask session + lock_debounce=0.1"
REPLACING_ROWS = (LATEST_ROW, DEBOUNCE_ROW)
#: lock_limit and lock_period (issue 18), drained with distinct keys only: each message
#: runs, so the row is the cost of the run's extra statement.
LIMIT_ROW = "SingletonTask session + lock_limit=3"
PERIOD_ROW = "SingletonTask session + lock_period"
#: Issue 34's features, distinct keys only: a rate's first start per key (its floor is the
#: period's), a slot of a group no drain fills, and the history of every outcome.
RATE_ROW = "SingletonTask session + lock_rate=3/h"
GROUP_ROW = "SingletonTask session + lock_group"
HISTORY_ROW = "SingletonTask session + pglock_history"
#: Issue 18's floors (bench_app): the rows the designs prescribe, written by hand with no
#: library; what any implementation of the design pays at least. Distinct keys only.
ROW_FLOOR = "plain + queued row by hand (floor)"
UNLOGGED_ROW_FLOOR = "plain + unlogged queued row by hand (floor)"
PERIOD_FLOOR = "plain + 2 round trips + period row (floor)"
GROUP_FLOOR = "plain + key and group slot by hand (floor)"
#: Latest wins' floor (issue 34), drained on every keyed workload as its row is: the
#: upsert at publish, the hand-over or the key and the row's delete at start, the unlock.
LATEST_FLOOR = "plain + latest row by hand (floor)"
DEBOUNCE_FLOOR = "plain + debounced row by hand (floor)"  #: the same with a due time
FLOORS = (
    *(ROW_FLOOR, UNLOGGED_ROW_FLOOR, PERIOD_FLOOR, GROUP_FLOOR),
    *(LATEST_FLOOR, DEBOUNCE_FLOOR),
)
DISTINCT_ONLY = (
    *(LIMIT_ROW, PERIOD_ROW, RATE_ROW, GROUP_ROW, HISTORY_ROW),
    *(ROW_FLOOR, UNLOGGED_ROW_FLOOR, PERIOD_FLOOR, GROUP_FLOOR),
)
CONTENDERS = {
    "plain": Contender("plain", bench_app.PLAIN),
    "plain + 2 round trips": Contender("plain", bench_app.PLAIN_ROUND_TRIPS),
    ROW_FLOOR: Contender("plain", bench_app.PLAIN_ROW_WRITES),
    UNLOGGED_ROW_FLOOR: Contender("plain", bench_app.PLAIN_UNLOGGED_ROW_WRITES),
    PERIOD_FLOOR: Contender("plain", bench_app.PLAIN_PERIOD_WRITE),
    GROUP_FLOOR: Contender("plain", bench_app.PLAIN_GROUP_SLOT),
    LATEST_FLOOR: Contender("plain", bench_app.PLAIN_LATEST_ROW),
    DEBOUNCE_FLOOR: Contender("plain", bench_app.PLAIN_DEBOUNCED_ROW),
    "SingletonTask session": Contender("pglock", bench_app.SESSION),
    "SingletonTask transaction": Contender("pglock", bench_app.TRANSACTION),
    SKIP_SUCCESS_ROW: Contender("pglock", bench_app.SKIP_SUCCESS),
    UNAWAITED_ROW: Contender(bench_app.UNAWAITED, bench_app.SESSION),
    BASELINE_ROW: Contender(bench_app.BASELINE, bench_app.SESSION),
    UNTIL_FINISHED_ROW: Contender("pglock", bench_app.UNTIL_FINISHED, True, True),
    UNTIL_STARTED_ROW: Contender("pglock", bench_app.UNTIL_STARTED, True, True),
    LATEST_ROW: Contender("pglock", bench_app.LATEST, True, True),
    DEBOUNCE_ROW: Contender("pglock", bench_app.DEBOUNCED, True, True),
    LIMIT_ROW: Contender("pglock", bench_app.LIMIT),
    PERIOD_ROW: Contender("pglock", bench_app.PERIOD),
    RATE_ROW: Contender("pglock", bench_app.RATE),
    GROUP_ROW: Contender("pglock", bench_app.GROUP),
    HISTORY_ROW: Contender(bench_app.HISTORY, bench_app.SESSION),
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
    # End to end (issue 18): publish time plus first start to last end; CPU per *send*
    # (dropped ones included), each of four places; None where it cannot be read.
    e2e_rate: float | None = None  #: sends per second
    producer_us: float | None = None  #: the publishing process, during publish
    worker_send_us: float | None = None  #: worker processes, during the drain
    redis_us: float | None = None  #: redis-server, publish through drain
    pg_send_us: float | None = None  #: the producer's and the worker's backends
