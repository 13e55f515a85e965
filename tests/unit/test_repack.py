"""Best-fit repack of the draining engines' tails, and when a reshard pays (scheduler.repack)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping

import pytest
from hypothesis import given
from hypothesis import strategies as st

from orchestrrl import errors
from scheduler.compute_state import (
    ComputePlan,
    ComputeState,
    MoveMethod,
    NodeGpus,
    Request,
    apply_plan,
    canonical_instances,
)
from scheduler.forecast import build_forecast
from scheduler.perf_model import H800, QWEN25_14B, PerfModel
from scheduler.repack import TailEngine, plan_repack, plan_tail, reshard_pays, tail_engines

pytestmark = pytest.mark.unit


def _e(
    iid: str, node: str, *tokens: int, version: int = 0, seats: int = 8, kv: int = 10_000
) -> TailEngine:
    return TailEngine(
        iid, node, 4, version, seats, kv, tuple((f"{iid}-r{i}", t) for i, t in enumerate(tokens))
    )


def test_the_tail_is_the_engines_at_or_below_their_share_of_seats() -> None:
    engines = [_e("a", "n0", 1, 2), _e("b", "n0", *[1] * 5), _e("c", "n1")]
    assert [e.id for e in tail_engines(engines, 0.25)] == ["a"]
    assert [e.id for e in tail_engines(engines, 1.0)] == ["a", "b"]  # c holds nothing
    with pytest.raises(errors.InvalidArgument, match="tail_fraction"):
        tail_engines(engines, 0.0)


def test_two_half_empty_engines_become_one_and_the_other_is_freed() -> None:
    plan = plan_repack([_e("a", "n0", 500, 400), _e("b", "n1", 300, 200, 100)], tail_fraction=1.0)
    assert plan.freed == ("a",)  # the lighter one empties into the other
    assert {m.request for m in plan.moves} == {"a-r0", "a-r1"}
    assert {m.target for m in plan.moves} == {"b"} and plan.targets == ("b",)


def test_best_fit_puts_the_largest_request_where_it_leaves_least_room() -> None:
    engines = [
        _e("src", "n0", 3000),
        _e("roomy", "n1", 100, 100, 100, kv=10_000),
        _e("tight", "n2", 100, 100, 100, kv=3_400),
    ]
    plan = plan_repack(engines, tail_fraction=1.0)
    assert [(m.request, m.target) for m in plan.moves] == [("src-r0", "tight")]


def test_nothing_moves_when_it_does_not_fit_and_engines_empty_whole_or_not_at_all() -> None:
    full = [_e("a", "n0", 6000, 3000), _e("b", "n1", 6000, 3000)]  # KV 10,000 each
    assert plan_repack(full, tail_fraction=1.0).empty
    seats = [_e("a", "n0", *[1] * 5, seats=6), _e("b", "n1", *[1] * 5, seats=6)]
    assert plan_repack(seats, tail_fraction=1.0).empty


def test_versions_never_share_a_tail() -> None:
    engines = [_e("a", "n0", 10, version=1), _e("b", "n1", 10, version=2)]
    assert plan_repack(engines, tail_fraction=1.0).empty
    engines.append(_e("c", "n2", 10, version=1))
    plan = plan_repack(engines, tail_fraction=1.0)
    assert plan.freed == ("a",) and {m.target for m in plan.moves} == {"c"}


def test_by_node_empties_whole_nodes_and_names_the_nodes_left_with_a_tail() -> None:
    engines = [
        _e("a0", "n0", 100),
        _e("a1", "n0", 100),
        _e("b0", "n1", 100, 100),
        _e("b1", "n1", 100),
        _e("c0", "n2", *[1] * 8),
        _e("c1", "n2"),  # c0 is not in a 0.5 tail: n2 stays out
    ]
    plan = plan_repack(engines, tail_fraction=0.5, by_node=True)
    assert set(plan.freed) == {"a0", "a1"}
    assert all(m.target == "node:n1" for m in plan.moves) and len(plan.moves) == 2
    assert plan.reshard_nodes == (("n1", 5),)


@given(
    st.lists(
        st.tuples(st.integers(0, 3), st.lists(st.integers(1, 4000), max_size=6), st.integers(0, 1)),
        min_size=1,
        max_size=8,
    )
)
def test_a_repack_never_overfills_a_target_and_moves_each_request_once(
    spec: list[tuple[int, list[int], int]],
) -> None:
    engines = [
        _e(f"e{i}", f"n{node}", *tokens, version=v) for i, (node, tokens, v) in enumerate(spec)
    ]
    plan = plan_repack(engines, tail_fraction=1.0)
    by_id = {e.id: e for e in engines}
    assert Counter(m.request for m in plan.moves).most_common(1)[0][1] == 1 if plan.moves else True
    for iid in plan.freed:  # a freed engine's every request moved
        assert {r for r, _ in by_id[iid].requests} == {
            m.request for m in plan.moves if m.source == iid
        }
    for t in {m.target for m in plan.moves}:
        e = by_id[t]
        moved = [m for m in plan.moves if m.target == t]
        assert t not in plan.freed and all(by_id[m.source].version == e.version for m in moved)
        assert len(e.requests) + len(moved) <= e.seats
        assert e.held + sum(m.tokens for m in moved) <= e.kv_tokens


def test_a_reshard_pays_when_the_wide_engine_frees_the_node_sooner() -> None:
    def iteration(tp: int, batch: int, ctx: float) -> float:
        return 0.02 / tp + 0.0001 * batch  # latency falls with TP, grows with the batch

    kw = {
        "base_tp": 2,
        "wide_tp": 8,
        "batch": 4,
        "context_tokens": 2000.0,
        "iteration_s": iteration,
    }
    assert reshard_pays(remaining_tokens=10_000, pause_s=2.0, **kw)  # type: ignore[arg-type]
    assert not reshard_pays(remaining_tokens=100, pause_s=2.0, **kw)  # too little left
    assert not reshard_pays(remaining_tokens=0, pause_s=0.0, **kw)  # type: ignore[arg-type]


def test_an_idle_engine_beside_a_tail_engine_leaves_its_node_whole() -> None:
    engines = [_e("a0", "n0", 100), _e("a1", "n0"), _e("b0", "n1", 100), _e("b1", "n1", 100)]
    plan = plan_repack(engines, tail_fraction=0.5, by_node=True)
    assert set(plan.freed) == {"a0", "a1"} and [m.request for m in plan.moves] == ["a0-r0"]


# -- plan_tail: the same on a live cluster's ComputeState --------------------------------

PERF = PerfModel(QWEN25_14B, H800)


def _state(
    spec: Mapping[str, tuple[tuple[int, ...], list[list[int]]]],
    queued: int = 0,
    kv_import: bool = True,
    pause_s: float = 0.0,
) -> ComputeState:
    """``spec``: node -> (layout, per instance the generated tokens of its requests)."""
    nodes, insts, reqs = [], [], []
    for node, (layout, per) in spec.items():
        gpus = tuple(range(sum(layout)))
        nodes.append(NodeGpus(node, gpus, kv_import, pause_s))
        mine = canonical_instances(node, gpus, layout)
        insts += mine
        for inst, gens in zip(mine, per, strict=True):
            reqs += [Request(f"{inst.id}#{k}", 100, g, inst.id, True) for k, g in enumerate(gens)]
    reqs += [Request(f"q{k}", 100) for k in range(queued)]
    return ComputeState(tuple(nodes), tuple(insts), tuple(reqs))


def _tail(state: ComputeState, **kw: object) -> ComputePlan | None:
    gens = [r.generated_tokens for r in state.requests]
    args: dict[str, object] = {
        "versions": {n.name: "v1" for n in state.nodes},
        "seats": 4,
        "perf": PERF,
        "forecast": build_forecast([], [], gens, max_tokens=16384),
        "now": 0.0,
        "tail_fraction": 0.5,
    }
    args.update(kw)
    return plan_tail(state, **args)  # type: ignore[arg-type]


def test_the_tail_of_two_nodes_moves_onto_one_which_reshards_wide_when_that_pays() -> None:
    # long requests (the forecast expects thousands of tokens more): one TP2 instance
    # ends the node's tail sooner than two TP1 instances, its pause included
    state = _state({"a": ((1, 1), [[6000], []]), "b": ((1, 1), [[7000], [8000]])})
    plan = _tail(state)
    assert plan is not None
    assert [(m.request, m.target, m.method) for m in plan.migrations] == [
        ("a/tp1-g0#0", "b/tp2-g0", MoveMethod.KV_NETWORK)
    ]
    (r,) = plan.reshards
    assert (r.node, r.before, r.after) == ("b", (1, 1), (2,))
    assert set(r.removed) == {"b/tp1-g0", "b/tp1-g1"} and r.pause_s > 0
    assert "frees a" in plan.reason and "reshards b to one TP2" in plan.reason
    after = apply_plan(state, plan)
    assert {r.instance for r in after.requests} == {"b/tp2-g0"}
    assert after.layout() == {"a": (1, 1), "b": (2,)}


def test_a_short_tail_moves_without_a_reshard_and_recomputes_where_kv_is_refused() -> None:
    state = _state({"a": ((1, 1), [[30], []]), "b": ((1, 1), [[20], [10]])}, kv_import=False)
    plan = _tail(state)
    assert plan is not None and not plan.reshards
    (m,) = plan.migrations
    assert m.method is MoveMethod.RECOMPUTE and m.target.startswith("b/")
    # a measured pause of a minute makes a reshard of a long tail not pay either
    long = _state({"a": ((1, 1), [[6000], []]), "b": ((1, 1), [[7000], [8000]])}, pause_s=600.0)
    held = _tail(long)
    assert held is not None and not held.reshards
    # two nodes whose tails cannot merge (each fills the other's seats), neither better off
    # wide: no plan, so the loop's other planning goes on
    full = {"a": ((1, 1), [[30, 30], [30, 30]]), "b": ((1, 1), [[20, 20], [20, 20]])}
    assert _tail(_state(full), seats=2, tail_fraction=1.0) is None


def test_no_tail_repack_while_requests_queue_or_versions_differ_or_moves_settle() -> None:
    spec = {"a": ((1, 1), [[30], []]), "b": ((1, 1), [[20], [10]])}
    assert _tail(_state(spec, queued=1)) is None  # a freed seat would take a queued request
    # of two versions, each node's tail stays on it (here b's two instances become one)
    split = _tail(_state(spec), versions={"a": "v1", "b": "v2"})
    assert split is not None
    assert [(m.source, m.target) for m in split.migrations] == [("b/tp1-g0", "b/tp1-g1")]
    assert _tail(_state(spec), versions={"a": "v1", "b": "v2"}, tail_fraction=0.2) is None
    assert _tail(_state(spec), settled=frozenset({"a/tp1-g0#0"})) is None
    busy = {"a": ((1, 1), [[1, 2, 3], [4, 5, 6]]), "b": ((2,), [[5]])}
    assert _tail(_state(busy)) is None  # one instance in the tail: nothing to pack it into
    with pytest.raises(errors.InvalidArgument, match="tail_fraction"):
        _tail(_state(spec), tail_fraction=1.5)


@given(
    st.lists(
        st.tuples(
            st.sampled_from([(1, 1), (2,), (1, 1, 1, 1), (2, 1, 1)]),
            st.lists(st.lists(st.integers(0, 9000), max_size=4), min_size=4, max_size=4),
            st.booleans(),
        ),
        min_size=1,
        max_size=4,
    )
)
def test_a_tail_plan_keeps_every_request_once_and_a_valid_state(
    spec: list[tuple[tuple[int, ...], list[list[int]], bool]],
) -> None:
    nodes = {f"n{i}": (layout, per[: len(layout)]) for i, (layout, per, _) in enumerate(spec)}
    state = _state(nodes)
    plan = _tail(state)
    if plan is None:
        return
    assert plan.migrations or plan.reshards  # never an empty plan
    after = apply_plan(state, plan)  # validates GPUs and ids
    assert sorted(r.id for r in after.requests) == sorted(r.id for r in state.requests)
    assert all(r.instance is not None for r in after.requests)
    load = Counter(r.instance for r in after.requests)
    moved_to = Counter(m.target for m in plan.migrations)
    for target in moved_to:
        assert load[target] <= 4 or target in {i.id for r in plan.reshards for i in r.added}
    for r in plan.reshards:
        assert r.after == (sum(r.before),) and load[r.added[0].id] <= 4
    before = {r.id: r.instance or "" for r in state.requests}
    resharded = {x.node for x in plan.reshards}
    changed = {r.id for r in after.requests if r.instance != before[r.id]}
    relaid = {  # a resharded node's own requests are re-laid out by its reshard
        rid for rid in changed if before[rid].split("/")[0] in resharded
    }
    assert {m.request for m in plan.migrations} == changed - relaid
