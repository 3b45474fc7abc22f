"""The tasks of a project whose tests use Celery's own fixtures (``celery.contrib.pytest``).

Shared tasks, so that they bind to the test app that ``celery_session_app`` builds; the
conftest names this module in ``celery_includes``. Celery's in-process worker runs them in
threads of the test process, so a test can hold a body open with a ``threading.Event``.
"""

from __future__ import annotations

import dataclasses
import threading
import time

from celery import shared_task

from celery_pglock import SingletonTask


@dataclasses.dataclass
class Gate:
    """What a test sees of one ``hold_report`` run: when it entered, and its exit."""

    entered: threading.Semaphore = dataclasses.field(
        default_factory=lambda: threading.Semaphore(0)
    )
    release: threading.Event = dataclasses.field(default_factory=threading.Event)
    bodies: int = 0


#: Gates by name, shared by the test and the worker's threads (one process).
GATES: dict[str, Gate] = {}
_count = threading.Lock()


@shared_task(base=SingletonTask, lock_args=("report_id",))
def hold_report(report_id: int, gate: str) -> int:
    """Build a report: one at a time per ``report_id``; stays open until the test says."""
    state = GATES[gate]
    with _count:
        state.bodies += 1
    state.entered.release()
    if not state.release.wait(timeout=30):
        raise TimeoutError(f"gate {gate!r} was never released")
    return report_id


@shared_task(base=SingletonTask, lock_args=("tenant_id",))
def export_tenant(tenant_id: int, seconds: float = 0.5) -> int:
    """Export one tenant: one export at a time per tenant."""
    time.sleep(seconds)
    return tenant_id
