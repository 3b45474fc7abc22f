"""A producer process of the chaos run's enqueue phase: sends hot keys of both
lock_enqueue tasks until its time is up (or it is SIGKILLed). Logs ``T <id>`` before
each send and ``R <id> <returned id>`` after, flushed, so a killed producer's last send is
known: ``python -m tests.chaos.producer RUN SECONDS SEED LOG QUEUE [latest]``."""

from __future__ import annotations

import random
import sys
import time
import uuid

KEYS = ("h0", "h1", "h2", "h3")


def main(
    run: str, seconds: float, seed: int, log_path: str, queue: str, mode: str = ""
) -> None:
    from tests.chaos import app

    rng = random.Random(seed)  # noqa: S311 - reproducible chaos, not crypto
    # "latest": the latest-wins phase's tasks (tests/chaos/latest_phase.py).
    tasks = (
        (app.latest, app.debounced)
        if mode == "latest"
        else (app.until_finished, app.until_started)
    )
    deadline = time.monotonic() + seconds
    with open(log_path, "w", buffering=1) as log:
        while time.monotonic() < deadline:
            task = rng.choice(tasks)
            task_id = str(uuid.uuid4())
            log.write(f"T {task_id}\n")
            args = (run, rng.choice(KEYS), rng.uniform(0.1, 0.6))
            returned = task.apply_async(args, task_id=task_id, queue=queue).id
            log.write(f"R {task_id} {returned}\n")
            time.sleep(rng.uniform(0.005, 0.03))


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]), int(sys.argv[3]), *sys.argv[4:])
