"""The planner weighs a reshard at its node's measured pause (``NodeGpus.reshard_pause_s``):
a reshard whose gain is below what the node's last reshard really took is left out; a
small measured pause changes nothing (the model's estimate stays the floor)."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrrl import errors
from scheduler.compute import plan_compute
from scheduler.compute_state import (
    ComputePlan,
    ComputeState,
    Instance,
    NodeGpus,
    Request,
    apply_plan,
    canonical_instances,
)
from tests.unit.test_compute_planner import HISTORY, PM, forecast_for

pytestmark = pytest.mark.unit


def measured(state: ComputeState, pauses: dict[str, float]) -> ComputeState:
    nodes = tuple(
        dataclasses.replace(n, reshard_pause_s=pauses.get(n.name, 0.0)) for n in state.nodes
    )
    return dataclasses.replace(state, nodes=nodes)


def tail_state() -> ComputeState:
    """Two nodes of 4 x TP2 draining to a long tail: the model merges them into TP8."""
    nodes = tuple(NodeGpus(f"n{i}", tuple(range(8))) for i in range(2))
    insts: list[Instance] = []
    for n in nodes:
        insts.extend(canonical_instances(n.name, n.gpus, (2, 2, 2, 2)))
    reqs = tuple(
        Request(f"t{i}", 1024, 8000 + 300 * i, insts[i % len(insts)].id, True) for i in range(6)
    )
    return ComputeState(nodes, tuple(insts), reqs)


def gain_before_pause(plan: ComputePlan) -> float:
    """What the model's chosen layout gains on the step before its pause."""
    best = plan.candidates[0]
    current = next(c for c in plan.candidates if c.switching_s == 0.0)  # the layout kept
    return current.score_s - best.makespan_s


def test_a_long_measured_pause_holds_a_reshard_whose_gain_is_below_it() -> None:
    state = tail_state()
    fc = forecast_for(state, HISTORY[-1])
    base = plan_compute(state, fc, PM, 0.0)
    assert {r.node for r in base.reshards} == {"n0", "n1"}, base.explain()
    assert base.cost_hold is None
    gain = gain_before_pause(base)
    model_pause = base.prediction.switching_s
    assert 0 < model_pause < gain  # the model's pause pays for itself

    # vLLM: a reshard restarts the instances, and the last one took longer than the gain
    slow = plan_compute(measured(state, {"n1": gain + 5.0}), fc, PM, 0.0)
    assert not slow.reshards, slow.explain()
    hold = slow.cost_hold
    assert hold is not None
    assert hold.nodes == ("n1",)
    assert hold.pause_s == gain + 5.0
    assert hold.model_pause_s == pytest.approx(model_pause)
    assert hold.gain_s == pytest.approx(gain)
    assert "measured reshard pause" in slow.reason and "n1" in slow.reason
    # re-planning after it, at the same measured pause, holds again (stable)
    after = apply_plan(measured(state, {"n1": gain + 5.0}), slow)
    assert not plan_compute(after, fc, PM, 0.0).reshards


def test_a_short_measured_pause_changes_nothing() -> None:
    """llama.cpp: a reshard measured under a second; the model's estimate stays the cost."""
    state = tail_state()
    fc = forecast_for(state, HISTORY[-1])
    base = plan_compute(state, fc, PM, 0.0)
    fast = plan_compute(measured(state, {"n0": 0.3, "n1": 0.9}), fc, PM, 0.0)
    assert fast == base
    assert fast.cost_hold is None
    assert fast.reason == base.reason


def test_a_measured_pause_the_gain_still_beats_is_paid_and_shown() -> None:
    state = tail_state()
    fc = forecast_for(state, HISTORY[-1])
    base = plan_compute(state, fc, PM, 0.0)
    gain = gain_before_pause(base)
    pause = (base.prediction.switching_s + gain) / 2.0  # above the model, below the gain
    assert gain - pause > 1.0  # more than the margin
    plan = plan_compute(measured(state, {"n0": pause}), fc, PM, 0.0)
    assert {r.node for r in plan.reshards} == {"n0", "n1"}, plan.explain()
    pauses = {r.node: r.pause_s for r in plan.reshards}
    assert pauses["n0"] == pause
    assert pauses["n1"] == pytest.approx(base.prediction.switching_s)
    assert plan.prediction.switching_s == pause
    assert f"switching {pause:.2f} s beats keeping" in plan.reason
    assert plan.prediction.planned_makespan_s == pytest.approx(
        base.prediction.planned_makespan_s + pause - base.prediction.switching_s
    )


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf")])
def test_a_measured_pause_must_be_finite_seconds(bad: float) -> None:
    with pytest.raises(errors.InvalidArgument, match="reshard_pause_s"):
        NodeGpus("n0", (0, 1), reshard_pause_s=bad)


# -- properties ---------------------------------------------------------------------


@st.composite
def states(draw: st.DrawFn) -> tuple[ComputeState, dict[str, float]]:
    n_nodes = draw(st.integers(1, 3))
    gpus = draw(st.sampled_from([2, 4, 8]))
    patterns = [(gpus,), (gpus // 2,) * 2, (1,) * gpus, (2,) * (gpus // 2)]
    nodes = tuple(NodeGpus(f"n{i}", tuple(range(gpus))) for i in range(n_nodes))
    insts: list[Instance] = []
    for n in nodes:
        insts.extend(canonical_instances(n.name, n.gpus, draw(st.sampled_from(patterns))))
    reqs = []
    for i in range(draw(st.integers(0, 16))):
        prompt = draw(st.integers(10, 3000))
        if draw(st.booleans()):
            reqs.append(Request(f"r{i:02d}", prompt))
        else:
            inst = draw(st.sampled_from(insts))
            reqs.append(Request(f"r{i:02d}", prompt, draw(st.integers(0, 12000)), inst.id, True))
    pause = st.one_of(st.just(0.0), st.floats(0.0, 5.0), st.floats(5.0, 500.0))
    pauses = {n.name: draw(pause) for n in nodes}
    return ComputeState(nodes, tuple(insts), tuple(reqs)), pauses


@settings(max_examples=60)
@given(case=states())
def test_a_measured_pause_only_ever_holds_a_reshard_back(
    case: tuple[ComputeState, dict[str, float]],
) -> None:
    """Whatever the measured pauses: a reshard is planned only where the model alone plans
    it too, at no less than the node's measured pause and only when the step still gains
    more than that pause; without reshards the plan is the model's own."""
    state, pauses = case
    fc = forecast_for(state)
    base = plan_compute(state, fc, PM, 0.0)
    plan = plan_compute(measured(state, pauses), fc, PM, 0.0)
    if plan.reshards:
        assert [(r.node, r.after) for r in plan.reshards] == [
            (r.node, r.after) for r in base.reshards
        ]
        for r in plan.reshards:
            assert r.pause_s >= pauses[r.node]
        assert plan.prediction.switching_s >= max(pauses[r.node] for r in plan.reshards)
        assert plan.cost_hold is None
    elif base.reshards:
        hold = plan.cost_hold
        assert hold is not None, plan.explain()
        assert hold.pause_s > hold.model_pause_s
        worst = max(c.score_s for c in plan.candidates)
        assert hold.gain_s - hold.pause_s <= max(0.5, 0.05 * worst) + 1e-9
        assert all(pauses[n] > 0 for n in hold.nodes)
    else:
        assert plan == base
        assert plan.cost_hold is None
    # re-planning after the plan, at the same measured pauses, changes nothing
    after = apply_plan(measured(state, pauses), plan)
    assert not plan_compute(after, fc, PM, 0.0).reshards
