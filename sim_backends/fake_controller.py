"""A minimal FabricController for tests and the overhead bench: records what agents send,
can reject registrations and forget sessions. Not for production use."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import grpc

from orchestrrl import grpcutil, leader
from orchestrrl.v1 import common_pb2, node_agent_pb2
from orchestrrl.v1 import fabric_controller_pb2 as pb
from orchestrrl.v1 import fabric_controller_pb2_grpc as pb_grpc

Context = Any


class FakeController(pb_grpc.FabricControllerServicer):
    def __init__(self, reject: str | None = None, heartbeat_interval_s: float = 0.05) -> None:
        self.reject = reject
        self.heartbeat_interval_s = heartbeat_interval_s
        self.registrations: list[pb.RegisterRequest] = []
        self.heartbeats: list[pb.HeartbeatRequest] = []
        self.samples: list[node_agent_pb2.TelemetrySample] = []  # from both telemetry RPCs
        self.batches: list[node_agent_pb2.TelemetryBatch] = []
        self.sessions: set[str] = set()

    async def Register(self, request: pb.RegisterRequest, context: Context) -> pb.RegisterResponse:
        self.registrations.append(request)
        if self.reject is not None:
            await context.abort(grpc.StatusCode.NOT_FOUND, self.reject)
        session_id = f"session-{len(self.registrations)}"
        self.sessions.add(session_id)
        return pb.RegisterResponse(
            session_id=session_id,
            heartbeat_interval_s=self.heartbeat_interval_s,
            epoch=3,
            phase=common_pb2.PHASE_GENERATION,
        )

    async def Heartbeat(
        self, request: pb.HeartbeatRequest, context: Context
    ) -> pb.HeartbeatResponse:
        if request.session_id not in self.sessions:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"node {request.node!r}: session {request.session_id!r} is not current",
            )
        self.heartbeats.append(request)
        return pb.HeartbeatResponse(epoch=3, phase=common_pb2.PHASE_GENERATION)

    async def ReportTelemetry(
        self, request_iterator: AsyncIterator[node_agent_pb2.TelemetrySample], context: Context
    ) -> pb.ReportTelemetryResponse:
        accepted = 0
        async for sample in request_iterator:
            self.samples.append(sample)
            accepted += 1
        return pb.ReportTelemetryResponse(accepted=accepted)

    async def ReportTelemetryBatch(
        self, request_iterator: AsyncIterator[node_agent_pb2.TelemetryBatch], context: Context
    ) -> pb.ReportTelemetryResponse:
        accepted = 0
        async for batch in request_iterator:
            self.batches.append(batch)
            self.samples.extend(node_agent_pb2.TelemetrySample.FromString(s) for s in batch.samples)
            accepted += len(batch.samples)
        return pb.ReportTelemetryResponse(accepted=accepted)


@dataclass
class RunningFakeController:
    fake: FakeController
    server: grpcutil.RunningServer

    @property
    def address(self) -> str:
        return self.server.address


async def start_fake_controller(
    listen: str = "127.0.0.1:0", **kwargs: Any
) -> RunningFakeController:
    fake = FakeController(**kwargs)  # type: ignore[abstract]  # only the agent-facing RPCs
    server = await grpcutil.start_server(
        listen,
        lambda s: pb_grpc.add_FabricControllerServicer_to_server(fake, s),
        [pb.DESCRIPTOR.services_by_name["FabricController"].full_name],
        options=leader.SERVER_OPTIONS,
    )
    return RunningFakeController(fake, server)
