"""Placement passes: the batched LPT and the vectorised load give the one-by-one result."""

from __future__ import annotations

import random

import pytest

from scheduler.compute_problem import Problem, build_problem
from scheduler.compute_state import ComputeState, Instance, NodeGpus, Request, canonical_instances
from scheduler.forecast import build_forecast
from scheduler.perf_model import H800, QWEN25_14B, PerfModel
from scheduler.placement import Placement, keep_makespan

pytestmark = pytest.mark.unit

PM = PerfModel(QWEN25_14B, H800)
RNG = random.Random(7)
HISTORY = [[min(16384, int(RNG.lognormvariate(7.6, 0.9))) for _ in range(512)] for _ in range(3)]


def problem(
    rng: random.Random, n_nodes: int, tp: int, n_req: int, *, same: bool, placed: float
) -> tuple[Problem, list[Instance]]:
    """Requests partly running on instances (``placed`` of them), the rest queued;
    ``same``: every request alike (all loads tie: the batches cannot go far)."""
    nodes = tuple(NodeGpus(f"n{i}", tuple(range(8))) for i in range(n_nodes))
    insts = sorted(i for n in nodes for i in canonical_instances(n.name, n.gpus, (tp,) * (8 // tp)))
    reqs = []
    for i in range(n_req):
        gen = 0 if same else rng.choice([0, rng.randint(0, 12000)])
        prompt = 1000 if same else rng.randint(100, 3000)
        if rng.random() < placed:
            reqs.append(Request(f"r{i:04d}", prompt, gen, rng.choice(insts).id, True))
        else:
            reqs.append(Request(f"r{i:04d}", prompt, gen))
    state = ComputeState(nodes, tuple(insts), tuple(reqs))
    gens = [r.generated_tokens for r in reqs]
    return build_problem(state, build_forecast(HISTORY, [], gens, max_tokens=16384), PM), insts


CASES = [
    (seed, n_nodes, tp, n_req, same, placed)
    for seed, (n_nodes, tp, n_req, same, placed) in enumerate(
        [
            (4, 1, 300, False, 0.0),
            (4, 1, 300, True, 0.0),  # ties everywhere: the heap fallback
            (8, 2, 500, False, 0.5),
            (8, 8, 200, True, 0.3),
            (16, 1, 40, False, 0.0),  # fewer requests than instances
            (2, 4, 700, False, 0.9),
        ]
    )
]


@pytest.mark.parametrize(("seed", "n_nodes", "tp", "n_req", "same", "placed"), CASES)
def test_batched_lpt_and_load_match_one_request_at_a_time(
    seed: int, n_nodes: int, tp: int, n_req: int, same: bool, placed: float
) -> None:
    rng = random.Random(seed)
    prob, insts = problem(rng, n_nodes, tp, n_req, same=same, placed=placed)
    index = {inst.id: k for k, inst in enumerate(insts)}
    running = [(r, index[c]) for r, c in enumerate(prob.current) if c is not None]
    queued = [r for r, c in enumerate(prob.current) if c is None]

    fast = Placement(prob, insts, all_candidates=False)
    fast.load(running)  # vectorised
    slow = Placement(prob, insts, all_candidates=False)
    for r, k in running:  # one at a time
        slow.add(r, k)
    assert fast.run == slow.run
    assert fast.qs == slow.qs
    assert fast.sum_m == slow.sum_m and fast.sum_pre == slow.sum_pre

    left_fast = fast.place_lpt(queued)  # one TP degree: the batched LPT
    # every instance looked at per request (ties by instance id == index order here)
    left_slow = slow.place_lpt(queued, cost_of=lambda r, k: 0.0)
    assert left_fast == left_slow
    assert fast.where == slow.where
    assert fast.run == slow.run
    assert fast.members == slow.members
    assert fast.qs == slow.qs

    placeable = list(range(len(prob.rids)))
    assert keep_makespan(prob, placeable, False) == keep_makespan(prob, placeable, True)
