"""The testbed's OCS alone: circuits as tc redirects between the ports of a namespace.

Four "ToR" namespaces (``e0`` with 10.77.0.N/24) are cabled to ports 1..4 of an OCS
namespace. The tests assert behaviour: which pairs of ToRs can open a TCP connection,
what the kernel holds (read back independently with ``tc``), and what the switch
reports, after circuits are set, moved, refused, or a port goes down.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

import grpc
import pytest

from fabric_controller.drivers.ocs import GrpcOcsDriver
from orchestrrl import errors, grpcutil
from orchestrrl.v1 import optical_switch_pb2 as pb
from orchestrrl.v1 import optical_switch_pb2_grpc as pb_grpc
from sim_backends import netns
from sim_backends.ocs import SimulatedOcs
from sim_backends.ocs_server import serve
from sim_backends.tc_ocs import NetnsOcs, NetnsOcsDriver, TcCircuits

pytestmark = pytest.mark.netns

PORTS = 4
PROBE_PORT = 7100
NO_PATH_TIMEOUT_S = 0.5


@dataclass(frozen=True)
class Bench:
    ocs: str  # namespace with ports p1..p4
    tors: tuple[str, ...]  # namespace cabled to port i+1, address 10.77.0.(i+1)

    def ip(self, port: int) -> str:
        return f"10.77.0.{port}"


def _ip_batch(lines: list[str]) -> None:
    subprocess.run(["ip", "-force", "-batch", "-"], input="\n".join(lines), text=True, check=False)


@pytest.fixture(scope="module")
def bench(netns_ready: None) -> Iterator[Bench]:
    """Built once per module (a veth's link state settles only about a second after it
    is created); every test starts from ``clean`` state."""
    ocs = netns.unique_name("ocs")
    tors = tuple(netns.unique_name("tor") for _ in range(PORTS))
    lines = [f"netns add {ns}" for ns in (ocs, *tors)]
    lines += [
        f"link add e0 netns {tor} type veth peer name p{i + 1} netns {ocs}"
        for i, tor in enumerate(tors)
    ]
    try:
        _ip_batch(lines)
        for i, tor in enumerate(tors):
            address = f"10.77.0.{i + 1}/24"
            subprocess.run(["ip", "-n", tor, "addr", "add", address, "dev", "e0"], check=True)
        yield Bench(ocs, tors)
    finally:
        _ip_batch([f"netns delete {ns}" for ns in (ocs, *tors)])
        left = set(netns.namespaces_with_prefix(netns.PREFIX)) & {ocs, *tors}
        assert not left, f"namespaces left behind: {left}"


async def clean(bench: Bench) -> None:
    """No redirects, every link up (and reported up), an ingress qdisc on every port."""
    for i, tor in enumerate(bench.tors):
        await netns.run(["ip", "-n", tor, "link", "set", "lo", "up"])
        await netns.run(["ip", "-n", tor, "link", "set", "e0", "up"])
        await netns.run(["ip", "-n", bench.ocs, "link", "set", f"p{i + 1}", "up"])
        await netns.run(
            ["tc", "-n", bench.ocs, "filter", "del", "dev", f"p{i + 1}", "parent", "ffff:"],
            check=False,
        )
    await netns.wait_links_up(bench.ocs)
    for tor in bench.tors:
        await netns.wait_links_up(tor)


@pytest.fixture
async def switch(bench: Bench) -> AsyncIterator[NetnsOcs]:
    await clean(bench)
    backend = await NetnsOcs(SimulatedOcs("ocs0", PORTS), TcCircuits(bench.ocs, PORTS)).open()
    try:
        yield backend
    finally:
        await backend.close()


async def settled(switch: NetnsOcs, down: set[int]) -> set[int]:
    """The DOWN ports once they equal ``down`` (or after 30 s): link state lags."""
    for _ in range(600):
        await switch.refresh_health()
        now = {s.port for s in switch.ocs.port_states() if not s.up}
        if now == down:
            break
        await asyncio.sleep(0.05)
    return now


async def reachable(bench: Bench, a: int, b: int) -> bool:
    """Can the ToR on port ``a`` open a TCP connection to the one on port ``b``?"""
    python = sys.executable
    module = "sim_backends.testbed.tcp"
    bind = f"{bench.ip(b)}:{PROBE_PORT}"
    receiver = await asyncio.create_subprocess_exec(
        "ip", "netns", "exec", bench.tors[b - 1], python, "-m", module, "receive", "--bind", bind,
        stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        assert receiver.stdout is not None
        assert b"listening" in await receiver.stdout.readline()
        send = f"send --to {bind} --bytes 10000 --connect-timeout {NO_PATH_TIMEOUT_S}"
        sent = await netns.run(
            [python, "-m", module, *send.split()], netns=bench.tors[a - 1], check=False
        )
        return sent.returncode == 0 and json.loads(sent.stdout.splitlines()[-1])["bytes"] == 10000
    finally:
        if receiver.returncode is None:
            receiver.kill()
        await receiver.wait()


async def kernel_redirects(ns: str) -> dict[str, str]:
    """{from device: to device} as `tc` (not our code) reads the kernel."""
    found: dict[str, str] = {}
    for port in range(1, PORTS + 1):
        out = await netns.run(
            ["tc", "-n", ns, "-j", "filter", "show", "dev", f"p{port}", "ingress"]
        )
        for f in json.loads(out.stdout or "[]"):
            for action in f.get("options", {}).get("actions", []):
                if action.get("kind") == "mirred":
                    found[f"p{port}"] = action["to_dev"]
    return found


async def test_a_circuit_is_a_path_and_moving_it_moves_the_path(
    bench: Bench, switch: NetnsOcs
) -> None:
    await switch.apply([], [(1, 2)])
    assert await kernel_redirects(bench.ocs) == {"p1": "p2", "p2": "p1"}
    assert await reachable(bench, 1, 2)
    assert not await reachable(bench, 1, 3)

    moved = await switch.apply([(1, 2)], [(1, 3)])  # one batch moves port 1 to port 3
    assert moved.cross_connects == {(1, 3)}
    assert await kernel_redirects(bench.ocs) == {"p1": "p3", "p3": "p1"}
    assert await reachable(bench, 1, 3)
    assert not await reachable(bench, 1, 2)
    assert (await switch.circuits.programmed()).circuits == switch.ocs.cross_connects()

    await switch.apply([(1, 3)], [])
    assert await kernel_redirects(bench.ocs) == {}


async def test_an_invalid_batch_changes_neither_table_nor_kernel(
    bench: Bench, switch: NetnsOcs
) -> None:
    await switch.apply([], [(1, 2)])
    with pytest.raises(errors.InvalidArgument, match="port 2 is already connected to port 1"):
        await switch.apply([], [(3, 4), (2, 3)])
    assert switch.ocs.cross_connects() == {(1, 2)}
    assert await kernel_redirects(bench.ocs) == {"p1": "p2", "p2": "p1"}


async def test_a_kernel_refusal_mid_batch_is_undone_and_reported(
    bench: Bench, switch: NetnsOcs
) -> None:
    await switch.apply([], [(1, 2)])
    await netns.run(["tc", "-n", bench.ocs, "qdisc", "del", "dev", "p4", "ingress"])
    with pytest.raises(errors.FailedPrecondition) as info:
        await switch.apply([(1, 2)], [(1, 3), (2, 4)])  # (1, 3) goes in, then p4 refuses
    assert "the batch was undone" in str(info.value)
    assert "p4" in str(info.value)
    assert switch.ocs.cross_connects() == {(1, 2)}
    assert await kernel_redirects(bench.ocs) == {"p1": "p2", "p2": "p1"}
    assert await reachable(bench, 1, 2)
    assert not await reachable(bench, 1, 3)


async def test_port_health_is_the_link_state_of_its_veth(bench: Bench, switch: NetnsOcs) -> None:
    await netns.run(["ip", "-n", bench.ocs, "link", "set", "p3", "down"])  # the OCS side
    await netns.run(["ip", "-n", bench.tors[3], "link", "set", "e0", "down"])  # the ToR side
    assert await settled(switch, {3, 4}) == {3, 4}
    with pytest.raises(errors.InvalidArgument, match="port 3 is DOWN"):
        await switch.apply([], [(1, 3)])
    await netns.run(["ip", "-n", bench.ocs, "link", "set", "p3", "up"])
    await netns.run(["ip", "-n", bench.tors[3], "link", "set", "e0", "up"])
    assert await settled(switch, set()) == set()
    await switch.apply([], [(1, 3)])
    assert await reachable(bench, 1, 3)


async def test_a_restarted_switch_adopts_its_circuits_and_clears_strays(
    bench: Bench, switch: NetnsOcs
) -> None:
    await switch.apply([], [(1, 2)])
    half = "filter add dev p3 parent ffff: protocol all u32 match u32 0 0 action mirred"
    await netns.run(["tc", "-n", bench.ocs, *half.split(), "egress", "redirect", "dev", "p4"])
    # a half circuit, as a crash between programming the two directions would leave
    await switch.close()
    again = await NetnsOcs(SimulatedOcs("ocs0", PORTS), TcCircuits(bench.ocs, PORTS)).open()
    try:
        assert again.ocs.cross_connects() == {(1, 2)}
        assert await kernel_redirects(bench.ocs) == {"p1": "p2", "p2": "p1"}
    finally:
        await again.close()


async def test_a_repeated_request_id_is_answered_without_reprogramming(
    bench: Bench, switch: NetnsOcs
) -> None:
    first = await switch.apply([], [(1, 2)], request_id="r1")
    await netns.run(["tc", "-n", bench.ocs, "filter", "del", "dev", "p1", "parent", "ffff:"])
    again = await switch.apply([], [(1, 2)], request_id="r1")
    assert again.replayed and again.cross_connects == first.cross_connects
    assert await kernel_redirects(bench.ocs) == {"p2": "p1"}  # not re-applied
    with pytest.raises(errors.InvalidArgument, match="different batch"):
        await switch.apply([], [(3, 4)], request_id="r1")


async def test_missing_port_devices_are_named(bench: Bench, switch: NetnsOcs) -> None:
    circuits = TcCircuits(bench.ocs, 6)
    with pytest.raises(
        errors.FailedPrecondition, match=r"lacks 2 of its 6 port devices \(p5, p6\)"
    ):
        await circuits.open()


async def test_the_grpc_switch_in_netns_mode(bench: Bench, switch: NetnsOcs) -> None:
    running, _ = await serve("127.0.0.1:0", dataplane=switch, fault_injection=True)
    driver = GrpcOcsDriver("ocs0", running.address)
    try:
        assert (await driver.info()).backend == "netns"
        assert await driver.apply([], [(1, 2), (3, 4)], request_id="g1") == {(1, 2), (3, 4)}
        assert await kernel_redirects(bench.ocs) == {"p1": "p2", "p2": "p1", "p3": "p4", "p4": "p3"}

        async with grpcutil.insecure_channel(running.address) as channel:
            faults = pb_grpc.OcsFaultInjectionStub(channel)
            await faults.FailNextApply(pb.FailNextApplyRequest(message="optics jammed"), timeout=5)
            with pytest.raises(errors.FailedPrecondition, match="optics jammed"):
                await driver.apply([(3, 4)], [])
            assert await driver.cross_connects() == {(1, 2), (3, 4)}

            await faults.SetPortHealth(pb.SetPortHealthRequest(port=4, up=False), timeout=5)
            link = await netns.run(["ip", "-n", bench.ocs, "-j", "link", "show", "p4"])
            assert "UP" not in json.loads(link.stdout)[0]["flags"]
            pairs, down = await driver.snapshot()
            assert pairs == {(1, 2), (3, 4)} and down == {4}

            stub = pb_grpc.OpticalSwitchStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.ApplyCrossConnects(
                    pb.ApplyCrossConnectsRequest(
                        disconnect=[pb.CrossConnect(a=3, b=4)],
                        connect=[pb.CrossConnect(a=2, b=4)],
                    ),
                    timeout=5,
                )
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "port 4 is DOWN" in (info.value.details() or "")
    finally:
        await driver.close()
        await running.stop(grace=0)


async def test_the_in_process_driver_follows_the_ocs_protocol(
    bench: Bench, switch: NetnsOcs
) -> None:
    driver = NetnsOcsDriver(switch)
    assert await driver.apply([], [(2, 3)]) == {(2, 3)}
    await netns.run(["ip", "-n", bench.ocs, "link", "set", "p1", "down"])
    assert await settled(switch, {1}) == {1}
    pairs, down = await driver.snapshot()
    assert pairs == {(2, 3)} and down == {1}
    assert await reachable(bench, 2, 3)


async def test_the_fence_is_not_jammed_by_an_empty_or_refused_batch(
    bench: Bench, switch: NetnsOcs
) -> None:
    await switch.apply([], [(1, 2)], fencing_token=8)
    with pytest.raises(errors.InvalidArgument, match=r"at most 1099511627776 .* ahead"):
        await switch.apply([], [], fencing_token=2**63)
    await switch.apply([], [], fencing_token=8 + 2**40)  # empty: carried out, not recorded
    with pytest.raises(errors.InvalidArgument):
        await switch.apply([], [(2, 3)], fencing_token=9)  # refused: not recorded either
    assert switch.ocs.fencing.newest == 8
    await switch.apply([(1, 2)], [(1, 3)], fencing_token=8)  # the real leader goes on
    assert await kernel_redirects(bench.ocs) == {"p1": "p3", "p3": "p1"}
    await switch.apply([(1, 3)], [], fencing_token=9)  # the next leader
    with pytest.raises(errors.FailedPrecondition, match="older than the newest seen, 9"):
        await switch.apply([], [(1, 2)], fencing_token=8)  # the deposed one changes nothing
    assert await kernel_redirects(bench.ocs) == {}
    # a batch the kernel refuses half-way is undone, and its token is not recorded
    await netns.run(["tc", "-n", bench.ocs, "qdisc", "del", "dev", "p4", "ingress"])
    with pytest.raises(errors.FailedPrecondition, match="the batch was undone"):
        await switch.apply([], [(1, 3), (2, 4)], fencing_token=10)
    assert switch.ocs.fencing.newest == 9 and await kernel_redirects(bench.ocs) == {}
