"""The chaos run's timings and sizes: what run.py, faults.py and report.py share."""

from __future__ import annotations

import dataclasses
from pathlib import Path

#: loss_app's pglock_watch_interval and the check timeouts of the two phases.
INTERVAL = 0.5
CHECK_TIMEOUT = 5.0
PARTITION_CHECK_TIMEOUT = 2.0
#: When the proxy closes a frozen link's connections (the server's keepalive deadline,
#: 30 s with the library's defaults, made much shorter to be strict).
CUT_AFTER = INTERVAL + PARTITION_CHECK_TIMEOUT + 2.0
HARD_LIMIT = 1.0  #: time_limit of the "hang" tasks, which sleep HANG seconds.
HANG = 3.0
PARTITION_HOLD = 8.0  #: How long a partitioned holder's body would run if not ended.
REPO_ROOT = Path(__file__).resolve().parents[2]


@dataclasses.dataclass(frozen=True)
class Plan:
    """How much of everything: :data:`SHORT` (CI) or :data:`FULL`."""

    tasks: int
    keys: int
    duration: float  #: Seconds over which the main phase sends its tasks.
    child_kills: int
    worker_kills: int
    restarts: int  #: Alternately pg_ctl restart (fast) and crash (immediate) + start.
    terminations: int
    partition_rounds: int


SHORT = Plan(
    tasks=300,
    keys=12,
    duration=30,
    child_kills=2,
    worker_kills=1,
    restarts=2,
    terminations=3,
    partition_rounds=1,
)
FULL = Plan(
    tasks=3000,
    keys=60,
    duration=240,
    child_kills=15,
    worker_kills=3,
    restarts=3,
    terminations=12,
    partition_rounds=3,
)
