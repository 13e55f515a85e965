"""A migrated request followed across agents over real gRPC with mutual TLS.

Node ``gen0-n0`` exports a request mid-response, ``gen0-n1`` admits it, and ``gen0-n0``'s
gateway follows it on ``gen0-n1``'s agent with ``FollowRequest`` (``GrpcPeers``): its
client reads one uninterrupted response. Only the node that exported the request (or the
controller) may follow it; any other certificate the CA signed is refused.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from node_agent.commands import CommandLog
from node_agent.engine import Destination
from node_agent.engines.base import Sampling
from node_agent.gateway.engine import GatewayConfig, GatewayEngine
from node_agent.gateway.requests import Request
from node_agent.nics import SysfsNics
from node_agent.peers import GrpcPeers
from node_agent.servicer import SERVICE_NAME, NodeAgentService
from node_agent.telemetry import Collector
from orchestrrl import grpcutil
from orchestrrl.devcerts import CertFiles, make_dev_pki
from orchestrrl.tls import Authorizer
from orchestrrl.v1 import node_agent_pb2 as pb
from orchestrrl.v1 import node_agent_pb2_grpc as pb_grpc
from sim_backends.gpus import SimulatedGpus
from sim_backends.token_engine import Hold, ScriptedEngine, greedy
from tests.helpers import eventually, tls

pytestmark = pytest.mark.component

GREEDY = Sampling(temperature=0.0)
CONTROLLER = "orl-fabric-controller"


def gateway(name: str, peers: GrpcPeers, hold: Hold) -> GatewayEngine:
    return GatewayEngine(
        "scripted", 1, (1,),
        lambda p: ScriptedEngine(p, max_num_seqs=4, token_delay_s=0.003, hold=hold),
        lambda p: 9000 + p.devices[0], peers=peers, node=name,
        config=GatewayConfig(restart_backoff_s=(0.01,)),
    )  # fmt: skip


@dataclass
class Pair:
    source: GatewayEngine
    destination: GatewayEngine
    address: str  # the destination agent's gRPC address
    pki: dict[str, CertFiles]
    source_hold: Hold
    destination_hold: Hold


@pytest.fixture
async def pair(tmp_path: Path) -> AsyncIterator[Pair]:
    pki = make_dev_pki(tmp_path / "pki", [CONTROLLER, "gen0-n0", "gen0-n1", "gen0-n2"])
    source_peers = GrpcPeers(tls(pki["gen0-n0"]))
    source_hold, destination_hold = Hold(), Hold()
    source = gateway("gen0-n0", source_peers, source_hold)
    destination = gateway("gen0-n1", GrpcPeers(tls(pki["gen0-n1"])), destination_hold)
    await source.start()
    await destination.start()
    collector = Collector("gen0-n1", SimulatedGpus(1, seed=1), SysfsNics([]), destination)
    await collector.open()
    commands = CommandLog()
    me = tls(pki["gen0-n1"])
    servicer = NodeAgentService(
        collector, destination, commands, 0.05, auth=Authorizer(me),
        controllers=frozenset({CONTROLLER}), gateway=destination,
    )  # fmt: skip
    server = await grpcutil.start_server(
        "127.0.0.1:0",
        lambda s: pb_grpc.add_NodeAgentServicer_to_server(servicer, s),
        [SERVICE_NAME],
        tls=me,
    )
    try:
        yield Pair(source, destination, server.address, pki, source_hold, destination_hold)
    finally:
        await source.close()
        await destination.close()
        await source_peers.close()
        await server.stop(0.1)
        await commands.close()


async def read_all(req: Request) -> list[int]:
    return [t async for chunk in req.tokens() for t in chunk]


async def moved(
    pair: Pair, prompt: tuple[int, ...], n: int
) -> tuple[Request, asyncio.Task[list[int]]]:
    pair.source_hold.until(len(prompt) + 10)  # it moves at 10 tokens
    req = pair.source.submit(prompt, n, GREEDY)
    reader = asyncio.create_task(read_all(req))
    await eventually(lambda: len(pair.source_hold.held) == 1)
    exported, missing = await pair.source.export_requests([req.id])
    assert not missing and [e.generated_tokens for e in exported] == [10]
    result = await pair.destination.import_requests(exported, 0, recompute=True)
    assert result.admitted == (req.id,)
    await pair.source.release_requests(exported, Destination("gen0-n1", pair.address))
    return req, reader


async def test_the_source_follows_a_migrated_request_over_grpc(pair: Pair) -> None:
    req, reader = await moved(pair, (4, 5, 6), 200)
    assert await asyncio.wait_for(reader, 30) == greedy((4, 5, 6), 200)
    assert req.hops == ["gen0-n0", "gen0-n1"]


async def test_only_the_exporting_node_or_the_controller_may_follow(pair: Pair) -> None:
    pair.destination_hold.until(3 + 100)  # it cannot finish while the followers look
    req, reader = await moved(pair, (7, 8, 9), 400)
    for who, allowed in (("gen0-n2", False), (CONTROLLER, True), ("gen0-n0", True)):
        async with grpcutil.channel(pair.address, tls(pair.pki[who])) as ch:
            call = pb_grpc.NodeAgentStub(ch).FollowRequest(
                pb.FollowRequestRequest(request_id=req.id, start=0), timeout=10
            )
            if allowed:
                first = await call.read()
                assert isinstance(first, pb.FollowRequestChunk) and first.token_ids
                call.cancel()
            else:
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await call.read()
                assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
                assert "gen0-n2" in info.value.details()
    pair.destination_hold.release()
    assert await asyncio.wait_for(reader, 30) == greedy((7, 8, 9), 400)


async def test_following_an_unknown_request_is_not_found(pair: Pair) -> None:
    async with grpcutil.channel(pair.address, tls(pair.pki["gen0-n0"])) as ch:
        call = pb_grpc.NodeAgentStub(ch).FollowRequest(
            pb.FollowRequestRequest(request_id="cmpl-nope", start=0), timeout=10
        )
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await call.read()
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    assert "cmpl-nope" in info.value.details()
