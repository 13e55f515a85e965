"""The flow model against closed-form max-min fair rates and hand-computed timelines."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrrl import errors
from sim_backends.clustersim.flows import FlowTransfer, max_min_rates, simulate

pytestmark = pytest.mark.unit


def test_single_bottleneck_splits_equally() -> None:
    rates = max_min_rates({"l": 12.0}, {f"f{i}": ["l"] for i in range(4)})
    assert rates == pytest.approx({f"f{i}": 3.0 for i in range(4)})


def test_three_links_four_flows_textbook() -> None:
    # Bertsekas & Gallager's example: f0, f1, f2 share link a (capacity 1) -> 1/3 each;
    # f0 and f3 share b (capacity 1): f3 takes what f0 leaves, 2/3; c is not a bottleneck.
    rates = max_min_rates(
        {"a": 1.0, "b": 1.0, "c": 1.0},
        {"f0": ["a", "b"], "f1": ["a"], "f2": ["a"], "f3": ["b", "c"]},
    )
    assert rates == pytest.approx({"f0": 1 / 3, "f1": 1 / 3, "f2": 1 / 3, "f3": 2 / 3})


def test_long_flow_over_three_links_with_one_cross_flow_each() -> None:
    rates = max_min_rates(
        {"a": 1.0, "b": 1.0, "c": 1.0},
        {"long": ["a", "b", "c"], "x": ["a"], "y": ["b"], "z": ["c"]},
    )
    assert rates == pytest.approx({"long": 0.5, "x": 0.5, "y": 0.5, "z": 0.5})


def test_parking_lot_with_a_crowded_first_link() -> None:
    # link 1 carries the long flow and two short ones (1/3 each); on links 2 and 3 the
    # short flow takes the rest: 2/3
    capacity = {1: 1.0, 2: 1.0, 3: 1.0}
    flows = {"long": [1, 2, 3], "s1a": [1], "s1b": [1], "s2": [2], "s3": [3]}
    rates = max_min_rates(capacity, flows)
    third = 1 / 3
    expected = {"long": third, "s1a": third, "s1b": third, "s2": 2 * third, "s3": 2 * third}
    assert rates == pytest.approx(expected)


def test_unequal_capacities_and_a_free_flow() -> None:
    rates = max_min_rates(
        {"a": 10.0, "b": 1.0}, {"f0": ["a", "b"], "f1": ["a"], "f2": ["a"], "f3": []}
    )
    assert rates["f0"] == pytest.approx(1.0)
    assert rates["f1"] == pytest.approx(4.5)
    assert rates["f2"] == pytest.approx(4.5)
    assert math.isinf(rates["f3"])


def test_bad_input_names_the_field() -> None:
    with pytest.raises(errors.InvalidArgument, match="capacity"):
        max_min_rates({"a": -1.0}, {"f": ["a"]})
    with pytest.raises(errors.InvalidArgument, match=r"flows\['f'\] link='zz'"):
        max_min_rates({"a": 1.0}, {"f": ["zz"]})
    with pytest.raises(errors.InvalidArgument, match="nbytes"):
        simulate({"a": 1.0}, [FlowTransfer("x", -1.0, (("a",),))])
    with pytest.raises(errors.InvalidArgument, match="paths"):
        simulate({"a": 1.0}, [FlowTransfer("x", 1.0, ())])


@st.composite
def networks(draw: st.DrawFn) -> tuple[dict[int, float], dict[int, list[int]]]:
    nlinks = draw(st.integers(1, 6))
    capacity = {i: draw(st.floats(0.5, 10.0)) for i in range(nlinks)}
    nflows = draw(st.integers(1, 8))
    flows = {
        f: sorted(draw(st.sets(st.integers(0, nlinks - 1), min_size=1, max_size=nlinks)))
        for f in range(nflows)
    }
    return capacity, flows


@settings(max_examples=150)
@given(networks())
def test_rates_are_feasible_and_every_flow_has_a_bottleneck(
    net: tuple[dict[int, float], dict[int, list[int]]],
) -> None:
    """The definition of max-min fairness: feasible, and every flow crosses a full link
    on which no other flow gets more."""
    capacity, flows = net
    rates = max_min_rates(capacity, flows)  # type: ignore[arg-type]
    load = {link: 0.0 for link in capacity}
    for f, path in flows.items():
        for link in path:
            load[link] += rates[f]
    for link, cap in capacity.items():
        assert load[link] <= cap * (1 + 1e-7)
    for f, path in flows.items():
        assert any(
            load[link] >= capacity[link] * (1 - 1e-7)
            and all(rates[g] <= rates[f] * (1 + 1e-7) for g, p in flows.items() if link in p)
            for link in path
        ), f"flow {f} has no bottleneck link"


def test_simulation_recomputes_rates_when_a_flow_ends() -> None:
    res = simulate(
        {"a": 1.0}, [FlowTransfer("small", 1.0, (("a",),)), FlowTransfer("big", 2.0, (("a",),))]
    )
    # both at 1/2 until small ends at t=2; big has 1 byte left at full rate: t=3
    assert res.finish == pytest.approx({"small": 2.0, "big": 3.0})
    assert res.makespan == pytest.approx(3.0)
    assert res.link_bytes == pytest.approx({"a": 3.0})


def test_simulation_recomputes_rates_when_a_flow_starts() -> None:
    res = simulate(
        {"a": 2.0},
        [FlowTransfer("early", 4.0, (("a",),)), FlowTransfer("late", 1.0, (("a",),), start=1.0)],
    )
    # early alone at 2 until t=1 (2 left), then both at 1 until late ends at t=2 (early
    # has 1 left), then early alone at 2 again: t=2.5
    assert res.finish == pytest.approx({"early": 2.5, "late": 2.0})


def test_ecmp_splits_over_paths_and_finishes_with_the_slowest() -> None:
    cap = {"p": 1.0, "q": 1.0, "slow": 0.25}
    both = simulate(cap, [FlowTransfer("t", 2.0, (("p",), ("q",)))])
    assert both.finish["t"] == pytest.approx(1.0)
    uneven = simulate(cap, [FlowTransfer("t", 2.0, (("p",), ("slow",)))])
    assert uneven.finish["t"] == pytest.approx(4.0)  # 1 byte over the 0.25 path


def test_a_transfer_over_a_dead_link_never_finishes() -> None:
    res = simulate(
        {"dead": 0.0, "ok": 1.0},
        [
            FlowTransfer("x", 1.0, (("dead",),)),
            FlowTransfer("y", 1.0, (("ok",),)),
        ],
    )
    assert math.isinf(res.finish["x"])
    assert res.finish["y"] == pytest.approx(1.0)


@settings(max_examples=100)
@given(networks(), st.lists(st.floats(0.1, 5.0), min_size=8, max_size=8))
def test_simulation_respects_the_link_bounds(
    net: tuple[dict[int, float], dict[int, list[int]]], sizes: list[float]
) -> None:
    """No transfer beats its own bottleneck, the makespan is no shorter than the busiest
    link needs, and it is no longer than running the transfers one after another."""
    capacity, flows = net
    transfers = [FlowTransfer(f, sizes[f], (tuple(path),)) for f, path in flows.items()]
    res = simulate(capacity, transfers)  # type: ignore[arg-type]
    for t in transfers:
        fastest = min(capacity[link] for link in t.paths[0])
        assert res.finish[t.key] >= t.nbytes / fastest * (1 - 1e-9)
    busiest = max(res.link_bytes[link] / cap for link, cap in capacity.items())
    assert res.makespan >= busiest * (1 - 1e-9)
    serial = sum(t.nbytes / min(capacity[link] for link in t.paths[0]) for t in transfers)
    assert res.makespan <= serial * (1 + 1e-9)
    for link in capacity:
        carried = sum(t.nbytes for t in transfers if link in t.paths[0])
        assert res.link_bytes[link] == pytest.approx(carried)
