"""Python client of the fabric controller, for RL trainers, scripts and orlctl.

``AsyncClient`` for asyncio code; ``Client`` for synchronous code (it runs the async
client on a private event loop). Every call has a timeout; errors arrive as
``orchestrrl.errors`` exceptions carrying the controller's message.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncGenerator, AsyncIterator, Iterator
from dataclasses import asdict, dataclass, field
from types import TracebackType
from typing import Any, TypeVar

import grpc

from orchestrrl import errors, grpcutil
from orchestrrl.convert import optional_phase_from_pb, phase_to_pb, stages_from_pb
from orchestrrl.logs import get_logger
from orchestrrl.model import Phase
from orchestrrl.tls import TlsConfig
from orchestrrl.v1 import fabric_controller_pb2 as pb
from orchestrrl.v1 import fabric_controller_pb2_grpc as pb_grpc

DEFAULT_CONTROLLER = "127.0.0.1:50051"
log = get_logger("orchestrrl.client")
T = TypeVar("T")


def controller_address(explicit: str | None = None) -> str:
    """--controller, else $ORL_CONTROLLER, else the local default."""
    return explicit or os.environ.get("ORL_CONTROLLER") or DEFAULT_CONTROLLER


@dataclass(frozen=True)
class CircuitView:
    ocs: str
    a: int
    b: int
    pod_a: str
    pod_b: str

    def __str__(self) -> str:
        return f"{self.ocs}:{self.a}<->{self.b} ({self.pod_a}<->{self.pod_b})"


def _circuits(ms: Any) -> list[CircuitView]:
    return [CircuitView(m.ocs, m.port_a, m.port_b, m.pod_a, m.pod_b) for m in ms]


def _phase_name(value: int) -> str | None:
    phase = optional_phase_from_pb(value)
    return None if phase is None else phase.value


@dataclass(frozen=True)
class PhaseState:
    epoch: int
    phase: str | None
    circuits: list[CircuitView]
    committed_at: float


@dataclass(frozen=True)
class MissingCircuits:
    """Circuits a pod pair lacks because OCS ports are down."""

    pod_a: str
    pod_b: str
    circuits: int


@dataclass(frozen=True)
class PhaseChange:
    epoch: int
    phase: str | None
    changed: bool
    circuits: list[CircuitView]
    added: list[CircuitView]
    removed: list[CircuitView]
    stages: dict[str, float]
    message: str
    gated: bool = False
    explanation: str = ""  # which planner chose the circuits, and why
    # fewer circuits than the phase would have with every OCS port up (``missing``: which
    # pod pairs lack how many); the controller re-plans when the ports come back up
    degraded: bool = False
    missing: list[MissingCircuits] = field(default_factory=list)


@dataclass(frozen=True)
class PhasePlan:
    phase: str | None
    circuits: list[CircuitView]
    added: list[CircuitView]
    removed: list[CircuitView]
    explanation: str = ""


@dataclass(frozen=True)
class NodeView:
    node: str
    pod: str
    role: str
    health: str
    agent_address: str
    last_seen_age_s: float | None
    gpu_backend: str
    telemetry: dict[str, Any] = field(default_factory=dict)
    engine: str = ""  # rollout engine kind
    gateway: str = ""  # HOST:PORT of the node's generation gateway ("" without one)


@dataclass(frozen=True)
class EventView:
    sequence: int
    timestamp: float
    kind: str
    node: str
    epoch: int
    phase: str | None
    message: str
    stages: dict[str, float]


@dataclass(frozen=True)
class ScheduleView:
    """The compute-scheduling loop's current plan and its last actions (GetSchedule)."""

    enabled: bool
    interval_s: float
    planned_at: float
    mode: str
    reason: str
    explanation: str
    acted: bool
    step: int
    requests: int
    layouts: list[dict[str, Any]]  # node, before, after (TP degrees)
    reshards: list[dict[str, Any]]  # node, before, after, pause_s
    migrations: list[dict[str, Any]]  # request_id, source/target node+instance, method, cost_s
    prediction: dict[str, float]
    actions: list[dict[str, Any]]  # timestamp, kind, node, command_id, ok, message, ...
    skipped_nodes: list[str]


def _schedule(r: pb.GetScheduleResponse) -> ScheduleView:
    p = r.prediction
    return ScheduleView(
        enabled=r.enabled,
        interval_s=r.interval_s,
        planned_at=r.planned_at,
        mode=r.mode,
        reason=r.reason,
        explanation=r.explanation,
        acted=r.acted,
        step=r.step,
        requests=r.requests,
        layouts=[
            {"node": x.node, "before": list(x.before), "after": list(x.after)} for x in r.layouts
        ],
        reshards=[
            {"node": x.node, "before": list(x.before), "after": list(x.after), "pause_s": x.pause_s}
            for x in r.reshards
        ],
        migrations=[
            {
                "request_id": m.request_id,
                "source_node": m.source_node,
                "source_instance": m.source_instance,
                "target_node": m.target_node,
                "target_instance": m.target_instance,
                "method": m.method,
                "cost_s": m.cost_s,
            }
            for m in r.migrations
        ],
        prediction={
            "keep_makespan_s": p.keep_makespan_s,
            "planned_makespan_s": p.planned_makespan_s,
            "steady_makespan_s": p.steady_makespan_s,
            "switching_s": p.switching_s,
            "migration_s": p.migration_s,
            "gain_s": p.gain_s,
        },
        actions=[
            {
                "timestamp": a.timestamp,
                "kind": a.kind,
                "node": a.node,
                "command_id": a.command_id,
                "ok": a.ok,
                "message": a.message,
                "seconds": a.seconds,
                "requests": list(a.requests),
            }
            for a in r.actions
        ],
        skipped_nodes=list(r.skipped_nodes),
    )


def to_json(value: Any) -> Any:
    """Plain JSON-able data of a client result (dataclass, list of them, or dict)."""
    if isinstance(value, list):
        return [to_json(v) for v in value]
    if hasattr(value, "__dataclass_fields__"):
        return asdict(value)
    return value


_HEALTH_NAMES = {
    pb.NODE_HEALTH_UP: "up",
    pb.NODE_HEALTH_DOWN: "down",
    pb.NODE_HEALTH_UNKNOWN: "unknown",
}


def _telemetry_summary(n: pb.NodeState) -> dict[str, Any]:
    if not n.HasField("last_telemetry"):
        return {}
    t = n.last_telemetry
    gpus = list(t.gpus)
    return {
        "timestamp": t.timestamp,
        "gpus": len(gpus),
        "gpu_utilization_mean": sum(g.utilization for g in gpus) / len(gpus) if gpus else 0.0,
        "gpu_memory_used_bytes": sum(g.memory_used_bytes for g in gpus),
        "tokens_per_s": t.engine.tokens_per_s,
        "running_requests": t.engine.running_requests,
        "queued_requests": t.engine.queued_requests,
        "kv_cache_usage": t.engine.kv_cache_usage,
        "tp_layout": list(t.tp_layout),
    }


class AsyncClient:
    def __init__(
        self, address: str | None = None, timeout_s: float = 30.0, tls: TlsConfig | None = None
    ) -> None:
        self.address = controller_address(address)
        self.timeout_s = timeout_s
        self._channel = grpcutil.channel(self.address, tls)
        self._stub = pb_grpc.FabricControllerStub(self._channel)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self._channel.close()

    def _what(self, rpc: str) -> str:
        return f"controller {self.address}: {rpc}"

    async def set_phase(
        self, phase: Phase | str, request_id: str = "", idle_window_s: float = 0.0
    ) -> PhaseChange:
        """Change the phase. ``idle_window_s``: predicted idle time of the traffic before
        the phase needs its circuits (0: unknown); a shorter window than the OCS needs
        keeps the current topology (``gated`` in the result, ``message`` says why)."""
        p = phase if isinstance(phase, Phase) else Phase.parse(phase)
        r = await grpcutil.call(
            self._what("SetPhase"),
            self._stub.SetPhase(
                pb.SetPhaseRequest(
                    phase=phase_to_pb(p), request_id=request_id, idle_window_s=idle_window_s
                ),
                timeout=self.timeout_s,
            ),
        )
        return PhaseChange(
            epoch=r.epoch,
            phase=_phase_name(r.phase),
            changed=r.changed,
            circuits=_circuits(r.circuits),
            added=_circuits(r.added),
            removed=_circuits(r.removed),
            stages=stages_from_pb(r.stages),
            message=r.message,
            gated=r.gated,
            explanation=r.explanation,
            degraded=r.degraded,
            missing=[MissingCircuits(m.pod_a, m.pod_b, m.circuits) for m in r.missing],
        )

    @contextlib.asynccontextmanager
    async def phase(
        self,
        phase: Phase | str,
        *,
        restore: bool = True,
        request_id: str = "",
        idle_window_s: float = 0.0,
    ) -> AsyncIterator[PhaseChange]:
        """``async with orl.phase("weight-sync"): await sync_weights()``: set the phase
        for the body, then (``restore``) return to the phase that was active before."""
        before = (await self.get_phase()).phase
        change = await self.set_phase(phase, request_id, idle_window_s)
        failed = False
        try:
            yield change
        except BaseException:
            failed = True
            raise
        finally:
            if restore and before is not None and before != change.phase:
                try:
                    await self.set_phase(before)
                except errors.OrlError as exc:
                    if not failed:
                        raise
                    log.error("phase_restore_failed", phase=before, error=str(exc))

    async def get_phase(self) -> PhaseState:
        r = await grpcutil.call(
            self._what("GetPhase"),
            self._stub.GetPhase(pb.GetPhaseRequest(), timeout=self.timeout_s),
        )
        return PhaseState(r.epoch, _phase_name(r.phase), _circuits(r.circuits), r.committed_at)

    async def plan_phase(self, phase: Phase | str) -> PhasePlan:
        p = phase if isinstance(phase, Phase) else Phase.parse(phase)
        r = await grpcutil.call(
            self._what("PlanPhase"),
            self._stub.PlanPhase(pb.PlanPhaseRequest(phase=phase_to_pb(p)), timeout=self.timeout_s),
        )
        return PhasePlan(
            _phase_name(r.phase),
            _circuits(r.circuits),
            _circuits(r.added),
            _circuits(r.removed),
            r.explanation,
        )

    async def topology(self) -> pb.Topology:
        return await grpcutil.call(
            self._what("GetTopology"),
            self._stub.GetTopology(pb.GetTopologyRequest(), timeout=self.timeout_s),
        )

    async def nodes(self) -> list[NodeView]:
        r = await grpcutil.call(
            self._what("ListNodes"),
            self._stub.ListNodes(pb.ListNodesRequest(), timeout=self.timeout_s),
        )
        return [
            NodeView(
                node=n.node,
                pod=n.pod,
                role=n.role,
                health=_HEALTH_NAMES.get(n.health, "unknown"),
                agent_address=n.agent_address,
                last_seen_age_s=None if n.last_seen_age_s < 0 else n.last_seen_age_s,
                gpu_backend=n.gpu_backend,
                telemetry=_telemetry_summary(n),
                engine=n.engine,
                gateway=n.gateway,
            )
            for n in r.nodes
        ]

    async def schedule(self) -> ScheduleView:
        """The compute-scheduling loop's current plan, why, and its last actions."""
        r = await grpcutil.call(
            self._what("GetSchedule"),
            self._stub.GetSchedule(pb.GetScheduleRequest(), timeout=self.timeout_s),
        )
        return _schedule(r)

    async def watch(self, recent: int = 0, follow: bool = True) -> AsyncIterator[EventView]:
        """The ``recent`` most recent events, then (``follow``) new ones as they happen,
        until the caller stops iterating."""
        call = self._stub.WatchEvents(pb.WatchEventsRequest(recent=recent, follow=follow))
        try:
            while True:
                e = await grpcutil.call(self._what("WatchEvents"), call.read())
                if e is grpc.aio.EOF:
                    return
                assert isinstance(e, pb.Event)
                yield EventView(
                    sequence=e.sequence,
                    timestamp=e.timestamp,
                    kind=e.kind,
                    node=e.node,
                    epoch=e.epoch,
                    phase=_phase_name(e.phase),
                    message=e.message,
                    stages=stages_from_pb(e.stages),
                )
        finally:
            call.cancel()


class Client:
    """Synchronous client: the same calls as ``AsyncClient``, blocking."""

    def __init__(
        self, address: str | None = None, timeout_s: float = 30.0, tls: TlsConfig | None = None
    ) -> None:
        self._runner = asyncio.Runner()
        self._async = self._runner.run(_make(address, timeout_s, tls))
        self.address = self._async.address

    def _run(self, coro: Any) -> Any:
        return self._runner.run(coro)

    def close(self) -> None:
        try:
            self._run(self._async.close())
        finally:
            self._runner.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def set_phase(
        self, phase: Phase | str, request_id: str = "", idle_window_s: float = 0.0
    ) -> PhaseChange:
        result: PhaseChange = self._run(self._async.set_phase(phase, request_id, idle_window_s))
        return result

    def get_phase(self) -> PhaseState:
        result: PhaseState = self._run(self._async.get_phase())
        return result

    @contextlib.contextmanager
    def phase(
        self,
        phase: Phase | str,
        *,
        restore: bool = True,
        request_id: str = "",
        idle_window_s: float = 0.0,
    ) -> Iterator[PhaseChange]:
        """``with orl.phase("weight-sync"): sync_weights()``: set the phase for the body,
        then (``restore``) return to the phase that was active before."""
        cm = self._async.phase(
            phase, restore=restore, request_id=request_id, idle_window_s=idle_window_s
        )
        change: PhaseChange = self._run(cm.__aenter__())
        try:
            yield change
        except BaseException as exc:
            if not self._run(cm.__aexit__(type(exc), exc, exc.__traceback__)):
                raise
        else:
            self._run(cm.__aexit__(None, None, None))

    def plan_phase(self, phase: Phase | str) -> PhasePlan:
        result: PhasePlan = self._run(self._async.plan_phase(phase))
        return result

    def topology(self) -> pb.Topology:
        result: pb.Topology = self._run(self._async.topology())
        return result

    def nodes(self) -> list[NodeView]:
        result: list[NodeView] = self._run(self._async.nodes())
        return result

    def schedule(self) -> ScheduleView:
        result: ScheduleView = self._run(self._async.schedule())
        return result

    def watch(self, recent: int = 0, follow: bool = True) -> Iterator[EventView]:
        stream = aiter(self._async.watch(recent, follow))
        assert isinstance(stream, AsyncGenerator)
        try:
            while True:
                try:
                    yield self._run(anext(stream))
                except StopAsyncIteration:
                    return
        finally:
            self._run(stream.aclose())


async def _make(address: str | None, timeout_s: float, tls: TlsConfig | None) -> AsyncClient:
    return AsyncClient(address, timeout_s, tls)


__all__ = [
    "AsyncClient",
    "CircuitView",
    "Client",
    "EventView",
    "NodeView",
    "PhaseChange",
    "PhasePlan",
    "PhaseState",
    "controller_address",
    "to_json",
]
