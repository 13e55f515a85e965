"""Re-planning points and the consistency of the plan's predictions."""

from __future__ import annotations

import math

import pytest

from orchestrrl import errors
from scheduler.compute import build_problem, plan_objective, solve
from scheduler.compute_state import ComputeState, NodeGpus, Request, canonical_instances
from scheduler.forecast import build_forecast
from scheduler.perf_model import H800, QWEN25_14B, PerfModel
from scheduler.replan import ReplanSchedule

pytestmark = pytest.mark.unit


def test_replan_at_step_start_and_then_every_interval() -> None:
    s = ReplanSchedule(interval_s=5.0)
    assert s.due(step_started_at=100.0, now=100.0, last_plan_at=None)
    assert not s.due(step_started_at=100.0, now=99.0, last_plan_at=None)
    # the last plan was in the previous step: the new step is planned at once
    assert s.due(step_started_at=100.0, now=100.0, last_plan_at=98.0)
    assert not s.due(step_started_at=100.0, now=104.9, last_plan_at=100.0)
    assert s.due(step_started_at=100.0, now=105.0, last_plan_at=100.0)
    # however long the step runs (the plan's prediction plays no part)
    assert s.due(step_started_at=100.0, now=1000.0, last_plan_at=994.0)


@pytest.mark.parametrize("bad", [0.0, 0.01, -1.0, 3601.0, math.nan, math.inf, "5", None, True])
def test_a_bad_replan_interval_is_refused_naming_the_field(bad: object) -> None:
    with pytest.raises(errors.InvalidArgument, match="replan_interval_s"):
        ReplanSchedule(interval_s=bad)  # type: ignore[arg-type]


def test_reported_prediction_is_the_objective() -> None:
    pm = PerfModel(QWEN25_14B, H800)
    nodes = tuple(NodeGpus(f"n{i}", tuple(range(8))) for i in range(2))
    insts = [i for n in nodes for i in canonical_instances(n.name, n.gpus, (2, 2, 2, 2))]
    reqs = tuple(
        Request(f"r{i}", 800, 500 * i, insts[i % 3].id, True) if i % 4 else Request(f"r{i}", 800)
        for i in range(20)
    )
    state = ComputeState(nodes, tuple(insts), reqs)
    fc = build_forecast(
        [[300, 900, 2000, 5000, 12000] * 20], [], [r.generated_tokens for r in reqs]
    )
    prob = build_problem(state, fc, pm)
    plan = solve(prob, 0.0)
    assert plan_objective(prob, plan) == pytest.approx(plan.prediction.planned_makespan_s, rel=1e-9)
