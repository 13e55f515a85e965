"""The testbed's plan (pure): what `orl-testbed up` would build from a wiring, the
augmented wiring the controller loads, the batches that build it, and whether it fits."""

from __future__ import annotations

import dataclasses
import ipaddress
from pathlib import Path

import pytest

from orchestrrl import errors
from orchestrrl import wiring as wiring_mod
from orchestrrl.model import Wiring
from sim_backends.synthetic import synthetic_wiring
from sim_backends.testbed import resources
from sim_backends.testbed.plan import (
    Scale,
    TestbedPlan,
    commands,
    free_subnet,
    make_plan,
    prefixlen_for,
    tbf,
)

pytestmark = pytest.mark.unit

MGMT = ipaddress.IPv4Network("10.255.0.0/24")
RUN = Path("/run/orchestrrl-testbed/tb")


def plan_of(w: Wiring, **kwargs: object) -> TestbedPlan:
    return make_plan(w, testbed_id="tb", run_dir=RUN, mgmt=MGMT, **kwargs)  # type: ignore[arg-type]


def test_every_element_is_a_namespace_named_after_it(example_wiring: Wiring) -> None:
    plan = plan_of(example_wiring)
    assert set(plan.namespaces()) == {
        "tb-ocs0",
        *(f"tb-tor-{p}" for p in ("train0", "train1", "gen0", "gen1")),
        *(f"tb-{n.name}" for n in example_wiring.nodes),
    }
    assert plan.root_links() == ("tb-br", *(f"tb-m{i}" for i in range(8)))
    kinds = [link.kind for link in plan.links]
    assert (kinds.count("uplink"), kinds.count("data"), kinds.count("mgmt")) == (32, 8, 8)


def test_capacities_are_the_wirings_scaled_down(example_wiring: Wiring) -> None:
    plan = plan_of(example_wiring, scale=Scale(4000))
    rates = {link.kind: link.mbps for link in plan.links}
    assert rates == {"uplink": 100.0, "data": 800.0, "mgmt": None}  # 8 x 400 Gb/s per node
    assert plan.scale.describe() == "1:4000 (400 Gb/s -> 100 Mb/s)"
    assert tbf(100.0) == "rate 100000kbit burst 65536 latency 50ms"
    assert tbf(800.0) == "rate 800000kbit burst 200000 latency 50ms"  # 2 ms at rate


def test_the_augmented_wiring_routes_every_pod(example_wiring: Wiring) -> None:
    plan = plan_of(example_wiring)
    w = plan.wiring
    again = wiring_mod.parse(wiring_mod.to_toml(w))
    assert again == w  # the file the controller loads says the same
    prefixes = [ipaddress.ip_network(p.prefix) for p in w.pods]
    assert len(set(prefixes)) == 4 and not any(p.overlaps(MGMT) for p in prefixes)
    ups = [u for t in w.tors for u in t.uplinks]
    assert len({u.ip for u in ups}) == 32
    assert not any(ipaddress.ip_address(u.ip) in p for u in ups for p in prefixes)
    assert all(t.netns == f"tb-{t.name}" for t in w.tors)
    assert {u.interface for u in w.tor("tor-gen1").uplinks} == {f"up{i}" for i in range(8)}
    assert w.controller == "10.255.0.1:50051" and w.ocs("ocs0").address == "10.255.0.1:50061"
    assert {n.agent for n in w.nodes} == {f"10.255.0.{i}:50101" for i in range(2, 10)}

    # the cabling is the user's: same pods, nodes, NICs and OCS ports
    def cabling(x: Wiring) -> object:
        tors = [(t.name, t.pod, [(u.port, u.ocs, u.ocs_port) for u in t.uplinks]) for t in x.tors]
        return ([p.name for p in x.pods], [(n.name, n.nics) for n in x.nodes], tors)

    assert cabling(w) == cabling(example_wiring)


def test_nodes_sit_behind_their_tors_gateway(example_wiring: Wiring) -> None:
    plan = plan_of(example_wiring)
    for node in plan.nodes:
        prefix = ipaddress.ip_network(plan.wiring.pod(node.pod).prefix)
        tor = next(t for t in plan.tors if t.name == node.tor)
        assert ipaddress.ip_address(node.ip) in prefix
        assert tor.gateway == f"{node.gateway}/{prefix.prefixlen}"
        assert node.device == "eth0"  # its first NIC's name
    assert len({n.ip for n in plan.nodes}) == 8


def test_the_wirings_own_addresses_and_devices_are_kept(example_wiring: Wiring) -> None:
    tor = example_wiring.tor("tor-train0")
    first = dataclasses.replace(tor.uplinks[0], device="uplink-a", ip="192.168.7.1")
    tors = tuple(
        dataclasses.replace(t, uplinks=(first, *t.uplinks[1:])) if t is tor else t
        for t in example_wiring.tors
    )
    pods = tuple(
        dataclasses.replace(p, prefix="10.200.0.0/24") if p.name == "gen1" else p
        for p in example_wiring.pods
    )
    w = dataclasses.replace(example_wiring, tors=tors, pods=pods)
    plan = plan_of(w)
    assert plan.wiring.tor("tor-train0").uplinks[0].interface == "uplink-a"
    assert plan.wiring.tor("tor-train0").uplinks[0].ip == "192.168.7.1"
    assert plan.wiring.pod("gen1").prefix == "10.200.0.0/24"


def test_the_batches_build_the_plan(example_wiring: Wiring) -> None:
    plan = plan_of(example_wiring)
    cmds = commands(plan)
    assert cmds.netns.count("netns add tb-") == 13
    assert "link add tb-br type bridge" in cmds.host
    assert "link add up0 netns tb-tor-train0 type veth peer name p1 netns tb-ocs0" in cmds.host
    assert "link add mg0 netns tb-gen1-n1 type veth peer name tb-m7" in cmds.host
    assert "link set tb-m7 master tb-br" in cmds.host
    tor = cmds.inside["tb-tor-train0"]
    assert "link set p0 master br0" in tor and "link set p8 master br0" in tor
    assert "addr add 10.0.0.1/24 dev br0" in tor
    node = cmds.inside["tb-train0-n1"]
    assert "route add default via 10.0.0.1 dev eth0" in node
    assert cmds.shaping["tb-ocs0"].count("root tbf rate 100000kbit") == 32
    assert "net.ipv4.ip_forward=1" in cmds.sysctls["tb-tor-gen0"]
    assert "net.ipv4.conf.all.rp_filter=0" in cmds.sysctls["tb-tor-gen0"]
    assert "net.ipv4.ip_forward=1" not in cmds.sysctls["tb-gen0-n0"]


def test_the_daemons_find_each_other_on_the_management_network(example_wiring: Wiring) -> None:
    plan = plan_of(example_wiring)
    roles = [d.role for d in plan.daemons]
    assert roles == ["ocs", "controller", *["agent"] * 8]
    ocs, controller, agent = plan.daemons[0], plan.daemons[1], plan.daemons[2]
    assert list(ocs.argv[ocs.argv.index("--netns") :][:2]) == ["--netns", "tb-ocs0"]
    assert "--plaintext" in ocs.argv and "--plaintext" in controller.argv
    assert str(RUN / "wiring.toml") in controller.argv
    assert agent.argv[:4] == ("ip", "netns", "exec", "tb-train0-n0")
    assert "10.255.0.1:50051" in agent.argv and "eth0=3200" in agent.argv


def test_what_the_testbed_cannot_model_is_listed_at_once(example_wiring: Wiring) -> None:
    w = example_wiring
    extra = dataclasses.replace(w.tor("tor-gen0"), name="gen0-n0", uplinks=())
    bare = dataclasses.replace(w.node("gen1-n1"), nics=())
    odd = dataclasses.replace(
        w,
        tors=(*w.tors, extra),
        nodes=tuple(bare if n.name == "gen1-n1" else n for n in w.nodes),
    )
    with pytest.raises(errors.InvalidArgument) as info:
        plan_of(odd)
    text = str(info.value)
    assert "pod 'gen0' has 2 ToRs" in text
    assert "node 'gen1-n1' has no NICs" in text
    assert "node 'gen0-n0': a ToR has the same name" in text


def test_ids_and_pod_prefixes_are_checked(example_wiring: Wiring) -> None:
    with pytest.raises(errors.InvalidArgument, match="--id='has-dash'"):
        make_plan(example_wiring, testbed_id="has-dash", run_dir=RUN, mgmt=MGMT)
    pods = tuple(dataclasses.replace(p, prefix="10.255.0.0/28") for p in example_wiring.pods[:1])
    w = dataclasses.replace(example_wiring, pods=(*pods, *example_wiring.pods[1:]))
    with pytest.raises(errors.InvalidArgument, match=r"overlaps the management 10\.255\.0\.0/24"):
        plan_of(w)


def test_addresses_are_allocated_where_nothing_else_is() -> None:
    used = [ipaddress.IPv4Network("10.255.0.0/24"), ipaddress.IPv4Network("10.255.1.0/25")]
    pool = ipaddress.IPv4Network("10.255.0.0/16")
    assert free_subnet(pool, 24, used) == ipaddress.IPv4Network("10.255.2.0/24")
    assert prefixlen_for(9) == 24 and prefixlen_for(300) == 23 and prefixlen_for(4097) == 19


def test_a_wiring_too_large_for_the_machine_says_what_is_missing() -> None:
    plan = make_plan(
        synthetic_wiring(512, nodes_per_pod=64),
        testbed_id="tb",
        run_dir=RUN,
        mgmt=ipaddress.IPv4Network("10.255.0.0/22"),
    )
    small = resources.Machine(
        cpus=2,
        mem_available_mb=8000,
        netns_in_use=0,
        max_netns=100,
        free_pids=30000,
        euid=1000,
        missing_tools=("tc",),
    )
    problems = resources.check(plan, small)
    assert len(problems) == 5
    assert problems[0].startswith("the testbed needs root")
    assert "missing commands: tc" in problems[1]
    assert problems[2].startswith("memory: 514 daemons (64 MB each)")
    assert problems[3].startswith("namespaces: 521 are needed but only 100 more are allowed")
    assert problems[4].startswith("cpu: starting 514 daemons takes about 154 s")
    roomy = dataclasses.replace(small, mem_available_mb=1e6, max_netns=10**5, euid=0, cpus=64)
    assert resources.check(plan, dataclasses.replace(roomy, missing_tools=())) == []
