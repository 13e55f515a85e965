"""The compute-scheduling loop's memory across restarts: encoding, bounds, bad input."""

from __future__ import annotations

import json
import random
import zlib

import pytest

from fabric_controller import scheduling
from fabric_controller.scheduling import StepTracker, memory_blob, memory_load, restored
from orchestrrl import errors
from scheduler.forecast import PriorLengths

pytestmark = pytest.mark.unit


def tracker(groups: int, seed: int = 0) -> StepTracker:
    rng = random.Random(seed)
    remembered = {
        f"prompt-{i:06d}": PriorLengths(
            tuple(rng.randint(1, 20480) for _ in range(16)), rng.uniform(6.0, 8.0)
        )
        for i in range(groups)
    }
    history = tuple(tuple(rng.randint(0, 20480) for _ in range(512)) for _ in range(3))
    return StepTracker(step=7, history=history, remembered=remembered)


def test_the_memory_round_trips_exactly() -> None:
    t = tracker(300)
    blob, left_out = memory_blob(t)
    assert left_out == 0
    history, remembered = memory_load(blob)
    assert history == t.history
    assert remembered == t.remembered
    assert list(remembered) == list(t.remembered)  # least recently seen first, as kept
    back = restored(history, remembered)
    assert back.step is None  # the step in progress is read anew from the nodes
    assert back.history == t.history and back.remembered == t.remembered


def test_an_empty_tracker_saves_and_restores_nothing() -> None:
    history, remembered = memory_load(memory_blob(StepTracker())[0])
    assert history == () and remembered == {}


def test_over_the_limit_the_least_recently_seen_groups_are_left_out() -> None:
    t = tracker(4000)
    full, _ = memory_blob(t)
    limit = len(full) // 2
    blob, left_out = memory_blob(t, limit)
    assert len(blob) <= limit
    assert 0 < left_out < 4000
    history, remembered = memory_load(blob)
    assert history == t.history
    assert list(remembered) == list(t.remembered)[left_out:]  # the most recent kept
    # as many as fit: one more would not
    one_more = StepTracker(
        history=t.history, remembered=dict(list(t.remembered.items())[left_out - 1 :])
    )
    assert len(memory_blob(one_more, 1 << 30)[0]) > limit


def test_a_history_alone_over_the_limit_is_refused() -> None:
    with pytest.raises(errors.FailedPrecondition, match="history alone"):
        memory_blob(tracker(10), limit=100)


def deflate(doc: object) -> bytes:
    return zlib.compress(json.dumps(doc).encode())


@pytest.mark.parametrize(
    ("raw", "says"),
    [
        (b"not zlib at all", "not a saved memory"),
        (zlib.compress(b"{not json"), "not a saved memory"),
        (deflate([1, 2]), "version"),
        (deflate({"version": 99, "history": [], "groups": []}), "version"),
        (deflate({"version": 1, "history": [[1, -2]], "groups": []}), "history"),
        (deflate({"version": 1, "history": [["x"]], "groups": []}), "history"),
        (deflate({"version": 1, "history": [], "groups": {}}), "groups must be a list"),
        (deflate({"version": 1, "history": [], "groups": [["g", [1, 2]]]}), r"groups\[0\]"),
        (deflate({"version": 1, "history": [], "groups": [["", [1], 7.0]]}), r"groups\[0\]"),
        (deflate({"version": 1, "history": [], "groups": [["g", [0], 7.0]]}), r"groups\[0\]"),
        (deflate({"version": 1, "history": [], "groups": [["g", [5], True]]}), r"groups\[0\]"),
        (zlib.compress(b" " * (scheduling.MEMORY_TEXT_LIMIT + 1)), "at most"),
    ],
)
def test_a_bad_memory_is_refused_naming_what_is_wrong(raw: bytes, says: str) -> None:
    with pytest.raises(errors.InvalidArgument, match=says):
        memory_load(raw)


def test_the_memory_of_a_dapo_sized_dataset_fits_etcds_limit() -> None:
    """17,000 prompts x 16 samples and 8 steps of history, the default bound (1 MiB)."""
    t = tracker(17_000, seed=3)
    t = StepTracker(history=t.history * 3, remembered=t.remembered)
    blob, left_out = memory_blob(t)
    assert len(blob) <= scheduling.MEMORY_LIMIT_BYTES
    assert left_out < 17_000
