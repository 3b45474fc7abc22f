"""sessions.Claims: the keys held by runs of one process (no database needed)."""

from __future__ import annotations

import threading
import time
import types

from celery_pglock.lock import sessions


def hold(ids: tuple[int, ...] = (42,), *, granted: bool = True) -> sessions.Hold:
    """A run's hold; granted: its session holds the key (as once a claim is taken)."""
    made = sessions.Hold(session=None, ids=ids)  # type: ignore[arg-type]
    made.connection = object() if granted else None
    return made


def test_a_claimed_key_is_refused_until_its_hold_releases_it() -> None:
    claims = sessions.Claims()
    first, second = hold(), hold()
    assert claims.claim(first)
    assert not claims.claim(second)
    assert claims.claim(hold((43,)))  # another key
    claims.release(first)
    assert claims.claim(second)


def test_a_late_release_never_frees_another_runs_claim() -> None:
    """Identity: a hold whose claim was already given back (or never granted) releases
    nothing, even when another hold of the same key holds it now."""
    claims = sessions.Claims()
    first, second = hold(), hold()
    assert claims.claim(first)
    claims.release(first)
    assert claims.claim(second)
    claims.release(first)  # late, and a refused hold's release
    assert not claims.claim(hold())  # second still holds the key


def test_a_bounded_wait_gives_up_at_its_deadline() -> None:
    claims = sessions.Claims()
    first = hold()
    assert claims.claim(first)
    started = time.monotonic()
    assert not claims.claim(hold(), time.monotonic() + 0.2)
    assert 0.2 <= time.monotonic() - started < 1.0


def test_a_bounded_wait_is_woken_by_the_release() -> None:
    claims = sessions.Claims()
    first, waiter = hold(), hold()
    assert claims.claim(first)
    outcome: dict[str, object] = {}

    def wait() -> None:
        outcome["granted"] = claims.claim(waiter, time.monotonic() + 10)
        outcome["at"] = time.monotonic()

    thread = threading.Thread(target=wait)
    thread.start()
    time.sleep(0.2)
    released_at = time.monotonic()
    claims.release(first)
    thread.join(10)
    assert outcome["granted"] is True
    assert float(outcome["at"]) - released_at < 0.5  # type: ignore[arg-type]
    assert not claims.claim(hold())  # the waiter holds it now


def test_a_hold_dropped_without_release_frees_its_key() -> None:
    """Weak: an AdvisoryLock garbage-collected while held (the pool's check-in then frees
    its lock in PostgreSQL) does not keep its key claimed in the process forever."""
    claims = sessions.Claims()
    dropped = hold()
    assert claims.claim(dropped)
    del dropped
    assert claims.claim(hold())  # a dropped hold's claim is gone


def test_an_ungranted_claim_this_thread_left_is_void_for_it_alone() -> None:
    """An interrupt in an acquire's cleanup can leave its claim behind, never granted,
    while a traceback keeps the hold: the thread's next claim of the key takes it over
    (its acquire has ended); another thread still waits for it, as it cannot know."""
    claims = sessions.Claims()
    left = hold(granted=False)
    assert claims.claim(left)
    outcome: dict[str, bool] = {}
    other = threading.Thread(target=lambda: outcome.update(got=claims.claim(hold())))
    other.start()
    other.join(10)
    assert outcome == {"got": False}
    again = hold()
    assert claims.claim(again)  # this thread: left's acquire has ended
    assert not claims.claim(hold())  # and again holds it now
    # The same for a lock_group slot claimed beside the key (claim_free).
    slot = types.SimpleNamespace(ids=(43,))
    first, second = hold(granted=False), hold(granted=False)
    assert [slot] == claims.claim_free([slot], first)
    assert [slot] == claims.claim_free([slot], second)  # first's was left: void here
    second.connection = object()  # granted with its key
    assert [] == claims.claim_free([slot], hold())
