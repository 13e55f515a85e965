"""A stand-in for SGLang's HTTP server where SGLang cannot run (it needs a GPU or an AMX Xeon).

It serves the part of SGLang's API that the gateway's adapter
(``node_agent/engines/sglang.py``) uses, with the request and response shapes of SGLang
0.5.23's source (the SGLang file and function are named where it matters), over a
deterministic model: the next token is a hash of the whole sequence so far (prompt and
output), like greedy decoding of a fixed model. A call resubmitted with its output so far
appended therefore continues exactly as an uninterrupted one, which is what migration,
reshard and crash recovery rely on.

Run it with the flags of ``python -m sglang.launch_server`` (a leading
``-m sglang.launch_server`` is skipped): :func:`write_launcher` writes an executable to
put where the adapter expects the Python that has SGLang (``EngineSettings.command``).
The model path is a directory with a ``config.json`` (``vocab_size``, ``eos_token_id``,
``max_position_embeddings``); ``--skip-tokenizer-init`` is required (it has no tokenizer).

What it serves:

- ``POST /generate`` (entrypoints/http_server.py ``generate_request``): ``input_ids``,
  ``rid``, ``sampling_params``, ``stream``; a body that breaks the contract (an unknown
  sampling key, a wrong type) is refused with HTTP 400 ``{"error": "..."}``. Streamed
  events are ``data: {"output_ids", "meta_info"}`` (all ids so far, or only the new ones
  with ``--incremental-streaming-output``; every ``--stream-interval`` tokens), then
  ``data: [DONE]``. ``meta_info.finish_reason`` is null, then ``{"type": "length",
  "length"}``, ``{"type": "stop", "matched"}`` or ``{"type": "abort", "message",
  "status_code", "err_type"}``. The tokenizer's refusals (input as long as the context,
  input + max_new_tokens beyond it, a duplicate rid) are one ``{"error": {...,
  "retryable": false}}`` event (so are input ids outside the vocabulary, which SGLang
  itself does not check); the scheduler's (input of at least ``context - 6`` tokens)
  an abort with ``status_code`` 400;
- ``POST /abort_request {"rid", "abort_all"}``: rids are matched by prefix; a queued call
  ends at once ("Abort in waiting queue"), a running one after one more decode step;
  a client that goes away aborts its call;
- ``POST /pause_generation {"mode": "abort" | "retract" | "in_place"}`` and ``POST
  /continue_generation``: new calls wait in the tokenizer while paused; ``in_place``
  stops decoding and keeps the running calls, ``retract`` puts them back in the queue
  (recomputed at the continue), ``abort`` aborts them. With
  ``ORL_FAKE_SGLANG_VERSION`` older than 0.5.6 the body is ignored and every pause
  aborts, as in 0.5.5;
- ``GET /health`` and ``GET /health_generate``: 503 while starting or exiting, else a
  one-token generation and 200 once the scheduler answered anything (polled every
  second), 503 after ``SGLANG_HEALTH_CHECK_TIMEOUT`` (20 s) without (so while paused in
  place); ``SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=false`` makes ``/health`` a plain 200;
- ``GET /metrics`` (``--enable-metrics``): ``sglang:num_running_reqs``,
  ``sglang:num_queue_reqs`` and ``sglang:token_usage`` (refreshed at each prefill, every
  ``--decode-log-interval`` decode steps and when idle, as the scheduler of TP rank 0
  does), ``sglang:prompt_tokens_total`` and ``sglang:generation_tokens_total`` (counted
  when a call ends), with SGLang's labels;
- ``GET /server_info`` and ``GET /get_server_info``: the launch settings and ``version``;
- ``return_logprob`` in ``/generate``: ``meta_info.output_token_logprobs``, a list of
  ``[logprob, token_id, null]`` (tokenizer_manager.py ``detokenize_logprob_tokens``), all
  of them so far, or with ``--incremental-streaming-output`` the new ones
  (``_INCREMENTAL_STREAMING_META_INFO_KEYS``). The stand-in's logprob of a token is a
  number in [-5, -0.001] fixed by the state it was drawn in (:func:`logprob_of`);
- ``POST /update_weights_from_disk {"model_path", "weight_version", "flush_cache"}``
  (http_server.py ``update_weights_from_disk``): ``{"success", "message",
  "num_paused_requests"}``, HTTP 400 and the old weights kept when the path has no
  ``config.json`` of the same vocabulary. The stand-in's "weights" are a salt of its rule,
  taken from the checkpoint's ``*.safetensors`` files (:func:`weights_salt`; 0 without
  any): the same checkpoint always continues a prefix the same way, another one
  differently. Calls retracted to the queue (``/pause_generation`` mode ``retract``) are
  recomputed on the new weights; ``weight_version`` is then every answer's
  ``meta_info.weight_version`` (``default`` before).

SIGTERM drains as SGLang does: it exits once no call is left, checking every 5 s.

Knobs of the stand-in itself (environment variables; SGLang has none of them):
``ORL_FAKE_SGLANG_TOKENS_PER_S`` (decode steps per second of a TP1 instance, default 100;
TP k is k times faster), ``ORL_FAKE_SGLANG_START_S`` (seconds before it listens, 0),
``ORL_FAKE_SGLANG_HEALTH_POLL_S`` (1), ``ORL_FAKE_SGLANG_DRAIN_POLL_S`` (5),
``ORL_FAKE_SGLANG_VERSION`` (0.5.23), ``ORL_FAKE_SGLANG_HOLD_AT`` (none; see the hold).

The hold, a control of the stand-in itself (SGLang has none), so that a test observes
calls that run and cannot finish while it looks: a call stops before generating the
token at sequence position ``at`` (input and output so far: the same point of a request
wherever it runs) and stays in the running batch, counted by the gauges, until the hold
is moved or released; a call being aborted and the health check's are never held.
``POST /orl_fake/hold {"at": N | null}`` sets it (answered once the scheduler has taken
it, between two steps), ``GET /orl_fake/hold`` says ``{"at", "held": [rids held now]}``,
and ``ORL_FAKE_SGLANG_HOLD_AT`` sets it from the start (instances a reshard starts).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import os
import random
import signal
import sys
import time
import uuid
from collections.abc import AsyncGenerator, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    disable_created_metrics,
    generate_latest,
)

VERSION = "0.5.23"
HEALTH_CHECK_RID_PREFIX = "HEALTH_CHECK"  # sglang/srt/constants.py
# sglang/api/v1/api_types.py SamplingParams: unknown keys are rejected
SAMPLING_KEYS = frozenset(
    {
        "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p",
        "top_k", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty",
        "min_new_tokens", "n", "json_schema", "regex", "ebnf", "structural_tag", "ignore_eos",
        "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim",
        "stream_interval", "logit_bias", "sampling_seed", "custom_params", "beam_width",
        "watermark", "choice",
    }
)  # fmt: skip
INT_KEYS = frozenset({"max_new_tokens", "top_k", "min_new_tokens", "n", "sampling_seed"})
FLOAT_KEYS = frozenset({"temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty"})
BOOL_KEYS = frozenset({"ignore_eos", "skip_special_tokens", "no_stop_trim"})

_P, _M = 1_000_003, 2_147_483_647


def extend_hash(h: int, tokens: Iterable[int]) -> int:
    """The model's state after ``tokens``: an order-sensitive hash of the sequence."""
    for t in tokens:
        h = (h * _P + t + 1) % _M
    return h


def start_hash(sequence: Iterable[int], salt: int = 0) -> int:
    """The model's state after ``sequence`` (prefilled) under the weights ``salt``."""
    return extend_hash((17 + salt) % _M, sequence)


def logprob_of(h: int) -> float:
    """The stand-in's logprob of the token drawn in state ``h``."""
    return -(1 + (h >> 7) % 5000) / 1000.0


def weights_salt(model_path: Path) -> int:
    """The stand-in's weights: a hash of the checkpoint's safetensors files (their size
    and their first and last 64 KiB), 0 when it has none."""
    digest = hashlib.sha256()
    files = sorted(model_path.glob("*.safetensors"))
    if not files:
        return 0
    for f in files:
        size = f.stat().st_size
        with f.open("rb") as fh:
            digest.update(size.to_bytes(8, "little") + fh.read(65536))
            fh.seek(max(0, size - 65536))
            digest.update(fh.read(65536))
    return int.from_bytes(digest.digest()[:4], "little") % _M


def greedy(prompt: Sequence[int], n: int, vocab: int, salt: int = 0) -> list[int]:
    """What an uninterrupted greedy call of ``n`` tokens returns (no stop tokens)."""
    return [t for t, _ in greedy_logprobs(prompt, n, vocab, salt)]


def greedy_logprobs(
    prompt: Sequence[int], n: int, vocab: int, salt: int = 0
) -> list[tuple[int, float]]:
    """The tokens and logprobs of an uninterrupted greedy call."""
    h = start_hash(prompt, salt)
    out: list[tuple[int, float]] = []
    for _ in range(n):
        out.append((h % vocab, logprob_of(h)))
        h = extend_hash(h, (out[-1][0],))
    return out


def abort_reason(message: str = "Aborted", status: int | None = None) -> dict[str, Any]:
    """FINISH_ABORT.to_json (sglang/srt/managers/schedule_batch.py)."""
    err_type = "BadRequestError" if status == 400 else None
    return {"type": "abort", "message": message, "status_code": status, "err_type": err_type}


def version_tuple(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in text.split(".")[:3] if p.isdigit())


@dataclass(frozen=True)
class Options:
    model_path: Path
    served_model_name: str
    host: str
    port: int
    tp_size: int
    max_running_requests: int
    context_length: int
    vocab_size: int
    eos_token_ids: frozenset[int]
    enable_metrics: bool
    incremental_streaming_output: bool
    stream_interval: int
    decode_log_interval: int
    device: str
    random_seed: int
    tokens_per_s: float = 100.0
    start_s: float = 0.0
    health_poll_s: float = 1.0
    health_timeout_s: float = 20.0
    health_generates: bool = True
    drain_poll_s: float = 5.0
    version: str = VERSION
    hold_at: int | None = None

    @property
    def max_req_input_len(self) -> int:
        """tp_worker.py: min(context - 1, KV pool - 1) - 5 (the pool here is ample)."""
        return self.context_length - 1 - 5


@dataclass(eq=False)
class Req:
    """A call as the scheduler holds it (managers/schedule_batch.py ``Req``)."""

    rid: str
    input_ids: list[int]
    max_new_tokens: int
    stop_token_ids: frozenset[int]
    ignore_eos: bool
    seed: int | None  # None: greedy
    stream: bool
    log_metrics: bool = True
    return_logprob: bool = False
    h: int = 0
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    stale: bool = False  # retracted: its state is recomputed at its next prefill
    finished_reason: dict[str, Any] | None = None
    to_finish: dict[str, Any] | None = None
    send_offset: int = 0
    num_retractions: int = 0

    def next_token(self, vocab: int) -> int:
        if self.seed is None:
            return self.h % vocab
        return extend_hash(self.h, (self.seed & 0x7FFFFFFF, len(self.output_ids))) % vocab


@dataclass(eq=False)
class ReqState:
    """A call as the tokenizer manager holds it (tokenizer_manager.py ``ReqState``)."""

    obj: Req
    created: float
    out_list: list[dict[str, Any]] = field(default_factory=list)
    finished: bool = False
    event: asyncio.Event = field(default_factory=asyncio.Event)
    output_ids: list[int] = field(default_factory=list)
    abort_sent: bool = False
    dispatched: bool = False


class Metrics:
    """The Prometheus metrics the adapter reads, with SGLang's names and labels
    (observability/metrics_collector.py)."""

    def __init__(self, model: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        base = {"model_name": model, "engine_type": "unified"}
        sched = {**base, "tp_rank": "0", "pp_rank": "0", "moe_ep_rank": "0"}

        def gauge(name: str, doc: str) -> Gauge:
            g = Gauge(name, doc, list(sched), registry=self.registry)
            g.labels(**sched).set(0)
            return g

        self.running = gauge("sglang:num_running_reqs", "The number of running requests.")
        self.queue = gauge("sglang:num_queue_reqs", "The number of requests in the waiting queue.")
        self.token_usage = gauge("sglang:token_usage", "The token usage.")
        self.sched_labels = sched
        names = [*base, "is_streaming"]
        self.prompt_tokens = Counter(
            "sglang:prompt_tokens_total",
            "Number of prefill tokens processed.",
            names,
            registry=self.registry,
        )
        self.generation_tokens = Counter(
            "sglang:generation_tokens_total",
            "Number of generation tokens processed.",
            names,
            registry=self.registry,
        )
        self.base = base

    def log_stats(self, running: int, queued: int, token_usage: float) -> None:
        self.running.labels(**self.sched_labels).set(running)
        self.queue.labels(**self.sched_labels).set(queued)
        self.token_usage.labels(**self.sched_labels).set(token_usage)

    def finished(self, prompt_tokens: int, completion_tokens: int, stream: bool) -> None:
        labels = {**self.base, "is_streaming": "true" if stream else "false"}
        self.prompt_tokens.labels(**labels).inc(prompt_tokens)
        self.generation_tokens.labels(**labels).inc(completion_tokens)


def contract_error(body: Any) -> str | None:
    """The part of api_contract.py ``generate_contract_error`` the stand-in checks."""
    if not isinstance(body, dict):
        return "invalid type: expected struct GenerateRequest"
    sp = body.get("sampling_params")
    if sp is None:
        return None
    if not isinstance(sp, dict):
        return "invalid type: expected struct SamplingParams"
    for key, value in sp.items():
        if key not in SAMPLING_KEYS:
            return f"unknown field `{key}`, expected one of {sorted(SAMPLING_KEYS)}"
        if value is None:
            continue
        if key in INT_KEYS and (isinstance(value, bool) or not isinstance(value, int)):
            return f"invalid type: {value!r}, expected i64 ({key})"
        if key in FLOAT_KEYS and (isinstance(value, bool) or not isinstance(value, int | float)):
            return f"invalid type: {value!r}, expected f64 ({key})"
        if key in BOOL_KEYS and not isinstance(value, bool):
            return f"invalid type: {value!r}, expected a boolean ({key})"
        if key == "stop_token_ids" and not (
            isinstance(value, list) and all(type(t) is int for t in value)
        ):
            return f"invalid type: {value!r}, expected a sequence of i64 (stop_token_ids)"
    return None


class FakeSglang:
    """The tokenizer manager, the scheduler and the HTTP routes, in one event loop. The
    scheduler takes messages (new calls, aborts, pauses) only between its steps, as
    SGLang's does (scheduler.py ``event_loop_normal``)."""

    def __init__(self, opts: Options) -> None:
        self.opts = opts
        self.step_s = 1.0 / (opts.tokens_per_s * opts.tp_size)
        self.pool = opts.max_running_requests * opts.context_length  # KV tokens
        # tokenizer manager
        self.rid_to_state: dict[str, ReqState] = {}
        self.is_pause = False
        self.is_pause_cond = asyncio.Condition()
        self.server_status = "Starting"
        self.gracefully_exit = False
        self.last_receive = 0.0
        # scheduler
        self.inbox: list[tuple[str, Any, asyncio.Future[None] | None]] = []
        self.inbox_ready = asyncio.Event()
        self.waiting: list[Req] = []
        self.running: list[Req] = []
        self.engine_paused = False
        self.forward_ct_decode = 0
        self.logged_running = 0
        self.hold_at = opts.hold_at
        self.metrics = Metrics(opts.served_model_name) if opts.enable_metrics else None
        self.sigterm_received = asyncio.Event()
        self.exited = asyncio.Event()
        self.model_path = opts.model_path
        self.salt = weights_salt(opts.model_path)
        self.weight_version = "default"

    # -- HTTP ----------------------------------------------------------------------------

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_route("POST", "/generate", self.http_generate)
        app.router.add_route("PUT", "/generate", self.http_generate)
        app.router.add_post("/abort_request", self.http_abort_request)
        app.router.add_post("/pause_generation", self.http_pause_generation)
        app.router.add_post("/continue_generation", self.http_continue_generation)
        app.router.add_get("/health", self.http_health)
        app.router.add_get("/health_generate", self.http_health)
        app.router.add_post("/update_weights_from_disk", self.http_update_weights_from_disk)
        app.router.add_get("/server_info", self.http_server_info)
        app.router.add_get("/get_server_info", self.http_server_info)
        if self.metrics is not None:
            app.router.add_get("/metrics", self.http_metrics)
        app.router.add_post("/orl_fake/hold", self.http_set_hold)
        app.router.add_get("/orl_fake/hold", self.http_get_hold)
        return app

    async def http_generate(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await request.json()
        except ValueError as exc:
            return web.json_response({"error": f"not JSON: {exc}"}, status=400)
        problem = contract_error(body)
        if problem is not None:
            return web.json_response({"error": problem}, status=400)
        if not body.get("stream"):
            try:
                async with contextlib.aclosing(self.generate_request(body)) as gen:
                    out = await anext(gen)
            except ValueError as exc:
                return web.json_response({"error": {"message": str(exc)}}, status=400)
            return web.json_response(out)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        with contextlib.suppress(ConnectionError):  # the client went away: the call is aborted
            async with contextlib.aclosing(self.generate_request(body)) as gen:
                try:
                    async for out in gen:
                        await response.write(b"data: " + dumps(out) + b"\n\n")
                except ValueError as exc:
                    error = {
                        "message": str(exc),
                        "type": "invalid_request_error",
                        "code": 400,
                        "retryable": False,
                    }
                    await response.write(b"data: " + dumps({"error": error}) + b"\n\n")
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
        return response

    async def http_abort_request(self, request: web.Request) -> web.Response:
        body = await json_body(request)
        self.abort_request(str(body.get("rid") or ""), bool(body.get("abort_all", False)))
        return web.Response(status=200)

    async def http_pause_generation(self, request: web.Request) -> web.Response:
        body = await json_body(request)
        mode = body.get("mode", "abort")
        if version_tuple(self.opts.version) < (0, 5, 6):
            mode = "abort"  # 0.5.5: no body, every pause aborts
        elif mode not in ("abort", "retract", "in_place"):
            return web.json_response({"error": f"mode {mode!r}"}, status=400)
        await self.pause_generation(mode)
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def http_continue_generation(self, request: web.Request) -> web.Response:
        await json_body(request)
        await self.continue_generation()
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

    async def http_update_weights_from_disk(self, request: web.Request) -> web.Response:
        body = await json_body(request)
        path = body.get("model_path")
        version = body.get("weight_version")
        if not isinstance(path, str) or not path:
            return web.json_response({"error": "model_path is required"}, status=400)
        try:
            config = json.loads((Path(path) / "config.json").read_text())
            if int(config.get("vocab_size", 32000)) != self.opts.vocab_size:
                raise ValueError(f"vocab_size {config.get('vocab_size')} != {self.opts.vocab_size}")
            salt = await asyncio.to_thread(weights_salt, Path(path))
        except (OSError, ValueError, TypeError) as exc:
            message = f"Failed to get weights iterator: {exc}. Rolling back to original weights."
            doc = {"success": False, "message": message, "num_paused_requests": 0}
            return web.json_response(doc, status=400)
        await self._call("weights", (Path(path), salt, version))
        message = "Succeeded to update model weights."
        return web.json_response({"success": True, "message": message, "num_paused_requests": 0})

    async def http_health(self, request: web.Request) -> web.Response:
        """http_server.py ``health_generate``."""
        if self.gracefully_exit or self.server_status == "Starting":
            return web.Response(status=503)
        if request.path == "/health" and not self.opts.health_generates:
            return web.Response(status=200)
        body = {
            "rid": f"{HEALTH_CHECK_RID_PREFIX}_{uuid.uuid4().hex}",
            "input_ids": [0],
            "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
        }

        async def gen() -> None:
            async with contextlib.aclosing(self.generate_request(body, log_metrics=False)) as g:
                async for _ in g:
                    break

        task = asyncio.create_task(gen())
        tic = time.monotonic()
        try:
            while time.monotonic() < tic + self.opts.health_timeout_s:
                await asyncio.sleep(self.opts.health_poll_s)
                if self.last_receive > tic:
                    self.server_status = "Up"
                    return web.Response(status=200)
            self.server_status = "UnHealthy"
            return web.Response(status=503)
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, ValueError):
                await task

    async def http_set_hold(self, request: web.Request) -> web.Response:
        """The stand-in's hold (see the module docstring)."""
        body = await json_body(request)
        at = body.get("at")
        if at is not None and (type(at) is not int or at < 1):
            return web.json_response(
                {"error": f"at={at!r}: a sequence position >= 1, or null to release"},
                status=400,
            )
        await self._call("hold", at)
        return web.json_response({"at": self.hold_at})

    async def http_get_hold(self, request: web.Request) -> web.Response:
        held = sorted(r.rid for r in self.running if self._held(r))
        return web.json_response({"at": self.hold_at, "held": held})

    async def http_metrics(self, request: web.Request) -> web.Response:
        assert self.metrics is not None
        text = generate_latest(self.metrics.registry)
        return web.Response(body=text, headers={"Content-Type": "text/plain; version=0.0.4"})

    async def http_server_info(self, request: web.Request) -> web.Response:
        o = self.opts
        return web.json_response(
            {
                "model_path": str(o.model_path),
                "served_model_name": o.served_model_name,
                "tp_size": o.tp_size,
                "max_running_requests": o.max_running_requests,
                "context_length": o.context_length,
                "skip_tokenizer_init": True,
                "enable_metrics": o.enable_metrics,
                "incremental_streaming_output": o.incremental_streaming_output,
                "device": o.device,
                "max_req_input_len": o.max_req_input_len,
                "internal_states": [{}],
                "version": o.version,
            }
        )

    # -- tokenizer manager ---------------------------------------------------------------

    def _make_req(self, body: dict[str, Any], log_metrics: bool) -> Req:
        """GenerateReqInput normalization and SamplingParams' checks (ValueError)."""
        ids = body.get("input_ids")
        if ids is None:
            raise ValueError(
                "Either text, input_ids or input_embeds should be provided."
                if body.get("text") is None
                else "text needs a tokenizer; this server runs with --skip-tokenizer-init"
            )
        if not isinstance(ids, list) or not ids or not all(type(t) is int for t in ids):
            raise ValueError("input_ids must be a non-empty list of token ids (one request)")
        sp: dict[str, Any] = dict(body.get("sampling_params") or {})

        def given(key: str, default: float) -> float:
            value = sp.get(key)
            return default if value is None else float(value)

        temperature, top_p = given("temperature", 1.0), given("top_p", 1.0)
        top_k, max_new = int(given("top_k", -1)), int(given("max_new_tokens", 128))
        if temperature < 0:
            raise ValueError(f"temperature must be non-negative, got {temperature}.")
        if not 0 < top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}.")
        if top_k < 1 and top_k != -1:
            raise ValueError(f"top_k must be -1 (disable) or at least 1, got {top_k}.")
        if max_new < 0:
            raise ValueError(f"max_new_tokens must be at least 0, got {max_new}.")
        greedy_ = temperature < 1e-6 or top_k == 1
        seed = sp.get("sampling_seed")
        rid = body.get("rid")
        return Req(
            rid=str(rid) if rid is not None else uuid.uuid4().hex,
            input_ids=list(ids),
            max_new_tokens=max_new,
            stop_token_ids=frozenset(sp.get("stop_token_ids") or ()),
            ignore_eos=bool(sp.get("ignore_eos", False)),
            seed=None if greedy_ else int(seed if seed is not None else random.getrandbits(31)),
            stream=bool(body.get("stream", False)),
            log_metrics=log_metrics,
            return_logprob=bool(body.get("return_logprob", False)),
            h=start_hash(ids, self.salt),
        )

    def _validate(self, req: Req) -> None:
        """tokenizer_manager.py ``_validate_one_request`` (no auto-truncation)."""
        n, context = len(req.input_ids), self.opts.context_length
        if n >= context:
            raise ValueError(
                f"The input ({n} tokens) is longer than the model's context length "
                f"({context} tokens)."
            )
        if req.max_new_tokens + n > context:
            raise ValueError(
                "Requested token count exceeds the model's maximum context length of "
                f"{context} tokens. You requested a total of {req.max_new_tokens + n} tokens: "
                f"{n} tokens from the input messages and {req.max_new_tokens} tokens for the "
                "completion. Please reduce the number of tokens in the input messages or the "
                "completion to fit within the limit."
            )
        if any(t < 0 or t >= self.opts.vocab_size for t in req.input_ids):
            raise ValueError(f"input_ids must be in [0, {self.opts.vocab_size})")

    async def generate_request(
        self, body: dict[str, Any], log_metrics: bool = True
    ) -> AsyncGenerator[dict[str, Any], None]:
        """tokenizer_manager.py ``generate_request`` and ``_stream_one_response``."""
        req = self._make_req(body, log_metrics)
        if req.rid in self.rid_to_state:
            raise ValueError(f"Duplicate request ID detected: {req.rid}")
        state = ReqState(req, time.monotonic())
        self.rid_to_state[req.rid] = state
        try:
            async with self.is_pause_cond:
                await self.is_pause_cond.wait_for(lambda: not self.is_pause)
            self._validate(req)
            state.dispatched = True
            self._dispatch("generate", req)
            incremental = req.stream and self.opts.incremental_streaming_output
            while True:
                await state.event.wait()
                out_list, state.out_list = state.out_list, []
                finished = state.finished
                state.event.clear()
                out = coalesce(out_list) if incremental else out_list[-1]
                if finished:
                    reason = out["meta_info"]["finish_reason"]
                    status = reason.get("status_code") if isinstance(reason, dict) else None
                    if not req.stream and isinstance(status, int) and status >= 400:
                        raise ValueError(reason["message"])
                    yield out
                    break
                if req.stream:
                    yield out
        except BaseException:
            self._release(state)
            raise

    def _release(self, state: ReqState) -> None:
        """``_release_req_states_on_failure``: a dispatched call is aborted and its state
        kept until the scheduler's answer; an undelivered one is dropped."""
        rid = state.obj.rid
        if self.rid_to_state.get(rid) is not state:
            return
        if state.dispatched:
            self.abort_request(rid)
        else:
            del self.rid_to_state[rid]

    def abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        """tokenizer_manager.py ``abort_request`` (one tokenizer worker)."""
        if not abort_all and not rid:
            return
        if not abort_all:
            state = self.rid_to_state.get(rid)
            if state is None or state.abort_sent:
                return
            state.abort_sent = True
        self._dispatch("abort", (rid, abort_all))

    async def pause_generation(self, mode: str) -> None:
        async with self.is_pause_cond:
            self.is_pause = True
            if mode != "abort":
                await self._call("pause", mode)
                return
            while True:
                self.abort_request(abort_all=True)
                if not any(s.dispatched for s in self.rid_to_state.values()):
                    break
                await asyncio.sleep(min(1.0, 20 * self.step_s))

    async def continue_generation(self) -> None:
        async with self.is_pause_cond:
            self.is_pause = False
            await self._call("continue", None)
            self.is_pause_cond.notify_all()

    def _handle_output(self, req: Req, delta: list[int]) -> None:
        """tokenizer_manager.py ``_handle_batch_output`` for one call."""
        state = self.rid_to_state.get(req.rid)
        if state is None or state.obj is not req:
            return
        reason = req.finished_reason
        state.output_ids.extend(delta)
        state.finished = reason is not None
        meta: dict[str, Any] = {
            "id": req.rid,
            "finish_reason": reason,
            "prompt_tokens": len(req.input_ids),
            "weight_version": self.weight_version,
            "num_retractions": req.num_retractions,
            "reasoning_tokens": 0,
            "completion_tokens": len(req.output_ids),
            "cached_tokens": 0,
        }
        if state.finished:
            meta["e2e_latency"] = time.monotonic() - state.created
            del self.rid_to_state[req.rid]
            if self.metrics is not None and req.log_metrics:
                self.metrics.finished(len(req.input_ids), len(req.output_ids), req.stream)
        incremental = req.stream and self.opts.incremental_streaming_output
        if req.return_logprob:
            n = len(req.output_ids)
            ids, lps = (
                (delta, req.output_logprobs[n - len(delta) :])
                if incremental
                else (req.output_ids, req.output_logprobs)
            )
            meta["output_token_logprobs"] = [[lp, t, None] for t, lp in zip(ids, lps, strict=True)]
        if incremental:
            out = {"output_ids": delta, "meta_info": meta}
        elif req.stream or state.finished:
            out = {"output_ids": list(state.output_ids), "meta_info": meta}
        else:
            return
        state.out_list.append(out)
        state.event.set()

    def _handle_abort_req(self, req: Req) -> None:
        """``_handle_abort_req``: the answer for a call aborted in the waiting queue."""
        state = self.rid_to_state.pop(req.rid, None)
        if state is None or state.obj is not req:
            return
        state.finished = True
        ids = state.output_ids
        if req.stream and self.opts.incremental_streaming_output:
            ids = ids[-1:]
        meta = {
            "id": req.rid,
            "finish_reason": {"type": "abort", "message": "Abort in waiting queue"},
            "weight_version": self.weight_version,
            "e2e_latency": time.monotonic() - state.created,
            "completion_tokens": len(state.output_ids),
        }
        state.out_list.append({"text": "", "output_ids": list(ids), "meta_info": meta})
        state.event.set()

    # -- scheduler -----------------------------------------------------------------------

    def _dispatch(self, kind: str, payload: Any) -> None:
        self.inbox.append((kind, payload, None))
        self.inbox_ready.set()

    async def _call(self, kind: str, payload: Any) -> None:
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.inbox.append((kind, payload, done))
        self.inbox_ready.set()
        await done

    def _ingest(self) -> None:
        messages, self.inbox = self.inbox, []
        for kind, payload, done in messages:
            if kind == "generate":
                self._handle_generate_request(payload)
            elif kind == "abort":
                self._abort(*payload)
            elif kind == "pause":
                self._pause(payload)
            elif kind == "continue":
                self.engine_paused = False
            elif kind == "weights":
                self._update_weights(*payload)
            elif kind == "hold":
                self.hold_at = payload
            if done is not None and not done.done():
                done.set_result(None)

    def _handle_generate_request(self, req: Req) -> None:
        if len(req.input_ids) >= self.opts.max_req_input_len:  # managers/utils.py
            message = (
                f"Input length ({len(req.input_ids)} tokens) exceeds the maximum allowed "
                f"length ({self.opts.max_req_input_len} tokens). Use a shorter input or "
                "enable --allow-auto-truncate."
            )
            req.input_ids = [0]  # Req.set_finish_with_abort: a cheap one-token prefill
            req.h = start_hash(req.input_ids, self.salt)
            req.to_finish = abort_reason(message, 400)
        self.waiting.append(req)

    def _abort(self, rid: str, abort_all: bool) -> None:
        """scheduler.py ``abort_request``: rids match by prefix."""
        for req in [r for r in self.waiting if abort_all or r.rid.startswith(rid)]:
            self.waiting.remove(req)
            self._handle_abort_req(req)
        for req in self.running:
            if req.finished_reason is None and (abort_all or req.rid.startswith(rid)):
                req.to_finish = abort_reason()  # after one more decode step

    def _update_weights(self, path: Path, salt: int, version: str | None) -> None:
        """The new weights for every later forward pass; a call still running keeps the
        state it had (SGLang keeps its KV cache), a queued one is prefilled anew."""
        self.model_path, self.salt = path, salt
        if version is not None:
            self.weight_version = version
        for req in self.waiting:
            req.stale = True

    def _pause(self, mode: str) -> None:
        self.engine_paused = True
        if mode == "retract":
            for req in self.running:
                req.num_retractions += 1
                req.stale = True
            self.waiting = self.running + self.waiting
            self.running = []
            self._log_stats(len(self.running))

    def _held(self, req: Req) -> bool:
        """The stand-in's hold stops ``req`` before its next token (module docstring)."""
        return (
            self.hold_at is not None
            and req.to_finish is None
            and req.finished_reason is None
            and not req.rid.startswith(HEALTH_CHECK_RID_PREFIX)
            and len(req.input_ids) + len(req.output_ids) >= self.hold_at
        )

    def _used_tokens(self) -> int:
        return sum(len(r.input_ids) + len(r.output_ids) for r in self.running)

    def _log_stats(self, running: int) -> None:
        self.logged_running = running
        if self.metrics is not None:
            self.metrics.log_stats(running, len(self.waiting), self._used_tokens() / self.pool)

    async def event_loop(self) -> None:
        while True:
            self._ingest()
            if self.engine_paused:
                await self._wait_for_messages()
                continue
            seats = self.opts.max_running_requests - len(self.running)
            if self.waiting and seats > 0:  # a prefill batch
                batch = self.waiting[:seats]
                del self.waiting[:seats]
                for req in batch:
                    if req.stale:  # a retracted call: its KV recomputed, on today's weights
                        req.h = start_hash(req.input_ids + req.output_ids, self.salt)
                        req.stale = False
                self._log_stats(len(self.running))  # the running batch before the merge
                self.running += batch
            elif any(not self._held(r) for r in self.running):  # a decode batch
                batch = [r for r in self.running if not self._held(r)]
                self.forward_ct_decode += 1
                if self.forward_ct_decode % self.opts.decode_log_interval == 0:
                    self._log_stats(len(self.running))
            elif self.running:  # every running call is held: nothing to step
                await self._wait_for_messages()
                continue
            else:  # idle: refresh stale gauges (``_maybe_log_idle_metrics``)
                if self.logged_running != 0:
                    self._log_stats(0)
                await self._wait_for_messages()
                continue
            await asyncio.sleep(self.step_s)  # the forward pass
            self._process_batch_result(batch)

    async def _wait_for_messages(self) -> None:
        if not self.inbox:
            self.inbox_ready.clear()
            await self.inbox_ready.wait()

    def _process_batch_result(self, batch: list[Req]) -> None:
        for req in batch:
            if self._held(req):  # held when it came in (a prefill), or meanwhile
                continue
            token = req.next_token(self.opts.vocab_size)
            req.output_logprobs.append(logprob_of(req.h))
            req.output_ids.append(token)
            req.h = extend_hash(req.h, (token,))
            self._update_finish_state(req, token)
            if req.finished_reason is not None and req in self.running:
                self.running.remove(req)
            self._stream_output(req)

    def _update_finish_state(self, req: Req, token: int) -> None:
        """schedule_batch.py ``Req.update_finish_state``: abort, stop token, length."""
        if req.to_finish is not None:
            req.finished_reason, req.to_finish = req.to_finish, None
        elif token in req.stop_token_ids or (
            not req.ignore_eos and token in self.opts.eos_token_ids
        ):
            req.finished_reason = {"type": "stop", "matched": token}
        elif len(req.output_ids) >= req.max_new_tokens:
            req.finished_reason = {"type": "length", "length": req.max_new_tokens}

    def _stream_output(self, req: Req) -> None:
        """output_streamer.py ``accept``: every stream_interval tokens, and the end."""
        if req.finished_reason is None:
            if not req.stream:
                return
            unsent = len(req.output_ids) - req.send_offset
            interval = self.opts.stream_interval
            if not (interval == 1 or unsent >= interval or (req.send_offset == 0 and unsent)):
                return
        delta = req.output_ids[req.send_offset :]
        req.send_offset = len(req.output_ids)
        self.last_receive = time.monotonic()
        self._handle_output(req, delta)

    # -- process -------------------------------------------------------------------------

    def sigterm(self) -> None:
        self.gracefully_exit = True
        self.sigterm_received.set()

    async def sigterm_watchdog(self) -> None:
        """tokenizer_manager.py ``sigterm_watchdog``: drain, then exit (SGLang looks
        every 5 s)."""
        await self.sigterm_received.wait()
        await asyncio.sleep(self.opts.drain_poll_s)
        while self.rid_to_state:
            print(f"Gracefully exiting... {len(self.rid_to_state)} request(s) left", flush=True)
            await asyncio.sleep(self.opts.drain_poll_s)
        self.exited.set()


def coalesce(out_list: list[dict[str, Any]]) -> dict[str, Any]:
    """``_coalesce_streaming_chunks``: incremental chunks queued together, as one."""
    if len(out_list) == 1:
        return out_list[0]
    out = dict(out_list[-1])
    out["output_ids"] = [t for chunk in out_list for t in chunk["output_ids"]]
    if "output_token_logprobs" in out["meta_info"]:
        out["meta_info"] = dict(out["meta_info"])
        out["meta_info"]["output_token_logprobs"] = [
            e for chunk in out_list for e in chunk["meta_info"].get("output_token_logprobs", [])
        ]
    return out


def dumps(obj: object) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


async def json_body(request: web.Request) -> dict[str, Any]:
    if not request.can_read_body:
        return {}
    try:
        body = await request.json()
    except ValueError:
        return {}
    return body if isinstance(body, dict) else {}


# -- command line ----------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="fake_sglang",
        description="A stand-in for `python -m sglang.launch_server` (its HTTP API subset).",
    )
    p.add_argument("--model-path", required=True, type=Path)
    p.add_argument("--served-model-name")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--tp-size", "--tensor-parallel-size", type=int, default=1)
    p.add_argument("--max-running-requests", type=int, default=64)
    p.add_argument("--context-length", type=int)
    p.add_argument("--random-seed", type=int, default=0)
    p.add_argument("--skip-tokenizer-init", action="store_true")
    p.add_argument("--enable-metrics", action="store_true")
    p.add_argument("--device", default="cuda")
    p.add_argument("--incremental-streaming-output", action="store_true")
    p.add_argument("--stream-interval", type=int, default=1)
    p.add_argument("--decode-log-interval", type=int, default=40)
    return p


def parse_args(argv: Sequence[str], env: Mapping[str, str]) -> Options:
    args = list(argv)
    if args[:2] == ["-m", "sglang.launch_server"]:
        args = args[2:]
    ns, unknown = _parser().parse_known_args(args)
    if unknown:
        print(f"fake_sglang: ignoring flags it does not model: {' '.join(unknown)}", flush=True)
    if not ns.skip_tokenizer_init:
        raise SystemExit("fake_sglang: it has no tokenizer: run it with --skip-tokenizer-init")
    config_path = ns.model_path / "config.json"
    try:
        config = json.loads(config_path.read_text())
    except (OSError, ValueError) as exc:
        raise SystemExit(f"fake_sglang: cannot read the model's {config_path}: {exc}") from None
    eos = config.get("eos_token_id")
    eos_ids = frozenset(eos if isinstance(eos, list) else [] if eos is None else [eos])
    context = ns.context_length or int(config.get("max_position_embeddings", 4096))

    def number(name: str, default: float) -> float:
        return float(env.get(name, default))

    return Options(
        model_path=ns.model_path,
        served_model_name=ns.served_model_name or str(ns.model_path),
        host=ns.host,
        port=ns.port,
        tp_size=ns.tp_size,
        max_running_requests=ns.max_running_requests,
        context_length=context,
        vocab_size=int(config.get("vocab_size", 32000)),
        eos_token_ids=eos_ids,
        enable_metrics=ns.enable_metrics,
        incremental_streaming_output=ns.incremental_streaming_output,
        stream_interval=ns.stream_interval,
        decode_log_interval=ns.decode_log_interval,
        device=ns.device,
        random_seed=ns.random_seed,
        tokens_per_s=number("ORL_FAKE_SGLANG_TOKENS_PER_S", 100.0),
        start_s=number("ORL_FAKE_SGLANG_START_S", 0.0),
        health_poll_s=number("ORL_FAKE_SGLANG_HEALTH_POLL_S", 1.0),
        health_timeout_s=number("SGLANG_HEALTH_CHECK_TIMEOUT", 20.0),
        health_generates=env.get("SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION", "true").lower()
        not in ("0", "false", "no", "off"),
        drain_poll_s=number("ORL_FAKE_SGLANG_DRAIN_POLL_S", 5.0),
        version=env.get("ORL_FAKE_SGLANG_VERSION", VERSION),
        hold_at=int(env["ORL_FAKE_SGLANG_HOLD_AT"]) if env.get("ORL_FAKE_SGLANG_HOLD_AT") else None,
    )


async def serve(opts: Options) -> None:
    server = FakeSglang(opts)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, server.sigterm)
    runner = web.AppRunner(server.app(), handler_cancellation=True, access_log=None)
    await runner.setup()
    async with asyncio.TaskGroup() as tasks:
        scheduler = tasks.create_task(server.event_loop())
        watchdog = tasks.create_task(server.sigterm_watchdog())
        await asyncio.sleep(opts.start_s)  # loading the model
        site = web.TCPSite(runner, opts.host, opts.port, shutdown_timeout=1.0)
        await site.start()
        server.server_status = "Up"
        print(f"fake_sglang {opts.version}: serving on http://{opts.host}:{opts.port}", flush=True)
        await server.exited.wait()
        await runner.cleanup()
        scheduler.cancel()
        watchdog.cancel()


def write_launcher(path: Path, python: str = sys.executable) -> Path:
    """An executable that runs the stand-in with the argv the SGLang adapter gives the
    Python that has SGLang (``python -m sglang.launch_server ...``)."""
    root = Path(__file__).resolve().parent.parent
    path.write_text(
        "#!/bin/sh\n"
        f'PYTHONPATH="{root}${{PYTHONPATH:+:$PYTHONPATH}}" '
        f'exec "{python}" -m sim_backends.fake_sglang "$@"\n'
    )
    path.chmod(0o755)
    return path


def main(argv: Sequence[str] | None = None) -> int:
    opts = parse_args(sys.argv[1:] if argv is None else argv, dict(os.environ))
    disable_created_metrics()  # type: ignore[no-untyped-call]  # SGLang's multiprocess collector has no *_created samples
    with contextlib.suppress(asyncio.CancelledError):
        asyncio.run(serve(opts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
