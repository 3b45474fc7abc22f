"""Lock metrics: the Metrics protocol, a no-op default, a Prometheus adapter (extra), a
producer's /metrics (a worker's: ``server.py``). Each series: docs/operations/metrics.md."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import threading
import time
from typing import TYPE_CHECKING, Any, Protocol

from celery_pglock import exceptions

if TYPE_CHECKING:
    from collections.abc import Iterable, Iterator, Mapping

#: Seconds buckets for the time a run spent asking for its lock (a try is ~0.1-1 ms).
WAIT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30)
HELD_BUCKETS = (0.01, 0.05, 0.1, 0.5, 1, 5, 15, 60, 300, 900, 3600, 4 * 3600)
_TASK_ONLY = ("acquired", "release_failed", "lost", "wait_seconds", "held_seconds")
DEFAULT_ADDRESS = "0.0.0.0"  # noqa: S104 - an exporter is scraped from other hosts


class Metrics(Protocol):
    """Where lock outcomes are counted. Labels never carry argument values."""

    def acquired(self, task: str, wait_seconds: float) -> None:
        """A run took its lock after ``wait_seconds``."""

    def skipped(self, task: str, policy: str, wait_seconds: float) -> None:
        """A run did not get its lock; ``policy`` is the lock_on_busy action applied."""

    def released(self, task: str, state: str, held_seconds: float) -> None:
        """A run released its lock; ``state`` is the run's Celery state."""

    def release_failed(self, task: str) -> None:
        """Releasing a lock went wrong (PostgreSQL no longer holds it)."""

    def lost(self, task: str) -> None:
        """The lock watcher found a held lock lost while its body ran."""


class NullMetrics:
    """The default sink: counts nothing."""

    def _nothing(self, *args: object, **kwargs: object) -> None:
        pass

    acquired = skipped = released = release_failed = lost = enqueued = throttled = (
        _nothing
    )


class PrometheusMetrics:
    """``celery_pglock_*`` collectors in ``registry`` (default ``REGISTRY``; unused in
    multiprocess mode), created on first use, in the process that counts (after fork)."""

    def __init__(self, registry: Any = None) -> None:
        _require_prometheus()
        self._registry = registry
        self._collectors: dict[str, Any] | None = None
        self._children: dict[tuple[str, ...], Any] = {}
        self._guard = threading.Lock()
        #: Wall-clock start of each lock this process holds now, by task.
        self._held: dict[str, list[float]] = {}
        self._held_guard = threading.Lock()

    def collectors(self) -> dict[str, Any]:
        if self._collectors is None:
            with self._guard:
                if self._collectors is None:
                    self._collectors = _create_collectors(self._registry)
                    if not multiprocess():
                        # One process: collect() serves the age.
                        import prometheus_client as prom

                        (self._registry or prom.REGISTRY).register(self)
        return self._collectors

    def collect(self) -> Iterator[Any]:
        """One process: the age of the oldest lock of each task held now (0: none)."""
        now = time.time()
        with self._held_guard:
            ages = {t: now - min(s) if s else 0.0 for t, s in self._held.items()}
        yield oldest_held_family(ages)

    def declare(self, tasks: Iterable[tuple[str, str]]) -> None:
        """Create the info gauge and each ``(task, policy)``'s series at zero, for absent()."""
        import importlib.metadata

        version = "unknown"  # run from a source tree
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            version = importlib.metadata.version("celery-pglock")
        self.collectors()["info"].labels(version).set(1)
        for task, policy in tasks:
            for name in _TASK_ONLY:
                self._child(name, task)
            self._child("skipped", task, policy)
            for state in ("SUCCESS", "FAILURE"):
                self._child("released", task, state)
            with self._held_guard:
                self._publish_held(task, self._held.setdefault(task, []))

    def _child(self, name: str, *labels: str) -> Any:
        # labels() costs microseconds a call; children (tasks x policies/states) are few.
        key = (name, *labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = self.collectors()[name].labels(*labels)
        return child

    def acquired(self, task: str, wait_seconds: float) -> None:
        self._child("acquired", task).inc()
        self._child("wait_seconds", task).observe(wait_seconds)
        with self._held_guard:
            starts = self._held.setdefault(task, [])
            starts.append(time.time())
            self._publish_held(task, starts)

    def skipped(self, task: str, policy: str, wait_seconds: float) -> None:
        self._child("skipped", task, policy).inc()
        self._child("wait_seconds", task).observe(wait_seconds)

    def released(self, task: str, state: str, held_seconds: float) -> None:
        self._child("released", task, state).inc()
        self._child("held_seconds", task).observe(held_seconds)
        # Which lock ended is not passed: the one started nearest now - held_seconds.
        with self._held_guard:
            if starts := self._held.get(task):
                began = time.time() - held_seconds
                starts.remove(min(starts, key=lambda start: abs(start - began)))
                self._publish_held(task, starts)

    def _publish_held(self, task: str, starts: list[float]) -> None:
        """Under _held_guard: the gauges of what ``task`` holds now in this process."""
        self._child("held_locks", task).set(len(starts))
        self._child("oldest_held_start_time_seconds", task).set(
            min(starts) if starts else 0.0
        )

    def release_failed(self, task: str) -> None:
        self._child("release_failed", task).inc()

    def lost(self, task: str) -> None:
        self._child("lost", task).inc()

    def enqueued(self, task: str, outcome: str) -> None:
        self._child("enqueued", task, outcome).inc()

    def throttled(self, task: str, reason: str) -> None:
        self._child("throttled", task, reason).inc()


#: Each series' help text, by its name after ``celery_pglock_``.
_HELP = {
    "acquired": "Runs that took their lock.",
    "skipped": "Runs that did not get their lock (policy: the lock_on_busy action applied).",
    "released": "Locks released, by the run's Celery state.",
    "release_failed": "Releases that failed; PostgreSQL no longer held the lock.",
    "lost": "Locks lost while their body ran.",
    "enqueued": "lock_enqueue sends, by outcome (published, duplicate, replaced, "
    "handed_over, hand_over, superseded, took_over, unchecked_*).",
    "throttled": "Skipped runs whose key was free: refused by lock_rate or lock_period "
    "(period, rate) or a full lock_group (group).",
    "wait_seconds": "Time a run spent asking for its lock.",
    "held_seconds": "Time a lock was held.",
    "held_locks": "Locks held now.",
    "oldest_held_start_time_seconds": "Unix time the oldest lock held now was taken; 0 if none.",
    "oldest_held_seconds": "Seconds the oldest lock held now has been held; 0 if none.",
    "info": "Always 1: this process serves celery-pglock metrics.",
}
#: The raw form of the held-lock age; the age itself is computed when collected.
OLDEST_START = "celery_pglock_oldest_held_start_time_seconds"


def _create_collectors(registry: Any) -> dict[str, Any]:
    import prometheus_client as prom

    made: dict[str, Any] = {}

    def new(kind: Any, name: str, *labels: str, **options: Any) -> None:
        options = ({} if registry is None else {"registry": registry}) | options
        made[name] = kind(
            f"celery_pglock_{name}", _HELP[name], labels or ["task"], **options
        )

    new(prom.Counter, "acquired")
    new(prom.Counter, "skipped", "task", "policy")
    new(prom.Counter, "released", "task", "state")
    new(prom.Counter, "release_failed")
    new(prom.Counter, "lost")
    new(prom.Counter, "enqueued", "task", "outcome")
    new(prom.Counter, "throttled", "task", "reason")
    new(prom.Histogram, "wait_seconds", buckets=WAIT_BUCKETS)
    new(prom.Histogram, "held_seconds", buckets=HELD_BUCKETS)
    # Multiprocess: the sum over live processes (a dead child holds nothing).
    new(prom.Gauge, "held_locks", multiprocess_mode="livesum")
    # Registered in multiprocess mode only, where the endpoint turns it into the age.
    new(
        prom.Gauge,
        "oldest_held_start_time_seconds",
        multiprocess_mode="liveall",
        **({} if multiprocess() else {"registry": None}),
    )
    new(prom.Gauge, "info", "version", multiprocess_mode="max")
    return made


def oldest_held_family(ages: Mapping[str, float]) -> Any:
    from prometheus_client.core import GaugeMetricFamily

    name = "oldest_held_seconds"
    family = GaugeMetricFamily(f"celery_pglock_{name}", _HELP[name], labels=["task"])
    for task, age in sorted(ages.items()):
        family.add_metric([task], max(age, 0.0) if math.isfinite(age) else 0.0)
    return family


def multiprocess() -> bool:
    """Whether prometheus_client counts in multiprocess files in this process."""
    from prometheus_client import values

    return bool(getattr(values.ValueClass, "_multiprocess", False))


#: The installed sink, or None: outcomes then make no call at all (the default).
sink: Metrics | None = None
_NULL = NullMetrics()


def current() -> Metrics:
    """The sink outcomes are counted in (NullMetrics unless configured)."""
    return _NULL if sink is None else sink


def install(metrics: Metrics) -> None:
    """Make ``metrics`` the sink of this process (e.g. a custom Metrics implementation)."""
    global sink
    sink = metrics


def configure(conf: Mapping[str, Any]) -> None:
    """Install the sink the settings ask for, at task bind; none without prometheus_client
    (a web app sharing the workers' settings): workers check for it at start."""
    wanted = from_conf(conf, require=False)
    if wanted is not None and not isinstance(wanted, str):
        install(wanted)
    elif wanted is not None and not isinstance(sink, PrometheusMetrics):
        with contextlib.suppress(exceptions.ConfigurationError):  # no prometheus_client
            install(PrometheusMetrics())


def from_conf(conf: Mapping[str, Any], *, require: bool = True) -> Metrics | str | None:
    """Validate the metrics settings; ``require``: "prometheus" needs prometheus_client."""
    value = conf.get("pglock_metrics")
    port = conf.get("pglock_metrics_port")
    address = conf.get("pglock_metrics_address")
    if port is not None and (
        isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536
    ):
        raise exceptions.ConfigurationError(
            f"pglock_metrics_port={port!r} is invalid; expected a TCP port number "
            "(1-65535), such as 9808, or None to serve no /metrics."
        )
    if address is not None and (not isinstance(address, str) or not address):
        raise exceptions.ConfigurationError(
            f"pglock_metrics_address={address!r} is invalid; expected an address to bind "
            f"/metrics to, such as {DEFAULT_ADDRESS!r} or '127.0.0.1'."
        )
    if value is None and port is None:
        return None
    if value is None or value == "prometheus":
        if require:
            _require_prometheus()
        return "prometheus"
    if isinstance(value, str) or not all(
        callable(getattr(value, name, None))
        for name in ("acquired", "skipped", "released", "release_failed", "lost")
    ):
        raise exceptions.ConfigurationError(
            f"pglock_metrics={value!r} is invalid; expected None, 'prometheus' or an "
            "object implementing celery_pglock.metrics.Metrics."
        )
    if port is not None:
        raise exceptions.ConfigurationError(
            "pglock_metrics_port serves Prometheus metrics; it cannot be combined with "
            f"a custom pglock_metrics={value!r}. Unset one of them."
        )
    return value  # type: ignore[no-any-return]


def producer_registry(app: Any) -> Any:
    """Count this process's ``lock_enqueue`` sends in Prometheus; the registry to serve.

    Mount it on your own ``/metrics``, or call :func:`serve_producer`. Idempotent. What it
    returns (multiprocess mode too), and why: docs/operations/metrics.md ("Producers").

    Args:
        app: The Celery app whose ``lock_enqueue`` tasks this process sends.
    """
    _require_prometheus()
    import prometheus_client as prom
    from prometheus_client import multiprocess as prom_multiprocess

    # Bound first: a task's bind installs the sink its app's settings ask for.
    names = sorted(
        str(task.name)
        for task in list(app.tasks.values())
        if getattr(getattr(task, "lock_config", None), "enqueue", None) is not None
    )
    installed = current()
    if type(installed) is NullMetrics:  # the default; a subclass is a custom sink
        installed = PrometheusMetrics()
        install(installed)
    if not isinstance(installed, PrometheusMetrics):
        raise exceptions.ConfigurationError(
            f"pglock_metrics={installed!r} counts outcomes in a custom sink, so there is "
            "nothing for Prometheus to serve; expected pglock_metrics unset or "
            "'prometheus' in a process that serves producer metrics."
        )
    for name in names:  # each series at zero, for absent()
        for outcome in ("published", "duplicate"):
            installed._child("enqueued", name, outcome)
    if not multiprocess():
        return prom.REGISTRY
    registry = prom.CollectorRegistry()
    prom_multiprocess.MultiProcessCollector(registry)  # type: ignore[no-untyped-call]
    return registry


@dataclasses.dataclass(frozen=True)
class ProducerEndpoint:
    """The ``/metrics`` server :func:`serve_producer` started (a daemon thread)."""

    httpd: Any  #: The ``wsgiref`` server.

    @property
    def port(self) -> int:
        """The port it listens on (the one chosen when asked for port 0)."""
        return int(self.httpd.server_port)

    def close(self) -> None:
        """Stop serving and free the port."""
        self.httpd.shutdown()
        self.httpd.server_close()


def serve_producer(
    app: Any, *, port: int, address: str = DEFAULT_ADDRESS
) -> ProducerEndpoint:
    """Serve this process's ``lock_enqueue`` outcomes on ``http://<address>:<port>/metrics``.

    For a producer with no exporter of its own, one port per process; otherwise mount
    :func:`producer_registry`.

    Args:
        app: The Celery app whose ``lock_enqueue`` tasks this process sends.
        port: The TCP port (0: any free one, read back from ``.port``).
        address: The address to bind, every interface by default.

    Raises:
        ConfigurationError: no ``prometheus_client``, a bad port, or the port is taken.
    """
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port < 65536:
        raise exceptions.ConfigurationError(
            f"serve_producer(port={port!r}) is invalid; expected a TCP port number "
            "(1-65535, or 0 for any free one), such as 9809."
        )
    registry = producer_registry(app)
    import prometheus_client as prom

    try:
        httpd, _ = prom.start_http_server(port, addr=address, registry=registry)
    except OSError as exc:
        raise exceptions.ConfigurationError(
            f"serve_producer(port={port!r}): cannot serve /metrics on {address}:{port} "
            f"({exc}). Give each producer process on a host its own port, or mount "
            "producer_registry() in the web app's own /metrics."
        ) from exc
    return ProducerEndpoint(httpd)


def _require_prometheus() -> None:
    try:
        import prometheus_client  # noqa: F401
    except ImportError:
        raise exceptions.ConfigurationError(
            "Prometheus metrics (pglock_metrics_port or pglock_metrics='prometheus') "
            "need prometheus_client: pip install 'celery-pglock[prometheus]'."
        ) from None
