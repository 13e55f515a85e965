"""Domain values of the agent to and from protobuf messages (no logic beyond mapping)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from node_agent.engine import EngineProgress, EngineState, EngineStats, ReshardResult
from node_agent.gpus import GpuSample
from node_agent.rdma import RdmaSample
from node_agent.telemetry import NodeStatus, Telemetry
from orchestrrl.v1 import common_pb2, node_agent_pb2

ENGINE_STATE_PB: dict[EngineState, node_agent_pb2.EngineState.ValueType] = {
    EngineState.RUNNING: node_agent_pb2.ENGINE_STATE_RUNNING,
    EngineState.DRAINED: node_agent_pb2.ENGINE_STATE_DRAINED,
    EngineState.RESHARDING: node_agent_pb2.ENGINE_STATE_RESHARDING,
}


def status_to_pb(status: NodeStatus) -> node_agent_pb2.NodeStatus:
    return node_agent_pb2.NodeStatus(
        node=status.node,
        gpu_backend=status.gpu_backend,
        gpus=[
            node_agent_pb2.GpuInfo(
                index=g.index, name=g.name, uuid=g.uuid, memory_total_bytes=g.memory_total_bytes
            )
            for g in status.gpus
        ],
        nics=[node_agent_pb2.NicInfo(name=n.name, speed_gbps=n.speed_gbps) for n in status.nics],
        engine_state=ENGINE_STATE_PB[status.engine_state],
        tp_layout=status.tp_layout,
        version=status.version,
        engine=status.engine,
        gateway=status.gateway,
        instance_health=status.instance_health,
        kv_import=status.kv_import,
        max_num_seqs=status.max_num_seqs,
        weight_version=status.weight_version,
        checkpoint_address=status.checkpoint_address,
        checkpoints=status.checkpoints,
    )


def telemetry_to_pb(sample: Telemetry) -> node_agent_pb2.TelemetrySample:
    """Sub-messages are built in place (``repeated.add``): a message built on its own and
    then handed to its parent is copied, which for the 8 GPUs and 8 NICs of every sample
    (10 Hz) costs a third of the conversion."""
    message = node_agent_pb2.TelemetrySample(
        node=sample.node,
        timestamp=sample.timestamp,
        engine_state=ENGINE_STATE_PB[sample.engine_state],
        tp_layout=sample.tp_layout,
        weight_version=sample.weight_version,
    )
    _fill_engine(message.engine, sample.engine, sample.progress)
    add_gpu = message.gpus.add
    for g in sample.gpus:
        _add_gpu(add_gpu, g)
    add_nic = message.nics.add
    for name, rx_bytes, tx_bytes, rx_gbps, tx_gbps, oper_up in sample.nics:
        add_nic(
            name=name,
            rx_bytes=rx_bytes,
            tx_bytes=tx_bytes,
            rx_gbps=rx_gbps,
            tx_gbps=tx_gbps,
            oper_up=oper_up,
        )
    if sample.rdma:
        message.rdma.extend([rdma_sample_to_pb(r) for r in sample.rdma])
    return message


def telemetry_batch_to_pb(samples: Sequence[Telemetry]) -> node_agent_pb2.TelemetryBatch:
    """Oldest first, each sample serialized (see TelemetryBatch in node_agent.proto)."""
    return node_agent_pb2.TelemetryBatch(
        samples=[telemetry_to_pb(s).SerializeToString() for s in samples]
    )


def gpu_sample_to_pb(g: GpuSample) -> node_agent_pb2.GpuSample:
    """A metric the GPU does not report (None) stays unset in the message."""
    return _add_gpu(node_agent_pb2.GpuSample, g)


def _add_gpu(
    new: Callable[..., node_agent_pb2.GpuSample], g: GpuSample
) -> node_agent_pb2.GpuSample:
    """``g`` built by ``new``: the message class, or a repeated field's ``add``."""
    return new(
        index=g.index,
        utilization=g.utilization,
        memory_used_bytes=g.memory_used_bytes,
        memory_total_bytes=g.memory_total_bytes,
        power_watts=g.power_watts,
        temperature_c=g.temperature_c,
        sm_clock_mhz=g.sm_clock_mhz,
        pcie_tx_bytes_per_s=g.pcie_tx_bytes_per_s,
        pcie_rx_bytes_per_s=g.pcie_rx_bytes_per_s,
        nvlink_tx_bytes_per_s=g.nvlink_tx_bytes_per_s,
        nvlink_rx_bytes_per_s=g.nvlink_rx_bytes_per_s,
        ecc_corrected=g.ecc_corrected,
        ecc_uncorrected=g.ecc_uncorrected,
        xid_errors=g.xid_errors,
        last_xid=g.last_xid,
    )


def rdma_sample_to_pb(r: RdmaSample) -> node_agent_pb2.RdmaPortSample:
    """Counters the driver does not expose (absent from the reading) stay unset."""
    c, rates = r.counters, r.rates
    return node_agent_pb2.RdmaPortSample(
        device=r.device,
        port=r.port,
        tx_bytes=c.get("port_xmit_data", 0),
        rx_bytes=c.get("port_rcv_data", 0),
        tx_bytes_per_s=r.tx_bytes_per_s,
        rx_bytes_per_s=r.rx_bytes_per_s,
        cnp_sent=c.get("np_cnp_sent"),
        cnp_handled=c.get("rp_cnp_handled"),
        ecn_marked_packets=c.get("np_ecn_marked_roce_packets"),
        out_of_sequence=c.get("out_of_sequence"),
        cnp_sent_per_s=rates.get("np_cnp_sent"),
        cnp_handled_per_s=rates.get("rp_cnp_handled"),
        ecn_marked_per_s=rates.get("np_ecn_marked_roce_packets"),
        out_of_sequence_per_s=rates.get("out_of_sequence"),
        pause_counters={k: v for k, v in c.items() if "pause" in k},
    )


def _fill_engine(
    sample: node_agent_pb2.EngineSample, stats: EngineStats, progress: EngineProgress | None
) -> None:
    """The aggregates, and with ``progress`` every request of the step (has_progress)."""
    sample.queued_requests = stats.queued_requests
    sample.running_requests = stats.running_requests
    sample.tokens_per_s = stats.tokens_per_s
    sample.kv_cache_usage = stats.kv_cache_usage
    sample.step = stats.step
    if progress is not None:
        sample.has_progress = True
        sample.step = progress.step
        add = sample.requests.add  # in place: no copy per request (see telemetry_to_pb)
        for request_id, instance, prompt_tokens, generated, max_tokens, group in progress.requests:
            add(
                request_id=request_id,
                instance=instance,
                prompt_tokens=prompt_tokens,
                generated_tokens=generated,
                max_tokens=max_tokens,
                group=group,
            )
        sample.completed_lengths.extend(progress.completed_lengths)
        sample.completed_groups.extend(progress.completed_groups)


def engine_state_to_pb(
    state: EngineState, stats: EngineStats
) -> node_agent_pb2.EngineStateResponse:
    """In-flight requests are those admitted and not finished (queued ones are not)."""
    return node_agent_pb2.EngineStateResponse(
        engine_state=ENGINE_STATE_PB[state], in_flight_requests=stats.running_requests
    )


def reshard_to_pb(command_id: str, result: ReshardResult) -> node_agent_pb2.ReshardResponse:
    return node_agent_pb2.ReshardResponse(
        command_id=command_id,
        old_layout=result.old_layout,
        new_layout=result.new_layout,
        stages=[common_pb2.StageTiming(stage=s.stage, seconds=s.seconds) for s in result.stages],
        bytes_moved=result.bytes_moved,
        message=result.message,
    )
