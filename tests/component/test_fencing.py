"""Fencing tokens in the southbound: the simulated OCS and the node agent refuse a
command stamped with a token older than the newest they have seen, over real gRPC;
token 0 (no HA) is admitted as before fencing existed, until a leader's token has been
seen: from then on it is refused too (issue 28)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import grpc
import pytest

from node_agent.commands import CommandLog
from node_agent.nics import SysfsNics
from node_agent.routes import HostRoutes, RoutesRequest, RoutesResult
from node_agent.servicer import SERVICE_NAME, NodeAgentService
from node_agent.telemetry import Collector
from orchestrrl import errors, grpcutil
from orchestrrl.fencing import FencingGate
from orchestrrl.routing import RouteChange, RuleChange
from orchestrrl.v1 import node_agent_pb2 as na
from orchestrrl.v1 import node_agent_pb2_grpc as na_grpc
from orchestrrl.v1 import optical_switch_pb2 as pb
from orchestrrl.v1 import optical_switch_pb2_grpc as pb_grpc
from sim_backends.engine import SimulatedEngine
from sim_backends.gpus import SimulatedGpus
from sim_backends.ocs import SimulatedOcs
from sim_backends.ocs_server import serve

if TYPE_CHECKING:
    from orchestrrl.v1.node_agent_pb2_grpc import NodeAgentAsyncStub
    from orchestrrl.v1.optical_switch_pb2_grpc import OpticalSwitchAsyncStub

pytestmark = pytest.mark.component

TIMEOUT = 5.0


def test_the_gate_keeps_the_newest_token() -> None:
    gate = FencingGate("OCS x")
    for token in (0, 0, 4, 4, 9):  # no HA until a token comes; equal and newer admitted
        gate.check(token)
        gate.record(token)
    assert gate.newest == 9
    with pytest.raises(errors.FailedPrecondition, match="OCS x: fencing token 4 is older than"):
        gate.check(4)
    with pytest.raises(errors.InvalidArgument, match="fencing_token=-1"):
        gate.check(-1)
    assert gate.newest == 9


def test_token_0_is_refused_once_an_ha_leader_has_been_seen() -> None:
    gate = FencingGate("OCS x")
    gate.check(0)  # a single controller: as before fencing
    gate.check(12)
    gate.record(12)
    with pytest.raises(errors.FailedPrecondition) as info:
        gate.check(0)
    assert str(info.value) == (
        "OCS x: a command without a fencing token (0: no HA), but an HA leader has "
        "commanded this with token 12: only the current leader may change it (restart it "
        "to leave HA); this command changed nothing"
    )
    assert gate.newest == 12
    gate.check(12)  # the leader itself goes on


async def refused(call: object) -> str:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call  # type: ignore[misc]
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    return info.value.details() or ""


@pytest.fixture
async def switch() -> AsyncIterator[tuple[SimulatedOcs, OpticalSwitchAsyncStub]]:
    running, ocs = await serve("127.0.0.1:0", name="ocs-f", port_count=8, switching_time_s=0.0)
    try:
        async with grpcutil.insecure_channel(running.address) as channel:
            yield ocs, cast("OpticalSwitchAsyncStub", pb_grpc.OpticalSwitchStub(channel))
    finally:
        await running.stop(grace=0)


async def test_the_ocs_refuses_a_batch_of_a_deposed_leader(
    switch: tuple[SimulatedOcs, OpticalSwitchAsyncStub],
) -> None:
    ocs, stub = switch

    def batch(token: int, connect: tuple[int, int] = (0, 0), rid: str = "") -> Any:
        pairs = [] if connect == (0, 0) else [pb.CrossConnect(a=connect[0], b=connect[1])]
        request = pb.ApplyCrossConnectsRequest(connect=pairs, fencing_token=token, request_id=rid)
        return stub.ApplyCrossConnects(request, timeout=TIMEOUT)

    await batch(5, (1, 2), rid="old-1")  # the old leader, token 5
    await batch(8, (3, 4))  # a new leader, token 8
    details = await refused(batch(5, (5, 6)))  # the old leader resumes
    assert details == (
        "OCS ocs-f: fencing token 5 is older than the newest seen, 8: "
        "a newer controller leads, this command changed nothing"
    )
    await refused(batch(5, (1, 2), rid="old-1"))  # a replay of its own batch too
    assert ocs.cross_connects() == {(1, 2), (3, 4)}
    # no token after an HA leader's: refused (a controller without --etcd, a forged batch)
    assert "a command without a fencing token (0: no HA)" in await refused(batch(0, (5, 6)))
    await batch(8, (7, 8))  # the same leader again
    assert ocs.cross_connects() == {(1, 2), (3, 4), (7, 8)}
    assert ocs.fencing.newest == 8


async def test_a_switch_that_never_saw_a_token_takes_commands_without_one(
    switch: tuple[SimulatedOcs, OpticalSwitchAsyncStub],
) -> None:
    ocs, stub = switch
    request = pb.ApplyCrossConnectsRequest(connect=[pb.CrossConnect(a=1, b=2)])
    await stub.ApplyCrossConnects(request, timeout=TIMEOUT)  # one controller, no HA
    assert ocs.cross_connects() == {(1, 2)} and ocs.fencing.newest == 0


class CountingRoutes(HostRoutes):
    """Applies nothing: answers that every route and rule asked for was added."""

    async def apply(self, request: RoutesRequest) -> RoutesResult:
        return RoutesResult(
            RouteChange(len(request.routes), 0, 0, 0), RuleChange(len(request.rules), 0, 0)
        )


async def test_one_batch_cannot_jam_the_switchs_fence(
    switch: tuple[SimulatedOcs, OpticalSwitchAsyncStub],
) -> None:
    """The attack of issue 28: one empty batch stamped 2**63 made the switch refuse
    every later batch of the real leader until it restarted."""
    ocs, stub = switch

    def batch(token: int, *pairs: tuple[int, int], rid: str = "") -> Any:
        request = pb.ApplyCrossConnectsRequest(
            connect=[pb.CrossConnect(a=a, b=b) for a, b in pairs],
            fencing_token=token,
            request_id=rid,
        )
        return stub.ApplyCrossConnects(request, timeout=TIMEOUT)

    await batch(8, (1, 2))  # the leader, token 8
    for pairs in ((), ((3, 4),)):  # empty or not, a token that far ahead is no leader's
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await batch(2**63, *pairs)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert (info.value.details() or "").startswith(
            "fencing_token=9223372036854775808 is not valid: at most 1099511627776 (2**40) "
            "ahead of the newest seen by OCS ocs-f, 8"
        )
    # within the bound, an empty batch is carried out (it asks for nothing) but does not
    # make its token the newest; nor does a batch refused as invalid
    await batch(8 + 2**40)
    with pytest.raises(grpc.aio.AioRpcError):
        await batch(9 + 2**40, (1, 99))  # port 99 of 8: refused
    assert ocs.fencing.newest == 8
    await batch(8, (3, 4))  # the real leader goes on
    await batch(9, (5, 6), rid="next")  # and so does the next leader
    await batch(9, (5, 6), rid="next")  # (a replay)
    assert ocs.cross_connects() == {(1, 2), (3, 4), (5, 6)}
    assert ocs.fencing.newest == 9
    assert "older than the newest seen, 9" in await refused(batch(8, (7, 8)))


@pytest.fixture
async def agent(tmp_path: Path) -> AsyncIterator[NodeAgentAsyncStub]:
    (tmp_path / "eth0" / "statistics").mkdir(parents=True)
    for name in ("rx_bytes", "tx_bytes"):
        (tmp_path / "eth0" / "statistics" / name).write_text("0")
    (tmp_path / "eth0" / "operstate").write_text("up\n")
    engine = SimulatedEngine(8, (2, 2, 2, 2), seed=1)
    nics = SysfsNics([("eth0", 400.0)], root=tmp_path)
    collector = Collector("gen0-n0", SimulatedGpus(8, seed=1), nics, engine)
    await collector.open()
    commands = CommandLog()
    # a route backend that counts what it is asked instead of touching the kernel
    servicer = NodeAgentService(
        collector, engine, commands, default_interval_s=0.05, routes=CountingRoutes()
    )
    running = await grpcutil.start_server(
        "127.0.0.1:0",
        lambda server: na_grpc.add_NodeAgentServicer_to_server(servicer, server),
        [SERVICE_NAME],
    )
    try:
        async with grpcutil.insecure_channel(running.address) as channel:
            yield cast("NodeAgentAsyncStub", na_grpc.NodeAgentStub(channel))
    finally:
        await running.stop(grace=0)
        await commands.close()


async def test_the_agent_refuses_a_route_command_of_a_deposed_leader(
    agent: NodeAgentAsyncStub,
) -> None:
    def command(cid: str, token: int) -> Any:
        route = na.Route(destination="10.0.0.0/24", gateways=["10.1.0.1"])
        request = na.ApplyRoutesRequest(command_id=cid, routes=[route], fencing_token=token)
        return agent.ApplyRoutes(request, timeout=TIMEOUT)

    assert (await command("c1", 7)).added == 1  # admitted (token 7 is newest)
    details = await refused(command("c2", 3))
    assert details == (
        "agent gen0-n0: ApplyRoutes: fencing token 3 is older than the newest seen, 7: "
        "a newer controller leads, this command changed nothing"
    )
    assert "without a fencing token" in await refused(command("c3", 0))  # HA seen: refused
    assert (await command("c4", 7)).added == 1  # the same leader again
    assert "older than the newest seen, 7" in await refused(command("c1", 6))


async def test_one_route_command_cannot_jam_the_agents_fence(agent: NodeAgentAsyncStub) -> None:
    async def command(cid: str, token: int, routes: int = 1) -> na.ApplyRoutesResponse:
        route = na.Route(destination="10.0.0.0/24", gateways=["10.1.0.1"])
        request = na.ApplyRoutesRequest(
            command_id=cid, routes=[route] * routes, fencing_token=token
        )
        reply: na.ApplyRoutesResponse = await agent.ApplyRoutes(request, timeout=TIMEOUT)
        return reply

    assert (await command("leader-1", 7)).added == 1
    # an empty command with a token far ahead: refused, and it raises nothing
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await command("jam-1", 2**63, routes=0)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "fencing_token=9223372036854775808 is not valid: at most 1099511627776" in str(
        info.value.details()
    )
    # an empty command with a token within the bound: carried out (nothing to do), and
    # still the newest token is the leader's
    assert (await command("jam-2", 7 + 2**40, routes=0)).added == 0
    assert (await command("leader-2", 7)).added == 1  # the real leader goes on
