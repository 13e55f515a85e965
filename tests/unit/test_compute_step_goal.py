"""The compute planner under partial rollout: the step's goal (what ends it), the work cut
where the goal is met, the earliest end as a floor, layouts only at the step's start, and
dispatch in arrival order to the shortest line."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrrl import errors
from scheduler.compute import PlannerConfig, build_problem, layout_frozen, plan_compute
from scheduler.compute_problem import goal_tokens
from scheduler.compute_state import (
    ComputeState,
    Instance,
    NodeGpus,
    Request,
    StepGoal,
    canonical_instances,
)
from scheduler.forecast import (
    LengthForecast,
    build_forecast,
    finish_probability_groups,
    predict_remaining_groups,
    remaining_square_groups,
    truncated_remaining_groups,
)
from scheduler.perf_model import H800, QWEN25_14B, PerfModel
from scheduler.rollout import RolloutMode, RolloutRule, StepEnd, StepProgress, step_goal

pytestmark = pytest.mark.unit

PM = PerfModel(QWEN25_14B, H800)
CAP = 16384
RNG = random.Random(5)
HISTORY = [[min(CAP, int(RNG.lognormvariate(7.3, 0.9))) for _ in range(512)] for _ in range(3)]
CARRY = PlannerConfig(carry_tail=True)


def cluster(n_nodes: int, pattern: tuple[int, ...]) -> tuple[tuple[NodeGpus, ...], list[Instance]]:
    nodes = tuple(NodeGpus(f"n{i}", tuple(range(8))) for i in range(n_nodes))
    insts: list[Instance] = []
    for n in nodes:
        insts.extend(canonical_instances(n.name, n.gpus, pattern))
    return nodes, insts


def fresh_state(n_nodes: int, pattern: tuple[int, ...], groups: int, size: int = 8) -> ComputeState:
    nodes, insts = cluster(n_nodes, pattern)
    reqs = tuple(
        Request(f"g{g:03d}-r{j}", 512, 0, None, False, f"g{g:03d}")
        for g in range(groups)
        for j in range(size)
    )
    return ComputeState(nodes, tuple(insts), reqs)


def forecast_of(state: ComputeState, history: list[list[int]] = HISTORY) -> LengthForecast:
    return build_forecast(
        history,
        [],
        [r.generated_tokens for r in state.requests],
        max_tokens=CAP,
        running_groups=[r.group for r in state.requests],
    )


FC = build_forecast(HISTORY, [], [], max_tokens=CAP)


# -- the distribution cut at a horizon --


@settings(max_examples=60)
@given(
    generated=st.lists(st.integers(0, CAP), min_size=1, max_size=20),
    w1=st.floats(0, 2 * CAP),
    w2=st.floats(0, 2 * CAP),
)
def test_cut_work_is_bounded_and_grows_with_the_horizon(
    generated: list[int], w1: float, w2: float
) -> None:
    lo, hi = sorted((w1, w2))
    groups: list[str | None] = [None] * len(generated)
    p_lo = finish_probability_groups(FC, generated, groups, lo)
    p_hi = finish_probability_groups(FC, generated, groups, hi)
    assert ((p_lo >= 0) & (p_lo <= 1) & (p_lo <= p_hi + 1e-12)).all()
    m_lo, sq_lo = truncated_remaining_groups(FC, generated, groups, lo)
    m_hi, _ = truncated_remaining_groups(FC, generated, groups, hi)
    full, _ = predict_remaining_groups(FC, generated, groups, 0.5)
    assert (m_lo >= 0).all() and (m_lo <= m_hi + 1e-6).all()
    assert (m_lo <= lo + 1e-6).all() and (m_hi <= full + 1e-6).all()
    # min(R, w)^2 <= w min(R, w) and E[X^2] >= E[X]^2
    assert (sq_lo <= lo * m_lo + 1e-3).all()
    assert (sq_lo + 1e-3 >= m_lo * m_lo).all()


def test_cut_at_the_cap_is_the_whole_remaining_work() -> None:
    generated = [0, 100, 2000, 9000]
    groups: list[str | None] = [None] * 4
    mean, square = truncated_remaining_groups(FC, generated, groups, CAP)
    full, _ = predict_remaining_groups(FC, generated, groups, 0.5)
    assert mean == pytest.approx(full, rel=1e-3, abs=1.0)
    assert square == pytest.approx(remaining_square_groups(FC, generated, groups), rel=1e-6)
    assert (finish_probability_groups(FC, generated, groups, CAP) == 1.0).all()


# -- the goal --


def test_goal_counts_groups_or_tokens_and_checks_its_values() -> None:
    with pytest.raises(errors.InvalidArgument, match="not both"):
        StepGoal(groups=1, tokens=1)
    with pytest.raises(errors.InvalidArgument, match=r"goal\.groups"):
        StepGoal(groups=-1)
    with pytest.raises(errors.InvalidArgument, match=r"goal\.floor_s"):
        StepGoal(floor_s=math.inf)
    with pytest.raises(errors.InvalidArgument, match=r"goal\.floor_s"):
        StepGoal(floor_s=-1.0)


@pytest.mark.parametrize(
    ("rule", "progress", "goal"),
    [
        (RolloutRule(), StepProgress(0.0, 0, 0, 10), None),
        (
            RolloutRule(RolloutMode.PARTIAL, 1.25, 1, StepEnd.GROUPS),
            StepProgress(30.0, 3, 0, 10, min_end_s=50.0),
            StepGoal(groups=5, floor_s=20.0),
        ),
        (
            RolloutRule(RolloutMode.PARTIAL, 1.25, 1, StepEnd.GROUPS),
            StepProgress(80.0, 11, 0, 10, min_end_s=50.0),
            StepGoal(groups=0, floor_s=0.0),
        ),
        (
            RolloutRule(RolloutMode.PARTIAL, 1.5, 1, StepEnd.TOKENS, token_budget=1000),
            StepProgress(5.0, 0, 400, 10, min_end_s=2.0),
            StepGoal(tokens=600, floor_s=0.0),
        ),
        (
            RolloutRule(RolloutMode.PARTIAL, 1.5, 1, StepEnd.TIME, time_budget_s=60.0),
            StepProgress(5.0, 0, 400, 10, min_end_s=20.0),
            StepGoal(floor_s=55.0),
        ),
    ],
)
def test_step_goal_of_each_rule(
    rule: RolloutRule, progress: StepProgress, goal: StepGoal | None
) -> None:
    assert step_goal(rule, 8, progress) == goal


def _expected_groups(generated: list[int], groups: list[str], w: float) -> float:
    p = finish_probability_groups(FC, generated, list(groups), w)
    out: dict[str, float] = {}
    for g, x in zip(groups, p.tolist(), strict=True):
        out[g] = out.get(g, 1.0) * x
    return sum(out.values())


@settings(max_examples=40)
@given(
    sizes=st.lists(st.integers(1, 6), min_size=1, max_size=12),
    data=st.data(),
)
def test_the_horizon_is_where_the_expected_groups_complete(
    sizes: list[int], data: st.DataObject
) -> None:
    groups = [f"g{i}" for i, n in enumerate(sizes) for _ in range(n)]
    generated = data.draw(
        st.lists(st.integers(0, 4000), min_size=len(groups), max_size=len(groups))
    )
    need = data.draw(st.integers(0, len(sizes)))
    w = goal_tokens(FC, generated, list(groups), StepGoal(groups=need))
    if need == 0:
        assert w == 0.0
        return
    assert 0 < w <= CAP
    assert _expected_groups(generated, groups, w) >= need - 1e-9
    assert _expected_groups(generated, groups, w - 1.0) < need
    more = goal_tokens(FC, generated, list(groups), StepGoal(groups=min(need + 1, len(sizes))))
    assert more >= w
    assert goal_tokens(FC, generated, list(groups), StepGoal(groups=len(sizes) + 1)) == math.inf


def test_the_horizon_of_a_token_budget_and_of_no_budget() -> None:
    generated = [0] * 50
    groups: list[str | None] = [None] * 50
    whole, _ = truncated_remaining_groups(FC, generated, groups, CAP)
    budget = int(whole.sum() / 3)
    w = goal_tokens(FC, generated, groups, StepGoal(tokens=budget))
    at, _ = truncated_remaining_groups(FC, generated, groups, w)
    before, _ = truncated_remaining_groups(FC, generated, groups, w - 1.0)
    assert at.sum() >= budget > before.sum()
    assert goal_tokens(FC, generated, groups, StepGoal(tokens=int(whole.sum()) + 10)) == math.inf
    assert goal_tokens(FC, generated, groups, StepGoal(floor_s=5.0)) == math.inf
    # requests without a group each complete a group of their own
    assert goal_tokens(FC, generated, groups, StepGoal(groups=50)) <= CAP


def test_the_problem_cuts_work_and_critical_paths_at_the_horizon() -> None:
    state = fresh_state(2, (4, 4), 40)
    fc = forecast_of(state)
    whole = build_problem(state, fc, PM, CARRY)
    full = build_problem(state, fc, PM, PlannerConfig())
    goal = StepGoal(groups=20, floor_s=3.0)
    cut = build_problem(state, fc, PM, CARRY, goal)
    assert whole.horizon_tokens == math.inf and 0 < cut.horizon_tokens < CAP
    assert cut.floor_s == 3.0
    q, m = np.array(cut.q), np.array(cut.m)
    assert (q <= cut.horizon_tokens + 1e-9).all()
    assert (m <= np.array(whole.m) + 1e-9).all() and m.sum() < sum(whole.m)
    # the critical path is the full rollout's, cut at the horizon
    assert (q == np.minimum(np.array(full.q), cut.horizon_tokens)).all()


# -- layouts under a goal --


def test_no_layout_gains_below_the_floor() -> None:
    """A fresh batch the planner would re-lay out for throughput keeps its layout when
    the step cannot end before the floor anyway (the trainer is still on its batch)."""
    state = fresh_state(6, (8,), 512, size=12)
    fc = forecast_of(state)
    goal = StepGoal(groups=400)
    moved = plan_compute(state, fc, PM, 0.0, CARRY, goal=goal)
    assert moved.reshards, moved.reason
    best = min(c.makespan_s + c.switching_s for c in moved.candidates)
    floored = StepGoal(groups=400, floor_s=2.0 * best + 100.0)
    kept = plan_compute(state, fc, PM, 0.0, CARRY, goal=floored)
    assert not kept.reshards and "no candidate predicts a shorter step" in kept.reason


def test_layouts_change_only_at_the_step_start_and_on_evidence() -> None:
    state = fresh_state(6, (8,), 512, size=12)
    goal = StepGoal(groups=400)
    fc0 = forecast_of(state)
    assert not layout_frozen(build_problem(state, fc0, PM, CARRY), fc0, None)
    # no finished length seen (no history, none finished): the prior alone decides nothing
    blind = forecast_of(state, history=[])
    assert blind.events == 0
    assert not plan_compute(state, blind, PM, 0.0, CARRY, goal=goal).reshards
    # once requests run (hold KV), the step is under way: the layout stays
    nodes = state.nodes
    insts = state.instances
    running = tuple(
        Request(r.id, r.prompt_tokens, 300, insts[k % len(insts)].id, True, r.group)
        for k, r in enumerate(state.requests)
    )
    busy = ComputeState(nodes, insts, running)
    fc = forecast_of(busy)
    prob = build_problem(busy, fc, PM, CARRY, goal)
    assert layout_frozen(prob, fc, goal)
    assert not plan_compute(busy, fc, PM, 10.0, CARRY, goal=goal).reshards
    # full rollout (no goal) still re-lays out a running step
    assert not layout_frozen(prob, fc, None)


# -- dispatch in arrival order --


def test_a_fresh_batch_is_dealt_out_in_turn_in_arrival_order() -> None:
    """On alike, empty instances the plan deals requests out in the order they arrived,
    one per instance in turn (as a static dispatcher does): every instance reaches a
    group at the same point of the arrival order."""
    nodes, insts = cluster(3, (4, 4))
    order = [f"g{g:03d}-r{j}" for g in range(30) for j in range(8)]
    shuffled = order[:]
    random.Random(3).shuffle(shuffled)  # ids do not give the order: the state's list does
    reqs = tuple(Request(rid, 512, 0, None, False, rid[:4]) for rid in shuffled)
    state = ComputeState(nodes, tuple(insts), reqs)
    # a floor beyond any layout's step: the layout stays (see the floor's test)
    goal = StepGoal(groups=24, floor_s=1e4)
    plan = plan_compute(state, forecast_of(state), PM, 0.0, CARRY, goal=goal)
    assert not plan.reshards
    where = dict(plan.assignment)
    ids = sorted(i.id for i in insts)
    assert [where[rid] for rid in shuffled] == [ids[k % len(ids)] for k in range(len(order))]


@settings(max_examples=30)
@given(
    pattern=st.sampled_from([(8,), (4, 4), (2, 2, 2, 2), (4, 2, 2)]),
    n_req=st.integers(1, 300),
    busy=st.integers(0, 40),
)
def test_dispatch_keeps_the_lines_even(pattern: tuple[int, ...], n_req: int, busy: int) -> None:
    """Queued requests go to the instance with the fewest requests per seat: after the
    plan no instance could take one of them with a shorter line."""
    nodes, insts = cluster(2, pattern)
    running = tuple(
        Request(f"a{k:03d}", 512, 200, insts[0].id, True, f"a{k:03d}") for k in range(busy)
    )
    queued = tuple(
        Request(f"q{k:03d}", 512, 0, None, False, f"q{k // 4:03d}") for k in range(n_req)
    )
    state = ComputeState(nodes, tuple(insts), running + queued)
    fc = forecast_of(state)
    goal = StepGoal(groups=1, floor_s=1e4)  # the layout stays (see the floor's test)
    prob = build_problem(state, fc, PM, CARRY, goal)
    plan = plan_compute(state, fc, PM, 0.0, CARRY, goal=goal)
    assert not plan.reshards
    count: dict[str, int] = {i.id: 0 for i in insts}
    for _, iid in plan.assignment:
        count[iid] += 1
    slots = {i.id: prob.costs[i.tp].slots for i in insts}
    line = {i: count[i] / slots[i] for i in count}
    took = {iid for rid, iid in plan.assignment if rid.startswith("q")}
    for iid in took:
        # the last request it took joined a line no longer than any other then
        assert (count[iid] - 1) / slots[iid] <= min(line.values()) + 1e-12
