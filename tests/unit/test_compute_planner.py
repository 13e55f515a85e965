"""The compute planner: layouts, placement, reactive balancing, stability."""

from __future__ import annotations

import dataclasses
import random
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrrl import errors
from scheduler.compute import PlannerConfig, balance, build_problem, plan_compute, solve
from scheduler.compute_state import (
    ComputePlan,
    ComputeState,
    Instance,
    MoveMethod,
    NodeGpus,
    Request,
    apply_plan,
    canonical_instances,
)
from scheduler.forecast import LengthForecast, build_forecast
from scheduler.perf_model import H800, QWEN25_14B, QWEN25_72B, PerfModel

pytestmark = pytest.mark.unit

PM = PerfModel(QWEN25_14B, H800)
RNG = random.Random(11)
HISTORY = [[min(16384, int(RNG.lognormvariate(7.6, 0.9))) for _ in range(512)] for _ in range(3)]


def cluster(
    n_nodes: int, pattern: tuple[int, ...], gpus: int = 8
) -> tuple[tuple[NodeGpus, ...], list[Instance]]:
    nodes = tuple(NodeGpus(f"n{i}", tuple(range(gpus))) for i in range(n_nodes))
    insts: list[Instance] = []
    for n in nodes:
        insts.extend(canonical_instances(n.name, n.gpus, pattern))
    return nodes, insts


def forecast_for(state: ComputeState, completed: list[int] | None = None) -> LengthForecast:
    running = [r.generated_tokens for r in state.requests]
    return build_forecast(HISTORY, completed or [], running, max_tokens=16384)


def assert_valid(state: ComputeState, plan: ComputePlan) -> None:
    """Every request placed exactly once (or reported unplaced); GPUs conserved."""
    placed = Counter(r for r, _ in plan.assignment)
    assert all(n == 1 for n in placed.values())
    assert set(placed) | set(plan.unplaced) == {r.id for r in state.requests}
    assert not set(placed) & set(plan.unplaced)
    ids = {i.id for i in plan.instances}
    assert all(i in ids for _, i in plan.assignment)
    for node in state.nodes:
        used = sorted(g for i in plan.instances if i.node == node.name for g in i.gpus)
        assert used == sorted(node.gpus), f"GPUs of {node.name} not conserved"
    after = apply_plan(state, plan)  # validates the new state
    assert len(after.requests) == len(state.requests)


NARROW = [[int(RNG.uniform(1500, 2500)) for _ in range(512)] for _ in range(3)]


def test_wide_batch_favours_small_tp_and_the_tail_large_tp() -> None:
    """The paper's typical result: small-TP instances while the batch is wide and no
    request is expected to run much longer than the rest (the bulk decides), merged into
    large-TP instances as the step drains to its long tail."""
    nodes, insts = cluster(2, (8,))
    wide = ComputeState(nodes, tuple(insts), tuple(Request(f"r{i:04d}", 1024) for i in range(1024)))
    narrow = build_forecast(NARROW, [], [0] * 1024, max_tokens=16384)
    plan = plan_compute(wide, narrow, PM, now=0.0)
    assert plan.reshards, plan.explain()
    assert max(i.tp for i in plan.instances) < 8
    assert_valid(wide, plan)

    nodes, insts = cluster(2, (2, 2, 2, 2))
    tail = ComputeState(
        nodes,
        tuple(insts),
        tuple(
            Request(f"t{i}", 1024, 8000 + 300 * i, insts[i % len(insts)].id, True) for i in range(6)
        ),
    )
    plan = plan_compute(tail, forecast_for(tail, HISTORY[-1]), PM, now=5.0)
    assert {i.tp for i in plan.instances} == {8}, plan.explain()
    assert plan.prediction.planned_makespan_s < plan.prediction.keep_makespan_s
    assert plan.now == 5.0
    assert "reshard" in plan.reason
    assert_valid(tail, plan)


@pytest.mark.parametrize("n_nodes", [2, 4])
def test_a_capped_long_tail_at_step_start(n_nodes: int) -> None:
    """1,024 fresh requests whose lengths reach the cap about 0.5% of the time: about
    five of them will run to the cap, the step ends with those, and any instance may get
    one. The planner's predicted step is at least a capped request alone on the widest
    instance (with each request's median as its critical path it predicted a fraction of
    that and split the nodes). On 4 nodes every request gets a seat on TP8 at once, and
    TP8 stays. On 2 nodes each TP8 instance queues 512 requests for 256 seats, first come
    first served, so a capped request may start half a step late: 2 x TP4 per node halves
    the queue, and the planner takes it (the simulator agrees on such loads: static TP4
    166 s, TP8 172 s, mean of 12 draws)."""
    nodes, insts = cluster(n_nodes, (8,))
    wide = ComputeState(nodes, tuple(insts), tuple(Request(f"r{i:04d}", 1024) for i in range(1024)))
    fc = forecast_for(wide)
    assert fc.survival_at(16383) > 0.003  # the cap holds about 0.5% of the mass
    plan = plan_compute(wide, fc, PM, now=0.0)
    alone = sum(PM.decode_iteration_time(8, 1, 1024 + i) for i in range(0, 16384, 64)) * 64
    assert plan.prediction.keep_makespan_s >= alone, plan.explain()
    if n_nodes == 4:
        assert not plan.reshards, plan.explain()
        assert {i.tp for i in plan.instances} == {8}
    else:
        assert {i.tp for i in plan.instances} == {4}, plan.explain()


def test_switch_only_when_the_gain_beats_the_cost_by_the_margin() -> None:
    nodes, insts = cluster(2, (2, 2, 2, 2))
    state = ComputeState(
        nodes,
        tuple(insts),
        tuple(
            Request(f"t{i}", 1024, 8000 + 300 * i, insts[i % len(insts)].id, True) for i in range(6)
        ),
    )
    fc = forecast_for(state, HISTORY[-1])
    strict = PlannerConfig(switch_margin_s=1000.0)
    plan = plan_compute(state, fc, PM, 0.0, strict)
    assert not plan.reshards
    assert "not more than the margin" in plan.reason
    # the explanation orlctl prints names the layouts it weighed
    text = plan.explain()
    assert "layouts considered" in text and "TP8" in text


def test_a_fresh_batch_is_not_held_to_the_layout_the_last_step_ended_in() -> None:
    """The relative switch margin protects work in flight. When a step's batch has just
    arrived (no request holds KV) the layout left by the previous step's tail is weighed
    against the others with the absolute margin only: the reshard pause is already in
    each score. The same gain under running requests stays below the relative margin (all
    of them running: queued ones would add the first-come-first-served delay to TP8's
    score, a larger gain)."""
    nodes, insts = cluster(6, (8,))
    n = 6144
    fresh = ComputeState(nodes, tuple(insts), tuple(Request(f"r{i:04d}", 256) for i in range(n)))
    plan = plan_compute(fresh, forecast_for(fresh), PM, 0.0)
    assert plan.reshards, plan.explain()
    assert {i.tp for i in plan.instances} != {8}
    running = ComputeState(
        nodes,
        tuple(insts),
        tuple(Request(f"r{i:04d}", 256, 0, insts[i % len(insts)].id, True) for i in range(n)),
    )
    kept = plan_compute(running, forecast_for(running), PM, 0.0)
    assert not kept.reshards, kept.explain()
    assert "not more than the margin" in kept.reason


def test_reactive_balancing_moves_requests_off_a_straggler() -> None:
    nodes, insts = cluster(2, (4, 4))
    hot = insts[0]
    reqs = tuple(Request(f"r{i:02d}", 2000, 500 + 10 * i, hot.id, True) for i in range(16))
    state = ComputeState(nodes, tuple(insts), reqs)
    plan = balance(state, forecast_for(state), PM, now=1.0)
    assert not plan.reshards
    moved = [m for m in plan.migrations if m.source != m.target]
    assert moved
    assert {m.method for m in moved} <= {MoveMethod.KV_NVLINK, MoveMethod.KV_NETWORK}
    assert plan.prediction.planned_makespan_s < plan.prediction.keep_makespan_s
    assert_valid(state, plan)


def test_recompute_wins_when_the_network_is_slow() -> None:
    slow = PerfModel(QWEN25_14B, dataclasses.replace(H800, nic_bandwidth=0.05e9))
    nodes, insts = cluster(2, (8,))
    reqs = tuple(Request(f"r{i:02d}", 3000, 200, insts[0].id, True) for i in range(24))
    state = ComputeState(nodes, tuple(insts), reqs)
    plan = balance(state, forecast_for(state), slow, now=0.0)
    methods = {m.method for m in plan.migrations if m.source != m.target}
    assert methods == {MoveMethod.RECOMPUTE}


def test_engines_that_take_no_kv_cache_get_recomputed_moves() -> None:
    """A gateway over vLLM/llama.cpp resubmits what it admits: moves to it are priced and
    labelled as recomputation, never as a KV move."""
    nodes, insts = cluster(2, (4, 4))
    nodes = tuple(dataclasses.replace(n, kv_import=False) for n in nodes)
    hot = insts[0]
    reqs = tuple(Request(f"r{i:02d}", 2000, 500 + 10 * i, hot.id, True) for i in range(16))
    state = ComputeState(nodes, tuple(insts), reqs)
    plan = balance(state, forecast_for(state), PM, now=1.0)
    moved = [m for m in plan.migrations if m.source != m.target]
    assert moved
    assert {m.method for m in moved} == {MoveMethod.RECOMPUTE}
    assert all(m.cost_s > 0 for m in moved)
    assert_valid(state, plan)


def test_requests_no_instance_can_hold_stay_queued() -> None:
    pm = PerfModel(QWEN25_72B, H800)
    nodes, insts = cluster(1, (4, 4))
    huge = Request("huge", 3_000_000)
    ok = Request("ok", 500)
    state = ComputeState(nodes, tuple(insts), (huge, ok))
    plan = plan_compute(state, forecast_for(state), pm, 0.0)
    assert plan.unplaced == ("huge",)
    assert dict(plan.assignment).keys() == {"ok"}
    assert "fit no instance" in plan.explain()
    assert_valid(state, plan)


def test_deterministic_and_independent_of_input_order() -> None:
    nodes, insts = cluster(2, (2, 2, 2, 2))
    rng = random.Random(3)
    reqs = [
        Request(
            f"r{i:03d}", rng.randint(100, 2000), rng.randint(0, 4000), rng.choice(insts).id, True
        )
        for i in range(40)
    ]
    a = ComputeState(nodes, tuple(insts), tuple(reqs))
    b = ComputeState(nodes, tuple(reversed(insts)), tuple(reversed(reqs)))
    fc = forecast_for(a)
    pa = plan_compute(a, fc, PM, 0.0)
    assert pa == plan_compute(a, fc, PM, 0.0)
    assert pa == plan_compute(b, fc, PM, 0.0)


def test_state_validation_names_the_problem() -> None:
    node = NodeGpus("n0", (0, 1, 2, 3))
    with pytest.raises(errors.InvalidArgument, match="shares GPUs"):
        ComputeState((node,), (Instance("a", "n0", (0, 1)), Instance("b", "n0", (1, 2, 3))), ())
    with pytest.raises(errors.InvalidArgument, match="belong to no instance"):
        ComputeState((node,), (Instance("a", "n0", (0, 1)),), ())
    with pytest.raises(errors.InvalidArgument, match="unknown instance"):
        ComputeState(
            (node,), (Instance("a", "n0", (0, 1, 2, 3)),), (Request("r", 10, 0, "zz", True),)
        )
    with pytest.raises(errors.InvalidArgument, match="running but has no instance"):
        ComputeState(
            (node,), (Instance("a", "n0", (0, 1, 2, 3)),), (Request("r", 10, 0, None, True),)
        )
    with pytest.raises(errors.InvalidArgument, match="uses 6 GPUs"):
        canonical_instances("n0", range(4), (4, 2))


# -- properties ---------------------------------------------------------------------


@st.composite
def states(draw: st.DrawFn) -> ComputeState:
    n_nodes = draw(st.integers(1, 3))
    gpus = draw(st.sampled_from([2, 4, 8]))
    patterns = [
        p for p in [(gpus,), (gpus // 2,) * 2, (1,) * gpus, (2,) * (gpus // 2)] if p[0] >= 1
    ]
    nodes = tuple(NodeGpus(f"n{i}", tuple(range(gpus))) for i in range(n_nodes))
    insts: list[Instance] = []
    for n in nodes:
        insts.extend(canonical_instances(n.name, n.gpus, draw(st.sampled_from(patterns))))
    n_req = draw(st.integers(0, 24))
    reqs = []
    for i in range(n_req):
        prompt = draw(st.integers(10, 3000))
        kind = draw(st.sampled_from(["queued", "dispatched", "running"]))
        if kind == "queued":
            reqs.append(Request(f"r{i:02d}", prompt))
        else:
            inst = draw(st.sampled_from(insts))
            gen = draw(st.integers(0, 12000)) if kind == "running" else 0
            reqs.append(Request(f"r{i:02d}", prompt, gen, inst.id, kind == "running"))
    return ComputeState(nodes, tuple(insts), tuple(reqs))


@settings(max_examples=60)
@given(state=states(), now=st.floats(0, 1e6), reshard=st.booleans())
def test_any_plan_is_valid_and_replanning_after_it_is_a_no_op(
    state: ComputeState, now: float, reshard: bool
) -> None:
    fc = forecast_for(state)
    plan = plan_compute(state, fc, PM, now, allow_reshard=reshard)
    assert_valid(state, plan)
    after = apply_plan(state, plan)
    again = plan_compute(after, fc, PM, now, allow_reshard=reshard)
    assert again.empty, again.explain()
    assert not again.reshards
    assert apply_plan(after, again) == after


@settings(max_examples=200)
@given(state=states(), seats=st.integers(1, 4))
def test_balancing_moves_a_kv_cache_only_to_a_free_seat(state: ComputeState, seats: int) -> None:
    """With ``seats`` sequences an instance, a request moved with its KV cache lands
    where fewer than ``seats`` requests hold a KV cache after the plan (counting the
    requests moved in before it): an engine would otherwise preempt it and recompute it,
    so the move bought nothing."""
    config = PlannerConfig(max_num_seqs=seats)
    plan = balance(state, forecast_for(state), PM, 0.0, config)
    running = {r.id for r in state.requests if r.has_kv}
    moved_in = Counter(m.target for m in plan.migrations if m.request in running)
    stayed = Counter(
        inst
        for rid, inst in plan.assignment
        if rid in running and rid not in {m.request for m in plan.migrations}
    )
    for inst, count in moved_in.items():
        assert stayed[inst] + count <= max(seats, stayed[inst]), (inst, plan.explain())


def test_a_request_does_not_return_to_a_seat_given_away() -> None:
    """Found by the property above: r07 swapped out to n0 for r05, then moved back to its
    own instance, whose one seat r05 now held; its own instance is no exception."""
    nodes = (NodeGpus("n0", (0, 1)), NodeGpus("n1", (0, 1)))
    insts = (
        Instance("n0/tp1-g0", "n0", (0,)),
        Instance("n0/tp1-g1", "n0", (1,)),
        Instance("n1/tp2-g0", "n1", (0, 1)),
    )
    reqs = [Request(f"r{i:02d}", 10) for i in range(11)]
    reqs[5] = Request("r05", 10, 14, "n0/tp1-g0", True)
    reqs[7] = Request("r07", 10, 7, "n1/tp2-g0", True)
    state = ComputeState(nodes, insts, tuple(reqs))
    plan = balance(state, forecast_for(state), PM, 0.0, PlannerConfig(max_num_seqs=1))
    running = Counter(inst for rid, inst in plan.assignment if rid in {"r05", "r07"})
    assert max(running.values()) == 1, plan.explain()


@settings(max_examples=30)
@given(state=states())
def test_predictions_are_consistent(state: ComputeState) -> None:
    fc = forecast_for(state)
    prob = build_problem(state, fc, PM)
    plan = solve(prob, 0.0)
    p = plan.prediction
    assert p.steady_makespan_s <= p.planned_makespan_s + 1e-9
    assert p.switching_s == max((r.pause_s for r in plan.reshards), default=0.0)
    assert p.migration_s == pytest.approx(sum(m.cost_s for m in plan.migrations))
    if not plan.reshards:
        assert p.switching_s == 0.0


@pytest.mark.parametrize(
    ("n_nodes", "n_req", "exhaustive"),
    [
        (1, 10, True),  # the MILP's small cases: every instance, and exchanges
        (2, 60, True),  # 16 instances x 60 requests, 60 x 60 / 16 exchanges
        (2, 400, False),  # many requests per instance: exchanges would grow as their square
        (8, 200, False),  # 64 instances x 200 requests: too many moves to look at
    ],
)
def test_balancing_looks_at_every_instance_only_when_the_search_stays_small(
    monkeypatch: pytest.MonkeyPatch, n_nodes: int, n_req: int, exhaustive: bool
) -> None:
    import scheduler.compute as compute_mod

    seen: list[bool] = []
    real = compute_mod.Placement

    def spy(prob: object, instances: object, all_candidates: bool) -> object:
        seen.append(all_candidates)
        return real(prob, instances, all_candidates)  # type: ignore[arg-type]

    monkeypatch.setattr(compute_mod, "Placement", spy)
    nodes, insts = cluster(n_nodes, (1,) * 8)
    rng = random.Random(n_req)
    reqs = tuple(
        Request(
            f"r{i:04d}",
            rng.randint(100, 2000),
            rng.randint(1, 3000),
            insts[i % len(insts)].id,
            True,
        )
        for i in range(n_req)
    )
    state = ComputeState(nodes, tuple(insts), reqs)
    plan = balance(state, forecast_for(state), PM, 0.0)
    assert seen == [exhaustive]
    assert_valid(state, plan)


def test_under_partial_rollout_the_planner_moves_nothing_off_stragglers() -> None:
    """With ``carry_tail`` (partial rollout) the step does not wait for its last instance:
    the straggler above is left alone, and a fresh batch keeps its layout unless the gain
    beats the relative margin (the prediction covers a tail the step will not wait for)."""
    carry = PlannerConfig(carry_tail=True)
    nodes, insts = cluster(2, (4, 4))
    hot = insts[0]
    reqs = tuple(Request(f"r{i:02d}", 2000, 500 + 10 * i, hot.id, True) for i in range(16))
    state = ComputeState(nodes, tuple(insts), reqs)
    plan = balance(state, forecast_for(state), PM, now=1.0, config=carry)
    assert not [m for m in plan.migrations if m.source != m.target]
    assert_valid(state, plan)
    nodes, insts = cluster(6, (8,))
    fresh = ComputeState(nodes, tuple(insts), tuple(Request(f"r{i:04d}", 256) for i in range(6144)))
    thru = plan_compute(fresh, forecast_for(fresh), PM, 0.0, config=carry)
    # scored on the work (no critical path): the most throughput, small instances
    assert thru.reshards and max(i.tp for i in thru.instances) < 8
    p = thru.prediction
    assert p.keep_makespan_s - p.planned_makespan_s > 0.05 * p.keep_makespan_s
    strict = dataclasses.replace(carry, switch_margin_rel=0.5)
    kept = plan_compute(fresh, forecast_for(fresh), PM, 0.0, config=strict)
    assert not kept.reshards and "not more than the margin" in kept.reason
