"""UpdateWeights on a node agent over real gRPC: the simulated engine takes a checkpoint
fetched from another agent's CheckpointStore and serves its version (status and
telemetry say so); a repeated command id answers with the first result; an update while
another runs is refused; a corrupt, missing or wrong-shape checkpoint, a llama.cpp node
without a GGUF converter, an agent without a checkpoint_dir and a stale fencing token
are refused naming the cause, and the node keeps the version it had."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import grpc
import pytest

from node_agent import convert
from node_agent.commands import CommandLog
from node_agent.nics import SysfsNics
from node_agent.servicer import SERVICE_NAME, NodeAgentService
from node_agent.telemetry import Collector
from node_agent.weights.fetch import GrpcCheckpointSource
from node_agent.weights.store import SERVICE_NAME as STORE_SERVICE
from node_agent.weights.store import CheckpointDir, CheckpointStoreService
from node_agent.weights.update import WeightUpdater, order_from_pb
from orchestrrl import checkpoint, errors, grpcutil
from orchestrrl.v1 import checkpoints_pb2, checkpoints_pb2_grpc
from orchestrrl.v1 import node_agent_pb2 as pb
from orchestrrl.v1 import node_agent_pb2_grpc as pb_grpc
from sim_backends.engine import SimulatedEngine
from sim_backends.gpus import SimulatedGpus
from sim_backends.tiny_models import TinyShape, write_checkpoint

if TYPE_CHECKING:
    from orchestrrl.v1.node_agent_pb2_grpc import NodeAgentAsyncStub

pytestmark = pytest.mark.component

SHAPE = TinyShape(layers=1, hidden=64, head_dim=32, intermediate=128, vocab=128)
TIMEOUT = 20.0


class GatedStore(CheckpointStoreService):
    """The real service; with ``hold`` set, a read waits until it is cleared."""

    def __init__(self, node: str, store: CheckpointDir) -> None:
        super().__init__(node, store)
        self.hold: asyncio.Event | None = None
        self.reading = asyncio.Event()

    async def ReadCheckpoint(
        self, request: checkpoints_pb2.ReadCheckpointRequest, context: Any
    ) -> AsyncIterator[checkpoints_pb2.CheckpointChunk]:
        self.reading.set()
        if self.hold is not None:
            await self.hold.wait()
        async for chunk in super().ReadCheckpoint(request, context):
            yield chunk


@dataclass
class Bed:
    stub: NodeAgentAsyncStub
    engine: SimulatedEngine
    collector: Collector
    source: GatedStore
    source_root: Path
    source_address: str
    updater: WeightUpdater | None

    def order(self, command_id: str, path: Path, **kw: Any) -> pb.UpdateWeightsRequest:
        m = checkpoint.parse_manifest((path / checkpoint.MANIFEST).read_bytes())
        fields: dict[str, Any] = {
            "command_id": command_id,
            "version": m.version,
            "checksum": m.checksum,
            "source_node": "train0-n0",
            "source_address": self.source_address,
            "timeout_s": TIMEOUT,
        }
        return pb.UpdateWeightsRequest(**{**fields, **kw})

    async def update(self, request: pb.UpdateWeightsRequest) -> pb.UpdateWeightsResponse:
        reply: pb.UpdateWeightsResponse = await self.stub.UpdateWeights(request, timeout=TIMEOUT)
        return reply

    async def refused(self, request: pb.UpdateWeightsRequest) -> tuple[grpc.StatusCode, str]:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await self.update(request)
        return info.value.code(), info.value.details() or ""


async def bed_for(tmp_path: Path, *, kind: str = "sim", store: bool = True) -> AsyncIterator[Bed]:
    source_root = tmp_path / "train"
    source = GatedStore("train0-n0", CheckpointDir(source_root))
    source_server = await grpcutil.start_server(
        "127.0.0.1:0",
        lambda s: checkpoints_pb2_grpc.add_CheckpointStoreServicer_to_server(source, s),
        [STORE_SERVICE],
    )
    engine = SimulatedEngine(2, (1, 1), seed=1)
    updater = (
        WeightUpdater(
            "gen0-n0",
            CheckpointDir(tmp_path / "gen"),
            engine,
            kind,
            lambda node, address: GrpcCheckpointSource(node, address, None),
            keep=2,
        )
        if store
        else None
    )
    collector = Collector(
        "gen0-n0",
        SimulatedGpus(2, seed=1),
        SysfsNics([], root=tmp_path),
        engine,
        weight_version=lambda: engine.weight_version,
        checkpoints=updater is not None,
    )
    await collector.open()
    commands = CommandLog()
    servicer = NodeAgentService(collector, engine, commands, 0.05, weights=updater)
    server = await grpcutil.start_server(
        "127.0.0.1:0",
        lambda s: pb_grpc.add_NodeAgentServicer_to_server(servicer, s),
        [SERVICE_NAME],
    )
    try:
        async with grpcutil.insecure_channel(server.address) as channel:
            stub = cast("NodeAgentAsyncStub", pb_grpc.NodeAgentStub(channel))
            yield Bed(stub, engine, collector, source, source_root, source_server.address, updater)
    finally:
        await server.stop(0)
        await commands.close()
        await source_server.stop(0)


@pytest.fixture
async def bed(tmp_path: Path) -> AsyncIterator[Bed]:
    async for b in bed_for(tmp_path):
        yield b


async def test_an_update_makes_the_node_serve_the_new_version(bed: Bed) -> None:
    ck = write_checkpoint(bed.source_root, "1", SHAPE, seed=1)
    size = checkpoint.verify(ck).manifest.size
    r = await bed.update(bed.order("c1", ck, in_flight="resume", streams=2))
    assert (r.version, r.previous, r.bytes_fetched, r.checkpoint_bytes) == ("1", "0", size, size)
    assert r.cached is False and r.streams == 2 and r.how.startswith("sim")
    assert [s.stage for s in r.stages] == ["fetch", "verify", "prepare", "load"]
    assert bed.engine.weight_version == "1"
    assert bed.collector.status().weight_version == "1"
    sample = convert.telemetry_to_pb(await bed.collector.sample())
    assert sample.weight_version == "1"
    status = await bed.stub.GetStatus(pb.GetStatusRequest(), timeout=TIMEOUT)
    assert (status.weight_version, status.checkpoints) == ("1", True)
    # the same command again: the first answer; the same version by another command: nothing
    assert await bed.update(bed.order("c1", ck, in_flight="resume", streams=2)) == r
    again = await bed.update(bed.order("c2", ck))
    assert (again.cached, again.bytes_fetched, again.version) == (True, 0, "1")
    # a newer version: fetched, loaded, and the oldest beyond `keep` removed
    ck2 = write_checkpoint(bed.source_root, "2", SHAPE, seed=2)
    assert (await bed.update(bed.order("c3", ck2))).version == "2"
    ck3 = write_checkpoint(bed.source_root, "3", SHAPE, seed=3)
    assert (await bed.update(bed.order("c4", ck3))).version == "3"
    assert bed.updater is not None
    assert [p.split("-")[0] for p in bed.updater.store.versions()] == ["2", "3"]


async def test_an_update_while_another_runs_is_refused(bed: Bed) -> None:
    ck = write_checkpoint(bed.source_root, "1", SHAPE, seed=1)
    ck2 = write_checkpoint(bed.source_root, "2", SHAPE, seed=2)
    bed.source.hold = asyncio.Event()
    first = asyncio.ensure_future(bed.update(bed.order("first", ck)))
    await asyncio.wait_for(bed.source.reading.wait(), TIMEOUT)  # it is fetching
    code, details = await bed.refused(bed.order("second", ck2))
    assert code is grpc.StatusCode.ABORTED
    assert "updating its weights to version '1' (command 'first')" in details
    bed.source.hold.set()
    assert (await first).version == "1"
    assert bed.engine.weight_version == "1"


async def test_a_corrupt_checkpoint_is_refused_and_the_old_version_kept(bed: Bed) -> None:
    ck = write_checkpoint(bed.source_root, "1", SHAPE, seed=1)
    weights = ck / checkpoint.WEIGHTS
    data = bytearray(weights.read_bytes())
    data[-7] ^= 0x01
    weights.write_bytes(bytes(data))
    code, details = await bed.refused(bed.order("c1", ck))
    assert code is grpc.StatusCode.INVALID_ARGUMENT
    assert "model.safetensors: SHA-256 of the fetched bytes differs" in details
    assert "keeps serving version '0'" in details
    assert bed.engine.weight_version == "0"


async def test_missing_and_wrong_shape_checkpoints_are_refused_naming_the_cause(
    bed: Bed, tmp_path: Path
) -> None:
    ck = write_checkpoint(bed.source_root, "1", SHAPE, seed=1)
    missing = bed.order("m", ck, version="9")
    code, details = await bed.refused(missing)
    assert code is grpc.StatusCode.NOT_FOUND and ck.name in details
    assert (await bed.update(bed.order("c1", ck))).version == "1"
    other = TinyShape(layers=1, hidden=64, head_dim=32, intermediate=256, vocab=128)
    wrong = write_checkpoint(bed.source_root, "2", other, seed=2)
    code, details = await bed.refused(bed.order("c2", wrong))
    assert code is grpc.StatusCode.INVALID_ARGUMENT
    assert "model.safetensors: tensor model.layers.0.mlp.down_proj.weight has shape" in details
    assert "keeps serving version '1'" in details
    assert bed.engine.weight_version == "1"


async def test_bad_requests_name_the_field(bed: Bed) -> None:
    ck = write_checkpoint(bed.source_root, "1", SHAPE, seed=1)
    for field, value in [
        ("version", "../1"),
        ("checksum", "xyz"),
        ("source_address", "nowhere"),
        ("in_flight", "later"),
        ("timeout_s", -1.0),
        ("streams", 99),
    ]:
        code, details = await bed.refused(bed.order("b", ck, **{field: value}))
        assert code is grpc.StatusCode.INVALID_ARGUMENT, field
        assert details.startswith(f"{field}="), details
    # a stale fencing token: refused, nothing changed
    assert (await bed.update(bed.order("f1", ck, fencing_token=7))).version == "1"
    ck2 = write_checkpoint(bed.source_root, "2", SHAPE, seed=2)
    code, details = await bed.refused(bed.order("f2", ck2, fencing_token=6))
    assert code is grpc.StatusCode.FAILED_PRECONDITION and "fencing token 6" in details
    assert bed.engine.weight_version == "1"
    # one command cannot jam the fence: a token far ahead is refused, and an update that
    # fails (a checksum the checkpoint does not have) leaves the newest token as it was
    code, details = await bed.refused(bed.order("f3", ck2, fencing_token=2**63))
    assert code is grpc.StatusCode.INVALID_ARGUMENT and "at most 1099511627776" in details
    code, details = await bed.refused(
        bed.order("f4", ck2, fencing_token=7 + 2**40, checksum="0" * 64)
    )
    assert bed.engine.weight_version == "1", details
    assert (await bed.update(bed.order("f5", ck2, fencing_token=7))).version == "2"


async def test_an_agent_without_a_checkpoint_dir_refuses(tmp_path: Path) -> None:
    async for bed in bed_for(tmp_path / "a", store=False):
        ck = write_checkpoint(bed.source_root, "1", SHAPE, seed=1)
        code, details = await bed.refused(bed.order("c1", ck))
        assert code is grpc.StatusCode.FAILED_PRECONDITION and "no checkpoint_dir" in details


async def test_a_gateways_engines_take_a_fetched_checkpoint_all_or_nothing(
    tmp_path: Path,
) -> None:
    """Real engine instances behind the gateway (scripted stand-ins loading in place):
    one instance refusing the new weights rolls the other back, the node keeps its
    version; the retry loads the checkpoint already fetched, without fetching again."""
    from node_agent.engines.base import Placement
    from node_agent.gateway.engine import GatewayEngine
    from sim_backends.token_engine import ScriptedEngine

    servers: list[ScriptedEngine] = []

    def make(p: Placement) -> ScriptedEngine:
        servers.append(ScriptedEngine(p, token_delay_s=0.001, in_place_updates=True))
        return servers[-1]

    gateway = GatewayEngine("scripted", 2, (1, 1), make, lambda p: 0, node="gen0-n0")
    await gateway.start()
    source_root = tmp_path / "train"
    store = CheckpointStoreService("train0-n0", CheckpointDir(source_root))
    server = await grpcutil.start_server(
        "127.0.0.1:0",
        lambda s: checkpoints_pb2_grpc.add_CheckpointStoreServicer_to_server(store, s),
        [STORE_SERVICE],
    )
    updater = WeightUpdater(
        "gen0-n0",
        CheckpointDir(tmp_path / "gen"),
        gateway,
        "scripted",
        lambda node, address: GrpcCheckpointSource(node, address, None),
    )
    try:
        ck = write_checkpoint(source_root, "1", SHAPE, seed=1)
        m = checkpoint.parse_manifest((ck / checkpoint.MANIFEST).read_bytes())
        order = order_from_pb(
            pb.UpdateWeightsRequest(
                command_id="g1", version="1", checksum=m.checksum, source_node="train0-n0",
                source_address=server.address, timeout_s=TIMEOUT,
            )
        )  # fmt: skip
        servers[1].fail_updates = 1
        with pytest.raises(errors.FailedPrecondition) as info:
            await updater.update(order)
        assert "instance 1" in str(info.value) and "keeps serving version '0'" in str(info.value)
        assert gateway.weight_version == "0"
        assert [s.model for s in servers] == ["scripted-0", "scripted-0"]  # rolled back
        done = await updater.update(order)
        assert (done.version, done.cached, done.bytes_fetched, done.how) == (
            "1",
            True,
            0,
            "in place",
        )
        assert gateway.weight_version == "1"
        assert {s.model for s in servers} == {str(tmp_path / "gen" / ck.name)}
    finally:
        await server.stop(0)
        await gateway.close()
