"""ApplyRoutes and ConfigureRoce over real gRPC (127.0.0.1:0) against the agent's
servicer, programming a throwaway namespace and a throwaway veth (root only)."""

from __future__ import annotations

import os
import shutil
from collections.abc import AsyncIterator, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, cast

import grpc
import pytest

from node_agent.commands import CommandLog
from node_agent.nics import SysfsNics
from node_agent.roce import RoceConfigurator
from node_agent.routes import HostRoutes, request_from_pb
from node_agent.servicer import SERVICE_NAME, NodeAgentService
from node_agent.telemetry import Collector
from orchestrrl import errors, grpcutil
from orchestrrl.netlink import Netlink
from orchestrrl.routing import RuleChange, RuleSpec
from orchestrrl.v1 import node_agent_pb2 as pb
from orchestrrl.v1 import node_agent_pb2_grpc as pb_grpc
from sim_backends import netns
from sim_backends.engine import SimulatedEngine
from sim_backends.gpus import SimulatedGpus
from tests.netns.helpers import GATEWAYS_V4, Switch, kernel_routes, owned_routes

if TYPE_CHECKING:
    from orchestrrl.v1.node_agent_pb2_grpc import NodeAgentAsyncStub

pytestmark = pytest.mark.netns

TIMEOUT = 10.0


@pytest.fixture
async def stub(tmp_path: Path, netns_ready: None) -> AsyncIterator[NodeAgentAsyncStub]:
    engine = SimulatedEngine(8, (2, 2, 2, 2), seed=1)
    collector = Collector("gen0-n0", SimulatedGpus(8, seed=1), SysfsNics([], root=tmp_path), engine)
    await collector.open()
    commands = CommandLog()
    servicer = NodeAgentService(
        collector, engine, commands, 0.05, routes=HostRoutes(), roce=RoceConfigurator()
    )
    running = await grpcutil.start_server(
        "127.0.0.1:0",
        lambda server: pb_grpc.add_NodeAgentServicer_to_server(servicer, server),
        [SERVICE_NAME],
    )
    try:
        async with grpcutil.insecure_channel(running.address) as channel:
            yield cast("NodeAgentAsyncStub", pb_grpc.NodeAgentStub(channel))
    finally:
        await running.stop(grace=0)
        await commands.close()


def request(
    command_id: str, ns: str, *routes: pb.Route, prune: bool = True
) -> pb.ApplyRoutesRequest:
    return pb.ApplyRoutesRequest(
        command_id=command_id,
        netns=ns,
        routes=routes,
        rules=[pb.PolicyRule(priority=500, source="10.8.0.0/24", table=100)],
        prune=prune,
    )


ECMP = pb.Route(destination="10.40.0.0/16", gateways=list(GATEWAYS_V4))
LOCAL = pb.Route(destination="10.41.0.0/24", device="p1", table=100)


async def failure(call: object) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call  # type: ignore[misc]
    return info.value.code(), info.value.details() or ""


async def test_apply_routes_programs_a_namespace(stub: NodeAgentAsyncStub, switch: Switch) -> None:
    reply = await stub.ApplyRoutes(request("a1", switch.netns, ECMP, LOCAL), timeout=TIMEOUT)
    assert (reply.command_id, reply.added, reply.removed, reply.unchanged) == ("a1", 3, 0, 0)
    assert [(r.destination, list(r.gateways), r.device, r.table) for r in reply.routes] == [
        ("10.41.0.0/24", [], "p1", 100),  # sorted by family, table, prefix
        ("10.40.0.0/16", list(GATEWAYS_V4), "p0", 254),
    ]
    assert [(r.priority, r.source, r.table) for r in reply.rules] == [(500, "10.8.0.0/24", 100)]
    assert await owned_routes(switch.netns) == {
        ("10.40.0.0/16", GATEWAYS_V4, "p0", "main", 0),
        ("10.41.0.0/24", (), "p1", "100", 0),
    }
    again = await stub.ApplyRoutes(request("a2", switch.netns, ECMP, LOCAL), timeout=TIMEOUT)
    assert (again.added, again.removed, again.unchanged) == (0, 0, 3)


async def test_a_repeated_command_id_is_answered_without_reapplying(
    stub: NodeAgentAsyncStub, switch: Switch
) -> None:
    first = await stub.ApplyRoutes(request("b1", switch.netns, ECMP), timeout=TIMEOUT)
    await netns.run(["ip", "-n", switch.netns, "route", "del", "10.40.0.0/16"])
    replay = await stub.ApplyRoutes(request("b1", switch.netns, ECMP), timeout=TIMEOUT)
    assert replay == first
    assert await owned_routes(switch.netns) == set()  # the replay did not run again
    fresh = await stub.ApplyRoutes(request("b2", switch.netns, ECMP), timeout=TIMEOUT)
    assert fresh.added == 1 and len(await owned_routes(switch.netns)) == 1


@pytest.mark.parametrize(
    ("route", "command_id", "details"),
    [
        (
            pb.Route(destination="10.40.0.300/16", gateways=["10.9.0.2"]),
            "c1",
            "routes[1].destination=",
        ),
        (pb.Route(destination="10.42.0.0/16", device="eth9"), "c2", "device='eth9' is not valid"),
        (ECMP, "", "command_id='' is not valid"),
    ],
)
async def test_bad_requests_are_invalid_and_change_nothing(
    stub: NodeAgentAsyncStub, switch: Switch, route: pb.Route, command_id: str, details: str
) -> None:
    before = await kernel_routes(switch.netns)
    call = stub.ApplyRoutes(request(command_id, switch.netns, LOCAL, route), timeout=TIMEOUT)
    code, message = await failure(call)
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert details in message
    assert await kernel_routes(switch.netns) == before
    rules = await netns.run(["ip", "-n", switch.netns, "rule", "show"])
    assert "500:" not in rules.stdout


async def test_an_unknown_namespace_is_invalid(stub: NodeAgentAsyncStub) -> None:
    call = stub.ApplyRoutes(request("d1", netns.unique_name("missing"), ECMP), timeout=TIMEOUT)
    code, message = await failure(call)
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert "no such network namespace" in message


async def test_configure_roce_on_a_veth_is_not_applied_and_says_why(
    stub: NodeAgentAsyncStub, testbed: netns.Testbed
) -> None:
    name = f"orlt{os.getpid() % 100000}r"
    await testbed.veth(name, name + "p")  # in the root namespace, where sysfs shows it
    nic = pb.RoceSettings(
        interface=name, mtu=9000, dscp_trust=True, pfc_priorities=[3], ecn=True, traffic_class=106
    )
    reply = await stub.ConfigureRoce(
        pb.ConfigureRoceRequest(command_id="r1", nics=[nic]), timeout=TIMEOUT
    )
    (result,) = reply.results
    assert not result.applied
    # without iproute2's dcb the reason is "dcb: command not found (install iproute2)"
    reason = "Operation not supported" if shutil.which("dcb") else "dcb: command not found"
    assert [entry.split(" (install")[0] for entry in result.unsupported] == [
        f"dcb app: {reason}",
        f"dcb pfc: {reason}",
        f"ecn sysfs: /sys/class/net/{name}/ecn missing",
        f"traffic class: no RDMA device (/sys/class/net/{name}/device/infiniband missing)",
    ]
    assert result.read_back.mtu == 9000  # the one thing a veth can do was done
    assert "set and read back mtu 9000" in result.message
    shown = await netns.run(["ip", "link", "show", name])
    assert "mtu 9000" in shown.stdout

    code, message = await failure(
        stub.ConfigureRoce(
            pb.ConfigureRoceRequest(command_id="r2", nics=[pb.RoceSettings(interface="nope0")]),
            timeout=TIMEOUT,
        )
    )
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert "nics[0].interface='nope0' is not valid" in message


class FailingRules(Netlink):
    """A netlink adapter whose rule changes fail (after the routes were applied)."""

    async def ensure_rules(self, desired: Iterable[RuleSpec], prune: bool) -> RuleChange:
        raise errors.FailedPrecondition("rules refused (test)")


@pytest.mark.parametrize(
    "routes",
    [(LOCAL,), (ECMP, LOCAL)],  # a change (one route pruned), or none (the same routes)
)
async def test_routes_are_put_back_when_the_rules_fail(
    switch: Switch, routes: tuple[pb.Route, ...]
) -> None:
    first = request_from_pb(request("r1", switch.netns, ECMP, LOCAL))
    await HostRoutes().apply(first)
    before = await kernel_routes(switch.netns)
    with pytest.raises(errors.FailedPrecondition, match="rules refused"):
        await HostRoutes(FailingRules).apply(request_from_pb(request("r2", switch.netns, *routes)))
    assert await kernel_routes(switch.netns) == before
