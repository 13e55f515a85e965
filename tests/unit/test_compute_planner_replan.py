"""Re-planning points and the consistency of the plan's predictions."""

from __future__ import annotations

import pytest

from orchestrrl import errors
from scheduler.compute import build_problem, plan_objective, solve
from scheduler.compute_state import ComputeState, NodeGpus, Request, canonical_instances
from scheduler.forecast import build_forecast
from scheduler.perf_model import H800, QWEN25_14B, PerfModel
from scheduler.replan import ReplanSchedule

pytestmark = pytest.mark.unit


def test_replan_at_step_start_and_at_regular_points() -> None:
    s = ReplanSchedule(fractions=(0.0, 0.5, 0.9), min_interval_s=1.0)
    assert s.points(100.0, 60.0) == (100.0, 130.0, 154.0)
    kw = {"step_started_at": 100.0, "predicted_step_s": 60.0}
    assert s.due(**kw, now=100.0, last_plan_at=None)
    assert s.due(**kw, now=100.0, last_plan_at=40.0)  # last plan was in the previous step
    assert not s.due(**kw, now=120.0, last_plan_at=100.0)
    assert s.due(**kw, now=131.0, last_plan_at=100.0)
    assert not s.due(**kw, now=130.5, last_plan_at=130.0)  # min interval
    assert s.next_at(**{**kw, "after": 100.0}) == 130.0
    assert s.next_at(**{**kw, "after": 153.5}) == 154.5  # not before the min interval
    assert s.next_at(**{**kw, "after": 160.0}) is None
    with pytest.raises(errors.InvalidArgument):
        ReplanSchedule(fractions=(0.5, 0.1))
    with pytest.raises(errors.InvalidArgument):
        ReplanSchedule(fractions=(1.0,))


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
