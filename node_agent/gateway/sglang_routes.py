"""The shell of SGLang's native protocol on the gateway: aiohttp handlers over
:class:`~node_agent.gateway.engine.GatewayEngine` that parse and answer with the pure
functions of :mod:`node_agent.gateway.sglang_api` (its docstring says what is served).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any

from aiohttp import web

from node_agent.gateway.engine import QueueFull
from node_agent.gateway.http import HttpError, _changes, _error, _event, _failure
from node_agent.gateway.requests import Request, RequestFailed, Where
from node_agent.gateway.sglang_api import (
    HEALTH_TIMEOUT_S,
    SGLANG_VERSION,
    Generate,
    get_load,
    loads,
    matching,
    model_info,
    output,
    parse_abort,
    parse_generate,
    parse_loads_query,
    parse_update_from_disk,
    server_info,
    update_result,
)
from orchestrrl import __version__, errors
from orchestrrl.logs import get_logger

if TYPE_CHECKING:
    from node_agent.gateway.http import GatewayServer

log = get_logger("node_agent.gateway.sglang")


class _GrpcProbeFilter(logging.Filter):
    """Drops aiohttp's error for an HTTP/2 connection preface ("PRI * HTTP/2.0"):
    ``sglang-router`` probes every worker for gRPC as well as HTTP when it registers it,
    and the gateway answering that probe with 400 is expected, not an error."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not (exc is not None and "PRI/Upgrade" in str(exc))


_GRPC_PROBE_FILTER = _GrpcProbeFilter()


class SglangRoutes:
    """SGLang's endpoints on a :class:`GatewayServer`'s app (see the module docstring)."""

    def __init__(self, server: GatewayServer) -> None:
        self.server = server
        self.engine = server.engine
        self.settings = server.settings

    def add_to(self, app: web.Application) -> None:
        server_log = logging.getLogger("aiohttp.server")
        if _GRPC_PROBE_FILTER not in server_log.filters:
            server_log.addFilter(_GRPC_PROBE_FILTER)
        app.router.add_post("/generate", self._generate)
        app.router.add_put("/generate", self._generate)
        app.router.add_post("/abort_request", self._abort)
        app.router.add_get("/health_generate", self._health_generate)
        for path in ("/model_info", "/get_model_info"):
            app.router.add_get(path, self._model_info)
        for path in ("/server_info", "/get_server_info"):
            app.router.add_get(path, self._server_info)
        app.router.add_get("/get_load", self._get_load)
        app.router.add_get("/v1/loads", self._loads)
        app.router.add_post("/flush_cache", self._flush_cache)
        app.router.add_get("/flush_cache", self._flush_cache)
        app.router.add_post("/update_weights_from_disk", self._update_weights)

    @property
    def _seats(self) -> int:
        return self.engine.max_num_seqs * len(self.engine.instances)

    def _version(self) -> str:
        return f"orchestrrl-{__version__} (SGLang {SGLANG_VERSION} protocol)"

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        try:
            self.server._check_key(request)
            params = parse_generate(await self.server._json(request), self.settings)
            reqs = self._submit(params)
        except HttpError as exc:
            return _error(exc)
        try:
            if params.stream:
                return await self._stream(request, reqs, params)
            return await self._whole(reqs, params)
        finally:
            for req in reqs:
                if req.done:
                    self.engine.release(req)
                else:  # the client went away (or the handler failed): nobody reads it
                    self.engine.abort([req.id], "aborted: the client disconnected")

    def _submit(self, params: Generate) -> list[Request]:
        """The call's requests (all or none: a refusal aborts those queued)."""
        reqs: list[Request] = []
        try:
            for s in params.samples:
                reqs.append(
                    self.engine.submit(
                        s.prompt,
                        s.max_tokens,
                        s.sampling,
                        s.request_id,
                        s.group,
                        logprobs=s.logprobs,
                        update_policy=params.on_weight_update,
                        max_staleness=params.max_staleness,
                    )
                )
        except (QueueFull, errors.InvalidArgument, errors.Unavailable) as exc:
            self.engine.abort([r.id for r in reqs], "aborted: its /generate was refused")
            for req in reqs:
                self.engine.release(req)
            if isinstance(exc, QueueFull):
                raise HttpError(429, "rate_limit_error", str(exc)) from None
            if isinstance(exc, errors.InvalidArgument):
                raise HttpError(400, "invalid_request_error", str(exc), "rid") from None
            raise HttpError(503, "service_unavailable", str(exc)) from None
        return reqs

    def _out(self, req: Request) -> dict[str, Any]:
        return output(req, self.engine.weight_version, time.time())

    async def _whole(self, reqs: list[Request], params: Generate) -> web.Response:
        async for _ in _changes(reqs):
            pass
        for req in reqs:
            if req.where is Where.FAILED:
                return _error(_failure(_failed(req)))
        outs = [self._out(r) for r in reqs]
        return web.json_response(outs if params.batch else outs[0])

    async def _stream(
        self, request: web.Request, reqs: list[Request], params: Generate
    ) -> web.StreamResponse:
        resp = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        sent = [-1] * len(reqs)
        try:
            async for i in _changes(reqs):
                req = reqs[i]
                if req.where is Where.FAILED:
                    raise _failed(req)
                if len(req.output) == sent[i] and not req.done:
                    continue
                sent[i] = len(req.output)
                event = self._out(req)
                if params.batch:
                    event["index"] = i
                if not resp.prepared:
                    await resp.prepare(request)
                await _event(resp, event)
        except RequestFailed as exc:
            if not resp.prepared:  # nothing sent yet: a plain error answer
                return _error(_failure(exc))
            await _event(resp, _failure(exc).body())
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def _abort(self, request: web.Request) -> web.Response:
        try:
            self.server._check_key(request)
            params = parse_abort(await self.server._json(request))
        except HttpError as exc:
            return _error(exc)
        live = self.engine.in_flight()
        ids = live if params.abort_all else matching(live, params.rids)
        why = params.message or "aborted by /abort_request"
        self.engine.abort(ids, why)
        log.info("sglang_abort", requests=len(ids), abort_all=params.abort_all)
        return web.json_response({"aborted": ids})

    async def _health_generate(self, request: web.Request) -> web.Response:
        """200 when the engines generate: tokens came while it waited, or a one-token
        probe answered on every instance; 503 naming what did not."""
        if not any(h == "up" for h in self.engine.instance_health()):
            health = ", ".join(self.engine.instance_health())
            return _health_failed(f"no engine instance is up: {health}")
        start = self.engine.tokens_generated
        probe = asyncio.ensure_future(self.engine.probe(HEALTH_TIMEOUT_S))
        try:
            while not probe.done():
                await asyncio.wait({probe}, timeout=0.25)
                if self.engine.tokens_generated > start:
                    return web.json_response({"status": "ok", "generating": True})
            failed = [why for why in probe.result() if why]
        finally:
            if not probe.done():
                probe.cancel()
                await asyncio.gather(probe, return_exceptions=True)
        if failed:
            return _health_failed("; ".join(failed))
        return web.json_response({"status": "ok", "generating": False})

    async def _model_info(self, request: web.Request) -> web.Response:
        try:
            self.server._check_key(request)
        except HttpError as exc:
            return _error(exc)
        return web.json_response(model_info(self.settings, self.engine.weight_version))

    async def _server_info(self, request: web.Request) -> web.Response:
        try:
            self.server._check_key(request)
        except HttpError as exc:
            return _error(exc)
        return web.json_response(
            server_info(
                self.settings,
                self.engine.kind,
                self.engine.tp_layout,
                self._seats,
                self.engine.weight_version,
                self._version(),
                self.engine.stale_stopped,
            )
        )

    async def _get_load(self, request: web.Request) -> web.Response:
        try:
            self.server._check_key(request)
        except HttpError as exc:
            return _error(exc)
        return web.json_response(
            get_load(self.engine.stats(), self.engine.progress(), time.perf_counter())
        )

    async def _loads(self, request: web.Request) -> web.Response:
        try:
            self.server._check_key(request)
            parse_loads_query(request.query)
        except HttpError as exc:
            return _error(exc)
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        return web.json_response(
            loads(self.engine.stats(), self.engine.progress(), self._seats, self._version(), now)
        )

    async def _flush_cache(self, request: web.Request) -> web.Response:
        try:
            self.server._check_key(request)
        except HttpError as exc:
            return _error(exc)
        return web.Response(
            text="Nothing to flush: the gateway keeps no KV cache of its own; its engine "
            "instances load new weights by /update_weights_from_disk.\n"
        )

    async def _update_weights(self, request: web.Request) -> web.Response:
        try:
            self.server._check_key(request)
            params = parse_update_from_disk(await self.server._json(request))
        except HttpError as exc:
            return _error(exc)
        aborted: list[str] = []
        if params.abort_all:
            aborted = self.engine.in_flight()
            self.engine.abort(aborted, "aborted: new weights are being loaded")
        try:
            done = await self.engine.update_weights(
                params.path,
                params.version,
                params.in_flight,
                drain_timeout_s=params.drain_timeout_s,
            )
        except errors.OrlError as exc:
            return web.json_response(
                {"success": False, "message": str(exc), "num_paused_requests": 0}, status=400
            )
        return web.json_response(update_result(done, len(aborted)))


def _failed(req: Request) -> RequestFailed:
    return RequestFailed(
        req.error or f"request {req.id!r} {req.where.value}",
        aborted=req.where is Where.ABORTED,
        refused=req.refused,
    )


def _health_failed(why: str) -> web.Response:
    log.warning("health_generate_failed", why=why)
    return web.json_response({"status": "unavailable", "message": why}, status=503)
