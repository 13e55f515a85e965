"""Best-fit repack of the draining engines' tails, and when a reshard pays (scheduler.repack)."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given
from hypothesis import strategies as st

from orchestrrl import errors
from scheduler.repack import TailEngine, plan_repack, reshard_pays, tail_engines

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
