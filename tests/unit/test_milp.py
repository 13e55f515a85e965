"""The exact MILP bounds the heuristic: within 5 % of the optimum on small cases."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler.cases import small_problem
from scheduler.compute import Problem, plan_objective, solve
from scheduler.milp import solve_exact
from scheduler.perf_model import H800, QWEN25_14B, QWEN25_72B, PerfModel

pytestmark = pytest.mark.unit

pytest.importorskip("highspy")

GAP_LIMIT = 0.05


def small_case(rng: random.Random, pm: PerfModel) -> Problem:
    return small_problem(rng, pm)


def gap_of(prob: Problem) -> tuple[float, float, float]:
    plan = solve(prob, 0.0)
    heuristic = plan_objective(prob, plan)
    exact = solve_exact(prob)
    assert exact.optimal
    # the exact solution is a valid plan: every request once, one layout per node
    placed = Counter(r for r, _ in exact.assignment)
    assert set(placed) == set(prob.rids) and set(placed.values()) == {1}
    assert set(exact.layout) == set(prob.nodes)
    return heuristic, exact.objective_s, heuristic / exact.objective_s - 1.0


@settings(
    max_examples=20,
    derandomize=True,
)
@given(seed=st.integers(0, 2**32 - 1), big=st.booleans())
def test_heuristic_within_five_percent_of_the_milp_optimum(seed: int, big: bool) -> None:
    pm = PerfModel(QWEN25_72B if big else QWEN25_14B, H800)
    heuristic, exact, gap = gap_of(small_case(random.Random(seed), pm))
    assert exact <= heuristic * (1 + 1e-6)  # the MILP is optimal
    assert gap <= GAP_LIMIT, f"heuristic {heuristic:.3f} s vs optimum {exact:.3f} s"


def test_worst_gap_on_a_fixed_sweep(capsys: pytest.CaptureFixture[str]) -> None:
    rng = random.Random(2026)
    pm = PerfModel(QWEN25_14B, H800)
    gaps = [gap_of(small_case(rng, pm))[2] for _ in range(12)]
    worst = max(gaps)
    with capsys.disabled():
        print(f"\nheuristic vs MILP: worst gap {worst:.2%} over {len(gaps)} cases")
    assert worst <= GAP_LIMIT
