"""Pool-child memory after N distinct big lock arguments: SingletonTask vs a plain task.

    CELERY_PGLOCK_TEST_DATABASE_URL=postgresql+psycopg2://postgres@127.0.0.1:5432/test \\
    CELERY_PGLOCK_TEST_BROKER_URL=redis://127.0.0.1:6379/6 \\
    python benchmarks/key_memory.py [--count 20] [--mb 5]

Starts prefork workers with ONE pool child each (tests/acceptance/security_app.py), sends
``--count`` distinct ``--mb`` MB string arguments one at a time, and prints each child's RSS
growth, twice: with glibc's default allocator settings, and with a fixed mmap threshold
(``MALLOC_MMAP_THRESHOLD_=131072``), under which every freed big block goes back to the
OS, so the growth is what is still referenced. tests/acceptance/test_security.py asserts
the second figure; docs/operations/security.md gives both.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from celery_pglock.testing import WorkerProcess, start_services  # noqa: E402

if TYPE_CHECKING:
    from types import ModuleType

MIB = 1024 * 1024
ALLOCATORS = {
    "glibc default": {},
    "fixed mmap threshold": {"MALLOC_MMAP_THRESHOLD_": "131072"},
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=20, help="distinct arguments")
    parser.add_argument("--mb", type=int, default=5, help="size of each, in MB")
    options = parser.parse_args(argv)
    services = start_services()
    queue = f"pglock-key-memory-{uuid.uuid4().hex[:8]}"
    env = {
        **services.env(),
        "PGLOCK_SECURITY_QUEUE": queue,
        "PGLOCK_TEST_NAMESPACE": queue,
        "PYTHONPATH": str(REPO_ROOT),
    }
    os.environ.update(env)
    from tests.acceptance import security_app

    logs = Path(tempfile.mkdtemp(prefix="pglock-key-memory-"))
    try:
        for allocator, malloc_env in ALLOCATORS.items():
            figures: list[str] = []
            for label, task in (
                ("SingletonTask", security_app.locked_blob),
                ("plain task", security_app.plain_blob),
            ):
                worker = WorkerProcess(
                    "tests.acceptance.security_app",
                    env={**env, **malloc_env},
                    concurrency=1,
                    queues=[queue],
                    log_path=logs / f"{len(figures)}-{allocator}.log",
                ).start(timeout=90)
                try:
                    growth = _growth(security_app, task, options.count, options.mb)
                finally:
                    worker.stop(timeout=20)
                figures.append(f"{label} {growth / MIB:.1f} MiB")
            print(
                f"{allocator}: RSS growth of the pool child after {options.count} "
                f"distinct {options.mb} MB arguments: {', '.join(figures)}"
            )
    finally:
        services.stop()
    return 0


def _growth(app_module: ModuleType, task: Any, count: int, mb: int) -> int:
    task.delay("warm-up").get(timeout=60)
    before = app_module.rss.delay().get(timeout=60)
    for index in range(count):
        blob = f"{index:06d}" + "x" * (mb * 1000 * 1000 - 6)
        task.delay(blob).get(timeout=120)
    return int(app_module.rss.delay().get(timeout=60)) - int(before)


if __name__ == "__main__":
    raise SystemExit(main())
