"""Random small compute-planning problems, for bounding the heuristic against the exact
MILP (used by the unit tests and by bench/planner.py alike)."""

from __future__ import annotations

import random

from scheduler.compute import PlannerConfig, Problem, build_problem
from scheduler.compute_state import ComputeState, Instance, NodeGpus, Request, canonical_instances
from scheduler.forecast import build_forecast
from scheduler.perf_model import PerfModel

# margins off: compare pure optimisation quality on the same objective
EXACT = PlannerConfig(switch_margin_s=0.0, switch_margin_rel=0.0, move_margin_s=0.0)


def small_problem(
    rng: random.Random, pm: PerfModel, *, max_requests: int = 8, config: PlannerConfig = EXACT
) -> Problem:
    """1-2 nodes of 2, 4 or 8 GPUs (those the model fits on), a random TP layout per
    node, and 1..``max_requests`` requests, about 70 % of them running."""
    sizes = [g for g in (2, 4, 8) if pm.fits(g)]
    gpus = rng.choice(sizes)
    nodes = tuple(NodeGpus(f"n{i}", tuple(range(gpus))) for i in range(rng.randint(1, 2)))
    patterns = [
        p
        for p in {(gpus,), (gpus // 2,) * 2, (1,) * gpus, (2,) * (gpus // 2)}
        if all(pm.fits(t) for t in p)
    ]
    insts: list[Instance] = []
    for n in nodes:
        insts.extend(canonical_instances(n.name, n.gpus, rng.choice(sorted(patterns))))
    reqs = []
    for i in range(rng.randint(1, max_requests)):
        if rng.random() < 0.3:
            reqs.append(Request(f"r{i}", rng.randint(100, 1500)))
        else:
            reqs.append(
                Request(
                    f"r{i}",
                    rng.randint(100, 1500),
                    rng.randint(0, 6000),
                    rng.choice(insts).id,
                    True,
                )
            )
    state = ComputeState(nodes, tuple(insts), tuple(reqs))
    history = [[int(rng.lognormvariate(7.5, 0.9)) for _ in range(200)]]
    fc = build_forecast(history, [], [r.generated_tokens for r in reqs], max_tokens=16384)
    return build_problem(state, fc, pm, config)
