"""The testbed end to end: `orl-testbed up` on the 8-node example, the real controller
and agents, and real TCP transfers through the circuits the controller sets.

Built once for the module (about ten seconds) at 1:4000 (a 400 Gb/s circuit is a
100 Mb/s tbf), torn down in the finalizer, which also checks that nothing with the
testbed's prefix is left. Each test sets the phase it needs first.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from orchestrrl import errors
from orchestrrl import wiring as wiring_mod
from orchestrrl.client import AsyncClient, CircuitView
from orchestrrl.model import Phase
from sim_backends import netns
from sim_backends.testbed import traffic
from sim_backends.testbed.plan import TestbedPlan
from sim_backends.testbed.state import ENV_MARKER, marked_pids, require

pytestmark = pytest.mark.netns

EXAMPLE = Path(__file__).parents[2] / "examples" / "local-8node.toml"
SCALE = 4000.0  # 400 Gb/s -> 100 Mb/s
CIRCUIT_MBPS = 100.0
PROBE_BYTES = 12_500_000  # one second on a circuit
FAILOVER_TIMEOUT_S = 15.0  # the controller checks the switches every 2 s


def bed_id(pid: int) -> str:
    """``zt<pid in base 36>``: unique per test process, recognisable when it is dead."""
    digits = "0123456789abcdefghijklmnopqrstuvwxyz"
    out = ""
    while True:
        pid, r = divmod(pid, 36)
        out = digits[r] + out
        if not pid:
            return f"zt{out}"


def cli(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        [sys.executable, "-m", "sim_backends.testbed.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
    if check and result.returncode:
        raise AssertionError(
            f"orl-testbed {' '.join(args)} exited {result.returncode}:\n"
            f"{result.stdout}\n{result.stderr}"
        )
    return result


def remove_dead_test_testbeds() -> None:
    """Testbeds of test processes that were killed before their finalizer ran."""
    ids = {ns.split("-", 1)[0] for ns in netns.namespaces_with_prefix("zt")}
    for tid in sorted(ids):
        try:
            pid = int(tid[2:], 36)
        except ValueError:
            continue
        if not Path(f"/proc/{pid}").exists():
            cli("down", "--id", tid, check=False)


@pytest.fixture(scope="module")
def bed(netns_ready: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestbedPlan]:
    remove_dead_test_testbeds()
    tid = bed_id(os.getpid())
    run_dir = tmp_path_factory.mktemp("testbed") / "run"
    try:
        args = ["--wiring", str(EXAMPLE), "--id", tid, "--run-dir", str(run_dir)]
        up = cli("up", *args, "--scale", f"{SCALE:g}", "--json")
        assert json.loads(up.stdout)["timings"]["up_s"] < 30.0
        yield require(run_dir, tid).plan
    finally:
        down = cli("down", "--id", tid, "--run-dir", str(run_dir), "--json", check=False)
        assert down.returncode == 0, down.stderr
        assert not netns.namespaces_with_prefix(f"{tid}-"), "namespaces left behind"
        links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
        assert f"{tid}-" not in links, "host interfaces left behind"
        assert not marked_pids(tid), f"processes with {ENV_MARKER}={tid} left behind"
        assert not run_dir.exists()


async def set_phase(plan: TestbedPlan, phase: Phase) -> list[CircuitView]:
    async with AsyncClient(plan.controller, timeout_s=30.0) as client:
        await client.set_phase(phase)
        return (await client.get_phase()).circuits


async def probe(plan: TestbedPlan, source: str, target: str) -> traffic.Result:
    """One TCP stream of PROBE_BYTES (iperf3 when installed)."""
    circuits = await traffic.committed_circuits(plan)
    report = await traffic.run_transfers(
        plan, [traffic.Transfer(source, target, PROBE_BYTES)], circuits=circuits, timeout_s=30
    )
    return report.results[0]


async def ocs_table(plan: TestbedPlan) -> set[tuple[int, int]]:
    """The circuits the OCS namespace really forwards, read with `tc` (not our code)."""
    ns = plan.ocses[0].netns
    redirects: dict[int, int] = {}
    for port in range(1, plan.ocses[0].ports + 1):
        out = await netns.run(
            ["tc", "-n", ns, "-j", "filter", "show", "dev", f"p{port}", "ingress"]
        )
        for f in json.loads(out.stdout or "[]"):
            for action in f.get("options", {}).get("actions", []):
                if action.get("kind") == "mirred":
                    redirects[port] = int(action["to_dev"].removeprefix("p"))
    assert all(redirects.get(b) == a for a, b in redirects.items()), redirects
    return {(a, b) for a, b in redirects.items() if a < b}


async def tor_next_hops(plan: TestbedPlan, tor: str, pod: str) -> set[str]:
    """Devices of the ToR's route to the pod's prefix, as iproute2 reads the kernel."""
    ns = next(t.netns for t in plan.tors if t.name == tor)
    prefix = plan.wiring.pod(pod).prefix
    out = await netns.run(["ip", "-n", ns, "-j", "route", "show", prefix])
    routes = json.loads(out.stdout or "[]")
    return {h["dev"] for r in routes for h in r.get("nexthops", [r]) if "dev" in h}


def pairs(circuits: list[CircuitView]) -> set[tuple[int, int]]:
    return {(c.a, c.b) for c in circuits}


async def test_up_makes_every_element_a_namespace_and_the_controller_sees_a_cluster(
    bed: TestbedPlan,
) -> None:
    names = set(netns.namespaces_with_prefix(f"{bed.id}-"))
    assert names == set(bed.namespaces())
    assert len(names) == 8 + 4 + 1  # nodes, ToRs, one OCS
    reread = wiring_mod.load(Path(bed.run_dir) / "wiring.toml")  # what the controller loaded
    assert all(t.netns and all(u.ip and u.device for u in t.uplinks) for t in reread.tors)
    assert all(p.prefix for p in reread.pods)
    async with AsyncClient(bed.controller, timeout_s=10.0) as client:
        nodes = await client.nodes()
    assert {n.node for n in nodes if n.health == "up"} == {n.name for n in bed.nodes}


async def test_circuits_set_by_the_controller_are_exactly_the_forwarding_paths(
    bed: TestbedPlan,
) -> None:
    circuits = await set_phase(bed, Phase.TRAINING)
    assert await ocs_table(bed) == pairs(circuits)
    assert {(c.pod_a, c.pod_b) for c in circuits} == {("train0", "train1")}
    assert (await probe(bed, "train0-n0", "train1-n0")).ok
    blocked = await probe(bed, "train0-n0", "gen0-n0")
    assert not blocked.ok and "unreachable" in blocked.error.lower()

    circuits = await set_phase(bed, Phase.WEIGHT_SYNC)
    assert await ocs_table(bed) == pairs(circuits)
    assert {tuple(sorted((c.pod_a, c.pod_b))) for c in circuits} == {
        ("gen0", "train0"),
        ("gen0", "train1"),
        ("gen1", "train0"),
        ("gen1", "train1"),
    }
    assert (await probe(bed, "train1-n1", "gen1-n0")).ok
    assert not (await probe(bed, "train0-n0", "train1-n0")).ok  # its circuits moved
    assert not (await probe(bed, "gen0-n0", "gen1-n0")).ok  # never a circuit


async def test_after_weight_sync_train_to_gen_reaches_the_circuit_capacity(
    bed: TestbedPlan,
) -> None:
    await set_phase(bed, Phase.WEIGHT_SYNC)
    result = await probe(bed, "train0-n0", "gen0-n0")
    assert result.ok, result.error
    assert result.capacity_mbps == CIRCUIT_MBPS  # one stream rides one circuit
    assert result.mbps >= 0.8 * CIRCUIT_MBPS, f"{result.mbps:.1f} Mb/s"


async def test_switching_back_drops_train_to_gen_as_the_planner_intended(
    bed: TestbedPlan,
) -> None:
    await set_phase(bed, Phase.WEIGHT_SYNC)
    assert await tor_next_hops(bed, "tor-train0", "gen0")
    circuits = await set_phase(bed, Phase.TRAINING)
    assert not any({"gen0", "gen1"} & {c.pod_a, c.pod_b} for c in circuits)
    assert await tor_next_hops(bed, "tor-train0", "gen0") == set()
    result = await probe(bed, "train0-n0", "gen0-n0")
    assert not result.ok and result.mbps == 0.0
    assert (await probe(bed, "train0-n1", "train1-n1")).ok  # what training gets instead


async def test_a_failed_ocs_port_is_detected_and_routed_around(bed: TestbedPlan) -> None:
    circuits = await set_phase(bed, Phase.WEIGHT_SYNC)
    tor = bed.wiring.tor("tor-train0")
    port_of = {u.ocs_port: u.interface for u in tor.uplinks}
    victim = next(c for c in circuits if {c.pod_a, c.pod_b} == {"train0", "gen0"})
    dead = victim.a if victim.a in port_of else victim.b
    assert port_of[dead] in await tor_next_hops(bed, "tor-train0", "gen0")
    ocs_ns = bed.ocses[0].netns
    await netns.run(["ip", "-n", ocs_ns, "link", "set", f"p{dead}", "down"])
    try:
        async with AsyncClient(bed.controller, timeout_s=10.0) as client:
            for _ in range(int(FAILOVER_TIMEOUT_S / 0.25)):
                now = await client.get_phase()
                if not any(dead in (c.a, c.b) for c in now.circuits):
                    break
                await asyncio.sleep(0.25)
        assert not any(dead in (c.a, c.b) for c in now.circuits), "not re-planned"
        assert now.phase == Phase.WEIGHT_SYNC.value
        assert await ocs_table(bed) == pairs(now.circuits)
        hops = await tor_next_hops(bed, "tor-train0", "gen0")
        assert hops and port_of[dead] not in hops
        result = await probe(bed, "train0-n0", "gen0-n0")
        assert result.ok, result.error
    finally:
        await netns.run(["ip", "-n", ocs_ns, "link", "set", f"p{dead}", "up"])


async def test_an_id_in_use_is_refused_and_nothing_changes(
    bed: TestbedPlan, tmp_path: Path
) -> None:
    before = netns.namespaces_with_prefix(f"{bed.id}-")
    args = ["--wiring", str(EXAMPLE), "--id", bed.id, "--run-dir", str(tmp_path / "x")]
    again = cli("up", *args, check=False)
    assert again.returncode == 1
    assert f"testbed id {bed.id!r} is already in use" in again.stderr
    assert "nothing was created" in again.stderr
    assert netns.namespaces_with_prefix(f"{bed.id}-") == before
    assert not (tmp_path / "x").exists()


async def test_status_shows_what_exists(bed: TestbedPlan) -> None:
    out = cli("status", "--id", bed.id, "--run-dir", bed.run_dir, "--json")
    status = json.loads(out.stdout)
    assert status["ready"] and set(status["namespaces"]) == set(bed.namespaces())
    assert all(status["processes"].values()) and len(status["processes"]) == 10
    assert "epoch" in status["fabric"]


async def test_weight_sync_follows_the_planner_and_reports_against_the_ideal(
    bed: TestbedPlan,
) -> None:
    await set_phase(bed, Phase.WEIGHT_SYNC)
    ws = await traffic.weight_sync(bed, 20_000_000, timeout_s=60)
    assert ws.traffic.ok
    assert ws.mode == "p2p" and ws.senders == 4 and ws.receivers == 4
    assert len(ws.traffic.results) == 16
    assert sum(r.nbytes for r in ws.traffic.results) == 4 * 20_000_000  # every node a copy
    assert 0 < ws.ideal_s < ws.completion_s
    await set_phase(bed, Phase.GENERATION)
    with pytest.raises(errors.FailedPrecondition, match="no circuit for"):
        await traffic.weight_sync(bed, 20_000_000)


async def test_a_checkpoint_crosses_the_weight_sync_circuits_and_only_them(
    bed: TestbedPlan,
) -> None:
    """Every generation agent fetches the training agent's checkpoint from its data
    address: with the weight-sync circuits the bytes leave the OCS ports toward the
    generation pods; without them (the slack gate keeps the generation topology) no byte
    crosses the OCS and every node keeps its version."""
    from orchestrrl import checkpoint
    from sim_backends.testbed import weights

    await set_phase(bed, Phase.GENERATION)
    path = await asyncio.to_thread(weights.publish, bed, "train0-n0", "1", 4_000_000)
    size = checkpoint.verify(path).manifest.size

    kept = await weights.checkpoint_sync(bed, "1", "train0-n0", idle_window_ms=1, timeout_s=6)
    assert kept.change.gated and kept.change.phase == "generation"
    assert not kept.complete and len(kept.nodes) == 4
    # no path: the packets to the training node's data address go nowhere
    assert all(not n.ok and "for the manifest (no answer)" in n.error for n in kept.nodes)
    assert all(n.version == "0" for n in kept.change.weight_sync.nodes)  # type: ignore[union-attr]
    assert kept.ocs_bytes == 0  # nothing crossed any circuit: there was none to cross

    done = await weights.checkpoint_sync(bed, "1", "train0-n0", timeout_s=60)
    assert done.complete and done.change.phase == "weight-sync", done.change.weight_sync
    assert done.fetched_bytes == 4 * size
    assert all(n.ok and n.circuits == 4 and n.capacity_mbps > 0 for n in done.nodes)
    # the bytes went out of the circuits' ports toward the generation pods (with the
    # TCP/IP, HTTP/2 and gRPC headers, and nothing else of that size)
    assert done.fetched_bytes <= done.circuit_bytes < 1.2 * done.fetched_bytes
    assert done.circuit_bytes <= done.ocs_bytes
