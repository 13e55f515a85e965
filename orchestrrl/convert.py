"""Conversions between protobuf messages and domain values (one place for all)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from orchestrrl import errors
from orchestrrl.model import Circuit, Phase
from orchestrrl.v1 import common_pb2

_PHASE_TO_PB: dict[Phase, common_pb2.Phase.ValueType] = {
    Phase.GENERATION: common_pb2.PHASE_GENERATION,
    Phase.TRAINING: common_pb2.PHASE_TRAINING,
    Phase.WEIGHT_SYNC: common_pb2.PHASE_WEIGHT_SYNC,
    Phase.ASYNC: common_pb2.PHASE_ASYNC,
}
_PHASE_FROM_PB = {v: k for k, v in _PHASE_TO_PB.items()}


def phase_to_pb(phase: Phase | None) -> common_pb2.Phase.ValueType:
    return common_pb2.PHASE_UNSPECIFIED if phase is None else _PHASE_TO_PB[phase]


def phase_from_pb(value: int, field: str = "phase") -> Phase:
    try:
        return _PHASE_FROM_PB[value]  # type: ignore[index]
    except KeyError:
        allowed = ", ".join(f"{p.value} ({int(v)})" for p, v in _PHASE_TO_PB.items())
        raise errors.field_error(field, value, f"expected one of {allowed}") from None


def optional_phase_from_pb(value: int) -> Phase | None:
    return None if value == common_pb2.PHASE_UNSPECIFIED else phase_from_pb(value)


def circuit_to_pb(c: Circuit, pods: tuple[str, str] = ("", "")) -> common_pb2.Circuit:
    return common_pb2.Circuit(ocs=c.ocs, port_a=c.a, port_b=c.b, pod_a=pods[0], pod_b=pods[1])


def circuit_from_pb(m: common_pb2.Circuit) -> Circuit:
    return Circuit(m.ocs, m.port_a, m.port_b)


def stages_to_pb(stages: Mapping[str, float]) -> list[common_pb2.StageTiming]:
    return [common_pb2.StageTiming(stage=k, seconds=v) for k, v in stages.items()]


def stages_from_pb(stages: Iterable[common_pb2.StageTiming]) -> dict[str, float]:
    return {s.stage: s.seconds for s in stages}
