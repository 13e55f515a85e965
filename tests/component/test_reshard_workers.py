"""Resharding across real worker processes over gloo: one pool of 8 for the module."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator, MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import grpc
import pytest
from structlog.testing import capture_logs

from node_agent.commands import CommandLog
from node_agent.config import SIM_ENGINE, AgentConfig
from node_agent.daemon import run_agent
from node_agent.engine import EngineState
from node_agent.nics import SysfsNics
from node_agent.reshard.engine import STAGES, TorchReshardEngine
from node_agent.reshard.plan import synthetic_model
from node_agent.reshard.protocol import InjectedFailure
from node_agent.reshard.weights import expected_checksums
from node_agent.reshard.workers import WorkerPool
from node_agent.servicer import SERVICE_NAME, NodeAgentService
from node_agent.telemetry import Collector
from node_agent.uplink import UplinkSettings
from orchestrrl import errors, grpcutil
from orchestrrl.v1 import node_agent_pb2 as pb
from orchestrrl.v1 import node_agent_pb2_grpc as pb_grpc
from sim_backends.engine import SimulatedEngine
from sim_backends.gpus import SimulatedGpus

if TYPE_CHECKING:
    from orchestrrl.v1.node_agent_pb2_grpc import NodeAgentAsyncStub

pytestmark = pytest.mark.component

GPUS = 8
SEED = 11
MODEL = synthetic_model(layers=2, hidden=256, ffn=1024, vocab=1024)
TIMEOUT = 60.0


@dataclass
class Pool:
    pool: WorkerPool
    expected: dict[str, str]
    start_logs: list[MutableMapping[str, Any]]


@pytest.fixture(scope="module")
def shared() -> Iterator[Pool]:
    pool = WorkerPool(GPUS, (8,), model=MODEL, seed=SEED, backend="auto", timeout_s=TIMEOUT)
    with capture_logs() as logs:
        pool.start()
    try:
        yield Pool(pool, expected_checksums(MODEL, SEED), logs)
    finally:
        pool.stop()


def go(pool: WorkerPool, layout: tuple[int, ...]) -> None:
    """Bring the shared pool to ``layout`` (tests do not depend on each other's order)."""
    if pool.layout != layout:
        pool.reshard(layout)


def test_the_pool_holds_the_seeded_model_and_logged_its_backend(shared: Pool) -> None:
    assert shared.pool.backend == "gloo"
    chosen = [e for e in shared.start_logs if e["event"] == "torch_distributed_backend"]
    assert chosen == [
        {
            "event": "torch_distributed_backend",
            "log_level": "info",
            "backend": "gloo",
            "reason": "CUDA is not available",
            "ranks": GPUS,
            "torch": chosen[0]["torch"],
        }
    ]
    assert len(set(shared.pool.pids)) == GPUS
    assert shared.pool.checksum() == shared.expected


WALK = [(4, 4), (2, 2, 2, 2), (1,) * 8, (2, 2, 2, 2), (4, 4), (8,), (4, 2, 2), (2, 4, 2), (8,)]


def test_walk_tp_1_2_4_8_and_back(shared: Pool) -> None:
    pool = shared.pool
    go(pool, (8,))
    for layout in WALK:
        plan = pool.plan(layout)
        report = pool.reshard(layout)
        assert (report.old_layout, report.new_layout) == (plan.old_layout, layout)
        assert pool.layout == layout
        assert report.bytes_moved == report.plan_bytes == plan.bytes_moved
        for w in report.workers:
            assert w.sent_bytes == plan.sent_bytes(w.rank)
            assert w.received_bytes == plan.received_bytes(w.rank)
        if plan.is_empty:  # more replicas -> fewer: every rank already holds its new shard
            assert report.bytes_moved == 0
        else:
            assert report.bytes_moved > 0
            assert report.senders > 1  # no single-sender funnel
        assert report.checksums == shared.expected
        assert pool.checksum() == shared.expected
    # growing TP from replicas is free; the other steps all move bytes
    assert pool.plan((4, 4)).bytes_moved > 0
    assert pool.plan((8,)).is_empty


@pytest.mark.parametrize("mode", ["raise", "stall"])
def test_a_failure_mid_move_keeps_the_old_layout(shared: Pool, mode: str) -> None:
    pool = shared.pool
    go(pool, (4, 4))
    inject = InjectedFailure(rank=5, after_sends=1, mode=cast(Any, mode))
    with pytest.raises(errors.FailedPrecondition) as info:
        pool.reshard((2, 2, 2, 2), inject=inject, timeout_s=2.0 if mode == "stall" else None)
    message = str(info.value)
    assert message.startswith("reshard [4, 4] -> [2, 2, 2, 2] failed: ")
    if mode == "raise":
        assert "rank 5: InjectedError: injected failure on rank 5 after 1 of" in message
    else:
        assert "timed out after 2 s waiting for ranks" in message
    assert message.endswith("every worker dropped what it had staged and kept layout [4, 4]")
    assert pool.layout == (4, 4)
    assert pool.broken is None
    assert pool.checksum() == shared.expected
    report = pool.reshard((2, 2, 2, 2))  # the fresh process group works
    assert report.bytes_moved > 0
    assert pool.checksum() == shared.expected


@pytest.mark.parametrize(
    ("layout", "rule"),
    [
        ((4, 2), "sum to the node's GPU count 8"),
        ((4, 4, 4), "sum to the node's GPU count 8"),
        ((3, 5), "power of two"),
        ((6, 2), "power of two"),
        ((16,), "power of two in 1..8"),
    ],
)
def test_a_layout_that_does_not_fit_is_refused_before_anything_moves(
    shared: Pool, layout: tuple[int, ...], rule: str
) -> None:
    pool = shared.pool
    before, sent = pool.layout, pool.commands_sent
    with pytest.raises(errors.InvalidArgument) as info:
        pool.reshard(layout)
    assert str(info.value).startswith(f"tp_layout={list(layout)!r} is not valid")
    assert rule in str(info.value)
    assert pool.commands_sent == sent  # no worker was asked anything
    assert pool.layout == before


def test_a_layout_whose_shards_exceed_gpu_memory_is_refused() -> None:
    tiny = synthetic_model(layers=1, hidden=64, ffn=128, vocab=64)
    pool = WorkerPool(2, (2,), model=tiny, memory_bytes=tiny.nbytes // 2 + 1024)
    with pytest.raises(errors.InvalidArgument, match="use larger TP degrees"):
        pool.check((1, 1))
    with pytest.raises(errors.InvalidArgument, match="use larger TP degrees"):
        WorkerPool(2, (1, 1), model=tiny, memory_bytes=tiny.nbytes // 2 + 1024)


def test_a_worker_that_dies_mid_move_stops_the_pool_with_a_clear_error() -> None:
    tiny = synthetic_model(layers=1, hidden=64, ffn=128, vocab=64)
    with WorkerPool(2, (2,), model=tiny, seed=1, timeout_s=TIMEOUT) as pool:
        with pytest.raises(errors.FailedPrecondition) as info:
            pool.reshard((1, 1), inject=InjectedFailure(rank=1, after_sends=0, mode="exit"))
        message = str(info.value)
        assert "reshard [2] -> [1, 1] failed: worker rank 1 exited by an injected failure" in (
            message
        )
        assert message.endswith("restart the agent to reload the model")
        assert pool.broken == message
        with pytest.raises(errors.FailedPrecondition, match="restart the agent"):
            pool.reshard((1, 1))


async def test_engine_failure_resumes_on_the_old_layout(shared: Pool) -> None:
    pool = shared.pool
    go(pool, (2, 2, 2, 2))
    engine = TorchReshardEngine(SimulatedEngine(GPUS, pool.layout, seed=3), pool)
    with pytest.raises(errors.FailedPrecondition) as info:
        await engine.reshard([8], inject=InjectedFailure(rank=2))
    assert "failed while moving weights" in str(info.value)
    assert "injected failure on rank 2" in str(info.value)
    assert engine.state is EngineState.RUNNING
    assert engine.tp_layout == pool.layout == (2, 2, 2, 2)
    assert pool.checksum() == shared.expected


@dataclass
class Agent:
    stub: NodeAgentAsyncStub
    engine: TorchReshardEngine


@pytest.fixture
async def agent(shared: Pool) -> AsyncIterator[Agent]:
    pool = shared.pool
    go(pool, (2, 2, 2, 2))
    engine = TorchReshardEngine(SimulatedEngine(GPUS, pool.layout, seed=1), pool)
    collector = Collector("gen0-n0", SimulatedGpus(GPUS, seed=1), SysfsNics([]), engine)
    await collector.open()
    commands = CommandLog()
    servicer = NodeAgentService(collector, engine, commands, default_interval_s=0.05)
    running = await grpcutil.start_server(
        "127.0.0.1:0",
        lambda server: pb_grpc.add_NodeAgentServicer_to_server(servicer, server),
        [SERVICE_NAME],
    )
    try:
        async with grpcutil.insecure_channel(running.address) as channel:
            stub = cast("NodeAgentAsyncStub", pb_grpc.NodeAgentStub(channel))
            yield Agent(stub, engine)
    finally:
        await running.stop(grace=0)
        await commands.close()  # the pool belongs to the module: not closed here


async def test_reshard_rpc_moves_real_weights(agent: Agent, shared: Pool) -> None:
    plan = shared.pool.plan((4, 4))
    request = pb.ReshardRequest(command_id="r1", tp_layout=[4, 4])
    reply = await agent.stub.Reshard(request, timeout=TIMEOUT)
    assert list(reply.old_layout) == [2, 2, 2, 2]
    assert list(reply.new_layout) == [4, 4]
    assert [s.stage for s in reply.stages] == list(STAGES)
    assert reply.bytes_moved == plan.bytes_moved > 0
    assert reply.message.startswith(
        f"moved {plan.bytes_moved} bytes of weight shards over torch.distributed (gloo; "
    )
    assert await agent.stub.Reshard(request, timeout=TIMEOUT) == reply  # replayed, not re-run
    status = await agent.stub.GetStatus(pb.GetStatusRequest(), timeout=TIMEOUT)
    assert list(status.tp_layout) == [4, 4]
    assert status.engine_state == pb.ENGINE_STATE_RUNNING
    assert shared.pool.checksum() == shared.expected

    bad = pb.ReshardRequest(command_id="r2", tp_layout=[4, 2])
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await agent.stub.Reshard(bad, timeout=TIMEOUT)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "sum to the node's GPU count 8" in (info.value.details() or "")
    assert agent.engine.tp_layout == (4, 4)


async def test_the_agent_starts_and_stops_its_worker_pool(tmp_path: Path) -> None:
    ready = tmp_path / "agent.ready"
    config = AgentConfig(
        engine=SIM_ENGINE,
        node="gen0-n1",
        listen="127.0.0.1:0",
        gpus=2,
        gpu_backend="sim",
        tp_layout=(2,),
        reshard_backend="torch",
        ready_file=ready,
        seed=1,
    )
    stop = asyncio.Event()
    nowhere = UplinkSettings(rpc_timeout_s=1.0, backoff_initial_s=1.0, backoff_max_s=1.0)
    with capture_logs() as logs:
        agent = asyncio.create_task(
            run_agent(config, stop.wait, controller=lambda: "127.0.0.1:1", uplink_settings=nowhere)
        )
        try:
            async with asyncio.timeout(TIMEOUT):
                while not ready.exists():  # noqa: ASYNC110 - the agent writes it when serving
                    await asyncio.sleep(0.05)
            async with grpcutil.insecure_channel(ready.read_text().strip()) as channel:
                stub = cast("NodeAgentAsyncStub", pb_grpc.NodeAgentStub(channel))
                request = pb.ReshardRequest(command_id="r1", tp_layout=[1, 1])
                reply = await stub.Reshard(request, timeout=TIMEOUT)
        finally:
            stop.set()
            async with asyncio.timeout(TIMEOUT):
                assert await agent == 0
    assert list(reply.new_layout) == [1, 1]
    assert reply.bytes_moved > 0
    events = [e["event"] for e in logs]
    backend = next(e for e in logs if e["event"] == "torch_distributed_backend")
    assert backend["backend"] == "gloo"
    serving = next(e for e in logs if e["event"] == "serving")
    assert serving["reshard_backend"] == "torch"
    assert events.index("torch_distributed_backend") < events.index("serving")
    assert events.index("reshard_workers_stopped") > events.index("stopping")
