"""lock_rate with two real prefork workers, real Redis and a lock database (a private
PostgreSQL) restarted in the middle: starts never exceed the rate in any window."""

from __future__ import annotations

import time

#: Sends, one every SPACING seconds: 20 over 15 s, across one and a half windows.
SENDS, SPACING = 20, 0.75
#: Between a start's row (PostgreSQL's now()) and its body's record (another server's
#: clock_timestamp()): a window of body starts may look this much shorter.
SLACK = 0.25


def test_rate_of_3_per_10s_holds_across_two_workers_and_a_restart(
    outage_workers, private_postgres, recorder, run
):
    """lock_rate=(3, 10) and the default 'skip': 20 sends of one key, one every 0.75 s,
    to two workers (-c 2 each); the lock database stops for 2 s after the 8th send
    (messages due then are re-queued by autoretry_for=DatabaseError). Any 4 starts span
    at least 10 s (the rows are durable: a restart forgets no start), and the rate is
    used: 3 starts in the first window, and starts in each later one."""
    outage = outage_workers(2)
    results = []
    for index in range(SENDS):
        results.append(outage.rated.delay(run, "k"))
        if index == 7:
            private_postgres.stop()
            time.sleep(2)
            private_postgres.start()
        time.sleep(SPACING)
    for result in results:
        result.get(timeout=90, propagate=False)
    starts = sorted(interval.started_at for interval in recorder.intervals(run))
    spans = [
        (later - earlier).total_seconds()
        for earlier, later in zip(starts, starts[outage.RATE[0] :], strict=False)
    ]
    assert all(span >= outage.RATE[1] - SLACK for span in spans), (starts, spans)
    assert 3 <= len(spans), starts  # 6+ starts: the rate is used, not blocking all
    assert (starts[2] - starts[0]).total_seconds() < 3, starts  # 3 at once at first
    skipped = [r for r in results if r.state == "FAILURE"]
    assert len(starts) + len(skipped) == SENDS, [r.state for r in results]
    assert all("lock_rate 3/10s" in str(r.result) for r in skipped)
