"""The worker's /metrics endpoint, started by task/worker_hooks.py before the pool forks;
imports only the bottom and ``metrics``. Why: docs/operations/metrics.md (Prefork)."""

from __future__ import annotations

import contextlib
import dataclasses
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


@dataclasses.dataclass(frozen=True)
class Server(metrics.ProducerEndpoint):
    directory: str  #: The PROMETHEUS_MULTIPROC_DIR in use.
    owned: bool  #: serve() created the directory: close() removes it.

    def close(self) -> None:
        super().close()
        if self.owned:
            shutil.rmtree(self.directory, ignore_errors=True)
            if os.environ.get(MULTIPROC_ENV) == self.directory:
                del os.environ[MULTIPROC_ENV]


_server: Server | None = None


def serve(
    conf: Mapping[str, Any], tasks: Iterable[tuple[str, str]] = ()
) -> Server | None:
    """Serve /metrics if ``pglock_metrics_port`` is set (idempotent); call before forking.
    ``tasks``: each SingletonTask's ``(name, on_busy)``, served at 0 from the start."""
    global _server
    port = conf.get("pglock_metrics_port")
    if port is None:
        return None
    if _server is not None:
        return _server
    metrics.from_conf(conf)
    import prometheus_client as prom
    from prometheus_client import values

    directory = os.environ.get(MULTIPROC_ENV)
    owned = not directory
    directory = directory or tempfile.mkdtemp(prefix="celery-pglock-metrics-")
    registry = prom.CollectorRegistry()
    registry.register(_ArchivingCollector(directory))
    address = conf.get("pglock_metrics_address") or metrics.DEFAULT_ADDRESS
    try:
        httpd, _ = prom.start_http_server(port, addr=address, registry=registry)
    except OSError as exc:
        if owned:
            shutil.rmtree(directory, ignore_errors=True)
        raise exceptions.ConfigurationError(
            f"pglock_metrics_port={port!r}: cannot serve /metrics on {address}:{port} "
            f"({exc}). Give each worker on a host its own port (e.g. from an environment "
            "variable per worker)."
        ) from exc
    os.environ[MULTIPROC_ENV] = directory  # now that it serves: children count there
    if not metrics.multiprocess():
        # prometheus_client chose in-process values at import; the children's use files.
        values.ValueClass = values.MultiProcessValue()  # type: ignore[no-untyped-call]
    _server = Server(httpd, directory, owned)
    sink = metrics.current()
    if not isinstance(sink, metrics.PrometheusMetrics):
        sink = metrics.PrometheusMetrics()
        metrics.install(sink)
    sink.declare(tasks)
    return _server


def stop() -> None:
    global _server
    server, _server = _server, None
    if server is not None:
        server.close()


def _close_in_child() -> None:
    # Only the main process holds the port: a lingering child cannot keep it bound.
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
        from prometheus_client import multiprocess

        self._directory = directory
        self._inner: Any = multiprocess.MultiProcessCollector(None, path=directory)  # type: ignore[no-untyped-call]
        self._guard = threading.Lock()

    def collect(self) -> Iterator[Any]:
        with self._guard:
            for kind in ("counter", "histogram"):
                _archive_dead(self._directory, kind)
            # A dead process holds no lock (as prometheus_client's mark_process_dead).
            _remove(_dead_files(self._directory, "gauge_*_*.db"))
            families = list(self._inner.collect())
        for family in families:
            if family.name != metrics.OLDEST_START:
                yield family
                continue
            oldest: dict[str, float] = {}  # task -> earliest start (inf: none held)
            for sample in family.samples:
                task, start = sample.labels["task"], sample.value or math.inf
                oldest[task] = min(oldest.get(task, math.inf), start)
            now = time.time()
            yield metrics.oldest_held_family({t: now - s for t, s in oldest.items()})


def _archive_dead(directory: str, kind: str) -> None:
    """Merge the ``<kind>_<pid>.db`` files of dead processes into ``<kind>_archive.db``."""
    from prometheus_client import mmap_dict, multiprocess

    dead = _dead_files(directory, f"{kind}_*.db")
    if not dead:
        return
    archive = os.path.join(directory, f"{kind}_archive.db")
    sources = [archive, *dead] if os.path.exists(archive) else dead
    merged = multiprocess.MultiProcessCollector.merge(sources, accumulate=False)  # type: ignore[no-untyped-call]
    scratch = archive + ".tmp"
    _remove([scratch])
    target: Any = mmap_dict.MmapedDict(scratch)  # type: ignore[no-untyped-call]
    try:
        for metric in merged:
            for sample in metric.samples:
                key = mmap_dict.mmap_key(
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
    _remove(dead)


def _dead_files(directory: str, pattern: str) -> list[str]:
    dead = []
    for path in glob.glob(os.path.join(directory, pattern)):
        pid = os.path.basename(path)[:-3].rsplit("_", 1)[-1]
        if pid.isdigit():
            try:
                os.kill(int(pid), 0)
            except ProcessLookupError:
                dead.append(path)
            except PermissionError:  # another user's process: alive
                pass
    return dead


def _remove(paths: list[str]) -> None:
    for path in paths:
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)
