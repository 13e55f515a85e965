"""The previous epoch's lengths of a prompt as a prior for its group's length scale."""

from __future__ import annotations

import math
import random
from collections.abc import Mapping

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from orchestrrl import errors
from scheduler.forecast import (
    ForecastConfig,
    PriorLengths,
    build_forecast,
    group_scales,
    prior_log_scales,
)

pytestmark = pytest.mark.unit


def _epochs(
    seed: int, prompts: int, samples: int, change: float = 0.0
) -> tuple[dict[str, PriorLengths], list[int], list[str], list[float]]:
    """Previous-epoch priors (lengths at a median of 300: drifted) and this step's
    lengths (median 1500) of prompts whose difficulty persists (plus ``change``)."""
    rng = random.Random(seed)
    priors: dict[str, PriorLengths] = {}
    lengths: list[int] = []
    groups: list[str] = []
    difficulty: list[float] = []
    then_logs: list[float] = []
    then: dict[str, tuple[int, ...]] = {}
    for p in range(prompts):
        d = rng.gauss(0.0, 0.6)
        prev = tuple(max(1, round(300 * math.exp(d + rng.gauss(0.0, 0.8)))) for _ in range(16))
        then[f"p{p}"] = prev
        then_logs += [math.log(x) for x in prev]
        d_now = d + rng.gauss(0.0, change)
        difficulty.append(d_now)
        for _ in range(samples):
            lengths.append(max(1, round(1500 * math.exp(d_now + rng.gauss(0.0, 0.8)))))
            groups.append(f"p{p}")
    ref = sum(then_logs) / len(then_logs)
    for g, prev in then.items():
        priors[g] = PriorLengths(prev, ref)
    return priors, lengths, groups, difficulty


def _spearman(a: list[float], b: list[float]) -> float:
    ra = np.argsort(np.argsort(a)).astype(float)
    rb = np.argsort(np.argsort(b)).astype(float)
    return float(np.corrcoef(ra, rb)[0, 1])


def test_the_prior_ranks_groups_before_anything_finishes() -> None:
    priors, lengths, groups, difficulty = _epochs(5, 64, 16)
    prior = prior_log_scales(priors)
    assert set(prior) == set(priors)
    est = [prior[f"p{p}"] for p in range(64)]
    assert _spearman(est, difficulty) > 0.8
    # at the step start every sample is queued at 0 tokens: without the prior no group
    # is scaled, with it every group carries its prior
    running = [0] * len(lengths)
    plain = build_forecast(running=running, running_groups=groups, max_tokens=20480)
    assert plain.group_log_scale == {}
    informed = build_forecast(
        running=running, running_groups=groups, max_tokens=20480, group_prior=prior
    )
    assert informed.group_log_scale == pytest.approx(prior)


def test_the_prior_is_shrunk_and_weighted() -> None:
    priors, *_ = _epochs(6, 32, 8)
    full = prior_log_scales(priors, ForecastConfig(epoch_prior_weight=1.0))
    half = prior_log_scales(priors, ForecastConfig(epoch_prior_weight=0.5))
    assert prior_log_scales(priors, ForecastConfig(epoch_prior_weight=0.0)) == {}
    for g, p in priors.items():
        raw = float(np.mean(np.log(p.lengths))) - p.step_log_mean
        assert abs(full[g]) <= abs(raw) + 1e-12  # shrunk toward zero
        assert full[g] * raw >= 0.0  # never flips the sign
        assert half[g] == pytest.approx(full[g] / 2)


def test_no_prior_from_one_group_or_from_groups_alike() -> None:
    assert prior_log_scales({"a": PriorLengths((100, 200), 5.0)}) == {}
    same = {g: PriorLengths((100, 100, 100), math.log(100)) for g in "abc"}
    assert prior_log_scales(same) == {}


def test_prior_lengths_are_validated() -> None:
    with pytest.raises(errors.InvalidArgument, match=r"prior\.lengths"):
        PriorLengths((), 1.0)
    with pytest.raises(errors.InvalidArgument, match=r"prior\.lengths"):
        PriorLengths((0, 5), 1.0)
    with pytest.raises(errors.InvalidArgument, match=r"prior\.step_log_mean"):
        PriorLengths((5,), math.nan)
    with pytest.raises(errors.InvalidArgument, match=r"forecast\.epoch_prior_weight"):
        ForecastConfig(epoch_prior_weight=1.5)


def test_siblings_and_prior_together_beat_either_alone_midway() -> None:
    # a quarter of the step has finished (the shortest responses); the rest run at the
    # 25th percentile of length
    priors, lengths, groups, difficulty = _epochs(11, 128, 16, change=0.3)
    cut = sorted(lengths)[len(lengths) // 4]
    done = [(x, g) for x, g in zip(lengths, groups, strict=True) if x <= cut]
    run = [(cut, g) for x, g in zip(lengths, groups, strict=True) if x > cut]
    kwargs = {
        "completed": [x for x, _ in done],
        "completed_groups": [g for _, g in done],
        "running": [x for x, _ in run],
        "running_groups": [g for _, g in run],
        "max_tokens": 20480,
    }
    siblings = build_forecast(**kwargs).group_log_scale  # type: ignore[arg-type]
    prior = prior_log_scales(priors)
    both = build_forecast(**kwargs, group_prior=prior).group_log_scale  # type: ignore[arg-type]
    names = [f"p{p}" for p in range(128)]

    def rho(scales: Mapping[str, float]) -> float:
        return _spearman([scales.get(g, 0.0) for g in names], difficulty)

    assert rho(both) > max(rho(siblings), rho(prior)) - 0.02
    assert rho(both) > rho(siblings) + 0.02


def test_without_a_prior_group_scales_are_unchanged() -> None:
    _, lengths, groups, _ = _epochs(2, 16, 8)
    fc = build_forecast(completed=lengths, max_tokens=20480)
    a = group_scales(fc, lengths, groups, [], [])
    assert group_scales(fc, lengths, groups, [], [], 2.0, {}) == a
    assert group_scales(fc, lengths, groups, [], [], 2.0, None) == a


@settings(max_examples=60)
@given(
    st.dictionaries(
        st.sampled_from(["a", "b", "c", "d", "e"]),
        st.tuples(
            st.lists(st.integers(1, 20480), min_size=1, max_size=16),
            st.floats(0.0, 10.0),
        ),
        max_size=5,
    ),
    st.lists(st.tuples(st.integers(1, 20480), st.sampled_from(["a", "b", "c", "x"])), max_size=30),
    st.lists(st.tuples(st.integers(0, 20479), st.sampled_from(["a", "b", "d", None])), max_size=30),
    st.floats(0.0, 1.0),
)
@example(raw={"a": ([1], 0.0), "b": ([1], 1.0)}, done=[], running=[], weight=1.0)  # no groups
def test_combined_scales_are_bounded_and_cover_the_prior(
    raw: dict[str, tuple[list[int], float]],
    done: list[tuple[int, str]],
    running: list[tuple[int, str | None]],
    weight: float,
) -> None:
    config = ForecastConfig(epoch_prior_weight=weight)
    priors = {g: PriorLengths(tuple(ls), ref) for g, (ls, ref) in raw.items()}
    prior = prior_log_scales(priors, config)
    for v in prior.values():
        assert abs(v) <= config.group_max_log_scale
    fc = build_forecast(
        completed=[x for x, _ in done],
        completed_groups=[g for _, g in done],
        running=[x for x, _ in running],
        running_groups=[g for _, g in running],
        max_tokens=20480,
        config=config,
        group_prior=prior,
    )
    for v in fc.group_log_scale.values():
        assert abs(v) <= config.group_max_log_scale
    # every group with a non-zero prior keeps a scale (the prior or its update)
    assert {g for g, v in prior.items() if v != 0.0} <= set(fc.group_log_scale)
