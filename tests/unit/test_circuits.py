"""Phase templates and the circuit allocator: budgets, balance, minimal churn."""

from __future__ import annotations

from collections import Counter
from itertools import combinations
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrrl import errors
from orchestrrl import wiring as wiring_mod
from orchestrrl.model import Circuit, Phase, Role, Wiring
from scheduler.circuits import allocate, pair, plan_phase, template_demand

pytestmark = pytest.mark.unit


def make_wiring(pods: list[tuple[str, list[tuple[str, int]]]], ocs_ports: dict[str, int]) -> Wiring:
    """pods: (role, [(ocs, n_uplinks), ...]) each; ports assigned in order per OCS."""
    doc: dict[str, Any] = {
        "ocs": [
            {"name": o, "address": f"127.0.0.1:{6000 + i}", "ports": n}
            for i, (o, n) in enumerate(ocs_ports.items())
        ],
        "pod": [],
        "tor": [],
        "node": [],
    }
    next_port = dict.fromkeys(ocs_ports, 1)
    for i, (role, uplinks) in enumerate(pods):
        name = f"p{i}"
        doc["pod"].append({"name": name})
        ups = []
        for ocs, n in uplinks:
            for _ in range(n):
                ups.append({"port": f"u{len(ups)}", "ocs": ocs, "ocs_port": next_port[ocs]})
                next_port[ocs] += 1
        doc["tor"].append({"name": f"tor-{name}", "pod": name, "uplinks": ups})
        doc["node"].append(
            {
                "name": f"{name}-n0",
                "pod": name,
                "role": role,
                "agent": f"127.0.0.1:{7000 + i}",
                "gpus": 8,
            }
        )
    return wiring_mod.validate(doc)


def owners(w: Wiring, c: Circuit) -> tuple[str, str]:
    a, b = w.circuit_pods(c)
    return pair(a, b)


def assert_valid(w: Wiring, circuits: frozenset[Circuit]) -> None:
    used = Counter(p for c in circuits for p in c.ports())
    assert all(n == 1 for n in used.values()), "a port is used twice"
    for c in circuits:
        a, b = w.circuit_pods(c)
        assert a and b, f"{c} uses a port not cabled to any pod"
        assert a != b, f"{c} connects a pod to itself"


def test_generation_isolates_pods(example_wiring: Wiring) -> None:
    assert template_demand(example_wiring, Phase.GENERATION) == {}
    assert plan_phase(example_wiring, Phase.GENERATION, []).desired == frozenset()


def test_training_meshes_training_pods_with_all_their_ports(example_wiring: Wiring) -> None:
    plan = plan_phase(example_wiring, Phase.TRAINING, [])
    assert_valid(example_wiring, plan.desired)
    assert Counter(owners(example_wiring, c) for c in plan.desired) == {("train0", "train1"): 8}


def test_weight_sync_connects_every_training_pod_to_every_generation_pod(
    example_wiring: Wiring,
) -> None:
    plan = plan_phase(example_wiring, Phase.WEIGHT_SYNC, [])
    assert_valid(example_wiring, plan.desired)
    assert Counter(owners(example_wiring, c) for c in plan.desired) == {
        ("gen0", "train0"): 4,
        ("gen0", "train1"): 4,
        ("gen1", "train0"): 4,
        ("gen1", "train1"): 4,
    }


def test_phase_walk_is_idempotent_and_keeps_ports(example_wiring: Wiring) -> None:
    observed: frozenset[Circuit] = frozenset()
    for phase in [Phase.TRAINING, Phase.WEIGHT_SYNC, Phase.GENERATION, Phase.WEIGHT_SYNC]:
        plan = plan_phase(example_wiring, phase, observed)
        observed = (observed - plan.remove) | plan.add
        assert observed == plan.desired
        assert plan_phase(example_wiring, phase, observed).empty


def test_existing_circuits_are_reused_when_the_pair_still_wants_them(
    example_wiring: Wiring,
) -> None:
    ws = plan_phase(example_wiring, Phase.WEIGHT_SYNC, []).desired
    # drop one circuit and ask again: only that one comes back, nothing else moves
    dropped = sorted(ws)[0]
    plan = plan_phase(example_wiring, Phase.WEIGHT_SYNC, ws - {dropped})
    assert plan.remove == frozenset()
    assert len(plan.add) == 1


def test_failed_ports_are_never_used(example_wiring: Wiring) -> None:
    down = {("ocs0", 1), ("ocs0", 17)}
    plan = plan_phase(example_wiring, Phase.WEIGHT_SYNC, [], down)
    assert not any(p in down for c in plan.desired for p in c.ports())
    assert len(plan.desired) == 15  # train0 and gen0 lost a port each: 7 + 8 circuits


def test_foreign_circuits_on_uncabled_ports_are_left_alone() -> None:
    w = make_wiring([("train", [("o", 2)]), ("gen", [("o", 2)])], {"o": 8})
    foreign = Circuit("o", 7, 8)  # ports 7 and 8 are not cabled to any pod
    plan = plan_phase(w, Phase.GENERATION, [foreign])
    assert foreign not in plan.remove


def test_multiple_ocs_use_common_switches_only() -> None:
    w = make_wiring(
        [("train", [("a", 2), ("b", 2)]), ("gen", [("a", 2)]), ("gen", [("b", 1)])],
        {"a": 8, "b": 8},
    )
    plan = plan_phase(w, Phase.WEIGHT_SYNC, [])
    assert_valid(w, plan.desired)
    by_pair = Counter((owners(w, c), c.ocs) for c in plan.desired)
    assert by_pair == {(("p0", "p1"), "a"): 2, (("p0", "p2"), "b"): 1}


def test_circuit_is_normalised_and_refuses_self_loops() -> None:
    assert Circuit("o", 5, 2) == Circuit("o", 2, 5)
    with pytest.raises(errors.InvalidArgument, match="to itself"):
        Circuit("o", 3, 3)


pod_strategy = st.tuples(
    st.sampled_from(["train", "gen"]),
    st.lists(
        st.tuples(st.sampled_from(["a", "b"]), st.integers(0, 4)), min_size=1, max_size=2
    ).filter(lambda ups: any(n for _, n in ups)),  # a ToR without uplinks is not valid wiring
)


@st.composite
def wirings(draw: st.DrawFn) -> Wiring:
    pods = draw(st.lists(pod_strategy, min_size=1, max_size=6))
    need = Counter()
    for _, ups in pods:
        for ocs, n in ups:
            need[ocs] += n
    ports = {o: max(2, need[o] + draw(st.integers(0, 3))) for o in ("a", "b")}
    return make_wiring(pods, ports)


@st.composite
def random_circuits(draw: st.DrawFn, w: Wiring) -> frozenset[Circuit]:
    """A valid set of circuits on the wiring's ports (what a switch might hold)."""
    ports = [(o, p) for _, o, p in w.uplink_ports()]
    order = draw(st.permutations(ports))
    out = []
    for (o1, p1), (o2, p2) in zip(order[::2], order[1::2], strict=False):
        if o1 == o2 and draw(st.booleans()):
            out.append(Circuit(o1, p1, p2))
    return frozenset(out)


@settings(max_examples=150)
@given(data=st.data(), w=wirings(), phase=st.sampled_from(list(Phase)))
def test_properties_of_any_plan(data: st.DataObject, w: Wiring, phase: Phase) -> None:
    observed = data.draw(random_circuits(w))
    plan = plan_phase(w, phase, observed)
    # every circuit respects the port budget and the template's pod pairs
    assert_valid(w, plan.desired)
    demand = template_demand(w, phase)
    assert all(owners(w, c) in demand for c in plan.desired)
    # the plan is exactly the difference, and applying it then planning again is empty
    assert (observed - plan.remove) | plan.add == plan.desired
    assert plan_phase(w, phase, plan.desired).empty
    # deterministic
    assert plan_phase(w, phase, observed) == plan


@settings(max_examples=150)
@given(w=wirings(), phase=st.sampled_from(list(Phase)))
def test_allocation_is_balanced_and_maximal(w: Wiring, phase: Phase) -> None:
    demand = template_demand(w, phase)
    circuits = allocate(w, demand)
    counts = Counter(owners(w, c) for c in circuits)
    free: Counter[tuple[str, str]] = Counter((pod, ocs) for pod, ocs, _ in w.uplink_ports())
    for c in circuits:
        a, b = w.circuit_pods(c)
        free[(a, c.ocs)] -= 1
        free[(b, c.ocs)] -= 1
    # maximal: no pair in demand still has a common OCS with a free port on both sides
    for a, b in demand:
        for o in {x.name for x in w.ocses}:
            assert min(free[(a, o)], free[(b, o)]) <= 0
    # with one OCS, pairs that could take more never trail another pair by more than one
    if len(w.ocses) == 1 or all(len(p.tors) == 1 for p in w.pods):
        for p1, p2 in combinations(demand, 2):
            if counts[p1] + 1 < counts[p2]:
                o = w.ocses[0].name
                assert min(free[(p1[0], o)], free[(p1[1], o)]) <= 0 or len(w.ocses) > 1


def test_roles_drive_templates(example_wiring: Wiring) -> None:
    train = set(example_wiring.pods_with_role(Role.TRAIN))
    for a, b in template_demand(example_wiring, Phase.WEIGHT_SYNC):
        assert (a in train) != (b in train)


def test_weighted_demand_is_served_bottleneck_first() -> None:
    w = make_wiring([("train", [("o", 8)]), ("gen", [("o", 4)]), ("gen", [("o", 4)])], {"o": 16})
    circuits = allocate(w, {("p0", "p1"): 3.0, ("p0", "p2"): 1.0})
    # p1 fills up (4 ports) while p0-p1 leads; p0's other 4 ports go to p2
    assert Counter(owners(w, c) for c in circuits) == {("p0", "p1"): 4, ("p0", "p2"): 4}
    # p1's 4 ports: one to the light pair first (sorted order), then the heavy pair
    uneven = allocate(w, {("p1", "p2"): 1.0, ("p0", "p1"): 0.25})
    assert Counter(owners(w, c) for c in uneven) == {("p0", "p1"): 1, ("p1", "p2"): 3}
