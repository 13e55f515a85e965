"""Python client of the fabric controller, for RL trainers, scripts and orlctl.

``AsyncClient`` for asyncio code; ``Client`` for synchronous code (it runs the async
client on a private event loop). Every call has a timeout; errors arrive as
``orchestrrl.errors`` exceptions carrying the controller's message.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import random
import uuid
from collections.abc import (
    AsyncGenerator,
    AsyncIterator,
    Awaitable,
    Callable,
    Iterable,
    Iterator,
    Sequence,
)
from dataclasses import asdict, dataclass, field
from types import TracebackType
from typing import Any, TypeVar

import grpc

from orchestrrl import errors, leader
from orchestrrl.convert import optional_phase_from_pb, phase_to_pb, stages_from_pb
from orchestrrl.logs import get_logger
from orchestrrl.model import Mode, Phase
from orchestrrl.tls import TlsConfig
from orchestrrl.v1 import fabric_controller_pb2 as pb
from orchestrrl.v1 import fabric_controller_pb2_grpc as pb_grpc

DEFAULT_CONTROLLER = "127.0.0.1:50051"
log = get_logger("orchestrrl.client")
T = TypeVar("T")


BACKOFF_INITIAL_S = 0.05  # before a second round through the controllers' addresses
BACKOFF_MAX_S = 0.25  # a takeover lasts about one lease (2 s): see the new leader promptly
# An attempt unanswered this long: the call asks the other controllers too (hedged). Well
# under the 2 s lease; a slow leader loses nothing (its attempt stays in flight)
ATTEMPT_TIMEOUT_S = 1.0
DEADLINE_GRACE_S = 0.5  # an attempt's gRPC deadline beyond the call's (see _Route.run)
AUTO_REQUEST_PREFIX = "auto-"  # request ids made up by the client (see AsyncClient)


def _positive(value: float, field: str) -> float:
    if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
        raise errors.field_error(field, value, "seconds > 0")
    return float(value)


def controller_address(explicit: str | None = None) -> str:
    """--controller, else $ORL_CONTROLLER, else the local default (as given: one
    HOST:PORT or several separated by commas; see :func:`controller_addresses`)."""
    return explicit or os.environ.get("ORL_CONTROLLER") or DEFAULT_CONTROLLER


def controller_addresses(
    explicit: str | Sequence[str] | None = None, field: str = "controller"
) -> tuple[str, ...]:
    """The controllers to try, validated: ``explicit`` (a HOST:PORT, several separated by
    commas, or a list; ``field`` names it in errors), else $ORL_CONTROLLER, else the local
    default."""
    if explicit:
        return leader.parse_addresses(explicit, field)
    env = os.environ.get("ORL_CONTROLLER")
    if env:
        return leader.parse_addresses(env, "$ORL_CONTROLLER")
    return (DEFAULT_CONTROLLER,)


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
class ModeState:
    """The cluster's mode ("phased" or "async") and the committed epoch behind it; from
    ``set_mode``, whether it committed a new epoch and what the controller said."""

    mode: str
    epoch: int
    phase: str | None
    circuits: int
    changed: bool = False
    message: str = ""


def _mode(r: pb.GetModeResponse) -> ModeState:
    return ModeState(r.mode, r.epoch, _phase_name(r.phase), r.circuits, r.changed, r.message)


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
    # with a checkpoint (weight-sync): what every generation node did with it
    weight_sync: WeightSyncView | None = None


@dataclass(frozen=True)
class NodeWeightSyncView:
    """One generation node's part of a weight sync."""

    node: str
    ok: bool  # it runs the new version
    version: str  # served now (after a failure: the version it kept)
    previous: str
    bytes_fetched: int
    fetch_seconds: float
    load_seconds: float
    seconds: float
    mbytes_per_s: float
    error: str  # why it did not take the new version
    how: str  # in place, restart, sim
    resumes: int  # ranges resumed after a cut connection
    cached: bool  # it had the checkpoint already
    circuits: int  # between the source's pod and its pod in the epoch
    finished_at: float  # seconds since the Unix epoch
    streams: int


@dataclass(frozen=True)
class WeightSyncView:
    """A weight sync (``set_phase("weight-sync", checkpoint=..., source=...)``)."""

    version: str
    checksum: str
    source_node: str
    source_address: str
    checkpoint_bytes: int
    epoch: int  # whose circuits carried the bytes
    complete: bool  # every generation node runs the new version
    completed_at: float  # when the last one said so (seconds since the Unix epoch; 0: not)
    seconds: float
    message: str
    nodes: list[NodeWeightSyncView]


class WeightSyncIncomplete(errors.FailedPrecondition):
    """A weight sync that did not reach every generation node: ``change`` is the whole
    answer (the epoch is committed; ``change.weight_sync`` names each node's outcome; a
    node that failed keeps its old version). Retrying the same ``request_id`` sends the
    updates again (nodes that took the version answer at once)."""

    def __init__(self, change: PhaseChange) -> None:
        self.change = change
        assert change.weight_sync is not None
        super().__init__(change.weight_sync.message)


def _weight_sync(r: pb.SetPhaseResponse) -> WeightSyncView | None:
    if not r.HasField("weight_sync"):
        return None
    w = r.weight_sync
    return WeightSyncView(
        version=w.version,
        checksum=w.checksum,
        source_node=w.source_node,
        source_address=w.source_address,
        checkpoint_bytes=w.checkpoint_bytes,
        epoch=w.epoch,
        complete=w.complete,
        completed_at=w.completed_at,
        seconds=w.seconds,
        message=w.message,
        nodes=[
            NodeWeightSyncView(
                node=n.node,
                ok=n.ok,
                version=n.version,
                previous=n.previous,
                bytes_fetched=n.bytes_fetched,
                fetch_seconds=n.fetch_seconds,
                load_seconds=n.load_seconds,
                seconds=n.seconds,
                mbytes_per_s=n.mbytes_per_s,
                error=n.error,
                how=n.how,
                resumes=n.resumes,
                cached=n.cached,
                circuits=n.circuits,
                finished_at=n.finished_at,
                streams=n.streams,
            )
            for n in w.nodes
        ],
    )


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
    weight_version: str = ""  # the weights its engines serve (newest telemetry; "" unknown)


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
    groups: int = 0  # sample groups among the step's requests (the length signal)
    groups_with_prior: int = 0  # of them, met in an earlier step (their previous epoch)
    paused: bool = False  # by an operator (pause_schedule)
    # per node, its last reshard's measured pause: a reshard there is planned at no less
    reshard_pause_s: dict[str, float] = field(default_factory=dict)


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
        groups=r.groups,
        groups_with_prior=r.groups_with_prior,
        paused=r.paused,
        reshard_pause_s=dict(sorted(r.reshard_pause_s.items())),
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
                "method": a.method,
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
        "weight_version": t.weight_version,
    }


class AsyncClient:
    """The controller's API. ``address``: one HOST:PORT, several separated by commas, or a
    list (default ``$ORL_CONTROLLER``, else the local default): the controllers of an HA
    group, of which one leads.

    Every unary call (and the opening of ``watch``) follows the leader: a standby's answer
    (UNAVAILABLE naming the leader, see :mod:`orchestrrl.leader`) sends the call to that
    leader at once (at most ``len(addresses) + 2`` such hops per round); UNAVAILABLE
    without a leader, or a controller that cannot be reached, sends it to the others. All of
    it within ``timeout_s`` per call; then :class:`errors.Unavailable` says what each
    address answered. Any other status is never retried.

    A controller that hangs (frozen, partitioned: its kernel may still accept TCP) holds a
    call for at most ``attempt_timeout_s`` (issue 28): the call goes first to the
    controller believed to lead; when that one fails, or has not answered within
    ``attempt_timeout_s``, it goes to every other listed controller at once (hedged), and
    the first to answer as the leader wins (the others are cancelled). An attempt that has
    no connection within ``connect_timeout_s`` fails as unreachable, and a connection that
    stops answering HTTP/2 pings is closed (``orchestrrl.leader``). Once every controller
    has failed, a short jittered backoff, then every one again.

    ``set_phase`` is sent as one request for all its attempts: with the caller's
    ``request_id``, or one made up per call (so a retried or hedged attempt is the same
    request: the controller answers it with the first outcome, never a second change)."""

    def __init__(
        self,
        address: str | Sequence[str] | None = None,
        timeout_s: float = 30.0,
        tls: TlsConfig | None = None,
        *,
        backoff_initial_s: float = BACKOFF_INITIAL_S,
        backoff_max_s: float = BACKOFF_MAX_S,
        attempt_timeout_s: float = ATTEMPT_TIMEOUT_S,
        connect_timeout_s: float = leader.CONNECT_TIMEOUT_S,
    ) -> None:
        self.addresses = controller_addresses(address)
        self.address = self.addresses[0]  # the controller calls go to (the leader, once known)
        self.timeout_s = timeout_s
        self._tls = tls
        self._backoff_initial_s = backoff_initial_s
        self._backoff_max_s = backoff_max_s
        self.attempt_timeout_s = _positive(attempt_timeout_s, "attempt_timeout_s")
        self.connect_timeout_s = _positive(connect_timeout_s, "connect_timeout_s")
        self._rng = random.Random()
        # one channel per controller dialled (the list, and leaders it named): a call in
        # flight on one is not cut when another call moves on
        self._channels: dict[str, grpc.aio.Channel] = {}

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        channels, self._channels = list(self._channels.values()), {}
        for ch in channels:
            await ch.close()

    def _channel(self, address: str) -> grpc.aio.Channel:
        ch = self._channels.get(address)
        if ch is None:
            ch = self._channels[address] = leader.channel(
                address, self._tls, watched=len(self.addresses) > 1
            )
        return ch

    def _stub_for(self, address: str) -> pb_grpc.FabricControllerStub:
        return pb_grpc.FabricControllerStub(self._channel(address))

    async def _unary(
        self, rpc: str, send: Callable[[Any, float], Awaitable[T]], patience_s: float = 0.0
    ) -> T:
        """``send(stub, timeout)`` to the leader: hedged, following redirects (see the
        class docstring). ``patience_s``: how much longer than usual the leader may work
        on this call before it is given up, or hedged for its silence (a weight sync moves
        bytes: a leader that died meanwhile is found by the connection's pings)."""
        return await _Route(self, rpc, patience_s).run(send)

    async def set_phase(
        self,
        phase: Phase | str,
        request_id: str = "",
        idle_window_s: float = 0.0,
        *,
        checkpoint: str = "",
        source: str = "",
        checksum: str = "",
        in_flight: str = "finish",
        sync_timeout_s: float = 600.0,
        streams: int = 0,
    ) -> PhaseChange:
        """Change the phase. ``idle_window_s``: predicted idle time of the traffic before
        the phase needs its circuits (0: unknown); a shorter window than the OCS needs
        keeps the current topology (``gated`` in the result, ``message`` says why).

        Weight sync (``phase="weight-sync"``): with ``checkpoint`` (a version) and
        ``source`` (the node whose agent holds it), every generation node fetches it over
        the phase's circuits and loads it; the result's ``weight_sync`` says when every one
        runs it. ``checksum``: that checkpoint exactly ("" the source's newest of the
        version); ``in_flight``: "finish" or "resume"; ``sync_timeout_s``: per node (the
        call waits that much longer than ``timeout_s``); ``streams``: connections per node
        (0: the default, 4). Raises :class:`WeightSyncIncomplete` (carrying the whole
        answer) when a generation node did not take it."""
        p = phase if isinstance(phase, Phase) else Phase.parse(phase)
        # one request for every attempt: a retry or a hedge carries the same request id
        request = pb.SetPhaseRequest(
            phase=phase_to_pb(p),
            request_id=request_id or f"{AUTO_REQUEST_PREFIX}{uuid.uuid4().hex}",
            idle_window_s=idle_window_s,
        )
        extra_s = 0.0
        if checkpoint or source:
            if (
                isinstance(streams, bool)
                or not isinstance(streams, int)
                or not 0 <= streams < 2**32
            ):
                raise errors.field_error("streams", streams, "connections per node, 0: the default")
            if not isinstance(sync_timeout_s, int | float) or not 0 <= sync_timeout_s < 1e9:
                raise errors.field_error("sync_timeout_s", sync_timeout_s, "seconds >= 0")
            request.checkpoint.CopyFrom(
                pb.WeightSyncRequest(
                    version=checkpoint,
                    source_node=source,
                    checksum=checksum,
                    in_flight=in_flight,
                    timeout_s=sync_timeout_s,
                    streams=streams,
                )
            )
            extra_s = sync_timeout_s if sync_timeout_s > 0 else 600.0
        r: pb.SetPhaseResponse = await self._unary(
            "SetPhase", lambda stub, timeout: stub.SetPhase(request, timeout=timeout), extra_s
        )
        change = PhaseChange(
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
            weight_sync=_weight_sync(r),
        )
        if change.weight_sync is not None and not change.weight_sync.complete:
            raise WeightSyncIncomplete(change)
        return change

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
        r: pb.GetPhaseResponse = await self._unary(
            "GetPhase", lambda stub, timeout: stub.GetPhase(pb.GetPhaseRequest(), timeout=timeout)
        )
        return PhaseState(r.epoch, _phase_name(r.phase), _circuits(r.circuits), r.committed_at)

    async def set_mode(
        self, mode: Mode | str, request_id: str = "", *, phase: Phase | str | None = None
    ) -> ModeState:
        """Put the cluster in ``mode``: "async" (trainer and rollout at once on one
        standing topology; training and generation phases are refused, weight-sync moves
        weights over the standing circuits) or "phased" (the per-phase API; ``phase``:
        the phase to commit on leaving async mode, generation by default)."""
        m = mode if isinstance(mode, Mode) else Mode.parse(mode)
        p = None if phase is None else phase if isinstance(phase, Phase) else Phase.parse(phase)
        request = pb.SetModeRequest(
            mode=m.value,
            phase=phase_to_pb(p),
            request_id=request_id or f"{AUTO_REQUEST_PREFIX}{uuid.uuid4().hex}",
        )
        r: pb.GetModeResponse = await self._unary(
            "SetMode", lambda stub, timeout: stub.SetMode(request, timeout=timeout)
        )
        return _mode(r)

    async def get_mode(self) -> ModeState:
        """The cluster's mode ("phased" or "async") and its committed epoch."""
        r: pb.GetModeResponse = await self._unary(
            "GetMode", lambda stub, timeout: stub.GetMode(pb.GetModeRequest(), timeout=timeout)
        )
        return _mode(r)

    async def plan_phase(self, phase: Phase | str) -> PhasePlan:
        p = phase if isinstance(phase, Phase) else Phase.parse(phase)
        request = pb.PlanPhaseRequest(phase=phase_to_pb(p))
        r: pb.PlanPhaseResponse = await self._unary(
            "PlanPhase", lambda stub, timeout: stub.PlanPhase(request, timeout=timeout)
        )
        return PhasePlan(
            _phase_name(r.phase),
            _circuits(r.circuits),
            _circuits(r.added),
            _circuits(r.removed),
            r.explanation,
        )

    async def topology(self) -> pb.Topology:
        topology: pb.Topology = await self._unary(
            "GetTopology",
            lambda stub, timeout: stub.GetTopology(pb.GetTopologyRequest(), timeout=timeout),
        )
        return topology

    async def nodes(self) -> list[NodeView]:
        r: pb.ListNodesResponse = await self._unary(
            "ListNodes",
            lambda stub, timeout: stub.ListNodes(pb.ListNodesRequest(), timeout=timeout),
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
                weight_version=n.last_telemetry.weight_version,
            )
            for n in r.nodes
        ]

    async def schedule(self) -> ScheduleView:
        """The compute-scheduling loop's current plan, why, and its last actions."""
        r: pb.GetScheduleResponse = await self._unary(
            "GetSchedule",
            lambda stub, timeout: stub.GetSchedule(pb.GetScheduleRequest(), timeout=timeout),
        )
        return _schedule(r)

    async def pause_schedule(self, paused: bool = True) -> ScheduleView:
        """Pause the compute-scheduling loop (it observes and decides nothing) or, with
        ``paused=False``, resume it: its next round re-plans at once."""
        request = pb.PauseScheduleRequest(paused=paused)
        r: pb.GetScheduleResponse = await self._unary(
            "PauseSchedule",
            lambda stub, timeout: stub.PauseSchedule(request, timeout=timeout),
        )
        return _schedule(r)

    async def watch(self, recent: int = 0, follow: bool = True) -> AsyncIterator[EventView]:
        """The ``recent`` most recent events, then (``follow``) new ones as they happen,
        until the caller stops iterating.

        The stream is opened on the leader as unary calls are (a standby's answer and an
        unreachable controller before the first event are followed); once events have
        arrived, a broken stream is an error (the caller resumes from the last sequence)."""
        request = pb.WatchEventsRequest(recent=recent, follow=follow)
        route = _Route(self, "WatchEvents")  # its deadline bounds the failovers only
        call = self._stub_for(route.address).WatchEvents(request)
        started = False
        try:
            while True:
                try:
                    if started:
                        e = await leader.call(route.what(), call.read())
                    else:  # the first event: within the connect deadline as unary calls
                        e = await leader.attempt(
                            self._channel(route.address),
                            route.what(),
                            call.read(),
                            route.connect_timeout(),
                        )
                except (leader.NotLeader, leader.Unreachable) as exc:
                    if started:
                        raise
                    await route.failed(exc)
                    call.cancel()
                    call = self._stub_for(route.address).WatchEvents(request)
                    continue
                if e is grpc.aio.EOF:
                    return
                started = True
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


class _Route:
    """One call's way to the leader (see :class:`AsyncClient`): the attempts in flight,
    when each address may be asked again, the redirects followed, the deadline.

    The client's current address is asked first; every other address once it fails or
    has been silent for the attempt timeout (a hedge), a leader named by a standby at once.
    An address that failed is asked again after its own jittered backoff (growing with its
    failures, at most ``backoff_max_s``), while a silent one stays in flight: a frozen
    controller never delays the others."""

    def __init__(self, client: AsyncClient, rpc: str, patience_s: float = 0.0) -> None:
        self._client = client
        self._rpc = rpc
        self._patience_s = patience_s  # more time for this call (and its silences)
        self.address = client.address  # where the next attempt goes
        self._loop = asyncio.get_running_loop()
        self._started = self._loop.time()
        self._deadline = self._started + client.timeout_s + patience_s
        # the list, the leader found by an earlier call, and the leaders named on the way
        self._candidates = list(dict.fromkeys([client.address, *client.addresses]))
        self._hops = 0  # redirects followed (watch), or new leaders named (unary calls)
        # addresses that failed in this call (watch: since the last backoff)
        self._failed: set[str] = set()
        self._failures: dict[str, int] = {}  # per address, for its backoff
        self._rounds = 0
        self._answers: dict[str, str] = {}  # each address's last answer, for the error

    def what(self, address: str | None = None) -> str:
        """The attempt, as errors name it."""
        return f"controller {address or self.address}: {self._rpc}"

    def _move_to(self, address: str) -> None:
        self.address = self._client.address = address  # later calls start there too

    def remaining(self) -> float:
        """What is left of the call's deadline."""
        return max(0.0, self._deadline - self._loop.time())

    def connect_timeout(self) -> float | None:
        """The connect deadline of an attempt: none when there is nowhere else to go (one
        controller: wait for it within the call's deadline)."""
        return self._client.connect_timeout_s if len(self._candidates) > 1 else None

    def _backoff(self, failures: int | None = None) -> float:
        c = self._client
        if failures is None:  # (watch) the rounds through the list
            self._rounds += 1
            failures = self._rounds
        ceiling = min(c._backoff_max_s, c._backoff_initial_s * 2.0 ** max(0, failures - 1))
        return c._rng.uniform(ceiling / 2.0, ceiling)

    async def run(self, send: Callable[[Any, float], Awaitable[T]]) -> T:
        """Attempts of ``send(stub, timeout)`` until one answers as the leader (see the
        class docstring); its result, or the error that ends the call."""
        c = self._client
        attempt_s = c.attempt_timeout_s + self._patience_s
        primary = self.address
        inflight: dict[asyncio.Task[T], tuple[str, float]] = {}  # -> (address, since)
        # when each address may be asked (again): the others after the hedge delay
        due = dict.fromkeys(self._candidates, self._started + attempt_s)
        due[primary] = self._started
        asked: set[str] = set()
        spread = False  # whether the others were asked yet

        def launch(address: str) -> None:
            # (the call's own deadline ends the attempts: gRPC's comes a little later)
            coro = send(c._stub_for(address), self.remaining() + DEADLINE_GRACE_S)
            task = asyncio.ensure_future(
                leader.attempt(c._channel(address), self.what(address), coro,
                               self.connect_timeout())
            )  # fmt: skip
            inflight[task] = (address, self._loop.time())
            asked.add(address)

        try:
            while True:
                now = self._loop.time()
                if now >= self._deadline:
                    raise self._give_up(a for a, _ in inflight.values())
                busy = {a for a, _ in inflight.values()}
                # an attempt that may still answer in time holds back the retries (not
                # the first asking of an address: a hedge, a leader just named); one to an
                # address that failed before in this call is a probe and holds back nothing
                talking = [
                    t + attempt_s
                    for a, t in inflight.values()
                    if now < t + attempt_s and a not in self._failed
                ]
                ready = [
                    a
                    for a in self._candidates
                    if a not in busy and due[a] <= now and (a not in asked or not talking)
                ]
                if not spread and any(a != primary for a in ready):
                    spread = True
                    log.warning(
                        "controller_try_next" if primary in self._failed else "controller_hedge",
                        rpc=self._rpc,
                        failed=primary if primary in self._failed else None,
                        reason=self._answers.get(primary),
                        silent=primary if primary in busy else None,
                        next=", ".join(a for a in ready if a != primary),
                    )
                for a in ready:
                    launch(a)
                busy = {a for a, _ in inflight.values()}
                waiting = [
                    max(due[a], min(talking)) if talking and a in asked else due[a]
                    for a in self._candidates
                    if a not in busy
                ]
                wake = min([self._deadline, *waiting])
                if not inflight:
                    await asyncio.sleep(max(0.0, wake - now))
                    continue
                done, _ = await asyncio.wait(
                    inflight, timeout=max(0.0, wake - now), return_when=asyncio.FIRST_COMPLETED
                )
                for task in done:
                    address, _ = inflight.pop(task)
                    try:
                        result = task.result()
                    except (leader.NotLeader, leader.Unreachable) as exc:
                        named = self._failure(address, exc)
                        if named is None and len(self._candidates) == 1:  # nowhere else
                            raise
                        now = self._loop.time()
                        fails = self._failures[address] = self._failures.get(address, 0) + 1
                        due[address] = now + self._backoff(fails)
                        if address == primary:  # the others at once
                            for a in self._candidates:
                                if a != primary:
                                    due[a] = min(due.get(a, now), now)
                        if named is not None:
                            due[named] = min(due.get(named, now), now)
                        continue
                    self._move_to(address)
                    return result
        finally:
            for task in inflight:
                task.cancel()
            if inflight:
                await asyncio.gather(*inflight, return_exceptions=True)

    def _failure(self, here: str, exc: errors.Unavailable) -> str | None:
        """Note that the attempt on ``here`` failed with ``exc``; the leader to ask at once
        when ``exc`` is a standby's answer naming one that has not failed since the last
        backoff (a new address counts against the hops allowed)."""
        self._answers[here] = str(exc)
        self._failed.add(here)
        named = exc.leader if isinstance(exc, leader.NotLeader) else None
        if named is None or named == here or named in self._failed:  # stale news
            return None
        if named not in self._candidates:
            if self._hops >= len(self._client.addresses) + 2:
                return None
            self._hops += 1
            self._candidates.append(named)
        log.info("controller_redirect", rpc=self._rpc, standby=here, leader=named)
        return named

    async def failed(self, exc: errors.Unavailable) -> None:
        """(``watch``, one attempt at a time) The attempt on the current address failed
        with ``exc``: move to where the next attempt goes (after a backoff when due), or
        raise when the call must give up."""
        here = self.address
        named = self._failure(here, exc)
        if named is not None:
            if self.remaining() <= 0.0:
                raise self._give_up(())
            self._move_to(named)
            return
        if len(self._candidates) == 1:  # nowhere else to try
            raise exc
        following = self._candidates[(self._candidates.index(here) + 1) % len(self._candidates)]
        delay = self._backoff() if following in self._failed else 0.0
        if self.remaining() <= delay:
            raise self._give_up(())
        log.warning(
            "controller_try_next",
            rpc=self._rpc,
            failed=here,
            reason=str(exc),
            next=following,
            retry_in_s=round(delay, 3),
        )
        if delay:
            await asyncio.sleep(delay)
            self._failed.clear()
            self._hops = 0
        self._move_to(following)

    def _give_up(self, silent: Iterable[str]) -> errors.Unavailable:
        waited = self._loop.time() - self._started
        for address in silent:
            self._answers[address] = "no answer yet (asked, still silent)"
        answers = errors.listed(f"{a}: {why}" for a, why in self._answers.items())
        return errors.Unavailable(
            f"{self._rpc}: no leader among the controllers {', '.join(self._candidates)} "
            f"answered within {waited:.1f} s (timeout {self._client.timeout_s:g} s); "
            f"last answers: {answers}"
        )


class Client:
    """Synchronous client: the same calls as ``AsyncClient``, blocking."""

    def __init__(
        self,
        address: str | Sequence[str] | None = None,
        timeout_s: float = 30.0,
        tls: TlsConfig | None = None,
        *,
        attempt_timeout_s: float = ATTEMPT_TIMEOUT_S,
        connect_timeout_s: float = leader.CONNECT_TIMEOUT_S,
    ) -> None:
        self._runner = asyncio.Runner()
        self._async = self._runner.run(
            _make(address, timeout_s, tls, attempt_timeout_s, connect_timeout_s)
        )
        self.addresses = self._async.addresses

    @property
    def address(self) -> str:
        """The controller calls go to (the leader, once one answered)."""
        return self._async.address

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
        self,
        phase: Phase | str,
        request_id: str = "",
        idle_window_s: float = 0.0,
        *,
        checkpoint: str = "",
        source: str = "",
        checksum: str = "",
        in_flight: str = "finish",
        sync_timeout_s: float = 600.0,
        streams: int = 0,
    ) -> PhaseChange:
        """See :meth:`AsyncClient.set_phase`."""
        result: PhaseChange = self._run(
            self._async.set_phase(
                phase,
                request_id,
                idle_window_s,
                checkpoint=checkpoint,
                source=source,
                checksum=checksum,
                in_flight=in_flight,
                sync_timeout_s=sync_timeout_s,
                streams=streams,
            )
        )
        return result

    def get_phase(self) -> PhaseState:
        result: PhaseState = self._run(self._async.get_phase())
        return result

    def set_mode(
        self, mode: Mode | str, request_id: str = "", *, phase: Phase | str | None = None
    ) -> ModeState:
        """See :meth:`AsyncClient.set_mode`."""
        result: ModeState = self._run(self._async.set_mode(mode, request_id, phase=phase))
        return result

    def get_mode(self) -> ModeState:
        """See :meth:`AsyncClient.get_mode`."""
        result: ModeState = self._run(self._async.get_mode())
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

    def pause_schedule(self, paused: bool = True) -> ScheduleView:
        result: ScheduleView = self._run(self._async.pause_schedule(paused))
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


async def _make(
    address: str | Sequence[str] | None,
    timeout_s: float,
    tls: TlsConfig | None,
    attempt_timeout_s: float,
    connect_timeout_s: float,
) -> AsyncClient:
    return AsyncClient(
        address,
        timeout_s,
        tls,
        attempt_timeout_s=attempt_timeout_s,
        connect_timeout_s=connect_timeout_s,
    )


__all__ = [
    "AsyncClient",
    "CircuitView",
    "Client",
    "EventView",
    "ModeState",
    "NodeView",
    "NodeWeightSyncView",
    "PhaseChange",
    "PhasePlan",
    "PhaseState",
    "WeightSyncIncomplete",
    "WeightSyncView",
    "controller_address",
    "controller_addresses",
    "to_json",
]
