"""The step planner (scheduler.step_plan): split, TP and over-provisioning across steps."""

from __future__ import annotations

import math
from statistics import NormalDist

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrrl import errors
from scheduler.forecast import build_forecast
from scheduler.perf_model import default_model
from scheduler.rollout import FULL, RolloutMode, RolloutRule, StepEnd
from scheduler.step_plan import (
    StepLoad,
    TrainingRate,
    generation_seconds,
    plan_step,
    split_switch_s,
)

pytestmark = pytest.mark.unit

PERF = default_model("Qwen2.5-14B", "H800-SXM")
PARTIAL = RolloutRule(RolloutMode.PARTIAL, 1.25, 1, StepEnd.GROUPS)
SPLITS = [(8, 56), (16, 48), (24, 40), (32, 32)]
# a log-normal step of 512 responses: median 1,500 tokens, log sd 1 (the suite's workload)
LENGTHS = [
    min(20480, round(1500 * math.exp(NormalDist().inv_cdf((i + 0.5) / 512)))) for i in range(512)
]
FORECAST = build_forecast([LENGTHS], max_tokens=20480)
LOAD = StepLoad(8192, 512.0, FORECAST)


def _plan(
    training: TrainingRate,
    current: tuple[int, int] = (16, 48),
    rule: RolloutRule = PARTIAL,
    **kw: object,
) -> object:
    return plan_step(
        PERF,
        SPLITS,
        current,
        rule=rule,
        load=LOAD,
        training=training,
        sync_s=0.1,
        gpus_per_node=8,
        tps=(1, 2, 4, 8),
        max_num_seqs=256,
        node_gbps=3200.0,
        **kw,  # type: ignore[arg-type]
    )


def test_partial_generation_is_the_bulk_and_shrinks_with_gpus() -> None:
    small = generation_seconds(PERF, 32, 8, (2, 4, 8), LOAD, 256)
    large = generation_seconds(PERF, 48, 8, (2, 4, 8), LOAD, 256)
    for t in (2, 4, 8):
        bulk, full = large[t]
        assert 0 < bulk <= full  # full rollout also waits for the longest response
        assert small[t][0] == pytest.approx(bulk * 48 / 32, rel=1e-6)
    assert generation_seconds(PERF, 0, 8, (4,), LOAD, 256) == {}
    assert generation_seconds(PERF, 4, 8, (8,), LOAD, 256) == {}  # no whole instance


def test_a_training_bound_step_moves_gpus_to_training() -> None:
    # 0.23 GPU-ms per token: the 24.7M tokens of a step take ~350 s on 16 GPUs
    slow_training = TrainingRate(gpu_s_per_token=2.3e-4)
    plan = _plan(slow_training)
    assert plan.current.train_s > plan.current.gen_s  # training-bound at 48/16
    assert plan.changes_split and (plan.chosen.train_gpus, plan.chosen.gen_gpus) == (24, 40)
    assert plan.chosen.step_s < plan.current.step_s - plan.switch_s
    assert plan.switch_s == split_switch_s(PERF, 1, 0, 3200.0)
    assert "split 48/16 -> 40/24" in plan.reason
    best = min(plan.options, key=lambda p: (p.step_s, -p.gen_gpus))
    assert plan.chosen == best


def test_a_generation_bound_step_keeps_or_moves_gpus_to_generation() -> None:
    fast_training = TrainingRate(gpu_s_per_token=1e-6)
    plan = _plan(fast_training, current=(32, 32))
    assert plan.chosen.train_gpus < 32 and plan.chosen.gen_gpus > 32
    kept = _plan(fast_training, current=(8, 56))
    assert not kept.changes_split and kept.switch_s == 0.0 and "kept" in kept.reason


def test_a_small_gain_does_not_pay_the_move() -> None:
    # find the training rate at which 48/16 and 40/24 predict nearly the same step: the
    # planner must keep the current split unless the gain beats the move and the margin
    for rate in (3e-5, 4e-5, 5e-5, 6e-5, 8e-5, 1e-4):
        plan = _plan(TrainingRate(rate))
        gain = plan.current.step_s - plan.chosen.step_s
        if plan.changes_split:
            assert gain > plan.switch_s + max(0.5, 0.05 * plan.current.step_s)
        else:
            assert plan.chosen == plan.current


def test_over_provisioning_is_turned_off_when_full_rollout_fits_in_training() -> None:
    plan = _plan(TrainingRate(1e-3))  # training far longer than any generation (32/32 too)
    assert plan.chosen.full_gen_s <= plan.chosen.train_s
    assert plan.over_provision == 1.0 and "over-provisioning off" in plan.reason
    busy = _plan(TrainingRate(1e-6), current=(8, 56))
    assert busy.over_provision == PARTIAL.over_provision
    assert _plan(TrainingRate(1e-3), rule=FULL).over_provision == 1.0


def test_the_last_measurement_corrects_the_model_level() -> None:
    plain = _plan(TrainingRate(1e-6), current=(8, 56))
    twice = _plan(TrainingRate(1e-6), current=(8, 56), measured_gen_s=2 * plain.current.gen_s)
    assert twice.current.gen_s == pytest.approx(2 * plain.current.gen_s)
    # a partial step's measurement leaves the full-rollout prediction alone
    assert twice.current.full_gen_s == pytest.approx(plain.current.full_gen_s)
    full = _plan(TrainingRate(1e-6), current=(8, 56), rule=FULL, measured_gen_s=100.0)
    assert full.current.gen_s == pytest.approx(100.0)
    assert "prediction x" in twice.reason


def test_switch_cost_and_bad_input() -> None:
    assert split_switch_s(PERF, 0, 0, 3200.0) == 0.0
    to_gen = split_switch_s(PERF, 0, 1, 3200.0)
    to_train = split_switch_s(PERF, 1, 0, 3200.0)
    assert PERF.efficiency.reshard_fixed_s < to_gen < to_train  # optimizer state > weights
    with pytest.raises(errors.InvalidArgument, match="current"):
        _plan(TrainingRate(1e-5), current=(40, 24))
    with pytest.raises(errors.InvalidArgument, match="train_gpus=0"):
        TrainingRate(1e-5).seconds(100.0, 0)


@settings(max_examples=40)
@given(
    rate=st.floats(1e-7, 1e-3),
    current=st.sampled_from(SPLITS),
    comm=st.floats(0.0, 20.0),
)
def test_the_plan_is_the_current_split_or_a_better_one(
    rate: float, current: tuple[int, int], comm: float
) -> None:
    plan = _plan(TrainingRate(rate, comm), current=current)
    assert (plan.current.train_gpus, plan.current.gen_gpus) == current
    if plan.changes_split:
        assert plan.chosen.step_s + plan.switch_s < plan.current.step_s
    else:
        assert plan.chosen == plan.current and plan.switch_s == 0.0
    assert plan.over_provision in (1.0, PARTIAL.over_provision)
