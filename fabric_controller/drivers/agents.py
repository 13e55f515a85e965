"""Clients of the node agents, for the commands the controller sends down.

One channel per registered agent address (re-opened when an agent re-registers at a new
address), mutual TLS the same way as the controller's OCS channels: the controller's
certificate is its identity, and agents accept commands only from that identity.

An agent address is bound to the node it was registered for, so that a node that
registered another node's agent address cannot have that agent run its commands: with
TLS the handshake requires the agent's certificate to name the node (its DNS subject
alternative name, checked instead of the address's host); with and without TLS every
command carries the node it is meant for (``x-orl-node`` metadata) and an agent refuses
a command meant for another node.
"""

from __future__ import annotations

from collections.abc import Awaitable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, TypeVar, cast

import grpc

from orchestrrl import errors, grpcutil
from orchestrrl.tls import TlsConfig, addressed_to
from orchestrrl.v1 import checkpoints_pb2 as ck_pb
from orchestrrl.v1 import checkpoints_pb2_grpc as ck_grpc
from orchestrrl.v1 import node_agent_pb2 as pb
from orchestrrl.v1 import node_agent_pb2_grpc as pb_grpc

if TYPE_CHECKING:
    from orchestrrl.v1.node_agent_pb2_grpc import NodeAgentAsyncStub

T = TypeVar("T")


@dataclass(frozen=True)
class Resolved:
    restored: tuple[str, ...]
    released: tuple[str, ...]
    message: str


class AgentClient(Protocol):
    """The commands of the compute-scheduling loop, on one agent."""

    node: str

    async def reshard(self, command_id: str, layout: Sequence[int]) -> pb.ReshardResponse: ...

    async def export_requests(
        self, command_id: str, request_ids: Sequence[str], hold_s: float
    ) -> pb.ExportRequestsResponse: ...

    async def import_requests(
        self,
        command_id: str,
        source_node: str,
        instance: int,
        recompute: bool,
        requests: Sequence[pb.RequestState],
    ) -> pb.ImportRequestsResponse: ...

    async def resolve_export(
        self,
        command_id: str,
        export_id: str,
        restore: bool,
        *,
        destination: tuple[str, str] | None = None,
    ) -> Resolved:
        """``destination`` (node, agent address): where released requests went."""


class GrpcAgentClient:
    def __init__(self, node: str, channel: grpc.aio.Channel, address: str, timeout_s: float):
        self.node = node
        self.address = address
        self.timeout_s = timeout_s
        self._stub = cast("NodeAgentAsyncStub", pb_grpc.NodeAgentStub(channel))
        self._checkpoints = ck_grpc.CheckpointStoreStub(channel)
        self._to = addressed_to(node)

    def _what(self, rpc: str) -> str:
        return f"agent {self.node!r} at {self.address}: {rpc}"

    async def _call(self, rpc: str, call: Awaitable[T]) -> T:
        try:
            return await grpcutil.call(self._what(rpc), call)
        except errors.Unavailable as exc:
            if "Hostname Verification" not in str(exc):
                raise
            raise errors.Unavailable(
                f"{exc} (the agent's certificate there does not name node {self.node!r}: "
                f"the address is another node's, or the node must register its own)"
            ) from None

    async def identify(self) -> None:
        """The agent at the address shows it is this node: its answer to a status call
        meant for the node (with TLS the handshake also requires its certificate to name
        the node); an OrlError naming what it is otherwise."""
        status = await self._call(
            "GetStatus",
            self._stub.GetStatus(
                pb.GetStatusRequest(), timeout=min(self.timeout_s, 5.0), metadata=self._to
            ),
        )
        if status.node != self.node:
            raise errors.FailedPrecondition(
                f"{self._what('GetStatus')}: the agent there is node "
                f"{errors.shown(status.node, 128)}"
            )

    async def reshard(self, command_id: str, layout: Sequence[int]) -> pb.ReshardResponse:
        req = pb.ReshardRequest(command_id=command_id, tp_layout=list(layout))
        # a reshard moves weights: allow it the pause the planner predicts, and more
        return await self._call(
            "Reshard",
            self._stub.Reshard(req, timeout=max(self.timeout_s, 120.0), metadata=self._to),
        )

    async def export_requests(
        self, command_id: str, request_ids: Sequence[str], hold_s: float
    ) -> pb.ExportRequestsResponse:
        req = pb.ExportRequestsRequest(
            command_id=command_id, request_ids=list(request_ids), hold_s=hold_s
        )
        return await self._call(
            "ExportRequests",
            self._stub.ExportRequests(req, timeout=self.timeout_s, metadata=self._to),
        )

    async def import_requests(
        self,
        command_id: str,
        source_node: str,
        instance: int,
        recompute: bool,
        requests: Sequence[pb.RequestState],
    ) -> pb.ImportRequestsResponse:
        req = pb.ImportRequestsRequest(
            command_id=command_id,
            source_node=source_node,
            instance=instance,
            method=pb.MIGRATION_METHOD_RECOMPUTE if recompute else pb.MIGRATION_METHOD_KV,
            requests=list(requests),
        )
        return await self._call(
            "ImportRequests",
            self._stub.ImportRequests(req, timeout=self.timeout_s, metadata=self._to),
        )

    async def resolve_export(
        self,
        command_id: str,
        export_id: str,
        restore: bool,
        *,
        destination: tuple[str, str] | None = None,
    ) -> Resolved:
        node, address = destination or ("", "")
        req = pb.ResolveExportRequest(
            command_id=command_id,
            export_command_id=export_id,
            restore=restore,
            destination_node=node,
            destination_address=address,
        )
        r = await self._call(
            "ResolveExport",
            self._stub.ResolveExport(req, timeout=self.timeout_s, metadata=self._to),
        )
        return Resolved(tuple(r.restored), tuple(r.released), r.message)

    # -- weight sync --

    async def get_status(self) -> pb.NodeStatus:
        status: pb.NodeStatus = await self._call(
            "GetStatus",
            self._stub.GetStatus(pb.GetStatusRequest(), timeout=self.timeout_s, metadata=self._to),
        )
        return status

    async def get_checkpoint(self, version: str, checksum: str) -> ck_pb.CheckpointInfo:
        req = ck_pb.GetCheckpointRequest(version=version, checksum=checksum)
        info: ck_pb.CheckpointInfo = await self._call(
            "GetCheckpoint",
            self._checkpoints.GetCheckpoint(req, timeout=self.timeout_s, metadata=self._to),
        )
        return info

    async def update_weights(
        self, request: pb.UpdateWeightsRequest, timeout_s: float
    ) -> pb.UpdateWeightsResponse:
        """``timeout_s``: the agent's own bound on fetch and load, plus a margin."""
        return await self._call(
            "UpdateWeights",
            self._stub.UpdateWeights(request, timeout=timeout_s, metadata=self._to),
        )


class AgentClients:
    """A channel per agent address, opened on first use; with TLS it accepts only an
    agent whose certificate names the node."""

    def __init__(self, tls: TlsConfig | None, timeout_s: float = 10.0) -> None:
        self._tls = tls
        self._timeout_s = timeout_s
        self._open: dict[str, tuple[str, grpc.aio.Channel, GrpcAgentClient]] = {}
        self._retired: list[grpc.aio.Channel] = []  # replaced addresses, closed at the end

    def get(self, node: str, address: str) -> GrpcAgentClient:
        entry = self._open.get(node)
        if entry is not None and entry[0] == address:
            return entry[2]
        channel = grpcutil.channel(address, self._tls, server_name=node)
        client = GrpcAgentClient(node, channel, address, self._timeout_s)
        self._open[node] = (address, channel, client)
        if entry is not None:
            self._retired.append(entry[1])
        return client

    async def close(self) -> None:
        for _, channel, _ in self._open.values():
            await channel.close()
        for channel in self._retired:
            await channel.close()
        self._open.clear()
        self._retired.clear()
