"""The NodeAgent gRPC service: translates requests to the collector, engine and command log."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any, TypeAlias

import grpc

from node_agent import convert, migration, roce, routes
from node_agent.commands import CommandLog
from node_agent.engine import Destination, RolloutEngine, check_import_ids
from node_agent.gateway.engine import GatewayEngine
from node_agent.gateway.requests import RequestFailed
from node_agent.metrics import AgentMetrics
from node_agent.roce import RoceConfigurator
from node_agent.routes import HostRoutes
from node_agent.telemetry import Collector, check_interval
from node_agent.weights.update import WeightUpdater, order_from_pb
from orchestrrl import errors
from orchestrrl.fencing import FencingGate
from orchestrrl.grpcutil import domain_errors_to_status, parse_address
from orchestrrl.logs import get_logger
from orchestrrl.tls import Authorizer, check_addressee
from orchestrrl.v1 import common_pb2, node_agent_pb2, node_agent_pb2_grpc

log = get_logger("node_agent.servicer")

SERVICE_NAME = node_agent_pb2.DESCRIPTOR.services_by_name["NodeAgent"].full_name

Context: TypeAlias = "grpc.aio.ServicerContext[Any, Any]"


class NodeAgentService(node_agent_pb2_grpc.NodeAgentServicer):
    def __init__(
        self,
        collector: Collector,
        engine: RolloutEngine,
        commands: CommandLog,
        default_interval_s: float,
        *,
        routes: HostRoutes | None = None,
        roce: RoceConfigurator | None = None,
        auth: Authorizer | None = None,
        controllers: frozenset[str] = frozenset({"orl-fabric-controller"}),
        metrics: AgentMetrics | None = None,
        gateway: GatewayEngine | None = None,
        weights: WeightUpdater | None = None,
    ) -> None:
        """``routes`` / ``roce`` None: this agent refuses ApplyRoutes / ConfigureRoce with
        FAILED_PRECONDITION instead of touching the host (the daemon always passes both).
        With mutual TLS (``auth``), commands are accepted only from ``controllers``."""
        self._auth = auth or Authorizer(None)
        self._controllers = controllers
        self._collector = collector
        self._engine = engine
        self._commands = commands
        self._default_interval_s = default_interval_s
        self._routes = routes
        self._roce = roce
        self._metrics = metrics
        self._exports = migration.Exports(engine)
        self._gateway = gateway
        self._weights = weights
        # the newest controller fencing token of a route command (controller HA)
        self._route_fencing = FencingGate(f"agent {collector.node}: ApplyRoutes")
        self._weights_fencing = FencingGate(f"agent {collector.node}: UpdateWeights")

    def _admit(self, context: Context, allowed: frozenset[str]) -> None:
        """Only ``allowed`` identities (with TLS), and only calls meant for this node."""
        self._auth.peer(context, allowed)
        check_addressee(context, self._collector.node)

    async def close(self) -> None:
        """Restore requests still held by unresolved exports (at shutdown)."""
        await self._exports.close()

    def set_default_interval(self, interval_s: float) -> None:
        """The StreamTelemetry interval when a request names none (config reload)."""
        self._default_interval_s = interval_s

    @domain_errors_to_status
    async def GetStatus(
        self, request: node_agent_pb2.GetStatusRequest, context: Context
    ) -> node_agent_pb2.NodeStatus:
        check_addressee(context, self._collector.node)
        return convert.status_to_pb(self._collector.status())

    @domain_errors_to_status
    async def StreamTelemetry(
        self, request: node_agent_pb2.StreamTelemetryRequest, context: Context
    ) -> AsyncIterator[node_agent_pb2.TelemetrySample]:
        check_addressee(context, self._collector.node)
        interval = request.interval_s or self._default_interval_s
        check_interval(interval, "interval_s")
        async for sample in self._collector.every(interval):
            yield convert.telemetry_to_pb(sample)

    @domain_errors_to_status
    async def Reshard(
        self, request: node_agent_pb2.ReshardRequest, context: Context
    ) -> node_agent_pb2.ReshardResponse:
        self._admit(context, self._controllers)

        async def reshard() -> node_agent_pb2.ReshardResponse:
            started = time.monotonic()
            result = await self._engine.reshard(list(request.tp_layout))
            if self._metrics is not None:
                self._metrics.reshard_seconds.observe(time.monotonic() - started)
            log.info(
                "resharded",
                command_id=request.command_id,
                old_layout=list(result.old_layout),
                new_layout=list(result.new_layout),
                stages={s.stage: round(s.seconds, 6) for s in result.stages},
                bytes_moved=result.bytes_moved,
                message=result.message,
            )
            return convert.reshard_to_pb(request.command_id, result)

        return await self._commands.run("Reshard", request.command_id, _key(request), reshard)

    @domain_errors_to_status
    async def Drain(
        self, request: node_agent_pb2.DrainRequest, context: Context
    ) -> node_agent_pb2.EngineStateResponse:
        self._admit(context, self._controllers)

        async def drain() -> node_agent_pb2.EngineStateResponse:
            await self._engine.drain()
            log.info("drained", command_id=request.command_id)
            return convert.engine_state_to_pb(self._engine.state, self._engine.stats())

        return await self._commands.run("Drain", request.command_id, _key(request), drain)

    @domain_errors_to_status
    async def Resume(
        self, request: node_agent_pb2.ResumeRequest, context: Context
    ) -> node_agent_pb2.EngineStateResponse:
        self._admit(context, self._controllers)

        async def resume() -> node_agent_pb2.EngineStateResponse:
            await self._engine.resume()
            log.info("resumed", command_id=request.command_id)
            return convert.engine_state_to_pb(self._engine.state, self._engine.stats())

        return await self._commands.run("Resume", request.command_id, _key(request), resume)

    @domain_errors_to_status
    async def ExportRequests(
        self, request: node_agent_pb2.ExportRequestsRequest, context: Context
    ) -> node_agent_pb2.ExportRequestsResponse:
        self._admit(context, self._controllers)

        async def export() -> node_agent_pb2.ExportRequestsResponse:
            exported, missing = await self._exports.export(
                request.command_id, request.request_ids, request.hold_s
            )
            return node_agent_pb2.ExportRequestsResponse(
                command_id=request.command_id,
                requests=[migration.state_to_pb(m) for m in exported],
                missing=missing,
                message=f"{len(exported)} request(s) exported and held; "
                f"{len(missing)} not on this node",
            )

        return await self._commands.run("ExportRequests", request.command_id, _key(request), export)

    @domain_errors_to_status
    async def ImportRequests(
        self, request: node_agent_pb2.ImportRequestsRequest, context: Context
    ) -> node_agent_pb2.ImportRequestsResponse:
        self._admit(context, self._controllers)
        recompute = migration.recompute_from_pb(request.method)
        states = [migration.state_from_pb(r) for r in request.requests]
        if not states:
            raise errors.field_error("requests", [], "at least one request to import")
        check_import_ids(states)  # every engine: all admitted or none, each id once

        async def admit() -> node_agent_pb2.ImportRequestsResponse:
            result = await self._engine.import_requests(states, request.instance, recompute)
            log.info(
                "requests_imported",
                command_id=request.command_id,
                source=request.source_node,
                instance=result.instance,
                requests=list(result.admitted),
                bytes_moved=result.bytes_moved,
                recomputed_tokens=result.recomputed_tokens,
            )
            return node_agent_pb2.ImportRequestsResponse(
                command_id=request.command_id,
                admitted=result.admitted,
                instance=result.instance,
                bytes_moved=result.bytes_moved,
                recomputed_tokens=result.recomputed_tokens,
                stages=[
                    common_pb2.StageTiming(stage=x.stage, seconds=x.seconds) for x in result.stages
                ],
                message=result.message,
            )

        return await self._commands.run("ImportRequests", request.command_id, _key(request), admit)

    @domain_errors_to_status
    async def ResolveExport(
        self, request: node_agent_pb2.ResolveExportRequest, context: Context
    ) -> node_agent_pb2.ResolveExportResponse:
        self._admit(context, self._controllers)
        if not request.export_command_id:
            raise errors.field_error(
                "export_command_id", "", "the command_id of the ExportRequests to resolve"
            )

        destination = None
        if request.destination_node or request.destination_address:
            if not (request.destination_node and request.destination_address):
                raise errors.field_error(
                    "destination_address" if request.destination_node else "destination_node",
                    "",
                    "destination_node and destination_address are given together",
                )
            parse_address(request.destination_address, "destination_address")
            destination = Destination(request.destination_node, request.destination_address)

        async def resolve() -> node_agent_pb2.ResolveExportResponse:
            result = await self._exports.resolve(
                request.export_command_id, request.restore, destination
            )
            return node_agent_pb2.ResolveExportResponse(
                command_id=request.command_id,
                restored=result.restored,
                released=result.released,
                message=result.message,
            )

        return await self._commands.run("ResolveExport", request.command_id, _key(request), resolve)

    @domain_errors_to_status
    async def FollowRequest(
        self, request: node_agent_pb2.FollowRequestRequest, context: Context
    ) -> AsyncIterator[node_agent_pb2.FollowRequestChunk]:
        check_addressee(context, self._collector.node)
        gateway = self._gateway
        if gateway is None:
            raise errors.FailedPrecondition(
                "FollowRequest: this node runs no generation gateway (its engine is simulated)"
            )
        if not request.request_id:
            raise errors.field_error("request_id", "", "the id of a request released here")
        source = gateway.source_of(request.request_id)
        if source is None:
            raise errors.NotFound(f"request {request.request_id!r} is not on this node")
        # only the node that exported it (its follower) or the controller may read it
        self._auth.peer(context, self._controllers | ({source} if source else set()))
        try:
            async for chunk in gateway.follow(request.request_id, request.start):
                yield node_agent_pb2.FollowRequestChunk(
                    token_ids=chunk.token_ids,
                    weight_version=chunk.weight_version,
                    finish_reason=chunk.finish or "",
                    logprobs=chunk.logprobs,
                )
        except RequestFailed as exc:
            raise errors.FailedPrecondition(f"request failed: {exc}") from exc

    @domain_errors_to_status
    async def UpdateWeights(
        self, request: node_agent_pb2.UpdateWeightsRequest, context: Context
    ) -> node_agent_pb2.UpdateWeightsResponse:
        self._admit(context, self._controllers)
        order = order_from_pb(request)
        token = request.fencing_token
        self._weights_fencing.check(token)  # a deposed leader changes nothing
        updater = self._weights
        if updater is None:
            raise errors.FailedPrecondition(
                f"node {self._collector.node!r} cannot update its weights: its agent has no "
                "checkpoint_dir (--checkpoint-dir)"
            )

        async def update() -> node_agent_pb2.UpdateWeightsResponse:
            done = (await updater.update(order)).to_pb(order.command_id)
            self._weights_fencing.record(token)  # only once the weights were loaded
            return done

        # the fencing token is not part of what the command is: a retry carries the same
        key = node_agent_pb2.UpdateWeightsRequest()
        key.CopyFrom(request)
        key.fencing_token = 0
        return await self._commands.run("UpdateWeights", order.command_id, _key(key), update)

    @domain_errors_to_status
    async def ApplyRoutes(
        self, request: node_agent_pb2.ApplyRoutesRequest, context: Context
    ) -> node_agent_pb2.ApplyRoutesResponse:
        self._admit(context, self._controllers)
        token = request.fencing_token
        self._route_fencing.check(token)  # a deposed leader changes nothing
        host_routes = self._routes
        # a command that changes nothing (no routes, no rules, no prune) never makes its
        # token the newest, nor does one refused: one command cannot jam the fence
        changes = bool(request.routes or request.rules or request.prune)

        async def apply() -> node_agent_pb2.ApplyRoutesResponse:
            if host_routes is None:
                raise errors.FailedPrecondition(
                    "ApplyRoutes: route programming is not enabled on this agent"
                )
            result = await host_routes.apply(routes.request_from_pb(request))
            if changes:
                self._route_fencing.record(token)
            log.info(
                "routes_applied",
                command_id=request.command_id,
                netns=request.netns or None,
                routes=len(result.routes.read_back),
                rules=len(result.rules.rules),
                added=result.routes.added + result.rules.added,
                replaced=result.routes.replaced,
                removed=result.routes.removed + result.rules.removed,
            )
            return routes.response_to_pb(request.command_id, result)

        return await self._commands.run("ApplyRoutes", request.command_id, _key(request), apply)

    @domain_errors_to_status
    async def ConfigureRoce(
        self, request: node_agent_pb2.ConfigureRoceRequest, context: Context
    ) -> node_agent_pb2.ConfigureRoceResponse:
        self._admit(context, self._controllers)
        configurator = self._roce

        async def configure() -> node_agent_pb2.ConfigureRoceResponse:
            if configurator is None:
                raise errors.FailedPrecondition(
                    "ConfigureRoce: RoCE configuration is not enabled on this agent"
                )
            results = await configurator.configure(roce.settings_from_pb(request.nics))
            return roce.results_to_pb(request.command_id, results)

        return await self._commands.run(
            "ConfigureRoce", request.command_id, _key(request), configure
        )


def _key(request: Any) -> bytes:
    data: bytes = request.SerializeToString(deterministic=True)
    return data
