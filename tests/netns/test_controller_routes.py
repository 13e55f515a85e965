"""The controller programs ToR routes over the circuits of every epoch, drains them
before circuits move, and rolls them back with the circuits when a change fails."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from fabric_controller.drivers.electrical import ElectricalDriver, LinuxSwitchDriver
from orchestrrl import errors
from orchestrrl import wiring as wiring_mod
from orchestrrl.client import AsyncClient
from orchestrrl.model import Wiring
from sim_backends import netns
from sim_backends.harness import Fabric, start_fabric

pytestmark = pytest.mark.netns

ROLES = ["train", "train", "gen"]
UPLINKS = 2


async def routed_testbed(bed: netns.Testbed) -> Wiring:
    """Three pods, one ToR namespace each with two uplink interfaces (their veth peers
    sit in an 'ocs' namespace; forwarding is not needed to check routes)."""
    ocs_ns = await bed.netns("ocs")
    doc: dict[str, list[dict[str, object]]] = {"pod": [], "tor": [], "node": []}
    for i, role in enumerate(ROLES):
        tor_ns = await bed.netns("tor")
        for k in range(UPLINKS):
            await bed.veth(f"u{k}", f"o{i}-{k}", netns_a=tor_ns, netns_b=ocs_ns)
        doc["pod"].append({"name": f"p{i}", "prefix": f"10.{i}.0.0/24"})
        doc["tor"].append(
            {"name": f"t{i}", "pod": f"p{i}", "netns": tor_ns,
             "uplinks": [{"port": f"u{k}", "ocs": "o", "ocs_port": i * UPLINKS + k + 1,
                          "ip": f"172.16.{i}.{k + 1}"} for k in range(UPLINKS)]}
        )  # fmt: skip
        doc["node"].append(
            {
                "name": f"n{i}",
                "pod": f"p{i}",
                "role": role,
                "agent": f"127.0.0.1:{7000 + i}",
                "gpus": 8,
            }
        )
    return wiring_mod.validate(
        {"ocs": [{"name": "o", "address": "127.0.0.1:1", "ports": 8}], **doc}
    )


@pytest.fixture
async def routed(testbed: netns.Testbed, tmp_path: Path) -> AsyncIterator[Fabric]:
    w = await routed_testbed(testbed)
    switches: dict[str, ElectricalDriver] = {
        t.name: LinuxSwitchDriver(t.name, t.netns) for t in w.tors
    }
    f = await start_fabric(w, tmp_path / "s.db", switching_time_s=0.0, electrical=switches)
    try:
        yield f
    finally:
        await f.stop()
        for s in switches.values():
            await s.close()


async def kernel_routes(ns: str) -> dict[str, list[tuple[str, str, bool]]]:
    """destination -> [(gateway, device, onlink)] of OrchestrRL's routes, as `ip` shows them."""
    out = await netns.run(["ip", "-j", "route", "show", "proto", "77"], netns=ns)
    routes = {}
    for r in json.loads(out.stdout or "[]"):
        hops = r.get("nexthops") or [r]
        routes[r["dst"]] = sorted(
            (h["gateway"], h["dev"], "onlink" in h.get("flags", [])) for h in hops
        )
    return routes


async def test_routes_follow_every_phase(routed: Fabric) -> None:
    w = routed.wiring
    ns = {t.name: t.netns for t in w.tors}
    async with AsyncClient(routed.address, timeout_s=10) as c:
        r = await c.set_phase("weight-sync")
        assert "drain_routes" in r.stages and "program_routes" in r.stages
        # t0 (train) reaches p2 (gen) over the circuit(s) the epoch has, and nothing else
        t0 = await kernel_routes(ns["t0"])
        assert set(t0) == {"10.2.0.0/24"}
        gateways = {g for g, _, _ in t0["10.2.0.0/24"]}
        assert gateways <= {"172.16.2.1", "172.16.2.2"}
        assert all(onlink for _, _, onlink in t0["10.2.0.0/24"])
        t2 = await kernel_routes(ns["t2"])
        assert set(t2) == {"10.0.0.0/24", "10.1.0.0/24"}

        await c.set_phase("training")
        assert set(await kernel_routes(ns["t0"])) == {"10.1.0.0/24"}
        assert await kernel_routes(ns["t2"]) == {}

        await c.set_phase("generation")
        for name in ns.values():
            assert await kernel_routes(name) == {}


async def test_a_route_failure_rolls_back_circuits_and_routes(routed: Fabric) -> None:
    ns = {t.name: t.netns for t in routed.wiring.tors}
    async with AsyncClient(routed.address, timeout_s=10) as c:
        good = await c.set_phase("training")
        before = await kernel_routes(ns["t0"])
        table = routed.ocs["o"].cross_connects()
        # an uplink of the gen pod's ToR disappears: routes over it cannot be installed
        await netns.run(["ip", "link", "del", "u0"], netns=ns["t2"])
        with pytest.raises(errors.FailedPrecondition) as info:
            await c.set_phase("weight-sync")
        assert "ToR 't2'" in str(info.value) and "u0" in str(info.value)
        assert routed.ocs["o"].cross_connects() == table
        assert await kernel_routes(ns["t0"]) == before
        assert (await c.get_phase()).epoch == good.epoch
