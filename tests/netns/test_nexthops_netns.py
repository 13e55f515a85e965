"""ECMP routes whose next hops each have their own device and the onlink flag, against a
real kernel (root only).

A throwaway ToR namespace has two uplinks, ``up0`` and ``up1``: veth pairs whose far
ends (``far0``/``far1``, in a peer namespace) hold the circuit addresses 172.16.0.9 and
172.16.0.10 as /32s, so the gateways are on no connected subnet of the ToR and need
``onlink``. Everything is read back twice: through the adapter, and independently
through iproute2's JSON.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest

from orchestrrl import errors
from orchestrrl.netlink import OWNER_PROTO, Netlink
from orchestrrl.routing import NextHop, RouteSpec
from sim_backends import netns

pytestmark = pytest.mark.netns

CIRCUITS = RouteSpec(
    "10.0.2.0/24",
    nexthops=(
        NextHop(gateway="172.16.0.9", device="up0", onlink=True),
        NextHop(gateway="172.16.0.10", device="up1", onlink=True),
    ),
)
CIRCUITS_V6 = RouteSpec(
    "fd00:2::/64",
    nexthops=(NextHop("fd00:16::9", "up0", True), NextHop("fd00:16::a", "up1", True)),
)
ONE_CIRCUIT = RouteSpec("10.0.3.0/24", nexthops=(NextHop("172.16.0.9", "up0", onlink=True),))

Hop = tuple[str, str, bool]  # gateway, dev, onlink


@dataclass(frozen=True)
class Tor:
    netns: str


@pytest.fixture
async def tor(testbed: netns.Testbed) -> Tor:
    name = await testbed.netns("tor")
    peer = await testbed.netns("peer")
    for i, (near, far) in enumerate((("172.16.0.1", "172.16.0.9"), ("172.16.0.2", "172.16.0.10"))):
        await testbed.veth(f"up{i}", f"far{i}", netns_a=name, netns_b=peer)
        await netns.add_address(f"up{i}", f"{near}/32", name)
        await netns.add_address(f"far{i}", f"{far}/32", peer)
    return Tor(name)


async def ip_hops(ns: str) -> dict[str, list[Hop]]:
    """destination -> sorted (gateway, dev, onlink) of OrchestrRL's routes, per `ip -j`."""
    shown: dict[str, list[Hop]] = {}
    for family in ("-4", "-6"):
        out = await netns.run(["ip", "-n", ns, "-j", family, "route", "show", "proto", "77"])
        for route in json.loads(out.stdout or "[]"):
            hops = route.get("nexthops") or [route]
            shown[route["dst"]] = sorted(
                (h["gateway"], h["dev"], "onlink" in h.get("flags", [])) for h in hops
            )
    return shown


def spec_hops(route: RouteSpec) -> list[Hop]:
    return sorted((h.gateway or "", h.device or "", h.onlink) for h in route.nexthops)


async def test_an_onlink_ecmp_route_with_a_device_per_hop(tor: Tor) -> None:
    async with Netlink(tor.netns) as nl:
        change = await nl.ensure_routes([CIRCUITS], prune=True)
        assert (change.added, change.replaced, change.removed, change.unchanged) == (1, 0, 0, 0)
        assert change.routes == await nl.routes() == frozenset({CIRCUITS})
        (read_back,) = change.routes
        assert [(h.gateway, h.device, h.onlink) for h in read_back.nexthops] == [
            ("172.16.0.9", "up0", True),
            ("172.16.0.10", "up1", True),
        ]
        assert await ip_hops(tor.netns) == {"10.0.2.0/24": spec_hops(CIRCUITS)}
        text = (await netns.run(["ip", "-n", tor.netns, "route", "show", "proto", "77"])).stdout
        assert "nexthop via 172.16.0.9 dev up0 weight 1 onlink" in text
        assert "nexthop via 172.16.0.10 dev up1 weight 1 onlink" in text
        chosen = await netns.run(["ip", "-n", tor.netns, "route", "get", "10.0.2.5"])
        assert " dev up0 " in chosen.stdout or " dev up1 " in chosen.stdout

        # the same again changes nothing, in the adapter's view and in the kernel's
        again = await nl.ensure_routes([CIRCUITS], prune=True)
        assert (again.added, again.replaced, again.removed, again.unchanged) == (0, 0, 0, 1)
        assert await ip_hops(tor.netns) == {"10.0.2.0/24": spec_hops(CIRCUITS)}
        assert (await nl.verify_routes([CIRCUITS], prune=True)).empty

        # one hop moves to the other uplink: same key and gateways, so a replace
        moved = RouteSpec(
            "10.0.2.0/24",
            nexthops=(NextHop("172.16.0.9", "up0", True), NextHop("172.16.0.10", "up0", True)),
        )
        assert len((await nl.verify_routes([moved], prune=True)).replace) == 1
        change = await nl.ensure_routes([moved], prune=True)
        assert (change.added, change.replaced, change.removed, change.unchanged) == (0, 1, 0, 0)
        assert change.routes == frozenset({moved})
        assert await ip_hops(tor.netns) == {"10.0.2.0/24": spec_hops(moved)}

        # prune removes it
        gone = await nl.ensure_routes([], prune=True)
        assert (gone.removed, gone.routes) == (1, frozenset())
        assert await ip_hops(tor.netns) == {}


async def test_single_hop_and_ipv6_onlink_routes_round_trip(tor: Tor) -> None:
    for dev, address in (("up0", "fd00:16::1/128"), ("up1", "fd00:16::2/128")):
        await netns.add_address(dev, address, tor.netns)
    desired = [CIRCUITS, CIRCUITS_V6, ONE_CIRCUIT]
    async with Netlink(tor.netns) as nl:
        change = await nl.ensure_routes(desired, prune=True)
        assert change.added == 3
        assert change.routes == frozenset(desired)
        assert await ip_hops(tor.netns) == {r.destination: spec_hops(r) for r in desired}
        await nl.ensure_routes([], prune=True)

        # installed by iproute2 instead, read back by the adapter as the same values
        via = "via 172.16.0.9 dev up0 onlink"
        for command in (
            f"10.0.2.0/24 proto {OWNER_PROTO} nexthop {via} nexthop via 172.16.0.10 dev up1 onlink",
            f"fd00:2::/64 proto {OWNER_PROTO} nexthop via fd00:16::9 dev up0 onlink "
            "nexthop via fd00:16::a dev up1 onlink",
            f"10.0.3.0/24 proto {OWNER_PROTO} {via}",
        ):
            await netns.run(["ip", "-n", tor.netns, "route", "add", *command.split()])
        assert await nl.routes() == frozenset(desired)
        assert (await nl.ensure_routes(desired, prune=True)).unchanged == 3


async def test_an_unknown_hop_device_is_refused_before_the_kernel_is_touched(tor: Tor) -> None:
    async with Netlink(tor.netns) as nl:
        await nl.ensure_routes([ONE_CIRCUIT], prune=False)
        before = await ip_hops(tor.netns)
        bad = RouteSpec(
            "10.0.2.0/24",
            nexthops=(NextHop("172.16.0.9", "up0", True), NextHop("172.16.0.10", "up9", True)),
        )
        with pytest.raises(errors.InvalidArgument) as info:
            await nl.ensure_routes([CIRCUITS_V6, bad], prune=True)
        assert str(info.value).startswith(
            "nexthops[1].device='up9' is not valid: no such interface in netns"
        )
        assert "route 10.0.2.0/24 nexthop via 172.16.0.9 dev up0 onlink" in str(info.value)
        assert await ip_hops(tor.netns) == before


async def test_dropping_onlink_is_a_replace_the_kernel_refuses_and_rolls_back(tor: Tor) -> None:
    """Without onlink the gateways are on no connected subnet: the kernel says so, and the
    routes already changed in the same ensure are put back."""
    async with Netlink(tor.netns) as nl:
        await nl.ensure_routes([CIRCUITS], prune=True)
        before = await ip_hops(tor.netns)
        plain = RouteSpec(
            "10.0.2.0/24",
            nexthops=(NextHop("172.16.0.9", "up0"), NextHop("172.16.0.10", "up1")),
        )
        assert (await nl.verify_routes([ONE_CIRCUIT, plain], prune=True)).replace == (plain,)
        with pytest.raises(errors.InvalidArgument, match="not on a connected network") as info:
            await nl.ensure_routes([ONE_CIRCUIT, plain], prune=True)
        assert "were rolled back" in str(info.value)
        assert await ip_hops(tor.netns) == before
