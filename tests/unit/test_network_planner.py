"""RFabric's network planner: demand, circuits, routes, slack gate, weight sync."""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrrl import errors
from orchestrrl import wiring as wiring_mod
from orchestrrl.model import SYNC_PHASES, Circuit, Phase, Role, Wiring
from scheduler.circuits import pair, plan_phase, template_demand
from scheduler.network import (
    NetworkConfig,
    NetworkPlan,
    PhaseDemand,
    Workload,
    _pair_counts,
    bottleneck_time,
    demand_matrix,
    plan_network,
    plan_phase_circuits,
    routes_for,
    workloads_for_phase,
)
from scheduler.weight_sync import plan_weight_sync

pytestmark = pytest.mark.unit


def make_wiring(
    pods: list[tuple[str, int, list[tuple[str, int]]]],
    ocs_ports: dict[str, int],
    switching_ms: float = 10.0,
) -> Wiring:
    """pods: (role, nodes, [(ocs, uplinks), ...]) each; one ToR per pod, 8 NICs a node."""
    doc: dict[str, Any] = {
        "ocs": [
            {
                "name": o,
                "address": f"127.0.0.1:{6000 + i}",
                "ports": n,
                "switching_time_ms": switching_ms,
            }
            for i, (o, n) in enumerate(ocs_ports.items())
        ],
        "pod": [],
        "tor": [],
        "node": [],
    }
    next_port = dict.fromkeys(ocs_ports, 1)
    agent = 7000
    for i, (role, n_nodes, uplinks) in enumerate(pods):
        name = f"p{i}"
        doc["pod"].append({"name": name})
        ups: list[dict[str, Any]] = []
        for ocs, n in uplinks:
            for _ in range(n):
                ups.append({"port": f"u{len(ups)}", "ocs": ocs, "ocs_port": next_port[ocs]})
                next_port[ocs] += 1
        doc["tor"].append({"name": f"tor-{name}", "pod": name, "uplinks": ups})
        for k in range(n_nodes):
            agent += 1
            nics = [
                {"name": f"nic{j}", "tor": f"tor-{name}", "tor_port": f"h{k}-{j}", "gbps": 400}
                for j in range(8)
            ]
            doc["node"].append(
                {
                    "name": f"{name}-n{k}",
                    "pod": name,
                    "role": role,
                    "agent": f"127.0.0.1:{agent}",
                    "gpus": 8,
                    "nics": nics,
                }
            )
    return wiring_mod.validate(doc)


def assert_valid(w: Wiring, plan: NetworkPlan) -> None:
    """Port budgets hold and no route uses a circuit the plan lacks."""
    desired = plan.circuits.desired
    used = Counter(p for c in desired for p in c.ports())
    assert all(n == 1 for n in used.values()), "an OCS port is used twice"
    for c in desired:
        a, b = w.circuit_pods(c)
        assert a and b and a != b
        ocs = w.ocs(c.ocs)
        assert 1 <= c.a <= ocs.ports and 1 <= c.b <= ocs.ports
    # every ToR uses at most its own uplinks
    uplinks = {(u.ocs, u.ocs_port): (t.name, u.port) for t in w.tors for u in t.uplinks}
    by_port = {}
    for c in desired:
        for end, other in ((c.a, c.b), (c.b, c.a)):
            tor, port = uplinks[(c.ocs, end)]
            by_port[(tor, port)] = w.port_owner(c.ocs, other)
    for route in plan.routes:
        assert route.uplink_ports, "a route without next hops"
        for port in route.uplink_ports:
            assert by_port.get((route.tor, port)) == route.destination_pod, (
                f"route {route} uses {port}, which has no circuit to {route.destination_pod}"
            )
    # and every circuit is reachable by the routes at both ends
    hops = {(r.tor, p) for r in plan.routes for p in r.uplink_ports}
    assert hops == set(by_port)


@pytest.fixture
def fabric() -> Wiring:
    return make_wiring(
        [
            ("train", 2, [("o", 8)]),
            ("train", 2, [("o", 8)]),
            ("gen", 2, [("o", 8)]),
            ("gen", 1, [("o", 8)]),
        ],
        {"o": 32},
    )


def test_demand_matrix_of_each_workload(fabric: Wiring) -> None:
    train = fabric.pods_with_role(Role.TRAIN)
    gen = fabric.pods_with_role(Role.GEN)
    d = demand_matrix(fabric, [Workload.training(train, 10.0)])
    assert d == {pair("p0", "p1"): 10.0}  # 2 * bytes / pods per pair
    d = demand_matrix(fabric, [Workload.weight_sync(train, gen, 8.0)])
    assert d == {pair(t, g): 4.0 for t in train for g in gen}
    assert demand_matrix(fabric, [Workload.generation("p2")]) == {}
    d = demand_matrix(
        fabric, [Workload.between("p2", "p3", 3.0), Workload.between("p3", "p2", 1.0)]
    )
    assert d == {pair("p2", "p3"): 4.0}
    with pytest.raises(errors.InvalidArgument, match="workload pod"):
        demand_matrix(fabric, [Workload.generation("nope")])


def test_async_workloads_cover_the_async_template(fabric: Wiring) -> None:
    """Async mode's standing topology: the planner serves every pod pair of the template
    (training mesh and trainer -> rollout), weighting them by their bytes."""
    workloads = workloads_for_phase(fabric, Phase.ASYNC, grad_bytes=4.0, model_bytes=2.0)
    demand = demand_matrix(fabric, workloads)
    assert set(demand) == set(template_demand(fabric, Phase.ASYNC))
    assert set(demand) == set(template_demand(fabric, Phase.TRAINING)) | set(
        template_demand(fabric, Phase.WEIGHT_SYNC)
    )
    plan = plan_network(fabric, workloads, frozenset(), config=NetworkConfig(keep_tolerance=None))
    assert_valid(fabric, plan)
    served = set(_pair_counts(fabric, plan.circuits.desired))
    assert served == set(demand)


@pytest.mark.parametrize("phase", SYNC_PHASES)
def test_default_workloads_reproduce_the_phase_templates(fabric: Wiring, phase: Phase) -> None:
    workloads = workloads_for_phase(fabric, phase)
    demand = demand_matrix(fabric, workloads)
    assert set(demand) == set(template_demand(fabric, phase))
    for observed in (frozenset(), plan_phase(fabric, Phase.TRAINING, []).desired):
        plan = plan_network(fabric, workloads, observed, config=NetworkConfig(keep_tolerance=None))
        assert plan.circuits == plan_phase(fabric, phase, observed)
        assert_valid(fabric, plan)


def test_bottleneck_first_gives_heavier_pairs_more_circuits(fabric: Wiring) -> None:
    wl = [Workload.between("p0", "p2", 30e9), Workload.between("p0", "p3", 10e9)]
    plan = plan_network(fabric, wl, [])
    counts = Counter(pair(*fabric.circuit_pods(c)) for c in plan.circuits.desired)
    assert counts[pair("p0", "p2")] == 6 and counts[pair("p0", "p3")] == 2
    assert plan.bottleneck_s == pytest.approx(30e9 / (6 * 50e9))
    assert "p0 <-> p2" in plan.explanation
    assert_valid(fabric, plan)


def test_near_equal_current_topology_is_kept(fabric: Wiring) -> None:
    wl = [Workload.between("p0", "p2", 10e9), Workload.between("p0", "p3", 10e9)]
    first = plan_network(fabric, wl, [])
    # the demand shifts a little: rewiring would gain less than 5 %, so nothing moves
    shifted = [Workload.between("p0", "p2", 10.2e9), Workload.between("p0", "p3", 9.8e9)]
    again = plan_network(fabric, shifted, first.circuits.desired)
    assert again.empty and again.kept_current and again.ports_moved == 0
    # a big shift rewires
    moved = plan_network(
        fabric,
        [Workload.between("p0", "p2", 30e9), Workload.between("p0", "p3", 1e9)],
        first.circuits.desired,
    )
    assert not moved.empty and moved.ports_moved == 2 * (
        len(moved.circuits.add) + len(moved.circuits.remove)
    )


def test_slack_gate_keeps_the_topology_when_the_window_is_too_short(fabric: Wiring) -> None:
    wl = workloads_for_phase(fabric, Phase.WEIGHT_SYNC, model_bytes=29.5e9)
    gated = plan_network(fabric, wl, [], idle_window_s=0.004)
    assert gated.empty and gated.kept_current
    assert gated.gate is not None and not gated.gate.reconfigure
    assert "kept the current topology" in gated.explanation
    assert gated.routes == ()
    ok = plan_network(fabric, wl, [], idle_window_s=0.5)
    assert not ok.empty and ok.gate is not None and ok.gate.reconfigure
    # the window can come from the workloads' start times and ``now``
    soon = [Workload.weight_sync(w.pods, w.targets, w.nbytes, starts_at=100.002) for w in wl]
    assert plan_network(fabric, soon, [], now=100.0).empty
    later = [Workload.weight_sync(w.pods, w.targets, w.nbytes, starts_at=101.0) for w in wl]
    plan = plan_network(fabric, later, [], now=100.0)
    assert not plan.empty and plan.planned_at == 100.0


def test_failed_ports_are_never_used(fabric: Wiring) -> None:
    down = {("o", 1), ("o", 17)}
    plan = plan_network(fabric, workloads_for_phase(fabric, Phase.WEIGHT_SYNC), [], down)
    assert not any(p in down for c in plan.circuits.desired for p in c.ports())
    assert_valid(fabric, plan)


def test_routes_follow_the_circuits(fabric: Wiring) -> None:
    circuits = {Circuit("o", 1, 17), Circuit("o", 2, 18), Circuit("o", 9, 25)}
    routes = routes_for(fabric, circuits)
    assert [(r.tor, r.destination_pod, r.uplink_ports) for r in routes] == [
        ("tor-p0", "p2", ("u0", "u1")),
        ("tor-p1", "p3", ("u0",)),
        ("tor-p2", "p0", ("u0", "u1")),
        ("tor-p3", "p1", ("u0",)),
    ]
    assert bottleneck_time(fabric, {pair("p0", "p3"): 1.0}, circuits, 400.0) == math.inf


def test_every_tor_of_a_pod_gets_circuits_and_routes() -> None:
    doc: dict[str, Any] = {
        "ocs": [{"name": "o", "address": "127.0.0.1:6000", "ports": 16}],
        "pod": [{"name": "a"}, {"name": "b"}],
        "tor": [],
        "node": [],
    }
    port = 1
    for pod, role in (("a", "train"), ("b", "gen")):
        for t in range(2):
            ups = []
            for u in range(4):
                ups.append({"port": f"u{u}", "ocs": "o", "ocs_port": port})
                port += 1
            doc["tor"].append({"name": f"{pod}-tor{t}", "pod": pod, "uplinks": ups})
        doc["node"].append(
            {
                "name": f"{pod}-n0",
                "pod": pod,
                "role": role,
                "agent": f"127.0.0.1:{7000 + port}",
                "gpus": 8,
            }
        )
    w = wiring_mod.validate(doc)
    plan = plan_network(w, [Workload.between("a", "b", 1e9)], [])
    assert len(plan.circuits.desired) == 8
    routes = {(r.tor, r.destination_pod): len(r.uplink_ports) for r in plan.routes}
    assert routes == {
        ("a-tor0", "b"): 4,
        ("a-tor1", "b"): 4,
        ("b-tor0", "a"): 4,
        ("b-tor1", "a"): 4,
    }
    few = plan_network(w, [Workload.between("a", "b", 1e9)], [], [("o", p) for p in (3, 4, 7, 8)])
    assert {r.tor for r in few.routes} == {"a-tor0", "a-tor1", "b-tor0", "b-tor1"}
    assert_valid(w, few)


def test_weight_sync_uses_every_sender_and_picks_the_faster_schedule() -> None:
    # few circuits per pod pair, many nodes per generation pod: the tree wins
    scarce = make_wiring([("train", 4, [("o", 2)]), ("gen", 8, [("o", 2)])], {"o": 8})
    circuits = plan_phase(scarce, Phase.WEIGHT_SYNC, []).desired
    ws = plan_weight_sync(scarce, circuits, 29.5e9)
    assert ws.mode == "tree" and ws.tree_s < ws.p2p_s
    senders = {t.source for t in ws.transfers if t.stage == 1}
    assert senders == set(scarce.pod("p0").nodes)  # no single-sender funnel
    heads = {t.target for t in ws.transfers if t.stage == 1}
    assert heads == {"p1-n0"}
    chain = [(t.source, t.target) for t in ws.transfers if t.stage == 2]
    assert chain == [(f"p1-n{k}", f"p1-n{k + 1}") for k in range(7)]
    # each generation node ends up with every byte of the model
    assert sum(t.nbytes for t in ws.transfers if t.stage == 1) == pytest.approx(29.5e9)

    # plenty of circuits: direct writes to every node win
    rich = make_wiring([("train", 2, [("o", 16)]), ("gen", 2, [("o", 16)])], {"o": 32})
    circuits = plan_phase(rich, Phase.WEIGHT_SYNC, []).desired
    ws = plan_weight_sync(rich, circuits, 29.5e9)
    assert ws.mode == "p2p" and ws.p2p_s <= ws.tree_s
    got = Counter(t.target for t in ws.transfers)
    assert set(got) == set(rich.pod("p1").nodes)
    for node in rich.pod("p1").nodes:
        assert sum(t.nbytes for t in ws.transfers if t.target == node) == pytest.approx(29.5e9)
    assert {t.source for t in ws.transfers} == set(rich.pod("p0").nodes)
    # the floor: model bytes over what the fabric gives the transfer
    floor = 29.5e9 / (2 * 8 * 400e9 / 8 * 0.8)
    assert ws.predicted_s >= floor


def test_weight_sync_without_circuits_says_so(fabric: Wiring) -> None:
    ws = plan_weight_sync(fabric, [], 1e9)
    assert math.isinf(ws.predicted_s) and ws.transfers == ()
    assert "impossible" in ws.explanation
    plan = plan_network(fabric, workloads_for_phase(fabric, Phase.WEIGHT_SYNC, model_bytes=1e9), [])
    assert plan.weight_sync is not None and plan.weight_sync.predicted_s < math.inf


# -- properties ---------------------------------------------------------------------

pod_strategy = st.tuples(
    st.sampled_from(["train", "gen"]),
    st.integers(1, 3),
    st.lists(
        st.tuples(st.sampled_from(["a", "b"]), st.integers(0, 4)), min_size=1, max_size=2
    ).filter(lambda ups: any(n for _, n in ups)),  # a ToR without uplinks is not valid wiring
)


@st.composite
def wirings(draw: st.DrawFn) -> Wiring:
    pods = draw(st.lists(pod_strategy, min_size=1, max_size=6))
    need: Counter[str] = Counter()
    for _, _, ups in pods:
        for ocs, n in ups:
            need[ocs] += n
    ports = {o: max(2, need[o] + draw(st.integers(0, 3))) for o in ("a", "b")}
    return make_wiring(pods, ports)


@st.composite
def workloads(draw: st.DrawFn, w: Wiring) -> list[Workload]:
    names = [p.name for p in w.pods]
    out: list[Workload] = []
    for _ in range(draw(st.integers(0, 4))):
        kind = draw(st.sampled_from(["train", "sync", "pair", "gen"]))
        size = draw(st.floats(1e6, 1e11))
        if kind == "train":
            out.append(Workload.training(draw(st.lists(st.sampled_from(names), unique=True)), size))
        elif kind == "sync":
            src = draw(st.lists(st.sampled_from(names), min_size=1, unique=True))
            dst = draw(st.lists(st.sampled_from(names), unique=True))
            out.append(Workload.weight_sync(src, dst, size))
        elif kind == "pair":
            out.append(
                Workload.between(draw(st.sampled_from(names)), draw(st.sampled_from(names)), size)
            )
        else:
            out.append(Workload.generation(draw(st.sampled_from(names))))
    return out


@st.composite
def random_circuits(draw: st.DrawFn, w: Wiring) -> frozenset[Circuit]:
    ports = [(o, p) for _, o, p in w.uplink_ports()]
    order = draw(st.permutations(ports))
    out = []
    for (o1, p1), (o2, p2) in zip(order[::2], order[1::2], strict=False):
        if o1 == o2 and draw(st.booleans()):
            out.append(Circuit(o1, p1, p2))
    return frozenset(out)


@settings(max_examples=80)
@given(data=st.data(), w=wirings(), tolerance=st.sampled_from([None, 0.0, 0.05]))
def test_properties_of_any_network_plan(
    data: st.DataObject, w: Wiring, tolerance: float | None
) -> None:
    wl = data.draw(workloads(w))
    observed = data.draw(random_circuits(w))
    config = NetworkConfig(keep_tolerance=tolerance)
    plan = plan_network(w, wl, observed, config=config)
    assert_valid(w, plan)
    assert (observed - plan.circuits.remove) | plan.circuits.add == plan.circuits.desired
    again = plan_network(w, wl, plan.circuits.desired, config=config)
    assert again.empty, again.explanation
    assert again.routes == plan.routes
    assert plan_network(w, wl, observed, config=config) == plan  # deterministic


# -- large fabrics, weighting, and the controller's entry point ------------------------


def test_weight_sync_bytes_follow_the_training_nodes() -> None:
    w = make_wiring(
        [("train", 3, [("o", 4)]), ("train", 1, [("o", 4)]), ("gen", 2, [("o", 4)])], {"o": 12}
    )
    d = demand_matrix(w, [Workload.weight_sync(["p0", "p1"], ["p2"], 8.0)])
    assert d == {pair("p0", "p2"): 6.0, pair("p1", "p2"): 2.0}  # shards of 3 vs 1 nodes


def test_more_partners_than_ports_still_rewires_and_reports_what_is_unserved() -> None:
    # 2 training pods x 4 generation pods, 2 uplinks each: at most 4 of 8 weight-sync
    # pairs can have a direct circuit. Neither the training circuits nor the new ones
    # serve every pair, yet the new ones serve far more: they must win.
    w = make_wiring([("train", 1, [("o", 2)])] * 2 + [("gen", 1, [("o", 2)])] * 4, {"o": 12})
    training = plan_network(w, workloads_for_phase(w, Phase.TRAINING), []).circuits.desired
    plan = plan_network(w, workloads_for_phase(w, Phase.WEIGHT_SYNC, model_bytes=8e9), training)
    assert not plan.kept_current and plan.circuits.remove == training
    assert len(plan.circuits.desired) == 4
    assert plan.unserved_bytes == pytest.approx(4 * 4e9)  # 4 pairs of 4 GB
    assert 0 < plan.bottleneck_s < math.inf
    assert "4 pod pair(s), 16.00 GB, without a direct circuit" in plan.explanation
    assert_valid(w, plan)
    # and applied, it stays (the same pairs keep their circuits)
    again = plan_network(
        w, workloads_for_phase(w, Phase.WEIGHT_SYNC, model_bytes=8e9), plan.circuits.desired
    )
    assert again.empty and again.kept_current


def test_no_inter_pod_demand_keeps_or_releases_the_circuits(fabric: Wiring) -> None:
    training = plan_network(fabric, workloads_for_phase(fabric, Phase.TRAINING), [])
    idle = workloads_for_phase(fabric, Phase.GENERATION)
    kept = plan_network(fabric, idle, training.circuits.desired)
    assert kept.empty and kept.kept_current  # nothing needs the network: no port moves
    assert "no inter-pod demand: kept the 8 current circuits" in kept.explanation
    released = plan_network(
        fabric, idle, training.circuits.desired, config=NetworkConfig(release_idle=True)
    )
    assert released.circuits.desired == frozenset() and released.routes == ()
    assert released.circuits.remove == training.circuits.desired
    assert "every circuit released, pods isolated" in released.explanation


def test_the_schedule_can_be_left_out(fabric: Wiring) -> None:
    wl = workloads_for_phase(fabric, Phase.WEIGHT_SYNC, model_bytes=1e9)
    plan = plan_network(fabric, wl, [], config=NetworkConfig(weight_sync_schedule=False))
    assert plan.weight_sync is None
    assert plan.circuits == plan_network(fabric, wl, []).circuits


def test_phase_circuits_come_from_the_planner_with_the_template_as_fallback(
    fabric: Wiring,
) -> None:
    net = plan_phase_circuits(fabric, Phase.WEIGHT_SYNC, [])
    assert net.planner == "network"
    assert net.explanation.startswith("network planner (weight-sync)")
    assert net.circuits == plan_phase(fabric, Phase.WEIGHT_SYNC, [])  # equal pods: same
    # bytes unknown: the template, saying so
    unknown = plan_phase_circuits(fabric, Phase.TRAINING, [], demand=PhaseDemand(0, 0))
    assert unknown.planner == "template"
    assert "no demand information (training_bytes is 0)" in unknown.explanation
    assert unknown.circuits == plan_phase(fabric, Phase.TRAINING, [])
    # nothing placeable (every generation port failed): the template, saying why
    gen_ports = [("o", p) for p in range(17, 33)]
    stuck = plan_phase_circuits(fabric, Phase.WEIGHT_SYNC, [], gen_ports)
    assert stuck.planner == "template" and "could place no circuit" in stuck.explanation
    assert stuck.circuits.desired == frozenset()
    # pods left out take no part
    without = plan_phase_circuits(fabric, Phase.WEIGHT_SYNC, [], without_pods=["p3"])
    assert {pod for c in without.circuits.desired for pod in fabric.circuit_pods(c)} == {
        "p0",
        "p1",
        "p2",
    }
    # generation: no demand, nothing to place, no fallback needed
    gen = plan_phase_circuits(fabric, Phase.GENERATION, net.circuits.desired)
    assert gen.planner == "network" and gen.circuits.desired == frozenset()


@pytest.mark.parametrize(
    ("field", "value"),
    [("model_bytes", -1.0), ("training_bytes", math.inf), ("model_bytes", math.nan)],
)
def test_phase_demand_is_validated(field: str, value: float) -> None:
    with pytest.raises(errors.InvalidArgument, match=f"{field}="):
        PhaseDemand(**{field: value})
