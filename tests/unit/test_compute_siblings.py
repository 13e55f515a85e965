"""The compute planner with the sibling-length signal: long groups are admitted first."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler.compute import PlannerConfig, build_problem, plan_compute
from scheduler.compute_state import (
    ComputeState,
    Instance,
    NodeGpus,
    Request,
    apply_plan,
    canonical_instances,
)
from scheduler.forecast import LengthForecast, build_forecast
from scheduler.perf_model import H800, QWEN25_14B, PerfModel

pytestmark = pytest.mark.unit

PM = PerfModel(QWEN25_14B, H800)


def _state(waiting: Sequence[tuple[str, str | None]]) -> ComputeState:
    nodes = (NodeGpus("n0", tuple(range(8))),)
    insts: list[Instance] = list(canonical_instances("n0", range(8), (4, 4)))
    reqs = [Request(rid, 256, 0, None, False, group) for rid, group in waiting]
    return ComputeState(nodes, tuple(insts), tuple(reqs))


def _finished(hard: str, easy: str) -> tuple[list[int], list[str]]:
    """Completed siblings: ``hard``'s samples long, ``easy``'s short, others between."""
    rng = random.Random(5)
    lengths: list[int] = []
    groups: list[str] = []
    for g, scale in ((hard, 6000.0), (easy, 300.0), ("m1", 1500.0), ("m2", 1500.0)):
        for _ in range(6):
            lengths.append(max(1, round(scale * rng.lognormvariate(0.0, 0.3))))
            groups.append(g)
    return lengths, groups


def test_waiting_siblings_of_a_long_group_are_admitted_first() -> None:
    done, done_groups = _finished("hard", "easy")
    waiting = [(f"e{k}", "easy") for k in range(4)] + [(f"h{k}", "hard") for k in range(3)]
    state = _state(waiting)
    fc = build_forecast(
        completed=done,
        completed_groups=done_groups,
        running=[0] * len(waiting),
        running_groups=[g for _, g in waiting],
        max_tokens=20480,
    )
    assert fc.group_log_scale["hard"] > 0 > fc.group_log_scale["easy"]
    plan = plan_compute(state, fc, PM, 0.0)
    assert set(plan.admit_order) == {"h0", "h1", "h2"}
    # the same request predicted from the pooled forecast alone is shorter
    pooled = build_forecast(completed=done, running=[0] * len(waiting), max_tokens=20480)
    alone = plan_compute(state, pooled, PM, 0.0)
    assert alone.admit_order == ()


def test_without_groups_the_queue_order_is_left_alone() -> None:
    waiting: list[tuple[str, str | None]] = [(f"r{k}", None) for k in range(10)]
    state = _state(waiting)
    fc = build_forecast(history=[[500, 1500, 4000]], running=[0] * 10, max_tokens=20480)
    plan = plan_compute(state, fc, PM, 0.0)
    assert plan.admit_order == ()


@settings(max_examples=25)
@given(
    st.lists(st.sampled_from(["a", "b", "c", None]), min_size=1, max_size=30),
    st.lists(st.tuples(st.integers(1, 20000), st.sampled_from(["a", "b", "c"])), max_size=30),
)
def test_admit_order_names_waiting_placed_requests_once_and_replans_keep_it(
    groups: list[str | None], done: list[tuple[int, str]]
) -> None:
    waiting = [(f"r{k}", g) for k, g in enumerate(groups)]
    state = _state(waiting)

    def forecast(s: ComputeState) -> LengthForecast:
        return build_forecast(
            completed=[x for x, _ in done],
            completed_groups=[g for _, g in done],
            running=[r.generated_tokens for r in s.requests],
            running_groups=[r.group for r in s.requests],
            max_tokens=20480,
        )

    fc = forecast(state)
    plan = plan_compute(state, fc, PM, 0.0)
    order = plan.admit_order
    assert len(order) == len(set(order))
    placed = {rid for rid, _ in plan.assignment}
    assert set(order) <= placed
    scales = fc.group_log_scale
    by_id = dict(waiting)
    for rid in order:
        g = by_id[rid]
        assert g is not None and scales.get(g, 0.0) > 0.0
    # the group of every request survives applying the plan
    after = apply_plan(state, plan)
    assert {r.id: r.group for r in after.requests} == by_id


def test_equal_requests_take_turns_between_groups_in_the_longest_first_order() -> None:
    waiting = [(f"{g}{k}", g) for g in ("a", "b", "c") for k in range(3)]
    state = _state(waiting)
    fc = build_forecast(history=[[500, 1500, 4000]], running=[0] * 9, max_tokens=20480)
    prob = build_problem(state, fc, PM)
    order = [prob.rids[r] for r in prob.by_length]
    # every group's first sample before any group's second (LPT spreads the siblings)
    assert [x[0] for x in order] == ["a", "b", "c"] * 3


def test_under_partial_rollout_long_groups_wait_their_turn() -> None:
    """With ``carry_tail`` a predicted-long group would be carried anyway: queues stay
    first come, first served."""
    done, done_groups = _finished("hard", "easy")
    waiting = [(f"e{k}", "easy") for k in range(4)] + [(f"h{k}", "hard") for k in range(3)]
    state = _state(waiting)
    fc = build_forecast(
        completed=done,
        completed_groups=done_groups,
        running=[0] * len(waiting),
        running_groups=[g for _, g in waiting],
        max_tokens=20480,
    )
    plan = plan_compute(state, fc, PM, 0.0, PlannerConfig(carry_tail=True))
    assert plan.admit_order == ()
