"""`set_phase("weight-sync", checkpoint=..., source=...)` over the controller's gRPC API,
in process: the controller commits the weight-sync epoch, then every generation node's
agent fetches the checkpoint from the training node's agent and loads it; the answer says
when every one runs it. A checkpoint the source lacks changes no circuit; a node that
fails is named (it keeps its version) and the epoch stays committed; a phase change asked
for during the sync waits for it."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from fabric_controller import cli
from node_agent.commands import CommandLog
from node_agent.nics import SysfsNics
from node_agent.servicer import SERVICE_NAME, NodeAgentService
from node_agent.telemetry import Collector
from node_agent.weights.fetch import GrpcCheckpointSource
from node_agent.weights.store import SERVICE_NAME as STORE_SERVICE
from node_agent.weights.store import CheckpointDir, CheckpointStoreService
from node_agent.weights.update import WeightUpdater
from orchestrrl import errors, grpcutil
from orchestrrl.client import AsyncClient, WeightSyncIncomplete
from orchestrrl.model import Role, Wiring
from orchestrrl.v1 import checkpoints_pb2, checkpoints_pb2_grpc
from orchestrrl.v1 import node_agent_pb2_grpc as pb_grpc
from sim_backends.engine import SimulatedEngine
from sim_backends.gpus import SimulatedGpus
from sim_backends.harness import Fabric, start_fabric
from sim_backends.tiny_models import TinyShape, write_checkpoint

pytestmark = pytest.mark.component

SHAPE = TinyShape(layers=1, hidden=64, head_dim=32, intermediate=128, vocab=128)


class GatedStore(CheckpointStoreService):
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
class Cluster:
    fabric: Fabric
    client: AsyncClient
    train_root: Path
    store: GatedStore
    engines: dict[str, SimulatedEngine] = field(default_factory=dict)


async def serve_agent(
    node: str, root: Path | None, stack: list[Any], *, store_service: GatedStore | None = None
) -> tuple[str, SimulatedEngine]:
    engine = SimulatedEngine(2, (1, 1), seed=1)
    updater = (
        WeightUpdater(
            node,
            CheckpointDir(root),
            engine,
            "sim",
            lambda n, a: GrpcCheckpointSource(n, a, None),
        )
        if root is not None
        else None
    )
    collector = Collector(
        node,
        SimulatedGpus(2, seed=1),
        SysfsNics([]),
        engine,
        weight_version=lambda: engine.weight_version,
        checkpoints=root is not None,
    )
    await collector.open()
    commands = CommandLog()
    agent = NodeAgentService(collector, engine, commands, 0.05, weights=updater)
    ck = store_service or CheckpointStoreService(node, CheckpointDir(root) if root else None)

    def register(s: Any) -> None:
        pb_grpc.add_NodeAgentServicer_to_server(agent, s)
        checkpoints_pb2_grpc.add_CheckpointStoreServicer_to_server(ck, s)

    server = await grpcutil.start_server("127.0.0.1:0", register, [SERVICE_NAME, STORE_SERVICE])
    stack.append((server, commands))
    return server.address, engine


@pytest.fixture
async def cluster(example_wiring: Wiring, tmp_path: Path) -> AsyncIterator[Cluster]:
    fabric = await start_fabric(
        example_wiring, tmp_path / "state.db", switching_time_s=0.001, deadline_s=60.0,
        lock_timeout_s=0.5,
    )  # fmt: skip
    stack: list[Any] = []
    train_root = tmp_path / "ckpt" / "train0-n0"
    store = GatedStore("train0-n0", CheckpointDir(train_root))
    c = Cluster(fabric, AsyncClient(fabric.address, timeout_s=20), train_root, store)
    try:
        for n in example_wiring.nodes:
            if n.name == "train0-n0":
                address, _ = await serve_agent(n.name, train_root, stack, store_service=store)
            elif n.name == "train1-n0":  # a training node without a checkpoint_dir
                address, _ = await serve_agent(n.name, None, stack)
            elif n.role is Role.GEN:
                root = tmp_path / "ckpt" / n.name
                address, c.engines[n.name] = await serve_agent(n.name, root, stack)
            else:
                continue
            fabric.controller.register(n.name, address, "sim", n.gpus, "sim")
        yield c
    finally:
        await c.client.close()
        for server, commands in stack:
            await server.stop(0)
            await commands.close()
        await fabric.stop()


async def test_every_generation_node_runs_the_new_version(cluster: Cluster) -> None:
    write_checkpoint(cluster.train_root, "1", SHAPE, seed=1)
    change = await cluster.client.set_phase(
        "weight-sync", request_id="s1", checkpoint="1", source="train0-n0", streams=2
    )
    ws = change.weight_sync
    assert ws is not None and change.phase == "weight-sync" and change.changed
    assert ws.complete and ws.epoch == change.epoch and ws.source_node == "train0-n0"
    assert [n.node for n in ws.nodes] == ["gen0-n0", "gen0-n1", "gen1-n0", "gen1-n1"]
    for n in ws.nodes:
        assert (n.ok, n.version, n.previous, n.bytes_fetched) == (
            True,
            "1",
            "0",
            ws.checkpoint_bytes,
        )
        assert n.circuits > 0 and n.mbytes_per_s > 0 and n.streams == 2 and not n.error
        assert cluster.engines[n.node].weight_version == "1"
    assert ws.completed_at == max(n.finished_at for n in ws.nodes)
    assert "serves on all 4 generation node(s)" in ws.message
    # the same request again: the agents answer with their first results, no new epoch
    again = await cluster.client.set_phase(
        "weight-sync", request_id="s1", checkpoint="1", source="train0-n0", streams=2
    )
    assert again.weight_sync is not None and not again.changed
    assert [n.bytes_fetched for n in again.weight_sync.nodes] == [n.bytes_fetched for n in ws.nodes]
    # the nodes report the version they serve
    nodes = {n.node: n for n in await cluster.client.nodes()}
    assert nodes["gen0-n0"].health == "up"


async def test_a_node_that_fails_is_named_and_keeps_its_version(
    cluster: Cluster, capsys: pytest.CaptureFixture[str]
) -> None:
    write_checkpoint(cluster.train_root, "1", SHAPE, seed=1)
    cluster.fabric.controller.register("gen1-n1", "127.0.0.1:1", "sim", 8, "sim")  # nobody there
    with pytest.raises(WeightSyncIncomplete) as info:
        await cluster.client.set_phase("weight-sync", checkpoint="1", source="train0-n0")
    change = info.value.change
    ws = change.weight_sync
    assert ws is not None and not ws.complete and ws.completed_at == 0.0
    failed = {n.node: n for n in ws.nodes if not n.ok}
    assert list(failed) == ["gen1-n1"] and "UNAVAILABLE" in failed["gen1-n1"].error
    assert cluster.engines["gen1-n1"].weight_version == "0"
    assert "serves on 3 of 4" in ws.message and "gen1-n1" in str(info.value)
    # the epoch is committed either way
    assert (await cluster.client.get_phase()).phase == "weight-sync"
    # orlctl prints the whole answer and exits 1
    capsys.readouterr()
    argv = ["--controller", cluster.fabric.address, "--json", "phase", "set", "weight-sync"]
    argv += ["--checkpoint", "1", "--from", "train0-n0"]
    assert await asyncio.to_thread(cli.main, argv) == 1
    captured = capsys.readouterr()
    printed = json.loads(captured.out[captured.out.index("{\n") :])
    assert printed["weight_sync"]["complete"] is False
    assert [n["node"] for n in printed["weight_sync"]["nodes"] if not n["ok"]] == ["gen1-n1"]
    assert "orlctl: error: version 1 serves on 3 of 4" in captured.err


async def test_a_checkpoint_the_source_lacks_changes_no_circuit(cluster: Cluster) -> None:
    await cluster.client.set_phase("generation")
    before = await cluster.client.get_phase()
    with pytest.raises(errors.NotFound, match="no checkpoint 5"):
        await cluster.client.set_phase("weight-sync", checkpoint="5", source="train0-n0")
    with pytest.raises(errors.FailedPrecondition, match="serves no checkpoints"):
        await cluster.client.set_phase("weight-sync", checkpoint="5", source="train1-n0")
    with pytest.raises(errors.FailedPrecondition, match="never registered"):
        await cluster.client.set_phase("weight-sync", checkpoint="5", source="train1-n1")
    with pytest.raises(errors.InvalidArgument, match=r"^controller .*checkpoint="):
        await cluster.client.set_phase("training", checkpoint="5", source="train0-n0")
    after = await cluster.client.get_phase()
    assert (after.epoch, after.phase) == (before.epoch, "generation")


async def test_a_phase_change_waits_for_the_bytes(cluster: Cluster) -> None:
    write_checkpoint(cluster.train_root, "1", SHAPE, seed=1)
    cluster.store.hold = asyncio.Event()
    sync = asyncio.ensure_future(
        cluster.client.set_phase("weight-sync", checkpoint="1", source="train0-n0")
    )
    await asyncio.wait_for(cluster.store.reading.wait(), 10)  # the bytes are moving
    with pytest.raises(errors.Aborted, match="weight sync of version 1 from train0-n0"):
        await cluster.client.set_phase("generation")
    cluster.store.hold.set()
    assert (await sync).weight_sync is not None
    assert (await cluster.client.get_phase()).phase == "weight-sync"


async def test_a_sync_may_outlast_the_clients_own_timeout(cluster: Cluster) -> None:
    """The client waits sync_timeout_s more than its timeout for a weight sync."""
    write_checkpoint(cluster.train_root, "1", SHAPE, seed=1)
    cluster.store.hold = asyncio.Event()
    async with AsyncClient(cluster.fabric.address, timeout_s=1.0) as quick:
        sync = asyncio.ensure_future(
            quick.set_phase("weight-sync", checkpoint="1", source="train0-n0", sync_timeout_s=60)
        )
        await asyncio.wait_for(cluster.store.reading.wait(), 10)
        await asyncio.sleep(1.5)  # the bytes are held past the client's 1 s
        assert not sync.done()
        cluster.store.hold.set()
        change = await sync
    assert change.weight_sync is not None and change.weight_sync.complete


async def test_in_async_mode_the_bytes_take_the_standing_circuits(cluster: Cluster) -> None:
    entered = await cluster.client.set_mode("async")
    write_checkpoint(cluster.train_root, "1", SHAPE, seed=1)
    change = await cluster.client.set_phase(
        "weight-sync", request_id="a1", checkpoint="1", source="train0-n0"
    )
    ws = change.weight_sync
    assert ws is not None and ws.complete
    # no circuit moved: the epoch is the async one, its circuits carried the bytes
    assert (change.epoch, change.phase, change.changed) == (entered.epoch, "async", False)
    assert ws.epoch == entered.epoch
    for n in ws.nodes:
        assert n.ok and n.version == "1" and n.bytes_fetched == ws.checkpoint_bytes
        assert n.circuits > 0
        assert cluster.engines[n.node].weight_version == "1"
    with pytest.raises(errors.FailedPrecondition, match="async mode"):
        await cluster.client.set_phase("generation")
