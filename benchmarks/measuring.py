"""What compare.py reads off a worker.

The CPU of its processes and of its lock sessions' PostgreSQL backends, the RSS of its
task processes, and the per-task records its hooks write.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import bench_app
import psutil

from celery_pglock.testing import _support

if TYPE_CHECKING:
    from pathlib import Path

    from celery_pglock.testing import Services, WorkerProcess

MiB = 1024 * 1024


class BenchError(Exception):
    """A measurement could not complete (a worker that never warmed up, a slow drain)."""


class Probe:
    """Reads CPU of a worker's processes and of its lock sessions' backends."""

    def __init__(self, services: Services) -> None:
        self.connection = _support.connect(
            services.database_url, application_name="pglock-bench probe"
        )
        self.connection.autocommit = True

    def lock_backends(self, worker: WorkerProcess) -> list[int]:
        pids = {worker.pid, *worker.child_pids()}
        with self.connection.cursor() as cursor:
            cursor.execute(
                "SELECT pid, application_name FROM pg_stat_activity WHERE application_name LIKE %s",
                (bench_app.APPLICATION_NAME + " %",),
            )
            rows = cursor.fetchall()
        found: list[int] = []
        for backend, name in rows:
            tag = name.split(" ")[1] if " " in name else ""
            if tag.rpartition(":")[2].isdigit() and int(tag.rpartition(":")[2]) in pids:
                found.append(backend)
        return found

    def cpu(self, worker: WorkerProcess) -> tuple[float, float, float | None]:
        """(worker CPU s, of which system s, lock backends' CPU s or None if unreadable)."""
        total = system = 0.0
        for pid in (worker.pid, *worker.child_pids()):
            with contextlib.suppress(psutil.Error):
                times = psutil.Process(pid).cpu_times()
                total += times.user + times.system
                system += times.system
        server: float | None = 0.0
        for backend in self.lock_backends(worker):
            try:
                times = psutil.Process(backend).cpu_times()
            except psutil.Error:  # PostgreSQL on another host
                server = None
                break
            server = (server or 0.0) + times.user + times.system
        return total, system, server

    def close(self) -> None:
        self.connection.close()


def rss(worker: WorkerProcess) -> float:
    """RSS in MiB of the largest task process (threads/solo: the main process)."""
    sizes = []
    for pid in worker.child_pids() or [worker.pid]:
        with contextlib.suppress(psutil.Error):
            sizes.append(psutil.Process(pid).memory_info().rss / MiB)
    return max(sizes, default=0.0)


def records(directory: Path) -> list[tuple[int, int, int]]:
    found: list[tuple[int, int, int]] = []
    for path in directory.glob("*.rec"):
        data = path.read_bytes()
        size = bench_app.RECORD.size
        found.extend(
            bench_app.RECORD.unpack_from(data, offset)
            for offset in range(0, len(data) - len(data) % size, size)
        )
    return found
