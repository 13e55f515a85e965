"""Electrical routes over optical circuits (pure).

A ToR that the controller programs (``netns`` set in the wiring) gets, for every other
pod with an address block, one ECMP route to that block whose next hops are the far
ends of its circuits into that pod: gateway = the far uplink's address (a /32 on the
peer's interface, hence on-link), device = this ToR's uplink interface. No circuit to
a pod, no route: traffic to it then follows whatever else the switch knows (nothing,
in the testbed), which is exactly the isolation the phase asked for.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

from orchestrrl.model import Circuit, Wiring
from orchestrrl.routing import NextHop, RouteSpec

TorRoutes = dict[str, frozenset[RouteSpec]]


def routed_tors(wiring: Wiring) -> tuple[str, ...]:
    """The ToRs the controller programs."""
    return tuple(t.name for t in wiring.tors if t.netns)


def tor_routes(wiring: Wiring, circuits: Iterable[Circuit]) -> TorRoutes:
    """The routes every programmed ToR needs for exactly these circuits."""
    hops: dict[tuple[str, str], list[NextHop]] = defaultdict(list)  # (tor, pod) -> hops
    for c in circuits:
        end_a, end_b = wiring.uplink_at(c.ocs, c.a), wiring.uplink_at(c.ocs, c.b)
        if end_a is None or end_b is None:
            continue
        for (tor, up), (far_tor, far_up) in ((end_a, end_b), (end_b, end_a)):
            if tor.netns and far_tor.pod != tor.pod and far_up.ip:
                hops[(tor.name, far_tor.pod)].append(
                    NextHop(gateway=far_up.ip, device=up.interface, onlink=True)
                )
    out: dict[str, set[RouteSpec]] = {name: set() for name in routed_tors(wiring)}
    for (tor_name, pod), nexthops in hops.items():
        prefix = wiring.pod(pod).prefix
        if prefix:
            out[tor_name].add(RouteSpec(prefix, nexthops=tuple(nexthops)))
    return {name: frozenset(routes) for name, routes in out.items()}
