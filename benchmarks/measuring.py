"""What compare.py reads off a worker, the producer and the servers.

The CPU of a worker's processes and of its lock sessions' PostgreSQL backends, the RSS of
its task processes, and the per-task records its hooks write; the CPU of the benchmark
process (the producer), of its own backends, and of redis-server when it runs on this host.
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import TYPE_CHECKING, Any

import bench_app
import psutil
import redis

from celery_pglock.testing import _support

if TYPE_CHECKING:
    from pathlib import Path

    from celery_pglock.testing import Services, WorkerProcess

MiB = 1024 * 1024


class BenchError(Exception):
    """A measurement could not complete (a worker that never warmed up, a slow drain)."""


class Probe:
    """Reads CPU of a worker's processes and of its lock sessions' backends."""

    def __init__(self, services: Services, redis_client: Any = None) -> None:
        self.connection = _support.connect(
            services.database_url, application_name="pglock-bench probe"
        )
        self.connection.autocommit = True
        self.redis_server = _local_redis(redis_client)

    def lock_backends(self, worker: WorkerProcess) -> list[int]:
        return self.backends({worker.pid, *worker.child_pids()})

    def backends(self, pids: set[int]) -> list[int]:
        """Backends whose application_name carries the ``host:pid`` of one of ``pids``."""
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

    def producer_backends(self) -> dict[int, float] | None:
        """CPU s by pid of this process's backends (None if unreadable: another host)."""
        found: dict[int, float] = {}
        for backend in self.backends({os.getpid()}):
            try:
                times = psutil.Process(backend).cpu_times()
            except psutil.Error:
                return None
            found[backend] = times.user + times.system
        return found

    def redis_seconds(self) -> float | None:
        """CPU s of redis-server, None when it is not on this host."""
        if self.redis_server is None:
            return None
        try:
            times = self.redis_server.cpu_times()
        except psutil.Error:
            return None
        return float(times.user + times.system)

    def close(self) -> None:
        self.connection.close()


def _local_redis(client: Any) -> psutil.Process | None:
    """The redis-server process answering ``client``, if it runs on this host: the pid
    from INFO server, checked by name and start time (a remote server's pid may exist here)."""
    if client is None:
        return None
    try:
        info = client.info("server")
        process = psutil.Process(int(info["process_id"]))
        uptime = float(info["uptime_in_seconds"])
        started_ago = time.time() - process.create_time()
    except (psutil.Error, redis.RedisError, KeyError, ValueError):
        return None
    if "redis" not in process.name() or abs(started_ago - uptime) > 5:
        return None
    return process


def own_cpu() -> float:
    """CPU s of this process (the producer), all threads."""
    times = psutil.Process().cpu_times()
    return float(times.user + times.system)


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
