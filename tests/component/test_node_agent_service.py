"""The NodeAgent service over real gRPC (127.0.0.1:0) with simulated GPUs and engine."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, cast

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from node_agent.commands import CommandLog
from node_agent.engine import EngineState
from node_agent.nics import SysfsNics
from node_agent.servicer import SERVICE_NAME, NodeAgentService
from node_agent.telemetry import Collector
from orchestrrl import __version__, grpcutil
from orchestrrl.v1 import node_agent_pb2 as pb
from orchestrrl.v1 import node_agent_pb2_grpc as pb_grpc
from sim_backends.engine import SimulatedEngine
from sim_backends.gpus import SimulatedGpus

if TYPE_CHECKING:
    from orchestrrl.v1.node_agent_pb2_grpc import NodeAgentAsyncStub

pytestmark = pytest.mark.component

TIMEOUT = 5.0


@dataclass
class Agent:
    stub: NodeAgentAsyncStub
    channel: grpc.aio.Channel
    engine: SimulatedEngine


def write_nic(root: Path, name: str, rx: int, tx: int) -> None:
    (root / name / "statistics").mkdir(parents=True, exist_ok=True)
    (root / name / "statistics" / "rx_bytes").write_text(str(rx))
    (root / name / "statistics" / "tx_bytes").write_text(str(tx))
    (root / name / "operstate").write_text("up\n")


@pytest.fixture
async def agent(tmp_path: Path) -> AsyncIterator[Agent]:
    write_nic(tmp_path, "eth0", 1000, 2000)
    released = asyncio.Event()
    released.set()  # a test clears it to hold a reshard in its relayout stage
    engine = SimulatedEngine(8, (2, 2, 2, 2), seed=1, relayout_delay_s=0.2, relayout_hold=released)
    gpus = SimulatedGpus(8, seed=1)
    nics = SysfsNics([("eth0", 400.0), ("eth9", None)], root=tmp_path)
    collector = Collector("gen0-n0", gpus, nics, engine)
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
            yield Agent(stub, channel, engine)
    finally:
        await running.stop(grace=0)
        await commands.close()


async def status_code(call: object) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call  # type: ignore[misc]
    return info.value.code(), info.value.details() or ""


async def test_health_reports_serving(agent: Agent) -> None:
    health = health_pb2_grpc.HealthStub(agent.channel)
    reply = await health.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=TIMEOUT)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


async def test_get_status(agent: Agent) -> None:
    status = await agent.stub.GetStatus(pb.GetStatusRequest(), timeout=TIMEOUT)
    assert status.node == "gen0-n0"
    assert status.gpu_backend == "sim"
    assert [g.index for g in status.gpus] == list(range(8))
    assert all(g.memory_total_bytes == 80 * 2**30 for g in status.gpus)
    assert [(n.name, n.speed_gbps) for n in status.nics] == [("eth0", 400.0), ("eth9", 0.0)]
    assert status.engine_state == pb.ENGINE_STATE_RUNNING
    assert list(status.tp_layout) == [2, 2, 2, 2]
    assert status.version == __version__


async def test_stream_telemetry(agent: Agent) -> None:
    samples = []
    stream = agent.stub.StreamTelemetry(pb.StreamTelemetryRequest(interval_s=0.05))
    async for sample in stream:
        samples.append(sample)
        if len(samples) == 3:
            stream.cancel()
            break
    assert [s.node for s in samples] == ["gen0-n0"] * 3
    assert samples[0].timestamp < samples[1].timestamp < samples[2].timestamp
    last = samples[-1]
    assert len(last.gpus) == 8
    assert all(g.memory_total_bytes == 80 * 2**30 for g in last.gpus)
    assert [(n.name, n.oper_up, n.rx_bytes) for n in last.nics] == [
        ("eth0", True, 1000),
        ("eth9", False, 0),
    ]
    assert last.engine_state == pb.ENGINE_STATE_RUNNING
    assert list(last.tp_layout) == [2, 2, 2, 2]
    assert last.HasField("engine")


async def test_stream_telemetry_default_interval(agent: Agent) -> None:
    stream = agent.stub.StreamTelemetry(pb.StreamTelemetryRequest())
    first = await stream.read()
    second = await stream.read()
    stream.cancel()
    assert isinstance(first, pb.TelemetrySample)
    assert isinstance(second, pb.TelemetrySample)
    assert second.timestamp > first.timestamp


@pytest.mark.parametrize("interval", [0.01, -1.0, 3601.0])
async def test_stream_telemetry_rejects_bad_intervals(agent: Agent, interval: float) -> None:
    stream = agent.stub.StreamTelemetry(pb.StreamTelemetryRequest(interval_s=interval))
    code, details = await status_code(stream.read())
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert details.startswith(f"interval_s={interval!r}")
    assert "between 0.05 and 3600 seconds" in details


async def test_drain_and_resume_are_idempotent_by_command_id(agent: Agent) -> None:
    drained = await agent.stub.Drain(pb.DrainRequest(command_id="d1"), timeout=TIMEOUT)
    assert drained.engine_state == pb.ENGINE_STATE_DRAINED
    resumed = await agent.stub.Resume(pb.ResumeRequest(command_id="r1"), timeout=TIMEOUT)
    assert resumed.engine_state == pb.ENGINE_STATE_RUNNING
    # A retried Drain (same id) returns its first result and does not drain again.
    again = await agent.stub.Drain(pb.DrainRequest(command_id="d1"), timeout=TIMEOUT)
    assert again == drained
    status = await agent.stub.GetStatus(pb.GetStatusRequest(), timeout=TIMEOUT)
    assert status.engine_state == pb.ENGINE_STATE_RUNNING
    # A new id is a new command.
    drained2 = await agent.stub.Drain(pb.DrainRequest(command_id="d2"), timeout=TIMEOUT)
    assert drained2.engine_state == pb.ENGINE_STATE_DRAINED


async def test_reshard_is_idempotent_by_command_id(agent: Agent) -> None:
    request = pb.ReshardRequest(command_id="s1", tp_layout=[4, 4])
    first = await agent.stub.Reshard(request, timeout=TIMEOUT)
    assert first.command_id == "s1"
    assert list(first.old_layout) == [2, 2, 2, 2]
    assert list(first.new_layout) == [4, 4]
    assert [s.stage for s in first.stages] == ["pause", "relayout", "resume"]
    assert first.bytes_moved == 0
    assert first.message == "simulated engine: layout changed, no weights moved"
    status = await agent.stub.GetStatus(pb.GetStatusRequest(), timeout=TIMEOUT)
    assert list(status.tp_layout) == [4, 4]
    assert status.engine_state == pb.ENGINE_STATE_RUNNING

    back = pb.ReshardRequest(command_id="s2", tp_layout=[8])
    assert list((await agent.stub.Reshard(back, timeout=TIMEOUT)).new_layout) == [8]
    assert await agent.stub.Reshard(request, timeout=TIMEOUT) == first  # replayed, not re-run
    assert agent.engine.tp_layout == (8,)

    changed = pb.ReshardRequest(command_id="s1", tp_layout=[1] * 8)
    code, details = await status_code(agent.stub.Reshard(changed, timeout=TIMEOUT))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert "command_id='s1' was already used" in details


async def test_concurrent_retries_of_one_reshard_share_its_result(agent: Agent) -> None:
    request = pb.ReshardRequest(command_id="s1", tp_layout=[8])
    first, second = await asyncio.gather(
        agent.stub.Reshard(request, timeout=TIMEOUT), agent.stub.Reshard(request, timeout=TIMEOUT)
    )
    assert first == second
    assert list(first.new_layout) == [8]


async def test_reshard_rejects_a_bad_layout(agent: Agent) -> None:
    call = agent.stub.Reshard(pb.ReshardRequest(command_id="s1", tp_layout=[3, 5]), timeout=TIMEOUT)
    code, details = await status_code(call)
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert details.startswith("tp_layout=[3, 5] is not valid")
    assert "power of two" in details
    call = agent.stub.Reshard(pb.ReshardRequest(command_id="s2", tp_layout=[4]), timeout=TIMEOUT)
    code, details = await status_code(call)
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert "sum to the node's GPU count 8" in details


async def test_commands_during_a_reshard_are_aborted(agent: Agent) -> None:
    hold = agent.engine.relayout_hold
    assert hold is not None
    hold.clear()  # the reshard stays in progress until the commands have been refused
    reshard = asyncio.ensure_future(
        agent.stub.Reshard(pb.ReshardRequest(command_id="s1", tp_layout=[8]), timeout=TIMEOUT)
    )
    async with asyncio.timeout(TIMEOUT):
        while agent.engine.state is not EngineState.RESHARDING:  # noqa: ASYNC110 - polls the engine
            await asyncio.sleep(0.005)
    status = await agent.stub.GetStatus(pb.GetStatusRequest(), timeout=TIMEOUT)
    assert status.engine_state == pb.ENGINE_STATE_RESHARDING
    code, details = await status_code(
        agent.stub.Drain(pb.DrainRequest(command_id="d1"), timeout=TIMEOUT)
    )
    assert code == grpc.StatusCode.ABORTED
    assert "reshard" in details
    hold.set()
    assert list((await reshard).new_layout) == [8]
    # The aborted Drain was not remembered: retrying its id works now.
    drained = await agent.stub.Drain(pb.DrainRequest(command_id="d1"), timeout=TIMEOUT)
    assert drained.engine_state == pb.ENGINE_STATE_DRAINED


@pytest.mark.parametrize("method", ["Drain", "Resume", "Reshard"])
async def test_empty_command_id_is_rejected(agent: Agent, method: str) -> None:
    requests = {
        "Drain": pb.DrainRequest(),
        "Resume": pb.ResumeRequest(),
        "Reshard": pb.ReshardRequest(tp_layout=[8]),
    }
    call = getattr(agent.stub, method)(requests[method], timeout=TIMEOUT)
    code, details = await status_code(call)
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert details.startswith("command_id='' is not valid")


async def test_apply_routes_without_a_route_backend_changes_nothing(agent: Agent) -> None:
    # this servicer was built without host routes: it must refuse, never pretend
    request = pb.ApplyRoutesRequest(
        command_id="a1", routes=[pb.Route(destination="10.0.0.0/24", gateways=["10.1.0.1"])]
    )
    code, details = await status_code(agent.stub.ApplyRoutes(request, timeout=TIMEOUT))
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    assert "ApplyRoutes" in details


def migrating(rid: str, instance: int = 0) -> pb.RequestState:
    return pb.RequestState(
        request_id=rid,
        prompt_tokens=512,
        generated_tokens=100,
        max_tokens=16384,
        source_instance=instance,
        engine_state=b'{"output_tokens": 9000}',
    )


async def test_import_refuses_a_request_id_twice_and_changes_nothing(agent: Agent) -> None:
    def imported(command_id: str, *ids: str) -> object:
        return agent.stub.ImportRequests(
            pb.ImportRequestsRequest(
                command_id=command_id,
                instance=0,
                method=pb.MIGRATION_METHOD_RECOMPUTE,
                requests=[migrating(i) for i in ids],
            ),
            timeout=TIMEOUT,
        )

    def on_node() -> list[str]:
        return sorted(r.request_id for r in agent.engine.progress().requests)

    before = on_node()
    code, details = await status_code(imported("i1", "m-1", "m-2", "m-1"))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert "requests=['m-1'] is not valid: each request id once per import" in details
    assert on_node() == before  # nothing admitted, not even m-2
    reply = await imported("i2", "m-1")  # type: ignore[misc]
    assert list(reply.admitted) == ["m-1"]
    code, details = await status_code(imported("i3", "m-2", "m-1"))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "'m-1'" in details
    assert on_node() == sorted([*before, "m-1"])
