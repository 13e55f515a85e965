"""gRPC FabricController servicer: translation between protobuf and the Controller only."""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from typing import TypeAlias

import grpc

from fabric_controller.controller import Controller
from fabric_controller.events import Event
from fabric_controller.registry import Health
from fabric_controller.store import EpochRecord
from orchestrrl import errors
from orchestrrl.convert import (
    circuit_to_pb,
    phase_from_pb,
    phase_to_pb,
    stages_to_pb,
)
from orchestrrl.grpcutil import domain_errors_to_status, parse_address
from orchestrrl.model import Circuit
from orchestrrl.tls import Authorizer
from orchestrrl.v1 import common_pb2, node_agent_pb2
from orchestrrl.v1 import fabric_controller_pb2 as pb
from orchestrrl.v1 import fabric_controller_pb2_grpc as pb_grpc

Ctx: TypeAlias = grpc.aio.ServicerContext

_HEALTH = {
    Health.UP: pb.NODE_HEALTH_UP,
    Health.DOWN: pb.NODE_HEALTH_DOWN,
    Health.UNKNOWN: pb.NODE_HEALTH_UNKNOWN,
}


class FabricControllerServicer(pb_grpc.FabricControllerServicer):
    """Agents may act only for their own node; everything else is for operators
    (with mutual TLS; plaintext allows all, for local development)."""

    def __init__(self, controller: Controller, auth: Authorizer | None = None) -> None:
        self.c = controller
        self.auth = auth or Authorizer(None)

    def _circuits(self, circuits: frozenset[Circuit]) -> list[common_pb2.Circuit]:
        return [circuit_to_pb(x, self.c.wiring.circuit_pods(x)) for x in sorted(circuits)]

    @domain_errors_to_status
    async def Register(self, request: pb.RegisterRequest, context: Ctx) -> pb.RegisterResponse:
        if not request.node:
            raise errors.field_error("node", request.node, "the node's name from the wiring file")
        self.auth.node(context, request.node)
        parse_address(request.agent_address, "agent_address")
        record = self.c.register(
            request.node,
            request.agent_address,
            request.status.gpu_backend,
            len(request.status.gpus),
        )
        cur = self.c.current
        return pb.RegisterResponse(
            session_id=record.session_id,
            heartbeat_interval_s=self.c.heartbeat_interval_s,
            epoch=cur.epoch,
            phase=phase_to_pb(cur.phase),
        )

    @domain_errors_to_status
    async def Heartbeat(self, request: pb.HeartbeatRequest, context: Ctx) -> pb.HeartbeatResponse:
        self.auth.node(context, request.node)
        self.c.heartbeat(request.node, request.session_id)
        cur = self.c.current
        return pb.HeartbeatResponse(epoch=cur.epoch, phase=phase_to_pb(cur.phase))

    @domain_errors_to_status
    async def ReportTelemetry(
        self,
        request_iterator: AsyncIterator[node_agent_pb2.TelemetrySample],
        context: Ctx,
    ) -> pb.ReportTelemetryResponse:
        accepted = 0
        async for sample in request_iterator:
            self.auth.node(context, sample.node)
            self.c.telemetry(sample)
            accepted += 1
        return pb.ReportTelemetryResponse(accepted=accepted)

    def _epoch_reply(
        self, record: EpochRecord, changed: bool, message: str, gated: bool = False
    ) -> pb.SetPhaseResponse:
        return pb.SetPhaseResponse(
            epoch=record.epoch,
            phase=phase_to_pb(record.phase),
            changed=changed,
            circuits=self._circuits(record.circuits),
            added=self._circuits(record.added) if changed else [],
            removed=self._circuits(record.removed) if changed else [],
            stages=stages_to_pb(record.stages),
            message=message,
            gated=gated,
        )

    @domain_errors_to_status
    async def SetPhase(self, request: pb.SetPhaseRequest, context: Ctx) -> pb.SetPhaseResponse:
        self.auth.operator(context)
        phase = phase_from_pb(request.phase)
        window = request.idle_window_s
        if not math.isfinite(window) or window < 0:
            raise errors.field_error(
                "idle_window_s", window, "seconds >= 0 (0 means unknown: no slack gate)"
            )
        result = await self.c.set_phase(phase, request.request_id, window or None)
        return self._epoch_reply(result.record, result.changed, result.message, result.gated)

    @domain_errors_to_status
    async def GetPhase(self, request: pb.GetPhaseRequest, context: Ctx) -> pb.GetPhaseResponse:
        self.auth.operator(context)
        cur = self.c.current
        return pb.GetPhaseResponse(
            epoch=cur.epoch,
            phase=phase_to_pb(cur.phase),
            circuits=self._circuits(cur.circuits),
            committed_at=cur.committed_at,
        )

    @domain_errors_to_status
    async def PlanPhase(self, request: pb.PlanPhaseRequest, context: Ctx) -> pb.PlanPhaseResponse:
        self.auth.operator(context)
        phase = phase_from_pb(request.phase)
        plan = await self.c.plan(phase)
        return pb.PlanPhaseResponse(
            phase=request.phase,
            circuits=self._circuits(plan.desired),
            added=self._circuits(plan.add),
            removed=self._circuits(plan.remove),
        )

    @domain_errors_to_status
    async def GetTopology(self, request: pb.GetTopologyRequest, context: Ctx) -> pb.Topology:
        self.auth.operator(context)
        w = self.c.wiring
        cur = self.c.current
        return pb.Topology(
            cluster=w.cluster,
            pods=[
                pb.PodInfo(name=p.name, role=p.role.value, nodes=p.nodes, tors=p.tors)
                for p in w.pods
            ],
            nodes=[
                pb.NodeInfo(
                    name=n.name,
                    pod=n.pod,
                    role=n.role.value,
                    agent_address=n.agent,
                    gpus=n.gpus,
                    nics=[
                        pb.NicCabling(
                            name=x.name, tor=x.tor, tor_port=x.tor_port, speed_gbps=x.gbps
                        )
                        for x in n.nics
                    ],
                )
                for n in w.nodes
            ],
            tors=[
                pb.TorInfo(
                    name=t.name,
                    pod=t.pod,
                    uplinks=[
                        pb.TorUplink(port=u.port, ocs=u.ocs, ocs_port=u.ocs_port) for u in t.uplinks
                    ],
                )
                for t in w.tors
            ],
            ocses=[
                pb.OcsInfo(
                    name=o.name,
                    address=o.address,
                    port_count=o.ports,
                    switching_time_s=o.switching_time_s,
                )
                for o in w.ocses
            ],
            circuits=self._circuits(cur.circuits),
            epoch=cur.epoch,
            phase=phase_to_pb(cur.phase),
        )

    @domain_errors_to_status
    async def ListNodes(self, request: pb.ListNodesRequest, context: Ctx) -> pb.ListNodesResponse:
        self.auth.operator(context)
        out = []
        for record, health, age in self.c.nodes():
            node = self.c.wiring.node(record.name)
            out.append(
                pb.NodeState(
                    node=record.name,
                    pod=node.pod,
                    role=node.role.value,
                    health=_HEALTH[health],
                    agent_address=record.agent_address,
                    last_seen_age_s=-1.0 if age is None else age,
                    last_telemetry=record.telemetry,
                    gpu_backend=record.gpu_backend,
                )
            )
        return pb.ListNodesResponse(nodes=out)

    @domain_errors_to_status
    async def WatchEvents(
        self, request: pb.WatchEventsRequest, context: Ctx
    ) -> AsyncIterator[pb.Event]:
        self.auth.operator(context)
        if not request.follow:
            for event in self.c.events.recent(request.recent):
                yield event_to_pb(event)
            return
        async for event in self.c.events.subscribe(request.recent):
            yield event_to_pb(event)


def event_to_pb(e: Event) -> pb.Event:
    return pb.Event(
        sequence=e.sequence,
        timestamp=e.timestamp,
        kind=e.kind,
        node=e.node,
        epoch=e.epoch,
        phase=phase_to_pb(e.phase),
        message=e.message,
        stages=stages_to_pb(e.stages),
    )
