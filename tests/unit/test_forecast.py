"""Length forecast: Kaplan-Meier within a step, Holt drift across steps."""

from __future__ import annotations

import dataclasses
import math
import random
from itertools import pairwise

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrrl import errors
from scheduler.forecast import (
    ForecastConfig,
    build_forecast,
    holt,
    log_mean,
    predict_remaining,
    reach_probability_groups,
    remaining_square_groups,
    survival_arrays,
)

pytestmark = pytest.mark.unit


def test_holt_follows_a_linear_trend_exactly() -> None:
    series = [5.0, 5.5, 6.0, 6.5]
    d = holt(series, alpha=0.3, beta=0.2)
    assert d.predicted_log_mean == pytest.approx(7.0)
    assert holt([]).steps == 0
    assert holt([4.0]).predicted_log_mean == 4.0


def test_without_censoring_the_estimate_is_the_empirical_distribution() -> None:
    lengths = [100, 200, 200, 400]
    fc = build_forecast(completed=lengths)
    assert fc.survival_at(99) == 1.0
    assert fc.survival_at(100) == pytest.approx(0.75)
    assert fc.survival_at(250) == pytest.approx(0.25)
    assert fc.survival_at(400) == pytest.approx(0.0)
    assert fc.mean_length() == pytest.approx(sum(lengths) / 4)
    # a request at 150 tokens will end at 200 (2/3) or 400 (1/3)
    assert fc.remaining_mean(150) == pytest.approx((50 * 2 + 250) / 3)
    assert fc.remaining_quantile(150, 0.5) == pytest.approx(50)
    assert fc.remaining_quantile(150, 0.9) == pytest.approx(250)


def test_censoring_keeps_early_estimates_from_being_biased_short() -> None:
    """Early in a step only short responses have finished; the running ones say the
    rest are longer."""
    done = [50, 60, 70, 80]
    naive = build_forecast(completed=done)
    censored = build_forecast(completed=done, running=[500] * 20)
    assert censored.mean_length() > 3 * naive.mean_length()
    assert censored.remaining_mean(500) > 0


def test_history_prior_and_drift() -> None:
    rng = random.Random(7)
    steps = [[int(rng.lognormvariate(6.0 + 0.2 * k, 0.5)) for _ in range(400)] for k in range(4)]
    fc = build_forecast(steps)
    # lengths grow by ~e^0.2 a step: the forecast expects the next step to be longer still
    assert fc.drift.predicted_log_mean > log_mean(steps[-1])
    assert fc.mean_length() > sum(steps[-1]) / len(steps[-1])
    flat = build_forecast(steps, config=ForecastConfig(max_drift=1.0))
    assert flat.mean_length() < fc.mean_length()


def test_generation_limit_caps_the_forecast() -> None:
    fc = build_forecast(completed=[100, 200], running=[900, 950], max_tokens=1000)
    assert fc.survival_at(1000) == 0.0
    for g in (0, 500, 950, 999):
        assert g + fc.remaining_quantile(g, 0.99) <= 1000 + 1e-9
        assert g + fc.remaining_mean(g) <= 1000 + 1e-9
    assert fc.remaining_mean(1000) == 0.0
    assert fc.remaining_quantile(1200, 0.5) == 0.0


def test_fallback_with_no_data_is_exponential() -> None:
    fc = build_forecast(config=ForecastConfig(fallback_mean_tokens=500.0))
    assert fc.remaining_mean(0) == pytest.approx(500.0)
    assert fc.remaining_mean(10_000) == pytest.approx(500.0)  # memoryless
    assert fc.remaining_quantile(0, 0.5) == pytest.approx(500.0 * math.log(2))


def test_config_and_argument_validation() -> None:
    with pytest.raises(errors.InvalidArgument):
        ForecastConfig(holt_alpha=1.5)
    with pytest.raises(errors.InvalidArgument):
        ForecastConfig(max_drift=0.5)
    with pytest.raises(errors.InvalidArgument):
        build_forecast(max_tokens=0)
    with pytest.raises(errors.InvalidArgument):
        build_forecast(completed=[1]).remaining_quantile(0, 1.0)


samples = st.lists(st.integers(1, 5000), max_size=60)


@settings(max_examples=60)
@given(
    history=st.lists(st.lists(st.integers(1, 8000), min_size=1, max_size=40), max_size=3),
    completed=samples,
    running=samples,
    max_tokens=st.one_of(st.none(), st.integers(5000, 20000)),
    generated=st.lists(st.integers(0, 25000), min_size=1, max_size=30),
    q=st.sampled_from([0.25, 0.5, 0.9, 0.999]),
)
def test_bulk_prediction_matches_per_request_and_is_sane(
    history: list[list[int]],
    completed: list[int],
    running: list[int],
    max_tokens: int | None,
    generated: list[int],
    q: float,
) -> None:
    fc = build_forecast(history, completed, running, max_tokens=max_tokens)
    means, quants = predict_remaining(fc, generated, q)
    for g, m, x in zip(generated, means, quants, strict=True):
        assert m == pytest.approx(fc.remaining_mean(g), rel=1e-9, abs=1e-9)
        assert x == pytest.approx(fc.remaining_quantile(g, q), rel=1e-9, abs=1e-9)
        assert m >= 0 and x >= 0
        assert fc.remaining_quantile(g, max(q, 0.95)) >= x - 1e-9
        if max_tokens is not None:
            assert g + x <= max(g, max_tokens) + 1e-6
    # the survival function never increases
    pts = sorted(set(generated))
    s = [fc.survival_at(x) for x in pts]
    assert all(a >= b - 1e-12 for a, b in pairwise(s))


@settings(max_examples=30)
@given(
    seed=st.integers(0, 10_000),
    cap=st.sampled_from([None, 4096, 16384]),
    xs=st.lists(st.floats(-10, 40_000, allow_nan=False), min_size=1, max_size=40),
)
def test_survival_arrays_are_survival_at(seed: int, cap: int | None, xs: list[float]) -> None:
    rng = random.Random(seed)
    done = [int(rng.lognormvariate(7.0, 1.0)) for _ in range(rng.randint(0, 300))]
    if cap is not None:
        done = [min(cap, x) for x in done]
    fc = build_forecast(
        [done] if done else [], [], [rng.randint(0, 3000) for _ in range(20)], max_tokens=cap
    )
    got = survival_arrays(fc, np.array(xs))
    assert got.tolist() == pytest.approx([fc.survival_at(x) for x in xs], rel=1e-12, abs=0)


def test_reaching_the_critical_path_at_a_cap_is_the_caps_mass() -> None:
    """A capped distribution's high quantiles are the cap: the chance of reaching it is
    the cap's whole mass (here 1 %), not one minus the quantile."""
    lengths = list(range(1, 991)) + [1000] * 10
    fc = build_forecast(completed=lengths, max_tokens=1000)
    _, quant = predict_remaining(fc, [0, 0], 0.9999)
    assert quant == [1000.0, 1000.0]
    reach = reach_probability_groups(fc, [0, 500], [None, None], np.array([1000.0, 500.0]))
    assert reach[0] == pytest.approx(0.01)
    assert reach[1] == pytest.approx(10 / 500)  # past 500 tokens: 500 of 1,000 left


@pytest.mark.parametrize("cap", [16384, None])
def test_the_remaining_second_moment_integrates_the_survival_function(cap: int | None) -> None:
    """``E[R^2 | L > g] = 2 int_g (x - g) S(x) dx / S(g)``, against the trapezoid rule
    on a fine grid, past the knots into the exponential tail; a group scaled by ``f``
    has ``f^2`` times the moment at ``g / f``."""
    rng = random.Random(4)
    done = [min(16384, int(rng.lognormvariate(7.3, 1.0))) for _ in range(800)]
    fc = build_forecast([done], [], [rng.randint(0, 3000) for _ in range(40)], max_tokens=cap)
    gs = [0, 100, 1500, 5000, 12000]
    got = remaining_square_groups(fc, gs, [None] * len(gs))
    upper = cap if cap is not None else 400_000
    xs = np.linspace(0.0, upper, 400_001)
    surv = survival_arrays(fc, xs)
    for g, value in zip(gs, got.tolist(), strict=True):
        past = xs >= g
        want = np.trapezoid(2.0 * (xs[past] - g) * surv[past], xs[past]) / fc.survival_at(g)
        assert value == pytest.approx(want, rel=1e-3)  # the grid: 1 token per step
        assert value >= fc.remaining_mean(g) ** 2  # E[R^2] >= E[R]^2
    scaled = dataclasses.replace(fc, group_log_scale={"long": math.log(2.0)})
    two = remaining_square_groups(scaled, [3000, 3000], ["long", None])
    assert two[1] == pytest.approx(remaining_square_groups(fc, [3000], [None])[0])
    if cap is None:
        assert two[0] == pytest.approx(4.0 * remaining_square_groups(fc, [1500], [None])[0])
    else:  # the scaled length is capped too: 2 L up to the cap, so L up to cap / 2
        past = (xs >= 1500) & (xs <= cap / 2)
        want = np.trapezoid(2.0 * (xs[past] - 1500) * surv[past], xs[past]) / fc.survival_at(1500)
        assert two[0] == pytest.approx(4.0 * want, rel=1e-3)
        assert two[0] <= (cap - 3000) ** 2


def test_the_second_moment_of_a_forecast_without_observations_is_the_exponentials() -> None:
    fc = build_forecast()
    square = remaining_square_groups(fc, [0, 500], [None, None])
    assert square.tolist() == pytest.approx([2.0 * fc.tail_mean**2] * 2)  # memoryless
