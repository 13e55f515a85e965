"""The cluster mode's pure rules (fabric_controller.modes), exhaustively and by property."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fabric_controller.modes import effective_phase, mode_target
from orchestrrl import errors
from orchestrrl.model import SYNC_PHASES, Mode, Phase

pytestmark = pytest.mark.unit

CURRENT = [None, *Phase]


@pytest.mark.parametrize("current", CURRENT)
@pytest.mark.parametrize("asked", list(Phase))
def test_effective_phase(current: Phase | None, asked: Phase) -> None:
    if asked is Phase.ASYNC:
        with pytest.raises(errors.InvalidArgument, match=r"phase='async' is not valid.*mode set"):
            effective_phase(current, asked)
    elif current is not Phase.ASYNC:
        assert effective_phase(current, asked) is asked  # phased: the per-phase API as ever
    elif asked is Phase.WEIGHT_SYNC:
        assert effective_phase(current, asked) is Phase.ASYNC  # the standing circuits
    else:
        with pytest.raises(errors.FailedPrecondition, match=f"{asked.value}: the cluster is in"):
            effective_phase(current, asked)


@pytest.mark.parametrize("current", CURRENT)
@pytest.mark.parametrize("leave_to", [None, *SYNC_PHASES])
def test_mode_target(current: Phase | None, leave_to: Phase | None) -> None:
    target = mode_target(current, Mode.PHASED, leave_to)
    if current is Phase.ASYNC:
        assert target is (leave_to or Phase.GENERATION)
    else:
        assert target is None  # phased already: nothing to change
    if leave_to is None:
        assert mode_target(current, Mode.ASYNC, None) is Phase.ASYNC
    else:
        with pytest.raises(errors.InvalidArgument, match="unspecified when entering"):
            mode_target(current, Mode.ASYNC, leave_to)
    with pytest.raises(errors.InvalidArgument, match="phase='async' is not valid"):
        mode_target(current, Mode.PHASED, Phase.ASYNC)


@given(st.text(max_size=20))
def test_mode_parse_names_the_value(text: str) -> None:
    if text.strip().lower() in ("phased", "async"):
        assert Mode.parse(text).value == text.strip().lower()
    else:
        with pytest.raises(errors.InvalidArgument, match=r"^mode=.* is not valid: phased or async"):
            Mode.parse(text)


def test_mode_of_a_phase() -> None:
    assert [Mode.of(p) for p in CURRENT] == [Mode.PHASED] * 4 + [Mode.ASYNC]
    with pytest.raises(errors.InvalidArgument, match="phase='async' is not valid"):
        Phase.parse("async")
