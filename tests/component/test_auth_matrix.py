"""Who may call what, over real mutual TLS (issue 14): every method of every service x
every kind of caller.

The services are the controller's FabricController, a node agent's NodeAgent (node
``gen0-n0``, a generation gateway holding a request released to it by ``gen0-n1``), and
the simulated switch's OpticalSwitch and OcsFaultInjection (served with
``fault_injection=True``). The callers: an operator, the controller, a node (``gen0-n1``),
another identity the CA signed, a certificate of another CA, and a plaintext client.

The methods come from the proto descriptors, and :data:`POLICY` must name each of them:
a new method fails :func:`test_the_policy_covers_every_method` until someone decides
who may call it. An allowed caller succeeds, or fails only because of what it asked
(:data:`ALLOWED_FAILS`); a signed caller that is not allowed gets PERMISSION_DENIED; an
untrusted or plaintext one fails the handshake (UNAVAILABLE); a refused call changes
nothing (controller state and events, the switch's table, failed ports and armed fault,
the agent's engine, held exports and command log).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf import message_factory
from google.protobuf.descriptor import MethodDescriptor, ServiceDescriptor
from google.protobuf.message import Message

from fabric_controller.controller import Controller
from fabric_controller.drivers.ocs import GrpcOcsDriver
from fabric_controller.servicer import FabricControllerServicer
from fabric_controller.store import Store
from node_agent.commands import CommandLog
from node_agent.engine import Destination
from node_agent.engines.base import Sampling
from node_agent.gateway.engine import GatewayConfig, GatewayEngine
from node_agent.nics import SysfsNics
from node_agent.peers import GrpcPeers
from node_agent.servicer import SERVICE_NAME as AGENT_SERVICE
from node_agent.servicer import NodeAgentService
from node_agent.telemetry import Collector
from node_agent.weights.store import SERVICE_NAME as STORE_SERVICE
from node_agent.weights.store import CheckpointDir, CheckpointStoreService
from orchestrrl import grpcutil
from orchestrrl.devcerts import make_dev_pki
from orchestrrl.model import Wiring
from orchestrrl.tls import Authorizer, TlsConfig
from orchestrrl.v1 import checkpoints_pb2 as ck_pb
from orchestrrl.v1 import checkpoints_pb2_grpc as ck_grpc
from orchestrrl.v1 import common_pb2
from orchestrrl.v1 import fabric_controller_pb2 as fc_pb
from orchestrrl.v1 import fabric_controller_pb2_grpc as fc_grpc
from orchestrrl.v1 import node_agent_pb2 as na_pb
from orchestrrl.v1 import node_agent_pb2_grpc as na_grpc
from orchestrrl.v1 import optical_switch_pb2 as os_pb
from sim_backends.gpus import SimulatedGpus
from sim_backends.ocs import SimulatedOcs
from sim_backends.ocs_server import serve as serve_ocs
from sim_backends.token_engine import ScriptedEngine
from tests.helpers import eventually, tls

pytestmark = pytest.mark.component

SERVICES: dict[str, ServiceDescriptor] = {
    "FabricController": fc_pb.DESCRIPTOR.services_by_name["FabricController"],
    "NodeAgent": na_pb.DESCRIPTOR.services_by_name["NodeAgent"],
    "OpticalSwitch": os_pb.DESCRIPTOR.services_by_name["OpticalSwitch"],
    "OcsFaultInjection": os_pb.DESCRIPTOR.services_by_name["OcsFaultInjection"],
    "CheckpointStore": ck_pb.DESCRIPTOR.services_by_name["CheckpointStore"],
}

OPERATOR, CONTROLLER, NODE, OTHER = "alice", "orl-fabric-controller", "gen0-n1", "mallory"
AGENT, SWITCH = "gen0-n0", "orl-sim-ocs"  # the servers' own identities
SIGNED = frozenset({"operator", "controller", "node", "other"})
CALLERS = ("operator", "controller", "node", "other", "untrusted", "plaintext")

_OPERATOR = frozenset({"operator"})
_CONTROLLER = frozenset({"controller"})
_NODE = frozenset({"node"})  # for its own node only (every request here names gen0-n1)
POLICY: dict[tuple[str, str], frozenset[str]] = {
    ("FabricController", "Register"): _NODE,
    ("FabricController", "Heartbeat"): _NODE,
    ("FabricController", "ReportTelemetry"): _NODE,
    ("FabricController", "ReportTelemetryBatch"): _NODE,
    ("FabricController", "SetPhase"): _OPERATOR,
    ("FabricController", "GetPhase"): _OPERATOR,
    ("FabricController", "SetMode"): _OPERATOR,
    ("FabricController", "GetMode"): _OPERATOR,
    ("FabricController", "PlanPhase"): _OPERATOR,
    ("FabricController", "GetTopology"): _OPERATOR,
    ("FabricController", "ListNodes"): _OPERATOR,
    ("FabricController", "GetSchedule"): _OPERATOR,
    ("FabricController", "PauseSchedule"): _OPERATOR,
    ("FabricController", "WatchEvents"): _OPERATOR,
    # an agent's reads are open to every identity the CA signed; its commands are the
    # controller's; a released request may be followed by the node that exported it
    ("NodeAgent", "GetStatus"): SIGNED,
    ("NodeAgent", "StreamTelemetry"): SIGNED,
    ("NodeAgent", "Reshard"): _CONTROLLER,
    ("NodeAgent", "ApplyRoutes"): _CONTROLLER,
    ("NodeAgent", "ConfigureRoce"): _CONTROLLER,
    ("NodeAgent", "Drain"): _CONTROLLER,
    ("NodeAgent", "Resume"): _CONTROLLER,
    ("NodeAgent", "ExportRequests"): _CONTROLLER,
    ("NodeAgent", "ImportRequests"): _CONTROLLER,
    ("NodeAgent", "ResolveExport"): _CONTROLLER,
    ("NodeAgent", "FollowRequest"): _CONTROLLER | _NODE,
    ("NodeAgent", "UpdateWeights"): _CONTROLLER,
    # an agent's checkpoints are open to every identity the CA signed (weight sync)
    ("CheckpointStore", "GetCheckpoint"): SIGNED,
    ("CheckpointStore", "ReadCheckpoint"): SIGNED,
    # a switch's reads are open to every identity the CA signed; changes are the
    # controller's; fault injection (served only when asked for) the operators'
    ("OpticalSwitch", "GetInfo"): SIGNED,
    ("OpticalSwitch", "ListPorts"): SIGNED,
    ("OpticalSwitch", "ListCrossConnects"): SIGNED,
    ("OpticalSwitch", "ApplyCrossConnects"): _CONTROLLER,
    ("OcsFaultInjection", "SetPortHealth"): _OPERATOR,
    ("OcsFaultInjection", "FailNextApply"): _OPERATOR,
}

# What an allowed caller gets when it is not OK: refused for what the request says
ALLOWED_FAILS: dict[tuple[str, str], grpc.StatusCode] = {
    ("FabricController", "Heartbeat"): grpc.StatusCode.FAILED_PRECONDITION,  # no session
    ("FabricController", "PauseSchedule"): grpc.StatusCode.FAILED_PRECONDITION,  # loop off
    ("NodeAgent", "ApplyRoutes"): grpc.StatusCode.FAILED_PRECONDITION,  # not enabled here
    ("NodeAgent", "ConfigureRoce"): grpc.StatusCode.FAILED_PRECONDITION,  # not enabled here
    ("NodeAgent", "ImportRequests"): grpc.StatusCode.INVALID_ARGUMENT,  # no method, requests
    ("NodeAgent", "ResolveExport"): grpc.StatusCode.NOT_FOUND,  # no such export
    ("NodeAgent", "UpdateWeights"): grpc.StatusCode.INVALID_ARGUMENT,  # no version
    ("CheckpointStore", "GetCheckpoint"): grpc.StatusCode.INVALID_ARGUMENT,  # no version
    ("CheckpointStore", "ReadCheckpoint"): grpc.StatusCode.INVALID_ARGUMENT,  # no version
}

HANDSHAKE_FAILED = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNAUTHENTICATED)
AUTH_CODES = (*HANDSHAKE_FAILED, grpc.StatusCode.PERMISSION_DENIED)


def test_the_policy_covers_every_method() -> None:
    methods = {(s, m.name) for s, d in SERVICES.items() for m in d.methods}
    assert set(POLICY) == methods, (
        f"decide who may call: {sorted(methods - set(POLICY))}; "
        f"gone: {sorted(set(POLICY) - methods)}"
    )
    assert set(ALLOWED_FAILS) <= methods


# -- the cluster -----------------------------------------------------------------------


@dataclass
class Cluster:
    controller: Controller
    ocs: SimulatedOcs
    agent: NodeAgentService
    gateway: GatewayEngine
    commands: CommandLog
    addresses: dict[str, str]  # service -> address
    callers: dict[str, TlsConfig | None]
    released: str  # the id of the request gen0-n1 released to gen0-n0

    def state(self) -> tuple[object, ...]:
        """Everything a refused call must leave as it was."""
        c, cur = self.controller, self.controller.current
        return (
            (cur.epoch, cur.phase, cur.circuits),
            tuple(
                (r.name, r.session_id, r.agent_address, r.telemetry) for r in c.registry.records()
            ),
            tuple(e.sequence for e in c.events.recent(1000)),
            self.ocs.cross_connects(),
            self.ocs.down_ports(),
            self.ocs._fault,  # an armed FailNextApply
            (self.gateway.state, self.gateway.tp_layout),
            frozenset(r.request_id for r in self.gateway.progress().requests),
            tuple(self.agent._exports.held()),
            len(self.commands),
        )


def scripted(node: str, peers: GrpcPeers) -> GatewayEngine:
    return GatewayEngine(
        "scripted", 1, (1,),
        lambda p: ScriptedEngine(p, max_num_seqs=4, token_delay_s=0.01),
        lambda p: 9000 + p.devices[0], peers=peers, node=node,
        config=GatewayConfig(restart_backoff_s=(0.01,)),
    )  # fmt: skip


@pytest.fixture
async def cluster(example_wiring: Wiring, tmp_path: Path) -> AsyncIterator[Cluster]:
    pki = make_dev_pki(tmp_path / "pki", [OPERATOR, CONTROLLER, NODE, OTHER, AGENT, SWITCH])
    untrusted = make_dev_pki(tmp_path / "other-ca", [OPERATOR])[OPERATOR]
    ctl = tls(pki[CONTROLLER])
    ocs_server, ocs = await serve_ocs(
        "127.0.0.1:0", switching_time_s=0.0, tls=tls(pki[SWITCH]),
        controllers=frozenset({CONTROLLER}), fault_injection=True,
        operators=frozenset({OPERATOR}),
    )  # fmt: skip
    driver = GrpcOcsDriver("ocs0", ocs_server.address, tls=ctl)
    controller = Controller(example_wiring, Store(tmp_path / "s.db"), {"ocs0": driver})
    await controller.start()
    controller_server = await grpcutil.start_server(
        "127.0.0.1:0",
        lambda s: fc_grpc.add_FabricControllerServicer_to_server(
            FabricControllerServicer(controller, Authorizer(ctl, frozenset({OPERATOR}))), s
        ),
        [SERVICES["FabricController"].full_name],
        tls=ctl,
    )
    # the agent under test (gen0-n0) holds a request that gen0-n1 exported to it
    source_peers, peers = GrpcPeers(tls(pki[NODE])), GrpcPeers(tls(pki[AGENT]))
    source, gateway = scripted(NODE, source_peers), scripted(AGENT, peers)
    await source.start()
    await gateway.start()
    collector = Collector(AGENT, SimulatedGpus(1, seed=1), SysfsNics([]), gateway)
    await collector.open()
    commands = CommandLog()
    agent = NodeAgentService(
        collector, gateway, commands, 0.05, auth=Authorizer(tls(pki[AGENT])),
        controllers=frozenset({CONTROLLER}), gateway=gateway,
    )  # fmt: skip
    store = CheckpointStoreService(AGENT, CheckpointDir(tmp_path / "checkpoints"))

    def register(s: Any) -> None:
        na_grpc.add_NodeAgentServicer_to_server(agent, s)
        ck_grpc.add_CheckpointStoreServicer_to_server(store, s)

    agent_server = await grpcutil.start_server(
        "127.0.0.1:0", register, [AGENT_SERVICE, STORE_SERVICE], tls=tls(pki[AGENT])
    )
    req = source.submit((4, 5, 6), 100_000, Sampling(temperature=0.0))
    await eventually(lambda: len(req.output) >= 2)
    exported, _ = await source.export_requests([req.id])
    await gateway.import_requests(exported, 0, recompute=True)
    await source.release_requests(exported, Destination(AGENT, agent_server.address))
    callers: dict[str, TlsConfig | None] = {
        "operator": tls(pki[OPERATOR]),
        "controller": ctl,
        "node": tls(pki[NODE]),
        "other": tls(pki[OTHER]),
        "untrusted": tls(untrusted),
        "plaintext": None,
    }
    addresses = {
        "FabricController": controller_server.address,
        "NodeAgent": agent_server.address,
        "OpticalSwitch": ocs_server.address,
        "OcsFaultInjection": ocs_server.address,
        "CheckpointStore": agent_server.address,
    }
    try:
        yield Cluster(
            controller, ocs, agent, gateway, commands, addresses, callers, req.id
        )  # fmt: skip
    finally:
        await source.close()
        await gateway.close()
        await source_peers.close()
        await peers.close()
        await agent_server.stop(0.1)
        await agent.close()
        await commands.close()
        await controller_server.stop(0.1)
        await driver.close()
        await ocs_server.stop(0.1)
        controller.store.close()


# -- one call of any method --------------------------------------------------------------


def request(service: str, method: str, caller: str, released: str) -> Message:
    """A request an allowed caller could make (names gen0-n1 where a node is named)."""
    tag = f"{caller}-{method}"
    sample = na_pb.TelemetrySample(node=NODE, timestamp=time.time())
    made: dict[tuple[str, str], Callable[[], Message]] = {
        ("FabricController", "Register"): lambda: fc_pb.RegisterRequest(
            node=NODE, agent_address="127.0.0.1:1"
        ),
        ("FabricController", "Heartbeat"): lambda: fc_pb.HeartbeatRequest(
            node=NODE, session_id="not-a-session"
        ),
        ("FabricController", "ReportTelemetry"): lambda: sample,
        ("FabricController", "ReportTelemetryBatch"): lambda: na_pb.TelemetryBatch(
            samples=[sample.SerializeToString()]
        ),
        ("FabricController", "SetPhase"): lambda: fc_pb.SetPhaseRequest(
            phase=common_pb2.PHASE_TRAINING, request_id=tag
        ),
        ("FabricController", "SetMode"): lambda: fc_pb.SetModeRequest(
            mode="phased", request_id=tag
        ),
        ("FabricController", "PlanPhase"): lambda: fc_pb.PlanPhaseRequest(
            phase=common_pb2.PHASE_WEIGHT_SYNC
        ),
        ("FabricController", "WatchEvents"): lambda: fc_pb.WatchEventsRequest(recent=1),
        ("NodeAgent", "StreamTelemetry"): lambda: na_pb.StreamTelemetryRequest(interval_s=0.05),
        ("NodeAgent", "Reshard"): lambda: na_pb.ReshardRequest(command_id=tag, tp_layout=[1]),
        ("NodeAgent", "ExportRequests"): lambda: na_pb.ExportRequestsRequest(
            command_id=tag, request_ids=["not-here"], hold_s=1.0
        ),
        ("NodeAgent", "ResolveExport"): lambda: na_pb.ResolveExportRequest(
            command_id=tag, export_command_id="no-such-export", restore=True
        ),
        ("NodeAgent", "FollowRequest"): lambda: na_pb.FollowRequestRequest(
            request_id=released, start=0
        ),
        ("OpticalSwitch", "ApplyCrossConnects"): lambda: os_pb.ApplyCrossConnectsRequest(
            connect_pairs=[29, 30], request_id=tag
        ),
        ("OcsFaultInjection", "SetPortHealth"): lambda: os_pb.SetPortHealthRequest(
            port=31, up=False
        ),
        ("OcsFaultInjection", "FailNextApply"): lambda: os_pb.FailNextApplyRequest(message=tag),
    }
    make = made.get((service, method))
    if make is not None:
        return make()
    m = SERVICES[service].methods_by_name[method]
    msg: Message = message_factory.GetMessageClass(m.input_type)()
    if "command_id" in m.input_type.fields_by_name:
        setattr(msg, "command_id", tag)  # noqa: B010 - the field of any command
    return msg


async def call(channel: grpc.aio.Channel, service: str, m: MethodDescriptor, req: Message) -> Any:
    """Call ``m`` generically (a stream: its first message); the status code."""
    path = f"/{SERVICES[service].full_name}/{m.name}"
    out = message_factory.GetMessageClass(m.output_type)
    kw: dict[str, Any] = {
        "request_serializer": type(req).SerializeToString,
        "response_deserializer": out.FromString,
    }
    try:
        if m.server_streaming:
            stream = channel.unary_stream(path, **kw)(req, timeout=5)
            try:
                await stream.read()
            finally:
                stream.cancel()
        elif m.client_streaming:
            await channel.stream_unary(path, **kw)(iter([req]), timeout=5)
        else:
            await channel.unary_unary(path, **kw)(req, timeout=5)
    except grpc.aio.AioRpcError as exc:
        return exc.code(), exc.details() or ""
    return grpc.StatusCode.OK, ""


async def test_every_method_of_every_service_by_every_caller(cluster: Cluster) -> None:
    c = cluster
    wrong: list[str] = []
    for service, descriptor in SERVICES.items():
        for caller in CALLERS:
            async with grpcutil.channel(c.addresses[service], c.callers[caller]) as ch:
                for m in descriptor.methods:
                    key = (service, m.name)
                    before = c.state()
                    code, details = await call(ch, service, m, request(*key, caller, c.released))
                    cell = f"{service}.{m.name} by {caller}: {code.name} {details[:150]!r}"
                    if caller in POLICY[key]:
                        if code not in (grpc.StatusCode.OK, ALLOWED_FAILS.get(key)):
                            wrong.append(f"allowed, but {cell}")
                        continue
                    expected = HANDSHAKE_FAILED if caller not in SIGNED else AUTH_CODES[2:]
                    if code not in expected:
                        wrong.append(f"refused expected ({'/'.join(e.name for e in expected)})"
                                     f", got {cell}")  # fmt: skip
                    await asyncio.sleep(0)  # (anything the call started has run)
                    if c.state() != before:
                        wrong.append(f"refused, but it changed something: {cell}")
    assert not wrong, "\n".join(wrong)
