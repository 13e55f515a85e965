"""An agent address is bound to the node it was registered for (issues 14 and 28).

A node certificate may register its own node name, but at another node's agent address.
The controller refuses an address that another node (up) holds, unless the agent there
shows it is the registering node (so the first to claim an address cannot lock out its
owner: the owner takes it back). Whatever the registry says, the controller must not
have another node's agent run a node's commands: with mutual TLS the controller's (and a
peer agent's) handshake requires the agent's certificate to name the node it means; with
and without TLS each command names its node (``x-orl-node``) and an agent refuses a
command meant for another node. Real servers, dev PKI.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from fabric_controller.controller import Controller
from fabric_controller.drivers.agents import AgentClients
from fabric_controller.drivers.ocs import GrpcOcsDriver
from fabric_controller.servicer import FabricControllerServicer
from fabric_controller.store import Store
from node_agent.commands import CommandLog
from node_agent.engine import Destination
from node_agent.gateway.requests import RequestFailed
from node_agent.nics import SysfsNics
from node_agent.peers import GrpcPeers
from node_agent.servicer import SERVICE_NAME, NodeAgentService
from node_agent.telemetry import Collector
from orchestrrl import errors, grpcutil
from orchestrrl.devcerts import CertFiles, make_dev_pki
from orchestrrl.model import Wiring
from orchestrrl.tls import Authorizer, TlsConfig, addressed_to
from orchestrrl.v1 import fabric_controller_pb2 as fc_pb
from orchestrrl.v1 import fabric_controller_pb2_grpc as fc_grpc
from orchestrrl.v1 import node_agent_pb2 as pb
from orchestrrl.v1 import node_agent_pb2_grpc as pb_grpc
from sim_backends.engine import SimulatedEngine
from sim_backends.gpus import SimulatedGpus
from sim_backends.ocs_server import serve as serve_ocs
from tests.helpers import tls as tls_of

pytestmark = pytest.mark.component

CONTROLLER = "orl-fabric-controller"
A, B = "gen0-n0", "gen0-n1"  # B's certificate registers B at A's agent address


def tls(files: CertFiles | None) -> TlsConfig | None:
    return None if files is None else tls_of(files)


@dataclass
class Agent:
    node: str
    address: str
    engine: SimulatedEngine


@asynccontextmanager
async def agent(node: str, cert: CertFiles | None) -> AsyncIterator[Agent]:
    """An agent of ``node`` serving with ``cert`` (a rogue one: another node's)."""
    engine = SimulatedEngine(8, (2, 2, 2, 2), seed=1)
    collector = Collector(node, SimulatedGpus(8, seed=1), SysfsNics([]), engine)
    await collector.open()
    commands = CommandLog()
    me = tls(cert)
    servicer = NodeAgentService(
        collector, engine, commands, 0.05, auth=Authorizer(me),
        controllers=frozenset({CONTROLLER}),
    )  # fmt: skip
    server = await grpcutil.start_server(
        "127.0.0.1:0",
        lambda s: pb_grpc.add_NodeAgentServicer_to_server(servicer, s),
        [SERVICE_NAME],
        tls=me,
    )
    try:
        yield Agent(node, server.address, engine)
    finally:
        await server.stop(0.1)
        await commands.close()


@asynccontextmanager
async def controller_server(
    wiring: Wiring, tmp_path: Path, me: TlsConfig | None
) -> AsyncIterator[tuple[Controller, str]]:
    ocs_server, _ = await serve_ocs("127.0.0.1:0", switching_time_s=0.0, tls=me)
    driver = GrpcOcsDriver("ocs0", ocs_server.address, tls=me)
    controller = Controller(wiring, Store(tmp_path / "s.db"), {"ocs0": driver})
    prover = AgentClients(me, timeout_s=5)  # as orl-fabric-controller wires it
    controller.identify = lambda node, address: prover.get(node, address).identify()
    await controller.start()
    server = await grpcutil.start_server(
        "127.0.0.1:0",
        lambda s: fc_grpc.add_FabricControllerServicer_to_server(
            FabricControllerServicer(controller, Authorizer(me, frozenset({"alice"}))), s
        ),
        ["orchestrrl.v1.FabricController"],
        tls=me,
    )
    try:
        yield controller, server.address
    finally:
        await server.stop(0.1)
        await prover.close()
        await driver.close()
        await ocs_server.stop(0.1)
        controller.store.close()


@pytest.fixture
def pki(tmp_path: Path) -> dict[str, CertFiles]:
    return make_dev_pki(tmp_path / "pki", [CONTROLLER, A, B])


async def register(address: str, node: str, at: str, cert: CertFiles | None) -> None:
    async with grpcutil.channel(address, tls(cert)) as ch:
        await fc_grpc.FabricControllerStub(ch).Register(
            fc_pb.RegisterRequest(node=node, agent_address=at), timeout=5
        )


def record_of(controller: Controller, node: str) -> tuple[str, str]:
    r = next(r for r, _, _ in controller.nodes() if r.name == node)
    return r.agent_address, r.session_id


@pytest.mark.parametrize("secure", [True, False], ids=["mtls", "plaintext"])
async def test_a_node_may_not_register_an_address_another_node_holds(
    example_wiring: Wiring, tmp_path: Path, pki: dict[str, CertFiles], secure: bool
) -> None:
    me = tls(pki[CONTROLLER]) if secure else None
    async with (
        agent(A, pki[A] if secure else None) as victim,
        controller_server(example_wiring, tmp_path, me) as (controller, address),
    ):
        await register(address, A, victim.address, pki[A] if secure else None)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await register(address, B, victim.address, pki[B] if secure else None)
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert f"is registered by node(s) {A} (up)" in (refused.value.details() or "")
        assert record_of(controller, B) == ("", "")  # nothing changed
        assert record_of(controller, A)[0] == victim.address


@pytest.mark.parametrize("secure", [True, False], ids=["mtls", "plaintext"])
async def test_the_owner_takes_back_an_address_another_node_registered_first(
    example_wiring: Wiring, tmp_path: Path, pki: dict[str, CertFiles], secure: bool
) -> None:
    me = tls(pki[CONTROLLER]) if secure else None
    async with (
        agent(A, pki[A] if secure else None) as victim,
        controller_server(example_wiring, tmp_path, me) as (controller, address),
    ):
        await register(address, B, victim.address, pki[B] if secure else None)  # first
        assert record_of(controller, B)[0] == victim.address
        await register(address, A, victim.address, pki[A] if secure else None)  # the owner
        assert record_of(controller, A)[0] == victim.address
        assert record_of(controller, B) == ("", "")  # B lost the address and its session
        registered = controller.events.recent(1)[-1]
        assert registered.node == A and f"node(s) {B} had registered the same" in (
            registered.message
        )
        with pytest.raises(grpc.aio.AioRpcError) as refused:  # and cannot take it again
            await register(address, B, victim.address, pki[B] if secure else None)
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION


@pytest.mark.parametrize("secure", [True, False], ids=["mtls", "plaintext"])
async def test_a_command_for_a_node_at_another_nodes_address_is_not_run_there(
    pki: dict[str, CertFiles], secure: bool
) -> None:
    me = tls(pki[CONTROLLER]) if secure else None
    async with agent(A, pki[A] if secure else None) as victim:
        clients = AgentClients(me, timeout_s=5)
        try:
            # what the compute loop would do with B registered at A's address
            wrong = clients.get(B, victim.address)
            if secure:  # the handshake: A's certificate does not name B
                with pytest.raises(errors.Unavailable, match=f"does not name node .{B}."):
                    await wrong.reshard("c1", [8])
            else:  # the agent: the command is meant for B, it is A
                with pytest.raises(errors.FailedPrecondition) as info:
                    await wrong.reshard("c1", [8])
                assert f"this agent is node '{A}', the call is meant for node '{B}'" in str(
                    info.value
                )
            with pytest.raises((errors.Unavailable, errors.FailedPrecondition)):
                await wrong.export_requests("c2", ["r1"], 5.0)
            with pytest.raises((errors.Unavailable, errors.FailedPrecondition)):
                await wrong.identify()  # nor does it pass for B
            assert victim.engine.tp_layout == (2, 2, 2, 2)  # nothing was done
            # the node the address belongs to is reached as before
            await clients.get(A, victim.address).identify()
            reply = await clients.get(A, victim.address).reshard("c3", [8])
            assert list(reply.new_layout) == [8]
        finally:
            await clients.close()


async def test_a_rogue_agent_with_another_nodes_certificate_at_a_registered_address(
    pki: dict[str, CertFiles],
) -> None:
    """A registered its address; an agent holding B's certificate now serves there."""
    async with agent(A, pki[B]) as rogue:
        clients = AgentClients(tls(pki[CONTROLLER]), timeout_s=5)
        try:
            with pytest.raises(errors.Unavailable):
                await clients.get(A, rogue.address).reshard("c1", [8])
            assert rogue.engine.tp_layout == (2, 2, 2, 2)
        finally:
            await clients.close()


async def test_the_agent_refuses_every_call_meant_for_another_node() -> None:
    """Plaintext: the agent checks the node named by the call (not only the commands)."""
    async with agent(A, None) as victim, grpcutil.channel(victim.address, None) as ch:
        stub = pb_grpc.NodeAgentStub(ch)
        to_b = addressed_to(B)
        calls = [
            stub.GetStatus(pb.GetStatusRequest(), timeout=5, metadata=to_b),
            stub.Drain(pb.DrainRequest(command_id="d1"), timeout=5, metadata=to_b),
            stub.Reshard(pb.ReshardRequest(command_id="r1", tp_layout=[8]), metadata=to_b),
        ]
        for call in calls:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await call
            assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert f"'{A}'" in (info.value.details() or "")
        stream = stub.StreamTelemetry(pb.StreamTelemetryRequest(), metadata=to_b)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stream.read()
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert victim.engine.state.value != "drained" and victim.engine.tp_layout == (2, 2, 2, 2)
        # the right node, or no node named (orlctl, tools), is served
        status = await stub.GetStatus(pb.GetStatusRequest(), timeout=5, metadata=addressed_to(A))
        assert status.node == A
        assert (await stub.GetStatus(pb.GetStatusRequest(), timeout=5)).node == A


@pytest.mark.parametrize("secure", [True, False], ids=["mtls", "plaintext"])
async def test_a_gateway_follows_a_request_only_on_the_node_it_was_released_to(
    pki: dict[str, CertFiles], secure: bool
) -> None:
    """GrpcPeers (agent -> agent FollowRequest): the destination must be that node."""
    async with agent(A, pki[A] if secure else None) as other:
        peers = GrpcPeers(tls(pki[B]) if secure else None)
        try:
            follow = peers.follow(Destination(B, other.address), "r1", 0)
            expected = errors.Unavailable if secure else RequestFailed
            with pytest.raises(expected) as info:
                await anext(follow)
            if not secure:
                assert f"meant for node '{B}'" in str(info.value)
        finally:
            await peers.close()
