"""Helpers of the netns tests: the switch namespace value and an independent reading of
the kernel's routes through iproute2."""

from __future__ import annotations

import json
from dataclasses import dataclass

from sim_backends import netns

GATEWAYS_V4 = ("10.9.0.2", "10.9.0.3")
GATEWAYS_V6 = ("fd00:9::2", "fd00:9::3")


@dataclass(frozen=True)
class Switch:
    """A namespace with a veth pair inside: ``p0`` (10.9.0.1/24, fd00:9::1/64) and
    ``p1`` (10.8.0.1/24); gateways in GATEWAYS_V4/V6 are on p0's subnets."""

    netns: str


Row = tuple[str, tuple[str, ...], str, str, int]  # dst, gateways, dev, table, metric


async def kernel_routes(ns: str, *selector: str) -> set[Row]:
    """Routes as iproute2 reports them (an independent reading of the kernel)."""
    rows: set[Row] = set()
    for family in ("-4", "-6"):
        out = await netns.run(
            ["ip", "-n", ns, "-j", family, "route", "show", "table", "all", *selector]
        )
        for route in json.loads(out.stdout or "[]"):
            if route.get("type", "unicast") != "unicast" or route.get("table") == "local":
                continue
            hops = route.get("nexthops") or [route]
            rows.add(
                (
                    route["dst"],
                    tuple(sorted(h["gateway"] for h in hops if "gateway" in h)),
                    ",".join(sorted({h.get("dev", "") for h in hops})),
                    str(route.get("table", "main")),
                    int(route.get("metric", 0)),
                )
            )
    return rows


async def owned_routes(ns: str) -> set[Row]:
    return await kernel_routes(ns, "proto", "77")
