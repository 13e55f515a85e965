"""The node's generation gateway over HTTP: an OpenAI-compatible ``/v1/completions``.

RL rollout clients (verl, slime, AReaL style) point at the agent instead of at an engine:
token-id prompts in, token ids out (``choices[].token_ids``, as vLLM returns them with
``return_token_ids``), streamed as server-sent events or in one answer. The gateway never
tokenizes: ``text`` is always empty. ``n`` samples of one prompt are ``n`` requests of
one sample group (ids ``<id>-0`` ... ``<id>-<n-1>``, a given seed ``s`` becomes ``s + i``);
``logprobs: 0`` reports each sampled token's logprob (OpenAI's ``logprobs`` object, with
``tokens`` as ``token_id:<id>``, as vLLM's ``return_tokens_as_token_ids`` gives them:
``true`` or absent is accepted, ``false`` refused); every choice says which weights made
which tokens (``orl.weight_versions``: runs of ``[first index, version]``);
``max_staleness`` (0..64) bounds a request's staleness: when new weights land that are
more versions than that newer than its oldest token, it stops there with
``finish_reason: "stale"`` and its tokens so far (counted in ``/health``'s
``stale_stopped``; versions compared as the trainer's counts, ``"3"``). vLLM's
``use_beam_search`` is accepted at ``false`` only; ``skip_special_tokens`` (any boolean)
is ignored: it shapes the text, which is always empty. Routes:

- ``POST /v1/completions`` (see :func:`parse_completion` for the accepted fields)
- ``GET /v1/models``, ``GET /health``
- ``POST /orl/v1/abort`` ``{"request_ids": [...]}``: all or none (unknown ids: 404)
- ``GET /orl/v1/requests/{id}``: where a request is and how far it got
- ``POST /orl/v1/update_weights`` ``{"path", "version", "in_flight": "finish"|"resume"}``:
  load new weights into every engine instance (see ``GatewayEngine.update_weights``)
- ``POST /orl/v1/weight_version`` ``{"version": "..."}``: relabel the weights served now
  (when they were changed outside the gateway)
- SGLang's native protocol (``POST /generate``, ``/abort_request``,
  ``/update_weights_from_disk``, ...): see :mod:`node_agent.gateway.sglang_api`

Errors are OpenAI-shaped: ``{"error": {"message", "type", "param", "code"}}`` with 400
(bad request, naming the field, the value and what is allowed), 401 (API key), 404,
429 (queue full), 500 (the request failed) or 503 (no instance up, agent stopping).
A client that disconnects aborts its request.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import math
import re
import uuid
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from node_agent.engine import MAX_GROUP_CHARS, check_group
from node_agent.engines.base import Sampling
from node_agent.gateway.engine import GatewayEngine, QueueFull, WeightUpdate
from node_agent.gateway.requests import MAX_STALENESS, UPDATE_POLICIES, Request, RequestFailed
from orchestrrl import errors
from orchestrrl.grpcutil import parse_address
from orchestrrl.logs import get_logger

log = get_logger("node_agent.gateway.http")

REQUEST_ID_RE = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
MAX_TOKEN_ID = 2**31 - 1
MAX_ABORT_IDS = 10_000
MAX_BODY_BYTES = 64 * 2**20  # a 1M-token prompt as JSON is ~8 MB

MAX_N = 64  # samples of one prompt per request (GRPO groups are 4-64)

# Fields of /v1/completions and how each is checked; any other field is refused.
_IGNORED_DEFAULTS: dict[str, Any] = {
    # OpenAI fields the gateway accepts only at their no-op value
    "best_of": 1,
    "echo": False,
    "suffix": None,
    "stop": None,
    "presence_penalty": 0,
    "frequency_penalty": 0,
    "logit_bias": None,
    "user": None,
}
_FIELDS = frozenset(
    {
        "model",
        "prompt",
        "max_tokens",
        "temperature",
        "top_p",
        "top_k",
        "seed",
        "stream",
        "stream_options",
        "stop_token_ids",
        "ignore_eos",
        "request_id",
        "return_token_ids",
        "group",
        "n",
        "logprobs",
        "on_weight_update",
        "max_staleness",
        # vLLM's extensions that AReaL's remote vLLM engine sends (areal/engine/vllm_remote.py)
        "return_tokens_as_token_ids",
        "use_beam_search",
        "skip_special_tokens",
        *_IGNORED_DEFAULTS,
    }
)


class HttpError(Exception):
    def __init__(self, status: int, kind: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.kind = kind
        self.message = message
        self.param = param

    def body(self) -> dict[str, Any]:
        return {
            "error": {"message": self.message, "type": self.kind, "param": self.param, "code": None}
        }


def bad(param: str, value: object, allowed: str) -> HttpError:
    shown = repr(value)
    if len(shown) > 80:
        shown = shown[:77] + "..."
    return HttpError(
        400, "invalid_request_error", f"{param}={shown} is not valid: {allowed}", param
    )


def only_fields(body: dict[str, Any], allowed: set[str]) -> None:
    """Refuse a body with a field not in ``allowed``, naming the first one."""
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise bad(
            unknown[0], body[unknown[0]], f"not a field; allowed: {', '.join(sorted(allowed))}"
        )


@dataclass(frozen=True)
class Completion:
    """A validated /v1/completions request."""

    prompt: tuple[int, ...]
    max_tokens: int
    sampling: Sampling
    stream: bool
    include_usage: bool
    request_id: str | None
    group: str = ""  # the request's sample group (GRPO: its prompt), see check_group
    n: int = 1  # samples of the prompt (one request each)
    logprobs: bool = False  # report the sampled tokens' logprobs
    on_weight_update: str = ""  # "finish" or "resume" ("": the update's policy)
    max_staleness: int | None = None  # stop it ("stale") beyond this lag (None: never)

    def sampling_of(self, i: int) -> Sampling:
        """Sample ``i``'s settings: a seed ``s`` becomes ``s + i`` (distinct samples)."""
        seed = self.sampling.seed
        if seed is None or self.n == 1:
            return self.sampling
        return dataclasses.replace(self.sampling, seed=(seed + i + 2**63) % 2**64 - 2**63)


@dataclass(frozen=True)
class GatewaySettings:
    served_model: str
    max_context: int  # prompt + max_tokens, in tokens (the engines' context length)
    api_key: str | None = None  # clients must send "Authorization: Bearer KEY"
    max_tokens_default: int = 16  # OpenAI's default
    max_n: int = MAX_N  # samples of one prompt per request


def _int(body: Mapping[str, Any], name: str, lo: int, hi: int, default: int | None) -> int | None:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise bad(name, value, f"an integer in {lo}..{hi}")
    return value


def _float(body: Mapping[str, Any], name: str, lo: float, hi: float, default: float) -> float:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise bad(name, value, f"a number in [{lo:g}, {hi:g}]")
    value = float(value)
    if not math.isfinite(value) or not lo <= value <= hi:
        raise bad(name, value, f"a number in [{lo:g}, {hi:g}]")
    return value


def _bool(body: Mapping[str, Any], name: str, default: bool) -> bool:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad(name, value, "true or false")
    return value


def _token_ids(value: object, name: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= MAX_TOKEN_ID for t in value
    ):
        raise bad(name, value, "a list of token ids (integers >= 0)")
    return tuple(value)


def parse_completion(
    body: object, settings: GatewaySettings, header_request_id: str | None = None
) -> Completion:
    """Validate a /v1/completions body; HttpError naming the first bad field."""
    if not isinstance(body, dict):
        raise HttpError(400, "invalid_request_error", "the body must be a JSON object")
    unknown = sorted(set(body) - _FIELDS)
    if unknown:
        allowed = ", ".join(sorted(_FIELDS))
        raise bad(
            unknown[0], body[unknown[0]], f"not a field of /v1/completions; allowed: {allowed}"
        )
    for name, default in _IGNORED_DEFAULTS.items():
        if name in body and body[name] not in (default, None):
            if name == "stop":
                raise bad(
                    name, body[name], "null: the gateway does not tokenize; use stop_token_ids"
                )
            raise bad(name, body[name], f"only {json.dumps(default)} is supported by the gateway")
    logprobs = body.get("logprobs")
    if logprobs is not None and (isinstance(logprobs, bool) or logprobs != 0):
        raise bad(
            "logprobs",
            logprobs,
            "null or 0 (each sampled token's logprob; top alternatives are not reported)",
        )
    policy = body.get("on_weight_update")
    if policy is not None and policy not in UPDATE_POLICIES:
        raise bad(
            "on_weight_update",
            policy,
            '"finish" (on the old weights) or "resume" (on the new ones) at a weight update',
        )
    max_staleness = parse_max_staleness(body)
    model = body.get("model")
    if model is not None and model != settings.served_model:
        raise HttpError(
            404,
            "not_found_error",
            f"model={model!r} is not served here; the model is {settings.served_model!r}",
            "model",
        )
    raw = body.get("prompt")
    if isinstance(raw, str) or (isinstance(raw, list) and raw and isinstance(raw[0], str)):
        raise bad("prompt", raw, "token ids (a list of integers): the gateway does not tokenize")
    if isinstance(raw, list) and raw and isinstance(raw[0], list):
        if len(raw) != 1:
            raise bad("prompt", f"{len(raw)} prompts", "one prompt per request")
        raw = raw[0]
    prompt = _token_ids(raw, "prompt")
    if not prompt:
        raise bad("prompt", [], "at least one token id")
    max_tokens = _int(body, "max_tokens", 1, 2**31 - 1, settings.max_tokens_default)
    assert max_tokens is not None
    if len(prompt) + max_tokens > settings.max_context:
        raise bad(
            "max_tokens",
            max_tokens,
            f"prompt ({len(prompt)} tokens) + max_tokens must fit the engine's context of "
            f"{settings.max_context} tokens (at most {max(0, settings.max_context - len(prompt))})",
        )
    top_k = _int(body, "top_k", -1, 2**31 - 1, 0)
    sampling = Sampling(
        temperature=_float(body, "temperature", 0.0, 100.0, 1.0),
        top_p=_float(body, "top_p", 1e-9, 1.0, 1.0),
        top_k=0 if top_k in (None, -1) else top_k,
        seed=_int(body, "seed", -(2**63), 2**63 - 1, None),
        ignore_eos=_bool(body, "ignore_eos", False),
        stop_token_ids=_token_ids(body.get("stop_token_ids") or [], "stop_token_ids"),
    )
    options = body.get("stream_options")
    if options is not None and (
        not isinstance(options, dict)
        or set(options) - {"include_usage", "continuous_usage_stats"}
        or not all(isinstance(v, bool) for v in options.values())
    ):
        raise bad("stream_options", options, 'an object such as {"include_usage": true}')
    rid = header_request_id or body.get("request_id")
    if rid is not None and (not isinstance(rid, str) or not REQUEST_ID_RE.match(rid)):
        raise bad("request_id", rid, "1-128 characters of A-Z a-z 0-9 . _ : -")
    _bool(body, "return_token_ids", True)
    if not _bool(body, "return_tokens_as_token_ids", True):
        raise bad(
            "return_tokens_as_token_ids",
            False,
            'true (or null): the gateway does not detokenize; logprobs tokens are "token_id:<id>"',
        )
    if _bool(body, "use_beam_search", False):
        raise bad(
            "use_beam_search", True, "false: the gateway samples; beam search is not supported"
        )
    _bool(body, "skip_special_tokens", True)  # shapes the text only, which is always ""
    group = body.get("group")
    if group is None:  # absent or null: no group
        group = ""
    try:
        check_group(group)
    except errors.InvalidArgument:
        raise bad(
            "group",
            group,
            f"a string of at most {MAX_GROUP_CHARS} characters (the sample "
            "group, e.g. the prompt's dataset index)",
        ) from None
    n = _int(body, "n", 1, settings.max_n, 1)
    assert n is not None
    return Completion(
        prompt,
        max_tokens,
        sampling,
        _bool(body, "stream", False),
        bool((options or {}).get("include_usage", False)),
        rid,
        group,
        n,
        logprobs is not None,
        policy or "",
        max_staleness,
    )


def parse_max_staleness(body: Mapping[str, Any]) -> int | None:
    """The request's ``max_staleness`` (absent or null: no bound)."""
    value = body.get("max_staleness")
    if value is not None and (
        isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_STALENESS
    ):
        raise bad(
            "max_staleness",
            value,
            f"an integer in 0..{MAX_STALENESS} (weight versions the request may fall behind "
            "the weights served, counted from its oldest token), or null",
        )
    return value


class GatewayServer:
    """Serves :class:`GatewayEngine` over HTTP; :meth:`start` binds, :meth:`stop` ends."""

    def __init__(self, engine: GatewayEngine, settings: GatewaySettings) -> None:
        self.engine = engine
        self.settings = settings
        self._runner: web.AppRunner | None = None
        self.address = ""
        app = web.Application(client_max_size=MAX_BODY_BYTES)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_post("/orl/v1/abort", self._abort)
        app.router.add_get("/orl/v1/requests/{request_id}", self._request)
        app.router.add_post("/orl/v1/weight_version", self._weight_version)
        app.router.add_post("/orl/v1/update_weights", self._update_weights)
        # SGLang's native protocol (/generate, ...) on the same app; that module imports this one
        from node_agent.gateway.sglang_routes import SglangRoutes

        SglangRoutes(self).add_to(app)
        self.app = app

    async def start(self, listen: str) -> str:
        """Bind ``HOST:PORT`` (port 0: any free port); the bound address."""
        host, port = parse_address(listen, "gateway_listen")
        # handler_cancellation: a client that goes away cancels its handler (and request)
        runner = web.AppRunner(self.app, handler_cancellation=True, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, host, port, reuse_address=True)
        try:
            await site.start()
        except OSError as exc:
            await runner.cleanup()
            raise errors.Unavailable(f"gateway_listen={listen!r}: cannot bind ({exc})") from exc
        self._runner = runner
        self.address = f"{host}:{runner.addresses[0][1]}"
        log.info("gateway_serving", address=self.address, model=self.settings.served_model)
        return self.address

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    # -- handlers ------------------------------------------------------------------------

    def _check_key(self, request: web.Request) -> None:
        key = self.settings.api_key
        if key is None:
            return
        given = request.headers.get("Authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {key}".encode()):
            raise HttpError(401, "authentication_error", "missing or wrong API key (Bearer)")

    async def _json(self, request: web.Request) -> Any:
        try:
            return await request.json(loads=json.loads)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise HttpError(400, "invalid_request_error", f"the body is not JSON: {exc}") from None
        except web.HTTPRequestEntityTooLarge:
            raise HttpError(
                413, "invalid_request_error", f"the body exceeds {MAX_BODY_BYTES} bytes"
            ) from None

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        try:
            self._check_key(request)
            params = parse_completion(
                await self._json(request), self.settings, request.headers.get("X-Request-Id")
            )
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

    def _submit(self, params: Completion) -> list[Request]:
        """The completion's ``n`` requests (all or none: a refusal aborts those queued)."""
        base = params.request_id or f"cmpl-{uuid.uuid4().hex}"
        ids = [base] if params.n == 1 else [f"{base}-{i}" for i in range(params.n)]
        group = params.group or ("" if params.n == 1 else base)
        reqs: list[Request] = []
        try:
            for i, rid in enumerate(ids):
                reqs.append(
                    self.engine.submit(
                        params.prompt,
                        params.max_tokens,
                        params.sampling_of(i),
                        rid,
                        group,
                        logprobs=params.logprobs,
                        update_policy=params.on_weight_update,
                        max_staleness=params.max_staleness,
                    )
                )
        except QueueFull as exc:
            self._undo(reqs)
            raise HttpError(429, "rate_limit_error", str(exc)) from None
        except errors.InvalidArgument as exc:
            self._undo(reqs)
            raise HttpError(400, "invalid_request_error", str(exc), "request_id") from None
        except errors.Unavailable as exc:
            self._undo(reqs)
            raise HttpError(503, "service_unavailable", str(exc)) from None
        return reqs

    def _undo(self, reqs: list[Request]) -> None:
        self.engine.abort([r.id for r in reqs], "aborted: its completion was refused")
        for req in reqs:
            self.engine.release(req)

    async def _whole(self, reqs: list[Request], params: Completion) -> web.Response:
        try:
            async for i in _changes(reqs):
                reqs[i].raise_if_failed()
        except RequestFailed as exc:
            return _error(_failure(exc))
        choices = [
            self._choice(i, req, 0, len(req.output), req.finish, params)
            for i, req in enumerate(reqs)
        ]
        return web.json_response(self._body(reqs, choices, usage=True))

    async def _stream(
        self, request: web.Request, reqs: list[Request], params: Completion
    ) -> web.StreamResponse:
        resp = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        sent = [0] * len(reqs)
        try:
            async for i in _changes(reqs):
                req = reqs[i]
                if len(req.output) > sent[i]:
                    if not resp.prepared:
                        await resp.prepare(request)
                    choice = self._choice(i, req, sent[i], len(req.output), None, params)
                    sent[i] = len(req.output)
                    await _event(resp, self._body(reqs, [choice]))
                if req.done:
                    req.raise_if_failed()
                    if not resp.prepared:
                        await resp.prepare(request)
                    final = self._choice(i, req, sent[i], sent[i], req.finish, params, orl=True)
                    await _event(resp, self._body(reqs, [final], orl=len(reqs) == 1))
        except RequestFailed as exc:
            if not resp.prepared:  # nothing sent yet: a plain error answer
                return _error(_failure(exc))
            await _event(resp, _failure(exc).body())
            await resp.write(b"data: [DONE]\n\n")
            return resp
        if params.include_usage:
            body = self._body(reqs, [], usage=True)
            await _event(resp, body)
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    def _choice(
        self,
        index: int,
        req: Request,
        start: int,
        end: int,
        finish: str | None,
        params: Completion,
        *,
        orl: bool | None = None,
    ) -> dict[str, Any]:
        """Choice ``index``: tokens ``start:end`` of ``req`` (with their logprobs), its
        finish; its request id, weight-version runs and nodes on the last event (``orl``)
        and in a whole answer."""
        tokens = req.output[start:end]
        choice: dict[str, Any] = {
            "index": index,
            "text": "",
            "token_ids": tokens,
            "finish_reason": finish,
            "logprobs": None,
        }
        if params.logprobs:
            choice["logprobs"] = {
                "tokens": [f"token_id:{t}" for t in tokens],
                "token_logprobs": req.logprobs[start:end],
                "top_logprobs": None,
                "text_offset": [0] * len(tokens),
            }
        if orl or (orl is None and finish is not None):
            choice["orl"] = _orl(req)
        return choice

    def _body(
        self,
        reqs: list[Request],
        choices: list[dict[str, Any]],
        *,
        usage: bool = False,
        orl: bool | None = None,
    ) -> dict[str, Any]:
        first = reqs[0]
        body: dict[str, Any] = {
            "id": first.id if len(reqs) == 1 else first.id.rsplit("-", 1)[0],
            "object": "text_completion",
            "created": int(first.created_wall),
            "model": self.settings.served_model,
            "choices": choices,
        }
        if usage:
            completion = sum(len(r.output) for r in reqs)
            body["usage"] = {
                "prompt_tokens": len(first.prompt),
                "completion_tokens": completion,
                "total_tokens": len(first.prompt) + completion,
            }
        if len(reqs) == 1 and (orl or (orl is None and usage)):
            body["orl"] = _orl(first)  # (one sample: also at the top, as before choices had it)
        return body

    async def _models(self, request: web.Request) -> web.Response:
        try:
            self._check_key(request)
        except HttpError as exc:
            return _error(exc)
        return web.json_response(
            {
                "object": "list",
                "data": [
                    {
                        "id": self.settings.served_model,
                        "object": "model",
                        "owned_by": "orchestrrl",
                        "max_model_len": self.settings.max_context,
                    }
                ],
            }
        )

    async def _health(self, request: web.Request) -> web.Response:
        health = self.engine.instance_health()
        up = any(h == "up" for h in health)
        return web.json_response(
            {
                "status": "ok" if up else "unavailable",
                "engine": self.engine.kind,
                "state": self.engine.state.value,
                "tp_layout": list(self.engine.tp_layout),
                "instances": list(health),
                "stale_stopped": self.engine.stale_stopped,
            },
            status=200 if up else 503,
        )

    async def _abort(self, request: web.Request) -> web.Response:
        try:
            self._check_key(request)
            body = await self._json(request)
            if isinstance(body, dict):
                only_fields(body, {"request_ids"})
            ids = body.get("request_ids") if isinstance(body, dict) else None
            if (
                not isinstance(ids, list)
                or not ids
                or len(ids) > MAX_ABORT_IDS
                or not all(isinstance(i, str) and i for i in ids)
            ):
                raise bad("request_ids", ids, f"a list of 1..{MAX_ABORT_IDS} request ids (strings)")
            unknown = [i for i in ids if (r := self.engine.request(i)) is None or r.done]
            if unknown:  # all or none: nothing is aborted
                raise HttpError(
                    404,
                    "not_found_error",
                    f"no request in flight with id {', '.join(map(repr, unknown[:10]))}"
                    + (f" and {len(unknown) - 10} more" if len(unknown) > 10 else "")
                    + "; nothing was aborted",
                    "request_ids",
                )
        except HttpError as exc:
            return _error(exc)
        self.engine.abort(ids)
        return web.json_response({"aborted": ids})

    async def _request(self, request: web.Request) -> web.Response:
        try:
            self._check_key(request)
        except HttpError as exc:
            return _error(exc)
        rid = request.match_info["request_id"]
        req = self.engine.request(rid)
        if req is None:
            return _error(HttpError(404, "not_found_error", f"no request {rid!r} here"))
        return web.json_response(
            {
                "id": req.id,
                "where": req.where.value,
                "instance": req.instance,
                "node": req.remote or self.engine.node,
                "prompt_tokens": len(req.prompt),
                "generated_tokens": len(req.output),
                "max_tokens": req.max_tokens,
                "finish_reason": req.finish,
                "error": req.error or None,
                "nodes": list(req.hops),
            }
        )

    async def _update_weights(self, request: web.Request) -> web.Response:
        try:
            self._check_key(request)
            path, version, in_flight, timeout = parse_update(await self._json(request))
        except HttpError as exc:
            return _error(exc)
        try:
            done = await self.engine.update_weights(
                path, version, in_flight, drain_timeout_s=timeout
            )
        except errors.InvalidArgument as exc:
            return _error(HttpError(400, "invalid_request_error", str(exc)))
        except errors.Aborted as exc:
            return _error(HttpError(409, "conflict", str(exc)))
        except errors.DeadlineExceeded as exc:
            return _error(HttpError(504, "timeout", str(exc)))
        except errors.OrlError as exc:
            return _error(HttpError(500, "engine_error", str(exc)))
        return web.json_response(update_answer(done))

    async def _weight_version(self, request: web.Request) -> web.Response:
        try:
            self._check_key(request)
            body = await self._json(request)
            if isinstance(body, dict):
                only_fields(body, {"version"})
            version = body.get("version") if isinstance(body, dict) else None
            if not isinstance(version, str) or not 1 <= len(version) <= 128:
                raise bad("version", version, "a label of 1-128 characters")
        except HttpError as exc:
            return _error(exc)
        old, self.engine.weight_version = self.engine.weight_version, version
        log.info("weight_version", old=old, new=version)
        return web.json_response({"version": version, "previous": old})


def _orl(req: Request) -> dict[str, Any]:
    return {
        "request_id": req.id,
        "weight_versions": [list(v) for v in req.versions],
        "nodes": list(req.hops),
        "node_starts": list(req.hop_starts),  # output tokens it had on arriving at each
    }


async def _changes(reqs: list[Request]) -> AsyncIterator[int]:
    """The index of each request as it gets tokens or ends, until all have ended (each
    ended one is named once more, last)."""
    ended: set[int] = set()
    seen = [0] * len(reqs)
    while len(ended) < len(reqs):
        moved = False
        for i, req in enumerate(reqs):
            if i in ended:
                continue
            if len(req.output) > seen[i] or req.done:
                seen[i] = len(req.output)
                moved = True
                if req.done:
                    ended.add(i)
                yield i
        if not moved:
            waiters = [r.waiter() for i, r in enumerate(reqs) if i not in ended]
            try:
                await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for w in waiters:
                    w.cancel()


def parse_update(body: object) -> tuple[str, str, str, float | None]:
    """``(path, version, in_flight, drain_timeout_s)`` of an update_weights body."""
    if not isinstance(body, dict):
        raise HttpError(400, "invalid_request_error", "the body must be a JSON object")
    only_fields(body, {"path", "version", "in_flight", "drain_timeout_s"})
    path = body.get("path")
    if not isinstance(path, str) or not 1 <= len(path) <= 4096:
        raise bad("path", path, "the path of the new weights on this node (1-4096 characters)")
    version = body.get("version")
    if not isinstance(version, str) or not 1 <= len(version) <= 128:
        raise bad("version", version, "a label of 1-128 characters")
    in_flight = body.get("in_flight", "finish")
    if in_flight not in UPDATE_POLICIES:
        raise bad(
            "in_flight",
            in_flight,
            '"finish" (running requests end on the old weights) or "resume" (they stop and '
            "go on with the new ones)",
        )
    timeout = body.get("drain_timeout_s")
    if timeout is not None and (
        isinstance(timeout, bool)
        or not isinstance(timeout, int | float)
        or not math.isfinite(timeout)
        or not 0 < timeout <= 86400
    ):
        raise bad("drain_timeout_s", timeout, "seconds in (0, 86400], or null: no limit")
    return path, version, in_flight, None if timeout is None else float(timeout)


def _failure(exc: RequestFailed) -> HttpError:
    if exc.refused:
        return HttpError(400, "invalid_request_error", str(exc))
    if exc.aborted:
        return HttpError(409, "request_aborted", str(exc))
    return HttpError(500, "engine_error", str(exc))


def _error(exc: HttpError) -> web.Response:
    return web.json_response(exc.body(), status=exc.status)


async def _event(resp: web.StreamResponse, body: dict[str, Any]) -> None:
    await resp.write(b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n")


def update_answer(done: WeightUpdate) -> dict[str, Any]:
    return {
        "version": done.version,
        "previous": done.previous,
        "instances": done.instances,
        "how": done.how,
        "resumed_requests": done.resumed,
        "finished_on_old_weights": done.finished_on_old,
        "stale_stopped_requests": done.stale_stopped,
        "stages": {s.stage: round(s.seconds, 4) for s in done.stages},
    }
