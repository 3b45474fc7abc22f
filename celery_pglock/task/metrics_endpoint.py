"""The worker's /metrics endpoint: served by the main process, counted by the pool.

Prefork hazard: the pool children count, but only the main process serves. So serving
uses prometheus_client's multiprocess mode: each child writes its values to mmap files in
``PROMETHEUS_MULTIPROC_DIR`` and the main process merges them per scrape. If that
variable is not set, :func:`serve` creates a private directory before the pool forks and
removes it at worker shutdown; the files of children that have exited (pool restarts,
``max_tasks_per_child``) are folded into one archive file per metric type at scrape time,
so the directory does not grow with every child ever started, and their gauge files
(locks held now) are deleted, as ``prometheus_client.multiprocess.mark_process_dead``
does: a child that died holding a lock holds nothing any more. A forked child closes its
inherited copy of the listening socket.
"""

from __future__ import annotations

import contextlib
import glob
import math
import os
import shutil
import tempfile
import threading
import time
from typing import TYPE_CHECKING, Any

from celery_pglock import exceptions, metrics

if TYPE_CHECKING:
    from collections.abc import Iterable, Iterator, Mapping

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"


class Server:
    """The /metrics endpoint of one worker: its HTTP server and multiprocess directory."""

    def __init__(self, httpd: Any, directory: str, owned: bool) -> None:
        self.httpd = httpd
        #: The PROMETHEUS_MULTIPROC_DIR in use.
        self.directory = directory
        self._owned = owned

    @property
    def port(self) -> int:
        """The port actually bound."""
        return int(self.httpd.server_port)

    def close(self) -> None:
        """Stop serving; remove the multiprocess directory if serve() created it."""
        self.httpd.shutdown()
        self.httpd.server_close()
        if self._owned:
            shutil.rmtree(self.directory, ignore_errors=True)
            if os.environ.get(MULTIPROC_ENV) == self.directory:
                del os.environ[MULTIPROC_ENV]


_server: Server | None = None


def serve(
    conf: Mapping[str, Any], tasks: Iterable[tuple[str, str]] = ()
) -> Server | None:
    """Serve /metrics on ``pglock_metrics_port`` if set (the worker's main process).

    Call before the pool forks (worker_init does): children inherit the multiprocess
    directory through the environment. Idempotent per process. ``tasks``: the
    ``(name, lock_on_busy action)`` of each SingletonTask, whose series are served at
    zero from the start (:meth:`metrics.PrometheusMetrics.declare`).
    """
    global _server
    port = conf.get("pglock_metrics_port")
    if port is None:
        return None
    if _server is not None:
        return _server
    metrics.from_conf(conf)
    import prometheus_client as prom
    from prometheus_client import values as _values

    values: Any = _values  # untyped parts of prometheus_client
    directory = os.environ.get(MULTIPROC_ENV)
    owned = not directory
    if not directory:
        directory = tempfile.mkdtemp(prefix="celery-pglock-metrics-")
    registry = prom.CollectorRegistry()
    registry.register(_ArchivingCollector(directory))
    address = conf.get("pglock_metrics_address") or metrics.DEFAULT_ADDRESS
    try:
        httpd, _ = prom.start_http_server(port, addr=address, registry=registry)
    except OSError as exc:
        # The port is taken (often: a second worker on this host with the same setting).
        # Counting goes on in memory, unserved; the tasks are not affected.
        if owned:
            shutil.rmtree(directory, ignore_errors=True)
        raise exceptions.ConfigurationError(
            f"pglock_metrics_port={port!r}: cannot serve /metrics on {address}:{port} "
            f"({exc}). Give each worker on a host its own port (e.g. from an environment "
            "variable per worker)."
        ) from exc
    # Only now that the server runs: children inherit the directory and count into it.
    os.environ[MULTIPROC_ENV] = directory
    if not getattr(values.ValueClass, "_multiprocess", False):
        # prometheus_client chose in-process values when it was first imported, before
        # the variable was set; values created from now on (in the children) use files.
        values.ValueClass = values.MultiProcessValue()
    _server = Server(httpd, directory, owned)
    sink = metrics.current()
    if not isinstance(sink, metrics.PrometheusMetrics):
        sink = metrics.PrometheusMetrics()
        metrics.install(sink)
    sink.declare(tasks)
    return _server


def stop() -> None:
    """Stop serving (worker shutdown); idempotent."""
    global _server
    server, _server = _server, None
    if server is not None:
        server.close()


def _close_in_child() -> None:
    # A forked pool child inherits the listening socket: close its copy, so that only the
    # main process holds the port (and a lingering child cannot keep it bound).
    global _server
    if _server is not None:
        with contextlib.suppress(OSError):
            _server.httpd.socket.close()
        _server = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_close_in_child)


class _ArchivingCollector:
    """MultiProcessCollector that first folds the files of exited processes into one."""

    def __init__(self, directory: str) -> None:
        from prometheus_client import multiprocess as _multiprocess

        multiprocess: Any = _multiprocess  # untyped
        self._directory = directory
        self._inner = multiprocess.MultiProcessCollector(None, path=directory)
        self._guard = threading.Lock()

    def collect(self) -> Iterator[Any]:
        inner: Any = self._inner
        with self._guard:
            for kind in ("counter", "histogram"):
                _archive_dead(self._directory, kind)
            _forget_dead_gauges(self._directory)
            families = list(inner.collect())
        for family in families:
            if family.name == metrics.OLDEST_START:
                yield _oldest_held(family)
            else:
                yield family


def _oldest_held(starts: Any) -> Any:
    """The age of each task's oldest held lock, from every live process's start times
    (one sample per process, 0 where it holds none)."""
    oldest: dict[str, float] = {}  # task -> earliest start; math.inf if none held
    for sample in starts.samples:
        task = sample.labels["task"]
        start = sample.value if sample.value > 0 else math.inf
        oldest[task] = min(oldest.get(task, math.inf), start)
    now = time.time()
    return metrics.oldest_held_family(
        {task: now - start for task, start in oldest.items()}
    )


def _forget_dead_gauges(directory: str) -> None:
    """Delete the gauge files of processes that are gone (their locks went with them)."""
    for path in glob.glob(os.path.join(directory, "gauge_*_*.db")):
        pid = os.path.basename(path)[:-3].rsplit("_", 1)[-1]
        if pid.isdigit() and not _alive(int(pid)):
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)


def _archive_dead(directory: str, kind: str) -> None:
    """Merge ``<kind>_<pid>.db`` files of processes that are gone into ``<kind>_archive.db``.

    Counters and histograms must keep the counts of exited children (a total never goes
    down), but one file per child ever started would make every scrape slower.
    """
    from prometheus_client import mmap_dict, multiprocess

    MmapedDict: Any = mmap_dict.MmapedDict  # noqa: N806 - untyped classes
    mmap_key = mmap_dict.mmap_key
    MultiProcessCollector: Any = multiprocess.MultiProcessCollector  # noqa: N806

    dead = []
    for path in glob.glob(os.path.join(directory, f"{kind}_*.db")):
        pid = os.path.basename(path)[len(kind) + 1 : -3]
        if pid.isdigit() and not _alive(int(pid)):
            dead.append(path)
    if not dead:
        return
    archive = os.path.join(directory, f"{kind}_archive.db")
    sources = [archive, *dead] if os.path.exists(archive) else dead
    merged = MultiProcessCollector.merge(sources, accumulate=False)
    scratch = archive + ".tmp"
    with contextlib.suppress(FileNotFoundError):
        os.remove(scratch)
    target = MmapedDict(scratch)
    try:
        for metric in merged:
            for sample in metric.samples:
                key = mmap_key(
                    metric.name,
                    sample.name,
                    list(sample.labels),
                    list(sample.labels.values()),
                    metric.documentation,
                )
                target.write_value(key, sample.value, 0.0)
    finally:
        target.close()
    os.replace(scratch, archive)  # "<kind>_archive.db" parses as kind <kind>
    for path in dead:
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
