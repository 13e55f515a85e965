"""Weight sync as a phase that moves bytes: the controller's shell.

:class:`WeightSync` resolves the checkpoint on its source's agent, has the epoch manager
commit the weight-sync phase, and, under the same phase lock, sends ``UpdateWeights`` to
every generation node at once (stamped with the leader's fencing token), waits for every
answer, and builds the report. Every decision is in :mod:`fabric_controller.weight_sync`;
this module only talks to the agents and reads the clock.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Protocol

from fabric_controller.controller import Controller, PhaseResult
from fabric_controller.events import Event
from fabric_controller.registry import Health
from fabric_controller.weight_sync import (
    NodeOutcome,
    NodeSeen,
    Source,
    SyncReport,
    SyncSpec,
    build_report,
    circuits_between,
    command_id,
    targets,
)
from orchestrrl import checkpoint, errors
from orchestrrl.logs import get_logger
from orchestrrl.model import Phase
from orchestrrl.v1 import checkpoints_pb2
from orchestrrl.v1 import node_agent_pb2 as pb

log = get_logger("fabric_controller.weight_sync")

ANSWER_MARGIN_S = 30.0  # beyond the agent's own timeout, before its answer is given up


class WeightSyncClient(Protocol):
    """What the weight sync needs of one agent (``drivers.agents.GrpcAgentClient``)."""

    node: str

    async def get_status(self) -> pb.NodeStatus: ...

    async def get_checkpoint(
        self, version: str, checksum: str
    ) -> checkpoints_pb2.CheckpointInfo: ...

    async def update_weights(
        self, request: pb.UpdateWeightsRequest, timeout_s: float
    ) -> pb.UpdateWeightsResponse: ...


class WeightSync:
    """``clients(node, agent_address)``: a client of that agent."""

    def __init__(
        self,
        controller: Controller,
        clients: Callable[[str, str], WeightSyncClient],
        *,
        wall_clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.c = controller
        self._clients = clients
        self._wall = wall_clock
        self._mono = monotonic

    def _seen(self) -> list[NodeSeen]:
        out = []
        for record, health, _age in self.c.nodes():
            version = record.telemetry.weight_version if record.telemetry is not None else ""
            why = {
                Health.UP: "",
                Health.DOWN: "down (missed its heartbeat deadline)",
                Health.UNKNOWN: "never registered",
            }[health]
            out.append(
                NodeSeen(record.name, health is Health.UP, record.agent_address, version, why)
            )
        return out

    async def resolve(self, spec: SyncSpec) -> Source:
        """The checkpoint as the source's agent holds it (before any circuit moves):
        FailedPrecondition when the source is not up or serves no checkpoints, NotFound
        when it does not hold the version (naming what it holds)."""
        seen = {s.node: s for s in self._seen()}.get(spec.source)
        if seen is None or not seen.up or not seen.address:
            why = seen.why_not if seen is not None else "not registered"
            raise errors.FailedPrecondition(
                f"checkpoint.source_node {spec.source!r} cannot serve checkpoint "
                f"{spec.version}: {why}; no circuit was changed"
            )
        client = self._clients(spec.source, seen.address)
        status = await client.get_status()
        if not status.checkpoints:
            raise errors.FailedPrecondition(
                f"checkpoint.source_node {spec.source!r} serves no checkpoints (its agent has "
                "no checkpoint_dir); no circuit was changed"
            )
        info = await client.get_checkpoint(spec.version, spec.checksum)
        manifest = checkpoint.parse_manifest(info.manifest)
        return Source(
            spec.source,
            status.checkpoint_address or seen.address,
            manifest.checksum,
            manifest.size,
        )

    async def set_phase(
        self,
        phase: Phase,
        request_id: str,
        idle_window_s: float | None,
        spec: SyncSpec,
    ) -> PhaseResult:
        """The weight-sync phase, then the weight sync on its circuits (module docstring)."""
        source = await self.resolve(spec)

        async def sync(result: PhaseResult) -> PhaseResult:
            report = await self.sync(result, spec, source, request_id)
            return replace(result, weight_sync=report)

        what = f"weight sync of version {spec.version} from {spec.source}"
        return await self.c.set_phase(phase, request_id, idle_window_s, sync, what)

    async def sync(
        self, result: PhaseResult, spec: SyncSpec, source: Source, request_id: str
    ) -> SyncReport:
        epoch = result.record
        token = self.c.role.fencing_token("UpdateWeights")  # NotLeader once deposed
        send, skip = targets(self.c.wiring, self._seen())
        nonce = secrets.token_hex(8)
        started = self._mono()
        log.info(
            "weight_sync_started",
            epoch=epoch.epoch,
            version=spec.version,
            checksum=source.checksum[:16],
            source=source.node,
            address=source.address,
            nodes=[s.node for s in send],
            skipped=[s.node for s in skip] or None,
        )

        async def one(node: NodeSeen) -> NodeOutcome:
            circuits = circuits_between(self.c.wiring, epoch.circuits, source.node, node.node)
            request = pb.UpdateWeightsRequest(
                command_id=command_id(request_id, nonce, spec, source.checksum, node.node),
                version=spec.version,
                checksum=source.checksum,
                source_node=source.node,
                source_address=source.address,
                in_flight=spec.in_flight,
                fencing_token=token,
                timeout_s=spec.timeout_s,
                streams=spec.streams,
            )
            t0 = self._mono()
            try:
                client = self._clients(node.node, node.address)
                r = await client.update_weights(request, spec.timeout_s + ANSWER_MARGIN_S)
            except errors.OrlError as exc:
                return NodeOutcome(
                    node.node, False, node.version, error=errors.bounded(str(exc), 600),
                    seconds=self._mono() - t0, circuits=circuits, finished_at=self._wall(),
                )  # fmt: skip
            return NodeOutcome(
                node.node,
                r.version == spec.version,
                r.version,
                previous=r.previous,
                bytes_fetched=r.bytes_fetched,
                fetch_seconds=r.fetch_seconds,
                load_seconds=r.load_seconds,
                seconds=self._mono() - t0,
                error="" if r.version == spec.version else f"answered version {r.version!r}",
                how=r.how,
                resumes=r.resumes,
                cached=r.cached,
                circuits=circuits,
                finished_at=self._wall(),
                streams=r.streams,
            )

        done = await asyncio.gather(*(one(n) for n in send))
        skipped = [
            NodeOutcome(
                s.node,
                False,
                s.version,
                error=f"{s.why_not or 'no agent address'}: not sent",
                circuits=circuits_between(self.c.wiring, epoch.circuits, source.node, s.node),
            )
            for s in skip
        ]
        order = {n.name: k for k, n in enumerate(self.c.wiring.nodes)}
        outcomes = sorted([*done, *skipped], key=lambda o: order[o.node])
        note = "the topology was kept: the bytes took the circuits in place" if result.gated else ""
        report = build_report(spec, source, epoch.epoch, outcomes, self._mono() - started, note)
        log.info(
            "weight_sync_done" if report.complete else "weight_sync_incomplete",
            epoch=epoch.epoch,
            version=spec.version,
            complete=report.complete,
            seconds=round(report.seconds, 3),
            message=report.message,
        )
        self.c.events.publish(
            Event(
                "weight_synced" if report.complete else "weight_sync_incomplete",
                epoch=epoch.epoch,
                phase=Phase.WEIGHT_SYNC,
                message=report.message,
            )
        )
        return report
