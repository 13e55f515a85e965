"""Routes over circuits: every next hop is a circuit of the epoch, every circuit a hop."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fabric_controller.tor_routes import routed_tors, tor_routes
from orchestrrl import wiring as wiring_mod
from orchestrrl.model import Circuit, Phase, Wiring
from scheduler.circuits import plan_phase

pytestmark = pytest.mark.unit


def routed_wiring(roles: list[str], uplinks: int = 2, netns: bool = True) -> Wiring:
    doc: dict[str, Any] = {
        "ocs": [{"name": "o", "address": "127.0.0.1:1", "ports": max(2, len(roles) * uplinks)}],
        "pod": [], "tor": [], "node": [],
    }  # fmt: skip
    for i, role in enumerate(roles):
        doc["pod"].append({"name": f"p{i}", "prefix": f"10.{i}.0.0/24"})
        doc["tor"].append(
            {
                "name": f"t{i}", "pod": f"p{i}", **({"netns": f"ns-t{i}"} if netns else {}),
                "uplinks": [
                    {"port": f"u{k}", "ocs": "o", "ocs_port": i * uplinks + k + 1,
                     "ip": f"172.16.{i}.{k + 1}"}
                    for k in range(uplinks)
                ],
            }
        )  # fmt: skip
        doc["node"].append(
            {"name": f"n{i}", "pod": f"p{i}", "role": role, "agent": f"127.0.0.1:{7000 + i}",
             "gpus": 8}
        )  # fmt: skip
    return wiring_mod.validate(doc)


def test_routes_follow_the_circuits() -> None:
    w = routed_wiring(["train", "train", "gen"])
    circuits = {Circuit("o", 1, 3), Circuit("o", 2, 5)}  # t0.u0-t1.u0, t0.u1-t2.u0
    routes = tor_routes(w, circuits)
    assert set(routes) == {"t0", "t1", "t2"}
    (r1, r2) = sorted(routes["t0"], key=lambda r: r.destination)
    assert r1.destination == "10.1.0.0/24"
    assert [(h.gateway, h.device, h.onlink) for h in r1.nexthops] == [("172.16.1.1", "u0", True)]
    assert r2.destination == "10.2.0.0/24"
    assert [(h.gateway, h.device) for h in r2.nexthops] == [("172.16.2.1", "u1")]
    (back,) = routes["t2"]
    assert back.destination == "10.0.0.0/24"
    assert [(h.gateway, h.device) for h in back.nexthops] == [("172.16.0.2", "u0")]
    assert tor_routes(w, set()) == {"t0": frozenset(), "t1": frozenset(), "t2": frozenset()}


def test_tors_without_netns_are_not_programmed() -> None:
    w = routed_wiring(["train", "gen"], netns=False)
    assert routed_tors(w) == ()
    assert tor_routes(w, {Circuit("o", 1, 3)}) == {}


@settings(max_examples=60)
@given(
    roles=st.lists(st.sampled_from(["train", "gen"]), min_size=2, max_size=5),
    uplinks=st.integers(1, 4),
    phase=st.sampled_from(list(Phase)),
)
def test_no_route_uses_a_circuit_the_epoch_lacks(
    roles: list[str], uplinks: int, phase: Phase
) -> None:
    w = routed_wiring(roles, uplinks)
    circuits = plan_phase(w, phase, frozenset()).desired
    hops = {
        (tor, h.device, h.gateway) for tor, rs in tor_routes(w, circuits).items()
        for r in rs for h in r.nexthops
    }  # fmt: skip
    expected = set()
    for c in circuits:
        end_a, end_b = w.uplink_at(c.ocs, c.a), w.uplink_at(c.ocs, c.b)
        assert end_a and end_b
        for (tor, up), (_, far) in ((end_a, end_b), (end_b, end_a)):
            expected.add((tor.name, up.interface, far.ip))
    assert hops == expected
