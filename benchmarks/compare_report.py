"""compare.py's results.

Medians, ratios paired per repetition, the Markdown tables (per handled message; end to
end, per send), the verdicts on the targets of issues 7, 18 and 35, and the generated
section of docs/benchmarks.md.
"""

from __future__ import annotations

import statistics
from typing import TYPE_CHECKING, Any

from contenders import (
    BASELINE_ROW,
    CONTENDERS,
    DEBOUNCE_FLOOR,
    DEBOUNCE_ROW,
    ENQUEUE_ROWS,
    LATEST_FLOOR,
    LATEST_ROW,
    LIMIT_ROW,
    PERIOD_FLOOR,
    PERIOD_ROW,
    PLAIN,
    REPLACING_ROWS,
    ROUND_TRIPS,
    ROW_FLOOR,
    SESSION,
    UNLOGGED_ROW_FLOOR,
    UNTIL_FINISHED_ROW,
    UNTIL_STARTED_ROW,
    WORKLOADS,
)

if TYPE_CHECKING:
    import argparse
    from collections.abc import Callable
    from pathlib import Path

    from contenders import Sample

TIMES = "\N{MULTIPLICATION SIGN}"  # the table is Markdown for people
BEGIN, END = "<!-- benchmark:begin -->", "<!-- benchmark:end -->"


def describe(sample: Sample) -> str:
    rate = f"{sample.rate:7.0f}/s" if sample.rate else "     n/a"
    cpu = (
        f"{sample.worker_us:6.0f} us (sys {sample.worker_sys_us or 0:4.0f})"
        if sample.worker_us
        else "     n/a"
    )
    return (
        f"{rate} wk {cpu} ran {sample.ran} skip {sample.skipped} dropped {sample.dropped}"
        f" | e2e {fmt(sample.e2e_rate, '.0f')}/s, us/send: producer "
        f"{fmt(sample.producer_us, '.0f')} redis {fmt(sample.redis_us, '.0f')} pg "
        f"{fmt(sample.pg_send_us, '.0f')} total {fmt(total_us(sample), '.0f')}"
    )


def median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def summarise(
    samples: dict[tuple[str, str], list[Sample]],
) -> dict[tuple[str, str], dict[str, Any]]:
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    for (name, workload), runs in samples.items():
        rows[name, workload] = {
            "rate": median([s.rate for s in runs]),
            "worker_us": median([s.worker_us for s in runs]),
            "pg_us": median([s.pg_us for s in runs]),
            "rss": median([s.rss for s in runs]),
            "connections": max(s.connections for s in runs),
            "ran": sum(s.ran for s in runs),
            "skipped": sum(s.skipped for s in runs),
            "dropped": sum(s.dropped for s in runs),
            "repetitions": len(runs),
            "e2e_rate": median([s.e2e_rate for s in runs]),
            "producer_us": median([s.producer_us for s in runs]),
            "worker_send_us": median([s.worker_send_us for s in runs]),
            "redis_us": median([s.redis_us for s in runs]),
            "pg_send_us": median([s.pg_send_us for s in runs]),
            "total_us": median([total_us(s) for s in runs]),
        }
    for (name, workload), row in rows.items():
        base_key = (
            PLAIN,
            "slow body 2 ms" if workload.startswith("slow") else "distinct keys",
        )
        # Paired per repetition: each ratio and CPU difference compares two drains that
        # ran seconds apart, and the median is taken over those pairs.
        base_runs = samples.get(base_key)  # None when plain was not measured
        pairs = (
            list(zip(samples[name, workload], base_runs, strict=True))
            if base_runs
            else []
        )
        row["ratio"] = median(
            [s.rate / b.rate if s.rate and b.rate else None for s, b in pairs]
        )
        row["cpu_over_plain"] = median(
            [
                s.worker_us - b.worker_us
                if s.worker_us is not None and b.worker_us is not None
                else None
                for s, b in pairs
            ]
        )
    return rows


def total_us(sample: Sample) -> float | None:
    """CPU per send over producer, worker, Redis and PostgreSQL; None if one is n/a."""
    parts = (
        sample.producer_us,
        sample.worker_send_us,
        sample.redis_us,
        sample.pg_send_us,
    )
    return None if None in parts else sum(p for p in parts if p is not None)


def fmt(value: float | None, pattern: str) -> str:
    return "n/a" if value is None else format(value, pattern)


def table(rows: dict[tuple[str, str], dict[str, Any]]) -> str:
    lines = [
        f"| workload | contender | msgs/s | {TIMES} plain | worker CPU µs/msg | PostgreSQL CPU µs/msg | RSS MiB | lock conns | ran / skipped / dropped at publish |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for workload in WORKLOADS:
        for name in CONTENDERS:
            row = rows.get((name, workload))
            if row is None:
                continue
            lines.append(
                f"| {workload} | {name} | {fmt(row['rate'], ',.0f')} | {fmt(row['ratio'], '.3f')} "
                f"| {fmt(row['worker_us'], ',.0f')} | {fmt(row['pg_us'], ',.0f')} | {fmt(row['rss'], '.0f')} "
                f"| {row['connections']} | {row['ran']} / {row['skipped']} / {row['dropped']} |"
            )
    return "\n".join(lines)


def e2e_table(rows: dict[tuple[str, str], dict[str, Any]]) -> str:
    """End to end: sends per second from the first send to the last run's end, and CPU
    per send in each of the four places that do work."""
    lines = [
        "| workload | contender | sends/s end to end | producer CPU µs/send | worker CPU µs/send | Redis CPU µs/send | PostgreSQL CPU µs/send | total CPU µs/send | queued / dropped at publish |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for workload in WORKLOADS:
        for name in CONTENDERS:
            row = rows.get((name, workload))
            if row is None:
                continue
            queued = row["ran"] + row["skipped"]
            lines.append(
                f"| {workload} | {name} | {fmt(row['e2e_rate'], ',.0f')} "
                f"| {fmt(row['producer_us'], ',.0f')} | {fmt(row['worker_send_us'], ',.0f')} "
                f"| {fmt(row['redis_us'], ',.0f')} | {fmt(row['pg_send_us'], ',.0f')} "
                f"| {fmt(row['total_us'], ',.0f')} | {queued} / {row['dropped']} |"
            )
    return "\n".join(lines)


def _paired(
    samples: dict[tuple[str, str], list[Sample]],
    ours: str,
    theirs: list[str],
    workload: str,
    figure: Callable[[Sample], float | None],
    best: Callable[[list[float]], float],
) -> float | None:
    """Median over repetitions of ours / the best of ``theirs`` in that repetition."""
    mine = samples.get((ours, workload), [])
    peers = [samples.get((name, workload), []) for name in theirs]
    ratios: list[float | None] = []
    for index, sample in enumerate(mine):
        values = [runs[index] for runs in peers if index < len(runs)]
        figures = [figure(s) for s in values]
        present = [f for f in figures if f is not None]
        value = figure(sample)
        if value is None or len(present) < len(theirs) or not present:
            ratios.append(None)
            continue
        ratios.append(value / best(present))
    return median(ratios)


def issue18_verdicts(
    samples: dict[tuple[str, str], list[Sample]],
) -> list[tuple[str, str, bool]]:
    """The targets of issue 18, paired per repetition; rows not measured are left out."""
    peers = [
        name
        for name, c in CONTENDERS.items()
        if c.locks_at_publish
        and not c.enqueue
        and any(key[0] == name for key in samples)
    ]
    ours = [name for name in ENQUEUE_ROWS if any(key[0] == name for key in samples)]
    checks: list[tuple[str, str, bool]] = []

    def rate(sample: Sample) -> float | None:
        return sample.e2e_rate

    for workload in ("one hot key", "per-tenant mix"):
        for name in ours:
            if (name, workload) not in samples or not peers:
                continue
            each = [
                (
                    peer,
                    _paired(samples, name, [peer], workload, rate, min),
                    _paired(samples, name, [peer], workload, total_us, min),
                )
                for peer in peers
            ]
            checks.append(
                (
                    f"{workload}, {name}: sends/s end to end ≥ each peer's, total CPU per send ≤ each peer's",
                    "; ".join(
                        f"{peer}: rate {fmt(r, '.2f')}{TIMES}, CPU {fmt(c, '.2f')}{TIMES}"
                        for peer, r, c in each
                    ),
                    all(
                        r is not None and r >= 1.0 and c is not None and c <= 1.0
                        for _, r, c in each
                    ),
                )
            )
    return checks


def issue34_verdicts(
    samples: dict[tuple[str, str], list[Sample]],
) -> list[tuple[str, str, bool]]:
    """Latest wins and debounce against until_started on the same workload, paired per
    repetition."""
    checks: list[tuple[str, str, bool]] = []
    for row in REPLACING_ROWS:
        for workload in ("one hot key", "per-tenant mix", "distinct keys"):
            if (row, workload) not in samples:
                continue
            if (UNTIL_STARTED_ROW, workload) not in samples:
                continue
            rate = _paired(
                samples,
                row,
                [UNTIL_STARTED_ROW],
                workload,
                lambda s: s.e2e_rate,
                min,
            )
            cpu = _paired(samples, row, [UNTIL_STARTED_ROW], workload, total_us, min)
            checks.append(
                (
                    f"{workload}, {row.rpartition(' + ')[2]}: sends/s end to end ≥ "
                    "until_started's, total CPU per send ≤ until_started's",
                    f"rate {fmt(rate, '.2f')}{TIMES}, CPU {fmt(cpu, '.2f')}{TIMES}",
                    rate is not None and rate >= 1.0 and cpu is not None and cpu <= 1.0,
                )
            )
    for workload in ("one hot key", "per-tenant mix", "distinct keys"):
        checks += _against_floor(
            samples, LATEST_ROW, LATEST_FLOOR, workload, 1.10, "the latest row by hand"
        )
        checks += _against_floor(
            samples, DEBOUNCE_ROW, DEBOUNCE_FLOOR, workload, 1.10, "the same, debounced"
        )
    return checks


def _against_floor(
    samples: dict[tuple[str, str], list[Sample]],
    name: str,
    floor: str,
    workload: str,
    bound: float,
    what: str,
) -> list[tuple[str, str, bool]]:
    """``name``'s total CPU per send over ``floor``'s, paired: at most ``bound``."""
    if (name, workload) not in samples or (floor, workload) not in samples:
        return []
    ratio = _paired(samples, name, [floor], workload, total_us, min)
    row = name.rpartition(" + ")[2]
    return [
        (
            f"{workload}, {row}: total CPU per send ≤ {bound:.2f}{TIMES} its floor ({what})",
            f"{fmt(ratio, '.3f')}{TIMES}",
            ratio is not None and ratio <= bound,
        )
    ]


def _cpu(sample: Sample) -> float | None:
    """Worker and PostgreSQL CPU per handled message."""
    if sample.worker_us is None or sample.pg_us is None:
        return None
    return sample.worker_us + sample.pg_us


def _over(
    samples: dict[tuple[str, str], list[Sample]],
    name: str,
    base: str,
    minus: str,
    plus: str,
) -> tuple[float, float] | None:
    """Medians of name minus base, and of plus minus minus, in CPU per run on distinct
    keys, paired per repetition."""

    def runs(row: str) -> list[Sample]:
        return samples.get((row, "distinct keys"), [])

    firsts: list[float | None] = []
    seconds: list[float | None] = []
    for index, sample in enumerate(runs(name)):
        paired = [runs(other) for other in (base, plus, minus)]
        if any(index >= len(r) for r in paired):
            continue
        figures = [_cpu(s) for s in (sample, *(r[index] for r in paired))]
        present = [f for f in figures if f is not None]
        if len(present) < len(figures):
            continue
        mine, based, high, low = present
        firsts.append(mine - based)
        seconds.append(high - low)
    first, second = median(firsts), median(seconds)
    return None if first is None or second is None else (first, second)


def issue35_verdicts(
    samples: dict[tuple[str, str], list[Sample]],
    publish: dict[str, list[dict[str, float | None]]] | None,
) -> list[tuple[str, str, bool]]:
    """The targets of issue 35 (the queue scopes at their floor), paired per repetition;
    ``publish``: publish_path.py's results of the same run. Rows not measured are left out."""
    peers = [
        name
        for name, c in CONTENDERS.items()
        if c.locks_at_publish and not c.enqueue and (name, "distinct keys") in samples
    ]
    checks: list[tuple[str, str, bool]] = []

    def rate(sample: Sample) -> float | None:
        return sample.e2e_rate

    name, workload = UNTIL_FINISHED_ROW, "distinct keys"
    checks += _against_floor(
        samples,
        name,
        UNLOGGED_ROW_FLOOR,
        workload,
        1.05,
        "the design shipped: the unlogged queued row by hand",
    )
    if (name, workload) in samples and peers:
        cpu = _paired(samples, name, peers, workload, total_us, min)
        fast = _paired(samples, name, peers, workload, rate, max)
        checks.append(
            (
                f"distinct keys, {name}: total CPU per send ≤ 1.10{TIMES} the better "
                f"peer's, sends/s end to end ≥ 0.90{TIMES} the better peer's",
                f"CPU {fmt(cpu, '.3f')}{TIMES}, rate {fmt(fast, '.3f')}{TIMES}",
                cpu is not None and cpu <= 1.10 and fast is not None and fast >= 0.90,
            )
        )
    for floor_row in (ROW_FLOOR, UNLOGGED_ROW_FLOOR):
        if (floor_row, workload) not in samples or not peers:
            continue
        # The design's rows with no library around them: if a floor misses the peer
        # target, no implementation of that design meets it.
        cpu = _paired(samples, floor_row, peers, workload, total_us, min)
        fast = _paired(samples, floor_row, peers, workload, rate, max)
        checks.append(
            (
                f"distinct keys, {floor_row} (no library): the same peer target",
                f"CPU {fmt(cpu, '.3f')}{TIMES}, rate {fmt(fast, '.3f')}{TIMES}",
                cpu is not None and cpu <= 1.10 and fast is not None and fast >= 0.90,
            )
        )
    if publish:

        def over_plain(label: str) -> float | None:
            rows = publish.get(label), publish.get("plain Celery")
            if not rows[0] or not rows[1]:
                return None
            return median([r["cpu"] for r in rows[0]]) - median(  # type: ignore[operator]
                [r["cpu"] for r in rows[1]]
            )

        once = over_plain("celery-once, new key")
        for label in ("until_finished, new key", "until_started, new key"):
            mine = over_plain(label)
            checks.append(
                (
                    f"delay() of a new key, {label.split(',')[0]}: producer CPU over "
                    "plain ≤ celery-once's (publish path, same run)",
                    f"{fmt(mine, '+.0f')} µs vs {fmt(once, '+.0f')} µs",
                    mine is not None and once is not None and mine <= once,
                )
            )
    found = _over(samples, PERIOD_ROW, SESSION, ROUND_TRIPS, PERIOD_FLOOR)
    if found is not None:
        extra, statement = found
        checks.append(
            (
                f"{PERIOD_ROW}: CPU per run over the session row ≤ 1.10{TIMES} its floor "
                "(the period floor over plain + 2 round trips)",
                f"{extra:+.0f} µs vs {statement:.0f} µs ({fmt(extra / statement if statement > 0 else None, '.2f')}{TIMES})",
                statement > 0 and extra <= 1.10 * statement,
            )
        )
    floor = _paired(samples, SESSION, [ROUND_TRIPS], workload, lambda s: s.rate, max)
    if floor is not None:
        checks.append(
            (
                f"run lock at its floor: SingletonTask session ≥ 0.97{TIMES} plain + 2 "
                "round trips (distinct keys, msgs/s)",
                f"{fmt(floor, '.3f')}{TIMES}",
                floor >= 0.97,
            )
        )
    found = _over(samples, LIMIT_ROW, SESSION, PLAIN, ROUND_TRIPS)
    if found is not None:
        # One statement: half of what "plain + 2 round trips" costs over plain.
        extra, statement = found[0], found[1] / 2
        checks.append(
            (
                f"{LIMIT_ROW}: CPU per run over the session row ≤ one statement "
                "(worker + PostgreSQL, distinct keys)",
                f"{extra:+.0f} µs vs {statement:.0f} µs",
                extra <= statement,
            )
        )
    return checks


def verdicts(
    rows: dict[tuple[str, str], dict[str, Any]],
    connections: int,
    flat: dict[str, float],
    args: argparse.Namespace,
) -> list[tuple[str, str, bool]]:
    distinct = rows.get((SESSION, "distinct keys"), {})
    hot = rows.get((SESSION, "one hot key"), {})
    peers = [
        rows.get((name, "distinct keys"), {}).get("ratio")
        for name in CONTENDERS
        if CONTENDERS[name].locks_at_publish and not CONTENDERS[name].enqueue
    ]
    ratio = distinct.get("ratio")
    growth = flat.get("after run", 0.0) - flat.get("warm", 0.0)
    return [
        *baseline_verdicts(rows),
        (
            f"distinct keys ≥ 0.95{TIMES} plain",
            f"{fmt(ratio, '.3f')}{TIMES}",
            ratio is not None and ratio >= 0.95,
        ),
        (
            "distinct keys above both peers",
            f"{fmt(ratio, '.3f')}{TIMES} vs "
            + " / ".join(f"{fmt(p, '.3f')}{TIMES}" for p in peers),
            ratio is not None and all(p is not None and ratio > p for p in peers),
        ),
        (
            "full contention ≥ distinct keys",
            f"{fmt(hot.get('ratio'), '.3f')}{TIMES} vs {fmt(ratio, '.3f')}{TIMES} plain "
            f"({fmt(hot.get('rate'), ',.0f')} vs {fmt(distinct.get('rate'), ',.0f')} msgs/s)",
            bool(hot.get("ratio") and ratio and hot["ratio"] >= ratio),
        ),
        (
            "worker CPU overhead ≤ 80 µs per locked task",
            f"{fmt(distinct.get('cpu_over_plain'), '+.0f')} µs",
            distinct.get("cpu_over_plain") is not None
            and distinct["cpu_over_plain"] <= 80,
        ),
        (
            "PostgreSQL CPU ≤ 60 µs per task",
            f"{fmt(distinct.get('pg_us'), '.0f')} µs",
            distinct.get("pg_us") is not None and distinct["pg_us"] <= 60,
        ),
        (
            "lock connections ≤ 2, threads worker at concurrency 64",
            str(connections),
            connections <= 2,
        ),
        (
            f"memory flat: {int(flat.get('skipped', 0)):,} skipped + {int(flat.get('ran', 0)):,} run, growth ≤ 10 MiB",
            f"{fmt(flat.get('warm'), '.1f')} → {fmt(flat.get('after skip'), '.1f')} → {fmt(flat.get('after run'), '.1f')} MiB ({growth:+.1f})",
            bool(flat) and growth <= 10.0,
        ),
    ]


def round_trip_note(rows: dict[tuple[str, str], dict[str, Any]]) -> str:
    """SingletonTask against the floor of two awaited round trips, in the same run."""
    floor = rows.get((ROUND_TRIPS, "distinct keys"), {})
    locked = rows.get((SESSION, "distinct keys"), {})
    needed = ("ratio", "cpu_over_plain")
    if not all(floor.get(k) is not None and locked.get(k) is not None for k in needed):
        return "(the two-round-trip floor: not measured in this run)"
    return (
        "The floor of a lock taken before the body and released, awaited, after it: a "
        f"plain task with a blocking `SELECT 1` before and after its body ran at "
        f"{floor['ratio']:.3f}{TIMES} plain, {floor['cpu_over_plain']:+,.0f} µs of worker "
        f"CPU and {fmt(floor.get('pg_us'), '.0f')} µs of PostgreSQL CPU per message in "
        f"this run; SingletonTask (session, distinct keys): {locked['ratio']:.3f}{TIMES}, "
        f"{locked['cpu_over_plain']:+,.0f} µs, {fmt(locked.get('pg_us'), '.0f')} µs."
    )


def write_docs(path: Path, text: str, begin: str = BEGIN, end: str = END) -> None:
    """Replace only the generated section of the docs page (create the page if missing)."""
    block = f"{begin}\n{text}\n{end}"
    if path.exists():
        current = path.read_text(encoding="utf-8")
        if begin in current and end in current:
            head, _, rest = current.partition(begin)
            _, _, tail = rest.partition(end)
            path.write_text(head + block + tail, encoding="utf-8")
            return
        path.write_text(current.rstrip("\n") + "\n\n" + block + "\n", encoding="utf-8")
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("# Benchmarks\n\n" + block + "\n", encoding="utf-8")


def baseline_verdicts(
    rows: dict[tuple[str, str], dict[str, Any]],
) -> list[tuple[str, str, bool]]:
    """With --baseline: no regression against the earlier code, per workload (its
    "x plain" ratio within 3 % of the baseline's, and worker CPU within 5 %)."""
    checks = []
    for workload in WORKLOADS:
        ours, theirs = rows.get((SESSION, workload)), rows.get((BASELINE_ROW, workload))
        if not ours or not theirs:
            continue
        rate = (
            ours["ratio"] / theirs["ratio"]
            if ours.get("ratio") and theirs.get("ratio")
            else None
        )
        cpu = (
            ours["worker_us"] / theirs["worker_us"]
            if ours.get("worker_us") and theirs.get("worker_us")
            else None
        )
        checks.append(
            (
                f"{workload}: no regression against the baseline code",
                f"rate {fmt(rate, '.3f')}{TIMES}, worker CPU {fmt(cpu, '.3f')}{TIMES} the baseline's",
                rate is not None and rate >= 0.97 and cpu is not None and cpu <= 1.05,
            )
        )
    return checks
