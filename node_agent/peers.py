"""The other agents, as this node's gateway needs them: following a released request.

When the controller migrates a request off this node, its client stays connected here;
the gateway follows the request on the destination with the destination agent's
``FollowRequest`` stream (mutual TLS as every agent channel: the destination accepts the
follow only from the node that exported the request). The destination must be the node
the controller named: with TLS its certificate must name that node (checked in the
handshake instead of the address's host), and the call says which node it is meant for
(``x-orl-node``), which an agent at that address but of another node refuses.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, cast

import grpc

from node_agent.engine import Destination
from node_agent.engines.base import FinishReason
from node_agent.gateway.engine import FollowChunk
from node_agent.gateway.requests import RequestFailed
from orchestrrl import errors, grpcutil
from orchestrrl.tls import TlsConfig, addressed_to
from orchestrrl.v1 import node_agent_pb2 as pb
from orchestrrl.v1 import node_agent_pb2_grpc as pb_grpc

if TYPE_CHECKING:
    from orchestrrl.v1.node_agent_pb2_grpc import NodeAgentAsyncStub

FINISH: dict[str, FinishReason] = {"length": "length", "stop": "stop", "stale": "stale"}


class GrpcPeers:
    """A channel per destination (node, address), opened on first use."""

    def __init__(self, tls: TlsConfig | None) -> None:
        self._tls = tls
        self._channels: dict[tuple[str, str], grpc.aio.Channel] = {}

    def _stub(self, node: str, address: str) -> NodeAgentAsyncStub:
        channel = self._channels.get((node, address))
        if channel is None:
            channel = self._channels[node, address] = grpcutil.channel(
                address, self._tls, server_name=node
            )
        return cast("NodeAgentAsyncStub", pb_grpc.NodeAgentStub(channel))

    async def follow(
        self, destination: Destination, request_id: str, start: int
    ) -> AsyncIterator[FollowChunk]:
        what = f"agent {destination.node!r} at {destination.address}: FollowRequest"
        call = self._stub(destination.node, destination.address).FollowRequest(
            pb.FollowRequestRequest(request_id=request_id, start=start),
            metadata=addressed_to(destination.node),
        )
        try:
            async for chunk in call:
                yield FollowChunk(
                    tuple(chunk.token_ids),
                    chunk.weight_version,
                    FINISH.get(chunk.finish_reason),
                    tuple(chunk.logprobs),
                )
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.NOT_FOUND:
                raise errors.NotFound(f"{what}: {exc.details()}") from None
            if exc.code() == grpc.StatusCode.FAILED_PRECONDITION:
                raise RequestFailed(f"{what}: {exc.details()}") from None
            raise errors.Unavailable(f"{what}: {exc.code().name}: {exc.details()}") from None
        finally:
            call.cancel()

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()
