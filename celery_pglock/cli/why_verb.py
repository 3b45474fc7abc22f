"""``pglock why``, as its help says; docs/guide/why.md."""

from __future__ import annotations

import datetime
import json
from typing import Any

import click
from celery.backends.base import DisabledBackend

from celery_pglock import exceptions
from celery_pglock.cli import shared
from celery_pglock.task import history, queued, replacing

_UNKNOWN = (
    "unknown: nothing is recorded for this id. pglock_history may be off (unset, or "
    "unset in the process that sent or ran it), the events may be older than its "
    "retention or not written yet (up to a second), or the id is not a SingletonTask "
    "message."
)


@click.command(
    help="What became of a SingletonTask message, from pglock_history: sent, returned "
    "as a duplicate, replaced (by which id), skipped (why, by whom), started (where, "
    "after what wait), ended, lost its lock. Without its events: from its key's "
    "queued row, then from the app's result backend."
)
@click.argument("task_id")
@click.option("--json", "as_json", is_flag=True, help="One JSON document on stdout.")
@click.pass_obj
def why(target: shared.Target, task_id: str, as_json: bool) -> None:
    with target.database("read pglock_history") as engine:
        found = history.events(engine, task_id) or []
        tombstone = replacing.lookup(engine, task_id)
        rows = [] if found else queued.summary(engine, task_id) or []
    if tombstone is not None and not any(event == "replaced" for _, event, _ in found):
        by, at, seen = tombstone  # kept without pglock_history: docs/guide/why.md
        found.append((at, "replaced", {"by_task": by, "delivered": seen is not None}))
        found.sort(key=lambda event: event[0])
    # Without events: what the queued row, then the result backend, say of it.
    verdict = (
        _verdict(found)
        if found
        else _from_row(task_id, rows[0])
        if rows
        else _from_result(target.app, task_id) or _UNKNOWN
    )
    if as_json:
        document = {
            "task_id": task_id,
            "verdict": verdict,
            "events": [
                {"at": _iso(at), "event": event, **detail}
                for at, event, detail in found
            ],
        }
        click.echo(json.dumps(document, indent=2, default=str))
        return
    for at, event, detail in found:
        said = ", ".join(f"{name} {value}" for name, value in detail.items())
        click.echo(f"{_iso(at)}  {event:<8} {said}")
    click.echo(f"{task_id}: {verdict}")


def _verdict(found: list[tuple[float, str, dict[str, Any]]]) -> str:
    """One sentence: the last thing that became of the message."""
    if not found:
        return _UNKNOWN
    # The first send precedes every run of its message, whatever the hosts' clocks say
    # (sent: the producer's clock; started, ended: the worker's).
    first = next((i for i, (_, e, _) in enumerate(found) if e == "sent"), None)
    if first is not None:
        found = [found[first], *found[:first], *found[first + 1 :]]
    _, event, detail = found[-1]
    by = next((d.get("by_task") for _, e, d in found if e == "replaced"), None) or next(
        (
            d.get("replaced_by")
            for _, e, d in found
            if e == "skipped" and d.get("reason") == "replaced"
        ),
        None,
    )
    if event == "sent" and detail.get("outcome") == "superseded":
        by = detail.get("queued")
    if by is not None:
        return (
            f"replaced by {by}, a later send of its key, before it started: its body "
            "did not run (pglock why that id)."
        )
    if event == "sent" and detail.get("outcome") == "duplicate":
        return (
            f"returned as a duplicate of {detail.get('queued')}, which was queued or "
            "running: nothing was published (pglock why that id)."
        )
    if event == "sent":
        return f"queued ({detail.get('outcome')}), not started yet."
    if event == "skipped":
        by = detail.get("holder") or detail.get("last_task") or "unknown"
        retried = (
            " (re-queued: more events follow)"
            if detail.get("policy") == "retry"
            else ""
        )
        return f"did not run: {detail.get('reason')}, held by {by}, policy {detail.get('policy')}{retried}."
    if event == "started":
        return f"running on {detail.get('on')} (or ended without a word: killed)."
    if event == "lost":
        return f"lost its lock while running: {detail.get('cause')}."
    started: dict[str, Any] = next(
        (d for _, e, d in reversed(found) if e == "started"), {}
    )
    held = detail.get("held")
    took = f" after {held:.3f}s" if isinstance(held, float) else ""
    return f"ran on {started.get('on', '?')}, ended {detail.get('state')}{took}."


def _from_row(task_id: str, row: dict[str, Any]) -> str:
    """The key's row names ``task_id``: its message, or the send its carrier carries."""
    due = row["due_in_seconds"] or 0.0
    when = f", due in {shared.duration(due)}" if due > 0 else ""
    if row["carrier"] == task_id:
        return (
            f"queued: its message carries {row['task_id']}, the latest send of key "
            f"{row['key']}, and will publish it when taken (pglock why that id)."
        )
    if row["carrier"]:
        return (
            f"queued: the latest send of key {row['key']}, waiting in the key's row "
            f"until its carrier {row['carrier']} is taken{when}."
        )
    return f"{row['state']} ({row['mode']}, key {row['key']}){when}."


def _from_result(app: Any, task_id: str) -> str | None:
    """What the app's result backend stored for ``task_id``; None if nothing."""
    backend = None if app is None else app.backend
    if backend is None or isinstance(backend, DisabledBackend):
        return None
    try:
        meta = backend.get_task_meta(task_id)
    except Exception:  # a fallback: the verdict stays unknown
        return None
    state, result = meta.get("status"), meta.get("result")
    if state in (None, "PENDING"):
        return None
    if isinstance(result, exceptions.TaskReplaced):
        return (
            f"replaced by {result.replaced_by}, a later send of its key, before it "
            "started: its body did not run (its result says so; pglock why that id)."
        )
    if isinstance(result, exceptions.LockSkipped):
        return f"did not run (its result says so): {result}"
    return f"ended {state} (its result says so; nothing else is recorded)."


def _iso(at: float) -> str:
    moment = datetime.datetime.fromtimestamp(at, tz=datetime.timezone.utc)
    return moment.isoformat(timespec="milliseconds")
