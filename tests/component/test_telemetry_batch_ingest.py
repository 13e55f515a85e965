"""The controller's ReportTelemetryBatch over real gRPC: what it stores, counts and refuses."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from orchestrrl.client import AsyncClient
from orchestrrl.model import Wiring
from orchestrrl.v1 import fabric_controller_pb2 as pb
from orchestrrl.v1 import fabric_controller_pb2_grpc as pb_grpc
from orchestrrl.v1 import node_agent_pb2
from sim_backends.harness import start_fabric

pytestmark = pytest.mark.component


def sample(node: str, timestamp: float, tokens_per_s: float) -> bytes:
    s = node_agent_pb2.TelemetrySample(node=node, timestamp=timestamp)
    s.engine.tokens_per_s = tokens_per_s
    s.engine.has_progress = True
    s.engine.requests.add(request_id="r1", instance=0, prompt_tokens=5, generated_tokens=3)
    return s.SerializeToString()


async def test_batches_store_the_newest_sample_and_count_them_all(
    example_wiring: Wiring, tmp_path: Path
) -> None:
    f = await start_fabric(example_wiring, tmp_path / "s.db")
    metrics = f.controller.metrics.registry
    try:
        async with grpc.aio.insecure_channel(f.address) as ch, AsyncClient(f.address) as c:
            stub = pb_grpc.FabricControllerStub(ch)
            await stub.Register(
                pb.RegisterRequest(node="gen0-n0", agent_address="127.0.0.1:1"), timeout=5
            )
            before = metrics.get_sample_value("orl_telemetry_samples_total") or 0.0
            batches = [
                node_agent_pb2.TelemetryBatch(
                    samples=[sample("gen0-n0", t, t * 100) for t in (1.0, 2.0, 3.0)]
                ),
                node_agent_pb2.TelemetryBatch(),  # empty: ignored
                node_agent_pb2.TelemetryBatch(samples=[sample("gen0-n0", 4.0, 400.0)]),
            ]
            reply = await stub.ReportTelemetryBatch(iter(batches), timeout=5)
            assert reply.accepted == 4
            assert metrics.get_sample_value("orl_telemetry_samples_total") == before + 4
            # one lag observation per upload (its newest sample)
            assert metrics.get_sample_value("orl_telemetry_lag_seconds_count") == 2
            nodes = {n.node: n for n in await c.nodes()}
            assert nodes["gen0-n0"].telemetry["tokens_per_s"] == 400.0
            assert nodes["gen0-n0"].health == "up"

            bad = node_agent_pb2.TelemetryBatch(
                samples=[sample("gen0-n0", 5.0, 500.0), sample("nope", 5.0, 1.0)]
            )
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.ReportTelemetryBatch(iter([bad]), timeout=5)
            assert info.value.code() is grpc.StatusCode.NOT_FOUND
            assert "node 'nope' is not in the wiring" in (info.value.details() or "")
            unregistered = node_agent_pb2.TelemetryBatch(samples=[sample("train0-n0", 5.0, 1.0)])
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.ReportTelemetryBatch(iter([unregistered]), timeout=5)
            assert info.value.code() is grpc.StatusCode.FAILED_PRECONDITION
            nodes = {n.node: n for n in await c.nodes()}
            assert nodes["gen0-n0"].telemetry["tokens_per_s"] == 400.0  # nothing stored
            assert metrics.get_sample_value("orl_telemetry_samples_total") == before + 4
    finally:
        await f.stop()
