"""gRPC FabricController servicer: translation between protobuf and the Controller only.

A controller that does not lead (a standby of an HA group, or a leader that just stepped
down) answers every FabricController call with the standby contract of
:mod:`orchestrrl.leader` (UNAVAILABLE, ``not the leader; the leader is at HOST:PORT``,
trailing metadata ``orl-leader``): agents' registrations, heartbeats and telemetry go to
the leader too. Streams are checked at every message, so a stream open on a leader that
steps down ends with that answer (a WatchEvents stream after the ``stepped_down`` event).
The health service is separate and keeps answering.
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeAlias, TypeVar

import grpc
from google.protobuf.message import DecodeError

from fabric_controller.controller import Controller, PhaseResult
from fabric_controller.events import Event
from fabric_controller.leadership import NotLeader
from fabric_controller.registry import Health
from fabric_controller.scheduler_loop import ComputeScheduler, ScheduleView
from fabric_controller.scheduling import after_index, layouts_after
from fabric_controller.store import EpochRecord
from fabric_controller.weight_sync import SyncReport, check_spec
from fabric_controller.weight_sync_runner import WeightSync
from orchestrrl import errors, leader, limits
from orchestrrl.convert import (
    circuit_to_pb,
    optional_phase_from_pb,
    phase_from_pb,
    phase_to_pb,
    stages_to_pb,
)
from orchestrrl.grpcutil import domain_errors_to_status, parse_address
from orchestrrl.logs import get_logger
from orchestrrl.model import Circuit, Mode
from orchestrrl.tls import Authorizer
from orchestrrl.v1 import common_pb2, node_agent_pb2
from orchestrrl.v1 import fabric_controller_pb2 as pb
from orchestrrl.v1 import fabric_controller_pb2_grpc as pb_grpc

Ctx: TypeAlias = grpc.aio.ServicerContext

log = get_logger("fabric_controller.servicer")

F = TypeVar("F", bound=Callable[..., Any])


def leader_only(func: F) -> F:
    """Decorate a servicer method (under ``domain_errors_to_status``): a controller that
    does not lead, or stops leading during the call, answers with the standby contract
    (``orchestrrl.leader.abort_not_leader``) naming the leader when it knows it."""

    if inspect.isasyncgenfunction(func):

        @functools.wraps(func)
        async def gen_wrapper(self: Any, request: Any, context: Any) -> AsyncIterator[Any]:
            role = self.c.role
            if not role.serves:
                await leader.abort_not_leader(context, role.redirect, role.overdue)
            try:
                async for item in func(self, request, context):
                    yield item
                    if not role.serves:  # stepped down while the stream was open
                        await leader.abort_not_leader(context, role.redirect, role.overdue)
            except NotLeader:
                await leader.abort_not_leader(context, role.redirect, role.overdue)

        return gen_wrapper  # type: ignore[return-value]

    @functools.wraps(func)
    async def wrapper(self: Any, request: Any, context: Any) -> Any:
        role = self.c.role
        if not role.serves:
            await leader.abort_not_leader(context, role.redirect, role.overdue)
        try:
            return await func(self, request, context)
        except NotLeader:
            await leader.abort_not_leader(context, role.redirect, role.overdue)

    return wrapper  # type: ignore[return-value]


_HEALTH = {
    Health.UP: pb.NODE_HEALTH_UP,
    Health.DOWN: pb.NODE_HEALTH_DOWN,
    Health.UNKNOWN: pb.NODE_HEALTH_UNKNOWN,
}


class FabricControllerServicer(pb_grpc.FabricControllerServicer):
    """Agents may act only for their own node; everything else is for operators
    (with mutual TLS; plaintext allows all, for local development)."""

    def __init__(
        self,
        controller: Controller,
        auth: Authorizer | None = None,
        scheduler: ComputeScheduler | None = None,
        weights: WeightSync | None = None,
    ) -> None:
        """``scheduler`` None: GetSchedule reports compute scheduling as off; ``weights``
        None: SetPhase with a checkpoint is refused (this controller sends no weight
        updates)."""
        self.weights = weights
        self.c = controller
        self.auth = auth or Authorizer(None)
        # Phase replies carry thousands of circuits on a large fabric, mostly the same
        # ones epoch after epoch. Each circuit is encoded once, as a one-circuit reply,
        # and a reply is the concatenation of those (protobuf parses concatenated
        # messages as one, appending repeated fields): a few ms instead of tens.
        self._encoded: dict[tuple[str, str], dict[Circuit, bytes]] = {}
        self._encoded_for: object = None
        self.scheduler = scheduler

    def _circuits(self, circuits: frozenset[Circuit]) -> list[common_pb2.Circuit]:
        return [circuit_to_pb(x, self.c.wiring.circuit_pods(x)) for x in sorted(circuits)]

    @domain_errors_to_status
    @leader_only
    async def Register(self, request: pb.RegisterRequest, context: Ctx) -> pb.RegisterResponse:
        if not request.node:
            raise errors.field_error("node", request.node, "the node's name from the wiring file")
        self.auth.node(context, request.node)
        parse_address(request.agent_address, "agent_address")
        record = await self.c.register_agent(
            request.node,
            request.agent_address,
            request.status.gpu_backend,
            len(request.status.gpus),
            request.status.engine,
            request.status.gateway,
            request.status.kv_import,
            request.status.max_num_seqs,
        )
        cur = self.c.current
        return pb.RegisterResponse(
            session_id=record.session_id,
            heartbeat_interval_s=self.c.heartbeat_interval_s,
            epoch=cur.epoch,
            phase=phase_to_pb(cur.phase),
        )

    @domain_errors_to_status
    @leader_only
    async def Heartbeat(self, request: pb.HeartbeatRequest, context: Ctx) -> pb.HeartbeatResponse:
        self.auth.node(context, request.node)
        self.c.heartbeat(request.node, request.session_id)
        cur = self.c.current
        return pb.HeartbeatResponse(epoch=cur.epoch, phase=phase_to_pb(cur.phase))

    @domain_errors_to_status
    @leader_only
    async def ReportTelemetry(
        self,
        request_iterator: AsyncIterator[node_agent_pb2.TelemetrySample],
        context: Ctx,
    ) -> pb.ReportTelemetryResponse:
        accepted = 0
        async for sample in request_iterator:
            self.c.role.check("ReportTelemetry")  # stepped down: the agent moves on
            self.auth.node(context, sample.node)
            self.c.telemetry(sample)
            accepted += 1
        return pb.ReportTelemetryResponse(accepted=accepted)

    @domain_errors_to_status
    @leader_only
    async def ReportTelemetryBatch(
        self,
        request_iterator: AsyncIterator[node_agent_pb2.TelemetryBatch],
        context: Ctx,
    ) -> pb.ReportTelemetryResponse:
        # Each sample is parsed only as far as its node and time; the newest of each node
        # in full (the registry keeps no other). A sample that does not decode is left out
        # (counted, and one bounded warning per batch); the batch's others are taken.
        head = node_agent_pb2.TelemetrySampleHead.FromString
        full = node_agent_pb2.TelemetrySample.FromString
        accepted = 0
        async for batch in request_iterator:
            self.c.role.check("ReportTelemetryBatch")
            raw = batch.samples
            if not raw:
                continue
            bad = errors.Problems(limit=1)
            last: dict[str, int] = {}
            for k, data in enumerate(raw):
                try:
                    last[head(data).node] = k
                except DecodeError as exc:
                    bad.add(f"samples[{k}]: {exc}")
            for node in last:  # (caps hold the batch, not the nodes inside its samples)
                limits.check_text("samples[].node", node, limits.MAX_NAME_CHARS, "a node name")
                self.auth.node(context, node)
            newest = []
            for node, k in last.items():
                try:
                    newest.append(full(raw[k]))
                except DecodeError as exc:
                    bad.add(f"samples[{k}] of node {errors.shown(node)}: {exc}")
            if bad:
                self._undecodable_samples(bad, len(raw), last)
            self.c.telemetry_batch(newest, len(raw) - bad.count)
            accepted += len(raw) - bad.count
        return pb.ReportTelemetryResponse(accepted=accepted)

    def _undecodable_samples(
        self, bad: errors.Problems, samples: int, nodes: dict[str, int]
    ) -> None:
        self.c.metrics.telemetry_rejected.labels(reason="undecodable").inc(bad.count)
        log.warning(
            "telemetry_samples_undecodable",
            rejected=bad.count,
            samples=samples,
            nodes=errors.listed(sorted(nodes), ", "),  # the batch's readable nodes
            first=errors.bounded(bad.shown[0], 300),
        )

    def _circuit_fields(self, reply: Any, **fields: frozenset[Circuit]) -> None:
        """Fill repeated Circuit fields of ``reply`` (sorted, with their pods)."""
        if self._encoded_for is not self.c.wiring:  # pods are the wiring's
            self._encoded_for = self.c.wiring
            self._encoded.clear()
        pods = self.c.wiring.circuit_pods
        parts = []
        for name, circuits in fields.items():
            cache = self._encoded.setdefault((type(reply).__name__, name), {})
            if len(cache) > 1 << 16:
                cache.clear()
            for c in sorted(circuits):
                one = cache.get(c)
                if one is None:
                    one = cache[c] = type(reply)(
                        **{name: [circuit_to_pb(c, pods(c))]}
                    ).SerializeToString()
                parts.append(one)
        reply.MergeFromString(b"".join(parts))

    def _epoch_reply(
        self,
        record: EpochRecord,
        changed: bool,
        message: str,
        gated: bool = False,
        explanation: str = "",
    ) -> pb.SetPhaseResponse:
        r = pb.SetPhaseResponse(
            epoch=record.epoch,
            phase=phase_to_pb(record.phase),
            changed=changed,
            stages=stages_to_pb(record.stages),
            message=message,
            gated=gated,
            explanation=explanation,
            degraded=record.degraded,
            missing=[
                pb.MissingCircuits(pod_a=a, pod_b=b, circuits=n) for a, b, n in record.missing
            ],
        )
        if changed:
            self._circuit_fields(
                r, circuits=record.circuits, added=record.added, removed=record.removed
            )
        else:
            self._circuit_fields(r, circuits=record.circuits)
        return r

    @domain_errors_to_status
    @leader_only
    async def SetPhase(self, request: pb.SetPhaseRequest, context: Ctx) -> pb.SetPhaseResponse:
        self.auth.operator(context)
        phase = phase_from_pb(request.phase)
        window = request.idle_window_s
        if not math.isfinite(window) or window < 0:
            raise errors.field_error(
                "idle_window_s", window, "seconds >= 0 (0 means unknown: no slack gate)"
            )
        if request.HasField("checkpoint"):
            ck = request.checkpoint
            spec = check_spec(
                self.c.wiring, phase, ck.version, ck.source_node, ck.checksum, ck.in_flight,
                ck.timeout_s, ck.streams,
            )  # fmt: skip
            if self.weights is None:
                raise errors.FailedPrecondition(
                    "this controller cannot send weight updates (it was started without agent "
                    "clients); set the phase without a checkpoint"
                )
            result = await self.weights.set_phase(phase, request.request_id, window or None, spec)
        else:
            result = await self.c.set_phase(phase, request.request_id, window or None)
        reply = self._epoch_reply(
            result.record, result.changed, result.message, result.gated, result.explanation
        )
        if result.weight_sync is not None:
            reply.weight_sync.CopyFrom(report_to_pb(result.weight_sync))
        return reply

    def _mode_reply(self, result: PhaseResult | None = None) -> pb.GetModeResponse:
        record = result.record if result is not None else self.c.current
        return pb.GetModeResponse(
            mode=Mode.of(record.phase).value,
            epoch=record.epoch,
            phase=phase_to_pb(record.phase),
            circuits=len(record.circuits),
            changed=result.changed if result is not None else False,
            message=result.message if result is not None else "",
        )

    @domain_errors_to_status
    @leader_only
    async def SetMode(self, request: pb.SetModeRequest, context: Ctx) -> pb.GetModeResponse:
        self.auth.operator(context)
        mode = Mode.parse(request.mode)
        leave_to = optional_phase_from_pb(request.phase)
        return self._mode_reply(await self.c.set_mode(mode, request.request_id, leave_to))

    @domain_errors_to_status
    @leader_only
    async def GetMode(self, request: pb.GetModeRequest, context: Ctx) -> pb.GetModeResponse:
        self.auth.operator(context)
        return self._mode_reply()

    @domain_errors_to_status
    @leader_only
    async def GetPhase(self, request: pb.GetPhaseRequest, context: Ctx) -> pb.GetPhaseResponse:
        self.auth.operator(context)
        cur = self.c.current
        return pb.GetPhaseResponse(
            epoch=cur.epoch,
            phase=phase_to_pb(cur.phase),
            circuits=self._circuits(cur.circuits),
            committed_at=cur.committed_at,
        )

    @domain_errors_to_status
    @leader_only
    async def PlanPhase(self, request: pb.PlanPhaseRequest, context: Ctx) -> pb.PlanPhaseResponse:
        self.auth.operator(context)
        phase = phase_from_pb(request.phase)
        preview = await self.c.plan(phase)
        plan = preview.circuits
        r = pb.PlanPhaseResponse(phase=request.phase, explanation=preview.explanation)
        self._circuit_fields(r, circuits=plan.desired, added=plan.add, removed=plan.remove)
        return r

    @domain_errors_to_status
    @leader_only
    async def GetTopology(self, request: pb.GetTopologyRequest, context: Ctx) -> pb.Topology:
        self.auth.operator(context)
        w = self.c.wiring
        cur = self.c.current
        return pb.Topology(
            cluster=w.cluster,
            pods=[
                pb.PodInfo(name=p.name, role=p.role.value, nodes=p.nodes, tors=p.tors)
                for p in w.pods
            ],
            nodes=[
                pb.NodeInfo(
                    name=n.name,
                    pod=n.pod,
                    role=n.role.value,
                    agent_address=n.agent,
                    gpus=n.gpus,
                    nics=[
                        pb.NicCabling(
                            name=x.name, tor=x.tor, tor_port=x.tor_port, speed_gbps=x.gbps
                        )
                        for x in n.nics
                    ],
                )
                for n in w.nodes
            ],
            tors=[
                pb.TorInfo(
                    name=t.name,
                    pod=t.pod,
                    uplinks=[
                        pb.TorUplink(port=u.port, ocs=u.ocs, ocs_port=u.ocs_port) for u in t.uplinks
                    ],
                )
                for t in w.tors
            ],
            ocses=[
                pb.OcsInfo(
                    name=o.name,
                    address=o.address,
                    port_count=o.ports,
                    switching_time_s=o.switching_time_s,
                )
                for o in w.ocses
            ],
            circuits=self._circuits(cur.circuits),
            epoch=cur.epoch,
            phase=phase_to_pb(cur.phase),
        )

    @domain_errors_to_status
    @leader_only
    async def ListNodes(self, request: pb.ListNodesRequest, context: Ctx) -> pb.ListNodesResponse:
        self.auth.operator(context)
        out = []
        for record, health, age in self.c.nodes():
            node = self.c.wiring.node(record.name)
            out.append(
                pb.NodeState(
                    node=record.name,
                    pod=node.pod,
                    role=node.role.value,
                    health=_HEALTH[health],
                    agent_address=record.agent_address,
                    last_seen_age_s=-1.0 if age is None else age,
                    last_telemetry=record.telemetry,
                    gpu_backend=record.gpu_backend,
                    engine=record.engine,
                    gateway=record.gateway,
                )
            )
        return pb.ListNodesResponse(nodes=out)

    @domain_errors_to_status
    @leader_only
    async def GetSchedule(
        self, request: pb.GetScheduleRequest, context: Ctx
    ) -> pb.GetScheduleResponse:
        self.auth.operator(context)
        if self.scheduler is None:
            return schedule_to_pb(ScheduleView(False, 0.0))
        return schedule_to_pb(self.scheduler.view())

    @domain_errors_to_status
    @leader_only
    async def PauseSchedule(
        self, request: pb.PauseScheduleRequest, context: Ctx
    ) -> pb.GetScheduleResponse:
        self.auth.operator(context)
        if self.scheduler is None:
            raise errors.FailedPrecondition("compute scheduling is off: nothing to pause")
        self.scheduler.pause(request.paused)
        return schedule_to_pb(self.scheduler.view())

    @domain_errors_to_status
    @leader_only
    async def WatchEvents(
        self, request: pb.WatchEventsRequest, context: Ctx
    ) -> AsyncIterator[pb.Event]:
        self.auth.operator(context)
        if not request.follow:
            for event in self.c.events.recent(request.recent):
                yield event_to_pb(event)
            return
        async for event in self.c.events.subscribe(request.recent):
            yield event_to_pb(event)


def report_to_pb(r: SyncReport) -> pb.WeightSyncReport:
    return pb.WeightSyncReport(
        version=r.version,
        checksum=r.checksum,
        source_node=r.source,
        source_address=r.source_address,
        checkpoint_bytes=r.checkpoint_bytes,
        nodes=[
            pb.NodeWeightSync(
                node=o.node,
                ok=o.ok,
                version=o.version,
                previous=o.previous,
                bytes_fetched=o.bytes_fetched,
                fetch_seconds=o.fetch_seconds,
                load_seconds=o.load_seconds,
                seconds=o.seconds,
                mbytes_per_s=o.mbytes_per_s,
                error=o.error,
                how=o.how,
                resumes=o.resumes,
                cached=o.cached,
                circuits=o.circuits,
                finished_at=o.finished_at,
                streams=o.streams,
            )
            for o in r.nodes
        ],
        complete=r.complete,
        completed_at=r.completed_at,
        seconds=r.seconds,
        message=r.message,
        epoch=r.epoch,
    )


def event_to_pb(e: Event) -> pb.Event:
    return pb.Event(
        sequence=e.sequence,
        timestamp=e.timestamp,
        kind=e.kind,
        node=e.node,
        epoch=e.epoch,
        phase=phase_to_pb(e.phase),
        message=e.message,
        stages=stages_to_pb(e.stages),
    )


def schedule_to_pb(v: ScheduleView) -> pb.GetScheduleResponse:
    out = pb.GetScheduleResponse(
        enabled=v.enabled,
        interval_s=v.interval_s,
        planned_at=v.planned_at,
        mode=v.mode,
        reason=v.reason,
        explanation=v.explanation(),
        acted=v.acted,
        step=v.step,
        skipped_nodes=v.skipped,
        groups=v.groups,
        groups_with_prior=v.groups_with_prior,
        paused=v.paused,
        reshard_pause_s=dict(v.reshard_pauses),
        actions=[
            pb.SchedulerAction(
                timestamp=a.timestamp,
                kind=a.kind,
                node=a.node,
                command_id=a.command_id,
                ok=a.ok,
                message=a.message,
                seconds=a.seconds,
                requests=a.requests,
                method=a.method,
            )
            for a in v.actions
        ],
    )
    plan, snap = v.plan, v.snapshot
    if plan is None or snap is None:
        return out
    after = layouts_after(plan, snap)
    out.layouts.extend(
        pb.NodeLayout(node=n, before=layout, after=after[n]) for n, layout in snap.layouts.items()
    )
    out.reshards.extend(
        pb.ScheduledReshard(node=r.node, before=r.before, after=r.after, pause_s=r.pause_s)
        for r in plan.reshards
    )
    where = after_index(plan, snap)
    for m in plan.migrations:
        src = snap.index.get(m.source or "", ("", -1))
        dst = where.get(m.target, ("", -1))
        out.migrations.append(
            pb.ScheduledMigration(
                request_id=m.request,
                source_node=src[0],
                source_instance=src[1],
                target_node=dst[0],
                target_instance=dst[1],
                method=m.method.value,
                cost_s=m.cost_s,
            )
        )
    p = plan.prediction
    out.prediction.CopyFrom(
        pb.SchedulePrediction(
            keep_makespan_s=p.keep_makespan_s,
            planned_makespan_s=p.planned_makespan_s,
            steady_makespan_s=p.steady_makespan_s,
            switching_s=p.switching_s,
            migration_s=p.migration_s,
            gain_s=p.gain_s,
        )
    )
    out.requests = len(snap.state.requests)
    return out
