"""The oracle policy's pure rules and the fluid lower bound."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler.compute_state import ComputeState, NodeGpus, Request, canonical_instances
from scheduler.perf_model import default_model
from sim_backends.clustersim.bound import fluid_bound
from sim_backends.clustersim.generation import simulate_step, uniform_layout
from sim_backends.clustersim.oracle import (
    OracleConfig,
    Speeds,
    best_lanes,
    candidate_layouts,
    list_schedule,
    oracle_plan,
)
from sim_backends.clustersim.workload import RolloutRequest

pytestmark = pytest.mark.unit

PERF = default_model("Qwen2.5-14B", "H800-SXM")


def test_list_schedule_puts_the_longest_on_the_faster_type_and_round_robins() -> None:
    sp = Speeds(slots={2: 2, 8: 1}, tau={2: 0.03, 8: 0.01}, context=1000.0)
    insts = [("a", 2, 0.0), ("b", 2, 0.0), ("c", 8, 0.0)]
    placed, makespan = list_schedule(insts, {}, [("long", 1000), ("x", 100), ("y", 100)], sp)
    assert placed[0] == ("long", "c")  # 10 s on TP8 beats 30 s on TP2
    assert {placed[1][1], placed[2][1]} == {"a", "b"}  # equal slots fill round robin
    assert makespan == pytest.approx(10.0)


def test_list_schedule_waits_for_running_requests() -> None:
    sp = Speeds(slots={2: 1}, tau={2: 0.01}, context=1000.0)
    placed, makespan = list_schedule([("a", 2, 0.0)], {"a": [5.0]}, [("r", 100)], sp)
    assert placed == [("r", "a")] and makespan == pytest.approx(6.0)


def test_candidate_layouts_are_uniform_and_big_plus_small_mixes() -> None:
    layouts = candidate_layouts(["n0", "n1"], 8, (2, 8))
    assert {"n0": (2, 2, 2, 2), "n1": (2, 2, 2, 2)} in layouts
    assert {"n0": (8,), "n1": (8,)} in layouts
    assert {"n0": (8,), "n1": (2, 2, 2, 2)} in layouts
    assert len(layouts) == 3


def _state(n_req: int, pattern: tuple[int, ...] = (8,)) -> ComputeState:
    gpus = tuple(range(8))
    insts = canonical_instances("n0", gpus, pattern)
    reqs = tuple(Request(f"r{i}", 100) for i in range(n_req))
    return ComputeState((NodeGpus("n0", gpus),), insts, reqs)


def test_oracle_dispatches_every_request_longest_first() -> None:
    state = _state(6)
    lengths = {f"r{i}": 100 * (i + 1) for i in range(6)}
    plan = oracle_plan(state, lengths, PERF, 0.0, OracleConfig(tps=(2, 4, 8)))
    order = [rid for rid, _ in plan.assignment]
    assert order[:6] == ["r5", "r4", "r3", "r2", "r1", "r0"]
    assert set(plan.dispatched) == set(lengths)
    ids = {i.id for i in plan.instances}
    assert all(iid in ids for _, iid in plan.assignment)


def test_oracle_grows_an_idle_small_node_once_the_queue_is_empty() -> None:
    gpus = tuple(range(8))
    insts = canonical_instances("n0", gpus, (2, 2, 2, 2)) + canonical_instances("n1", gpus, (8,))
    running = Request("r0", 100, 50, insts[-1].id, True)
    state = ComputeState((NodeGpus("n0", gpus), NodeGpus("n1", gpus)), insts, (running,))
    plan = oracle_plan(state, {"r0": 5000}, PERF, 10.0, OracleConfig(tps=(2, 4, 8)))
    assert [(r.node, r.after) for r in plan.reshards] == [("n0", (8,))]
    assert plan.reshards[0].pause_s > 0  # charged like any reshard


def _requests(lengths: list[tuple[int, int]]) -> list[RolloutRequest]:
    return [RolloutRequest(f"q{i}", i, p, n) for i, (p, n) in enumerate(lengths)]


@settings(max_examples=12)
@given(
    st.lists(st.tuples(st.integers(16, 2048), st.integers(1, 6000)), min_size=1, max_size=40),
    st.sampled_from([1, 2]),
)
def test_fluid_bound_is_below_every_policy(lengths: list[tuple[int, int]], nodes: int) -> None:
    reqs = _requests(lengths)
    names = tuple(f"gen{i:03d}" for i in range(nodes))
    tps = (1, 2, 4, 8)
    bound = fluid_bound(PERF, lengths, 8 * nodes, tps, 256)
    assert bound.seconds == max(bound.work_s, bound.path_s, bound.coupled_s) > 0
    for policy, tp in [
        *(("static", t) for t in tps),
        ("oracle", 8),
        ("adaptive", 4),
        ("prompt-oracle", 4),
    ]:
        res = simulate_step(PERF, reqs, uniform_layout(names, 8, tp), policy=policy)
        assert bound.seconds <= res.seconds * (1 + 1e-9), (policy, tp)


def test_a_lane_takes_requests_only_into_slots_free_before_the_horizon() -> None:
    sp = Speeds(slots={2: 4, 8: 4}, tau={2: 0.03, 8: 0.02}, context=1000.0)
    insts = [("bulk", 2, 0.0), ("lane", 8, 0.0)]
    pending = [("long", 1000), ("mid", 500), ("s1", 50), ("s2", 50)]
    starts: dict[str, float] = {}
    placed, _ = list_schedule(
        insts, {}, pending, sp, lanes={"lane": (1, 0.005)}, lane_horizon=1.0, starts=starts
    )
    # the lane's one slot takes the longest; it frees at 5 s, after the horizon, so the
    # rest go to the bulk instance rather than wait for the lane
    assert placed[0] == ("long", "lane")
    assert all(iid == "bulk" for _, iid in placed[1:])
    assert all(starts[rid] == 0.0 for rid, _ in placed)


def test_lanes_are_scored_only_in_a_mixed_layout() -> None:
    sp = Speeds(slots={2: 256, 8: 256}, tau={2: 0.04, 8: 0.015}, context=2000.0)
    cfg = OracleConfig(tps=(2, 8))
    pending = [(f"r{i}", 20000 if i < 4 else 500) for i in range(400)]
    uniform = [(f"n{i}", 8, 0.0) for i in range(3)]
    lanes, _ = best_lanes(uniform, {}, pending, sp, PERF, cfg)
    assert lanes == {}
    mixed = [("n0", 8, 0.0), *((f"n1/{k}", 2, 0.0) for k in range(4))]
    lanes, makespan = best_lanes(mixed, {}, pending, sp, PERF, cfg)
    # four very long requests: a TP8 lane at a small batch ends the schedule first
    assert set(lanes) == {"n0"}
    slots, tau = lanes["n0"]
    assert slots in cfg.lane_slots and tau < sp.tau[8]
    _, full = list_schedule(mixed, {}, pending, sp)
    assert makespan < full


def test_the_oracle_puts_the_longest_requests_on_the_large_instance_of_a_mix() -> None:
    gpus = tuple(range(8))
    nodes = (NodeGpus("a", gpus), NodeGpus("b", gpus))
    insts = (*canonical_instances("a", gpus, (8,)), *canonical_instances("b", gpus, (2, 2, 2, 2)))
    reqs = tuple(Request(f"r{i}", 100) for i in range(300))
    lengths = {f"r{i}": 20000 if i < 3 else 300 for i in range(300)}
    state = ComputeState(nodes, insts, reqs)
    plan = oracle_plan(state, lengths, PERF, 0.0, OracleConfig(tps=(2, 8)))
    placed = dict(plan.assignment)
    # every request is placed or reported; each placed once
    assert len(placed) == len(plan.assignment)
    assert set(placed) | set(plan.unplaced) <= set(lengths)
    # the three long requests run on the TP8 instance
    assert {placed[f"r{i}"] for i in range(3)} <= {"a/tp8-g0"}
