"""The asynchronous job's split, planned from the measured rates and idle ratios
(scheduler.async_plan)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from orchestrrl import errors
from scheduler.async_plan import PeriodMeasure, SplitDecision, plan_async_split

pytestmark = pytest.mark.unit

# a period of 100 s on 32 trainer + 32 rollout GPUs; per group 16 x 1,500 response tokens
# generated and 16 x 2,000 tokens trained
GEN, TRAIN = 16 * 1500.0, 16 * 2000.0


def _m(**kw: float) -> PeriodMeasure:
    base = dict(
        train_gpus=32,
        gen_gpus=32,
        wall_s=100.0,
        trainer_wait_s=0.0,
        train_busy_s=100.0,
        trained_tokens=100 * TRAIN,
        generated_tokens=100 * GEN,
        rollout_idle_gpu_s=32 * 50.0,
    )
    base.update(kw)
    return PeriodMeasure(**base)  # type: ignore[arg-type]


def _plan(m: PeriodMeasure, **kw: object) -> SplitDecision:
    args: dict[str, object] = dict(
        unit=8,
        min_train_gpus=0,
        max_train_gpus=0,
        train_tokens_per_group=TRAIN,
        gen_tokens_per_group=GEN,
        period_s=200.0,
        switch_s=lambda a, b: 2.0,
    )
    args.update(kw)
    return plan_async_split(m, **args)  # type: ignore[arg-type]


def test_a_trainer_bound_job_moves_gpus_to_the_trainer() -> None:
    # the trainer never waits, the rollout idles half the time: 1 group/s trained on 32
    d = _plan(_m())
    assert d.changed and d.train_gpus > 32 and d.gen_gpus == 64 - d.train_gpus
    assert "trainer idle 0%, rollout idle 50%" in d.reason
    rates = dict(d.rates)
    assert rates[d.train_gpus] == max(rates.values())


def test_a_rollout_bound_job_moves_gpus_to_the_rollout() -> None:
    d = _plan(_m(trainer_wait_s=50.0, train_busy_s=50.0, rollout_idle_gpu_s=0.0))
    assert d.changed and d.train_gpus < 32


def test_no_move_when_the_idle_ratios_disagree_with_the_model() -> None:
    # the model favours the trainer, but the trainer idled more than the rollout
    d = _plan(_m(trainer_wait_s=60.0, rollout_idle_gpu_s=32 * 10.0, generated_tokens=200 * GEN))
    assert not d.changed and "idled no more than the trainer" in d.reason


def test_no_move_when_the_gain_does_not_beat_the_pause_and_the_margin() -> None:
    d = _plan(_m(), switch_s=lambda a, b: 500.0)
    assert not d.changed and "would save" in d.reason


def test_bounds_and_the_unit_hold() -> None:
    d = _plan(_m(), max_train_gpus=40)
    assert d.train_gpus == 40
    assert all(t % 8 == 0 and 8 <= t <= 40 for t, _ in d.rates)
    with pytest.raises(errors.InvalidArgument, match="unit"):
        _plan(_m(), unit=12)


def test_nothing_measured_keeps_the_split() -> None:
    d = _plan(_m(trained_tokens=0.0))
    assert not d.changed and "measured no training" in d.reason


@given(
    st.floats(1, 100), st.floats(0, 1), st.floats(0, 1), st.floats(1e5, 1e8), st.floats(1e5, 1e8)
)
def test_a_move_never_lowers_the_predicted_rate(
    busy: float, wait_share: float, idle_share: float, trained: float, generated: float
) -> None:
    m = _m(
        train_busy_s=busy,
        trainer_wait_s=wait_share * 100.0,
        rollout_idle_gpu_s=idle_share * 0.99 * 32 * 100.0,
        trained_tokens=trained,
        generated_tokens=generated,
    )
    d = _plan(m, switch_s=lambda a, b: 0.0)
    rates = dict(d.rates)
    if d.changed:
        assert rates[d.train_gpus] > rates[32]
