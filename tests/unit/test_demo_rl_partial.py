"""demo-rl's partial-rollout settings and checks (no cluster, no engine)."""

from __future__ import annotations

import pytest

from fabric_controller.demo_rl import RLConfig, StepRow, check_partial, format_row, header
from orchestrrl import errors
from orchestrrl.rollout import Group, Sample

pytestmark = pytest.mark.unit


def test_bad_partial_settings_name_the_flag_the_value_and_the_range() -> None:
    RLConfig(rollout="partial", over_provision=2.0, max_staleness=0).check()
    with pytest.raises(errors.InvalidArgument) as e:
        RLConfig(rollout="later", over_provision=2.5, max_staleness=-1).check()
    text = str(e.value)
    assert "--rollout='later'" in text and "full or partial" in text
    assert "--over-provision=2.5 is not valid: a number from 1.0 to 2.0" in text
    assert "--max-staleness=-1 is not valid: an integer in 0..16" in text


def sample(rid: str, versions: tuple[str, ...]) -> Sample:
    return Sample(rid, (1,) * len(versions), None, versions, "stop", ("n",), "g")


def test_a_partial_batch_is_checked_for_lost_duplicated_and_too_stale_responses() -> None:
    trained: set[str] = set()
    first = [Group((1,), "a", (sample("a-0", ("1", "2")), sample("a-1", ("2",))))]
    assert check_partial(first, 2, ["2", "1"], trained) == 0
    assert trained == {"a-0", "a-1"}
    again = [Group((1,), "b", (sample("a-1", ("2",)),))]  # trained before, and one missing
    assert check_partial(again, 2, ["2", "1"], trained) == 2
    stale = [Group((1,), "c", (sample("c-0", ("0", "2")), sample("c-1", ("2",))))]
    with pytest.raises(errors.FailedPrecondition, match=r"c-0.*outlived max_staleness"):
        check_partial(stale, 2, ["2", "1"], trained)


def test_partial_rows_show_carried_resumed_and_the_offpolicy_share() -> None:
    row = StepRow(
        step=3,
        weight_version="3",
        reward_mean=0.5,
        length_p50=40,
        length_p99=90,
        length_mean=45,
        stop_fraction=0.8,
        logprob_mean_abs_diff=1e-6,
        logprob_max_abs_diff=1e-5,
        phase_s={"generation": 1.0, "training": 2.0, "weight-sync": 3.0},
        reshards=0,
        migrations=1,
        moved_running=0,
        moved_tokens=0,
        samples=32,
        sync_bytes=100,
        versions_seen=["2", "3"],
        carried=5,
        resumed=4,
        offpolicy_share=0.125,
        dropped=2,
    )
    assert header(True).split()[-4:] == ["carried", "resumed", "offpol", "dropped"]
    assert format_row(row, True).split()[-4:] == ["5", "4", "12.5%", "2"]
    assert "carried" not in header() and len(format_row(row).split()) == 13  # full: as before
