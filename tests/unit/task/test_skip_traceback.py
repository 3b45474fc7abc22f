"""A skip's traceback is one fixed frame (see LockSkipped.__traceback__): Celery's
failure path copies every frame it is given, so a skip must not give it the worker's."""

from __future__ import annotations

import pickle
import traceback

import pytest
from billiard.einfo import ExceptionInfo

from celery_pglock.exceptions import LockBusy, LockSkipped, TaskReplaced


def _deep(depth: int, error: Exception) -> None:
    if depth:
        _deep(depth - 1, error)
    raise error


@pytest.mark.parametrize(
    "error",
    [LockSkipped("skipped", {"key": "1"}), TaskReplaced("replaced", replaced_by="x")],
)
def test_a_skip_shows_one_frame_however_deep_it_was_raised(error):
    try:
        _deep(20, error)
    except (LockSkipped, TaskReplaced) as skip:
        frames = traceback.extract_tb(skip.__traceback__)
        einfo = ExceptionInfo((type(skip), skip, skip.__traceback__))
    assert 1 == len(frames)
    assert "nothing ran" in frames[0].filename
    assert einfo.tb.tb_next is None  # what Celery pickles to the worker's main process
    assert "_deep" not in einfo.traceback
    assert len(pickle.dumps(einfo)) < 4096


def test_a_skips_traceback_can_still_be_set_and_other_errors_keep_theirs():
    skip = LockSkipped("skipped")
    skip.__traceback__ = None  # as contextlib and others do: must not raise
    assert skip.with_traceback(None) is skip
    with pytest.raises(LockBusy) as raised:
        _busy()
    assert "_busy" in "".join(traceback.format_tb(raised.value.__traceback__))


def _busy() -> None:
    raise LockBusy("busy")
