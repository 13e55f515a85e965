"""Domain values of the agent to and from protobuf messages (no logic beyond mapping)."""

from __future__ import annotations

from node_agent.engine import EngineState, EngineStats, ReshardResult
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
    )


def telemetry_to_pb(sample: Telemetry) -> node_agent_pb2.TelemetrySample:
    return node_agent_pb2.TelemetrySample(
        node=sample.node,
        timestamp=sample.timestamp,
        gpus=[
            node_agent_pb2.GpuSample(
                index=g.index,
                utilization=g.utilization,
                memory_used_bytes=g.memory_used_bytes,
                memory_total_bytes=g.memory_total_bytes,
                power_watts=g.power_watts,
                temperature_c=g.temperature_c,
            )
            for g in sample.gpus
        ],
        nics=[
            node_agent_pb2.NicSample(
                name=n.name,
                rx_bytes=n.rx_bytes,
                tx_bytes=n.tx_bytes,
                rx_gbps=n.rx_gbps,
                tx_gbps=n.tx_gbps,
                oper_up=n.oper_up,
            )
            for n in sample.nics
        ],
        engine=engine_stats_to_pb(sample.engine),
        engine_state=ENGINE_STATE_PB[sample.engine_state],
        tp_layout=sample.tp_layout,
    )


def engine_stats_to_pb(stats: EngineStats) -> node_agent_pb2.EngineSample:
    return node_agent_pb2.EngineSample(
        queued_requests=stats.queued_requests,
        running_requests=stats.running_requests,
        tokens_per_s=stats.tokens_per_s,
        kv_cache_usage=stats.kv_cache_usage,
    )


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
