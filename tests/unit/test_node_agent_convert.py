"""The agent's telemetry as protobuf: GPU extras, RDMA ports, engine progress, batches."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from node_agent import convert
from node_agent.engine import EngineProgress, EngineState, EngineStats, RequestProgress
from node_agent.gpus import GpuSample
from node_agent.nics import NicSample
from node_agent.rdma import RdmaSample
from node_agent.telemetry import Telemetry
from orchestrrl.v1 import node_agent_pb2

pytestmark = pytest.mark.unit

GPU_EXTRAS = (
    "sm_clock_mhz",
    "pcie_tx_bytes_per_s",
    "pcie_rx_bytes_per_s",
    "nvlink_tx_bytes_per_s",
    "nvlink_rx_bytes_per_s",
    "ecc_corrected",
    "ecc_uncorrected",
    "xid_errors",
    "last_xid",
)


def has(message: Any, name: str) -> bool:
    return bool(message.HasField(name))


def gpu(**extras: float | int | None) -> GpuSample:
    return GpuSample(0, 0.5, 10, 80, 300.0, 55.0, **extras)  # type: ignore[arg-type]


def telemetry(progress: EngineProgress | None = None, ts: float = 1.0) -> Telemetry:
    return Telemetry(
        node="gen0-n0",
        timestamp=ts,
        gpus=(gpu(),),
        nics=(NicSample("eth0", 1, 2, 0.5, 0.25, True),),
        engine=EngineStats(2, 3, 100.0, 0.4, step=5),
        engine_state=EngineState.RUNNING,
        tp_layout=(2, 2),
        progress=progress,
    )


def test_gpu_extras_reach_the_message() -> None:
    sample = gpu(
        sm_clock_mhz=1980.0,
        pcie_tx_bytes_per_s=1e8,
        pcie_rx_bytes_per_s=2e8,
        nvlink_tx_bytes_per_s=3e9,
        nvlink_rx_bytes_per_s=4e9,
        ecc_corrected=7,
        ecc_uncorrected=1,
        xid_errors=2,
        last_xid=79,
    )
    pb = convert.gpu_sample_to_pb(sample)
    assert all(has(pb, name) for name in GPU_EXTRAS)
    assert (pb.sm_clock_mhz, pb.pcie_rx_bytes_per_s, pb.nvlink_tx_bytes_per_s) == (1980, 2e8, 3e9)
    assert (pb.ecc_corrected, pb.ecc_uncorrected, pb.xid_errors, pb.last_xid) == (7, 1, 2, 79)
    assert (pb.index, pb.utilization, pb.power_watts) == (0, 0.5, 300.0)


def test_a_metric_the_gpu_does_not_report_is_unset_not_zero() -> None:
    pb = convert.gpu_sample_to_pb(gpu(ecc_corrected=0))
    assert pb.HasField("ecc_corrected") and pb.ecc_corrected == 0  # reported: none
    assert not any(has(pb, name) for name in GPU_EXTRAS if name != "ecc_corrected")


def test_rdma_port_counters_rates_and_pause_counters() -> None:
    sample = RdmaSample(
        device="mlx5_0",
        port=1,
        tx_bytes_per_s=4e9,
        rx_bytes_per_s=2e9,
        counters={
            "port_xmit_data": 4000,
            "port_rcv_data": 800,
            "np_cnp_sent": 12,
            "rp_cnp_handled": 3,
            "out_of_sequence": 0,
            "rx_prio3_pause": 5,
        },
        rates={"np_cnp_sent": 2.5, "out_of_sequence": 0.0},
    )
    pb = convert.rdma_sample_to_pb(sample)
    assert (pb.device, pb.port, pb.tx_bytes, pb.rx_bytes) == ("mlx5_0", 1, 4000, 800)
    assert (pb.tx_bytes_per_s, pb.rx_bytes_per_s) == (4e9, 2e9)
    assert (pb.cnp_sent, pb.cnp_handled, pb.out_of_sequence) == (12, 3, 0)
    assert pb.HasField("out_of_sequence")  # 0 read from the driver is a value
    assert not pb.HasField("ecn_marked_packets")  # the driver does not expose it
    assert (pb.cnp_sent_per_s, pb.out_of_sequence_per_s) == (2.5, 0.0)
    assert not pb.HasField("cnp_handled_per_s")  # no rate before the second reading
    assert dict(pb.pause_counters) == {"rx_prio3_pause": 5}


def test_rdma_ports_are_in_the_telemetry_sample() -> None:
    with_rdma = dataclasses.replace(telemetry(), rdma=(RdmaSample("mlx5_1", 2, 1.0, 2.0),))
    pb = convert.telemetry_to_pb(with_rdma)
    assert [(r.device, r.port) for r in pb.rdma] == [("mlx5_1", 2)]
    assert not pb.rdma[0].HasField("cnp_sent")


def test_engine_progress_fields() -> None:
    progress = EngineProgress(
        step=6,
        requests=(
            RequestProgress("a-1", 0, 512, 100, 16384, "prompt-3"),
            RequestProgress("a-2", -1, 256, 0, 0),
        ),
        completed_lengths=(900, 37),
        completed_groups=("prompt-3", ""),
    )
    engine = convert.telemetry_to_pb(telemetry(progress)).engine
    assert engine.has_progress and engine.step == 6
    assert [
        (r.request_id, r.instance, r.prompt_tokens, r.generated_tokens, r.max_tokens, r.group)
        for r in engine.requests
    ] == [("a-1", 0, 512, 100, 16384, "prompt-3"), ("a-2", -1, 256, 0, 0, "")]
    assert list(engine.completed_lengths) == [900, 37]
    assert list(engine.completed_groups) == ["prompt-3", ""]
    assert (engine.queued_requests, engine.running_requests, engine.tokens_per_s) == (2, 3, 100)


def test_a_sample_without_progress_says_so_and_keeps_the_step() -> None:
    engine = convert.telemetry_to_pb(telemetry(None)).engine
    assert not engine.has_progress
    assert engine.step == 5  # from EngineStats
    assert not engine.requests and not engine.completed_lengths


def test_a_batch_holds_serialized_samples_oldest_first() -> None:
    batch = convert.telemetry_batch_to_pb([telemetry(None, 1.0), telemetry(None, 2.0)])
    wire = batch.SerializeToString()
    back = node_agent_pb2.TelemetryBatch.FromString(wire)
    samples = [node_agent_pb2.TelemetrySample.FromString(b) for b in back.samples]
    assert [s.timestamp for s in samples] == [1.0, 2.0]
    assert samples[0].nics[0].name == "eth0"
    heads = [node_agent_pb2.TelemetrySampleHead.FromString(b) for b in back.samples]
    assert [(h.node, h.timestamp) for h in heads] == [("gen0-n0", 1.0), ("gen0-n0", 2.0)]
