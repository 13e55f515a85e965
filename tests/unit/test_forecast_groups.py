"""Sibling-length signal: per-group length scales from the samples of one prompt."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrrl import errors
from scheduler.forecast import (
    build_forecast,
    group_scales,
    predict_remaining_arrays,
    predict_remaining_groups,
)

pytestmark = pytest.mark.unit


def _grpo(seed: int, prompts: int, samples: int) -> tuple[list[int], list[str], list[float]]:
    """Lengths of ``prompts`` x ``samples`` with a shared log-normal difficulty per prompt."""
    rng = random.Random(seed)
    lengths: list[int] = []
    groups: list[str] = []
    difficulty: list[float] = []
    for p in range(prompts):
        d = rng.gauss(0.0, 0.6)
        difficulty.append(d)
        for _ in range(samples):
            lengths.append(max(1, round(1500 * math.exp(d + rng.gauss(0.0, 0.8)))))
            groups.append(f"p{p}")
    return lengths, groups, difficulty


def test_finished_siblings_rank_the_groups_by_difficulty() -> None:
    lengths, groups, difficulty = _grpo(7, 64, 16)
    fc = build_forecast(completed=lengths, completed_groups=groups, max_tokens=20480)
    scales = fc.group_log_scale
    assert len(scales) == 64
    est = np.array([scales[f"p{p}"] for p in range(64)])
    truth = np.array(difficulty)
    assert float(np.corrcoef(est, truth)[0, 1]) > 0.8
    # shrunk towards zero: never further from the grand mean than the raw group mean
    logs = np.log(np.array(lengths, dtype=float))
    for p in range(64):
        raw = float(np.mean(logs[p * 16 : (p + 1) * 16]) - np.mean(logs))
        assert abs(scales[f"p{p}"]) <= abs(raw) + 1e-9


def test_running_samples_of_one_length_carry_no_group_signal() -> None:
    # early in a step every sample has generated the same tokens: nothing is known
    fc = build_forecast(
        history=[[1000, 2000, 3000]],
        running=[50] * 40,
        running_groups=[f"p{k % 4}" for k in range(40)],
    )
    assert fc.group_log_scale == {}


def test_a_long_group_gets_longer_remaining_predictions() -> None:
    lengths, groups, _ = _grpo(3, 32, 8)
    fc = build_forecast(completed=lengths, completed_groups=groups, max_tokens=20480)
    hard = max(fc.group_log_scale, key=lambda g: fc.group_log_scale[g])
    easy = min(fc.group_log_scale, key=lambda g: fc.group_log_scale[g])
    mean, quant = predict_remaining_groups(fc, [500, 500], [hard, easy], 0.9)
    assert mean[0] > mean[1]
    assert quant[0] > quant[1]
    # a request without a group (or of an unknown one) is predicted by the pooled forecast
    pooled_m, pooled_q = predict_remaining_arrays(fc, [500], 0.9)
    m2, q2 = predict_remaining_groups(fc, [500, 500], [None, "unknown"], 0.9)
    assert m2.tolist() == [pooled_m[0]] * 2
    assert q2.tolist() == [pooled_q[0]] * 2


def test_group_lists_must_match_their_lengths() -> None:
    with pytest.raises(errors.InvalidArgument, match="completed_groups"):
        build_forecast(completed=[1, 2, 3], completed_groups=["a", "b"])
    with pytest.raises(errors.InvalidArgument, match="running_groups"):
        build_forecast(running=[1, 2], running_groups=["a"])


def test_one_group_or_singletons_give_no_scales() -> None:
    fc = build_forecast(completed=[10, 20, 30])
    assert group_scales(fc, [10, 20, 30], ["a", "a", "a"], [], []) == {}
    assert group_scales(fc, [10, 20, 30], ["a", "b", "c"], [], []) == {}


@settings(max_examples=60)
@given(
    st.lists(
        st.tuples(st.integers(1, 20000), st.sampled_from(["a", "b", "c", "d"])),
        min_size=2,
        max_size=40,
    ),
    st.lists(
        st.tuples(st.integers(0, 20479), st.sampled_from(["a", "b", "c", "e", None])),
        max_size=40,
    ),
    st.floats(0.05, 0.95),
)
def test_group_predictions_stay_within_the_cap(
    done: list[tuple[int, str]], running: list[tuple[int, str | None]], q: float
) -> None:
    cap = 20480
    fc = build_forecast(
        completed=[x for x, _ in done],
        running=[g for g, _ in running],
        completed_groups=[g for _, g in done],
        running_groups=[g for _, g in running],
        max_tokens=cap,
    )
    for d in fc.group_log_scale.values():
        assert abs(d) <= 2.0
    gens = [g for g, _ in running]
    mean, quant = predict_remaining_groups(fc, gens, [g for _, g in running], q)
    for g, m, x in zip(gens, mean.tolist(), quant.tolist(), strict=True):
        assert 0.0 <= m <= cap - g
        assert 0.0 <= x <= cap - g
