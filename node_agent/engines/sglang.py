"""SGLang as a rollout instance: ``python -m sglang.launch_server``.

Written against SGLang's own API, read from the source of 0.5.23 and compared with 0.5.5,
0.5.6, 0.5.7 and 0.5.10 where they differ (the file and function of each point are named
so that another release can be checked quickly):

- generation: ``POST /generate`` with ``input_ids``, ``rid``, ``sampling_params`` and
  ``stream`` (entrypoints/http_server.py ``generate_request``; in 0.5.23 the body is
  first checked against sglang/api/v1's ``GenerateRequest``, whose ``SamplingParams``
  rejects unknown keys with HTTP 400). With ``--skip-tokenizer-init`` each event is
  ``data: {"output_ids": [...], "meta_info": {...}}`` and the stream ends with
  ``data: [DONE]``. ``output_ids`` holds all ids so far, or only the new ones with
  ``--incremental-streaming-output`` (``--stream-output`` up to 0.5.7;
  managers/tokenizer_manager.py ``_handle_batch_output``); ``meta_info.completion_tokens``
  is always the count so far, so the adapter takes the last ``completion_tokens - seen``
  ids, which is right either way. ``meta_info.finish_reason`` is null until the last event, then
  ``{"type": "length" | "stop" | "abort", ...}`` (managers/schedule_batch.py
  ``FINISH_*.to_json``); an abort carries ``status_code``: null when the call was
  aborted (retry), 4xx when the scheduler refused the request
  (``Req.set_finish_with_abort``: retrying cannot help). A request the tokenizer
  refuses (too long for the context) gets one ``{"error": {..., "retryable": false}}``
  event instead;
- logprobs: ``return_logprob: true`` (``logprob_start_len`` -1: output tokens only); each
  event's ``meta_info.output_token_logprobs`` is a list of ``[logprob, token_id, text]``
  (text null without a tokenizer; managers/tokenizer_manager.py
  ``add_logprob_to_meta_info`` and ``detokenize_logprob_tokens``), all of them so far or,
  with incremental streaming, the new ones (``_INCREMENTAL_STREAMING_META_INFO_KEYS``):
  the adapter takes the last as many as the event has new ids, right either way. By
  default SGLang reports ``log_softmax(logits / temperature)``; the adapter sets
  ``SGLANG_RETURN_ORIGINAL_LOGPROB=1`` so that it reports the raw distribution
  (temperature 1), as vLLM and llama.cpp do (layers/sampler.py);
- weights in place: ``POST /update_weights_from_disk {"model_path", "weight_version",
  "flush_cache"}`` (entrypoints/http_server.py; managers/io_struct.py
  ``UpdateWeightFromDiskReqInput``) answers ``{"success", "message",
  "num_paused_requests"}`` (HTTP 400 when not successful; the model runner then reloads
  the weights it had). The cache flush fails while calls run, so the adapter first
  pauses in mode ``retract``: the running calls go back to the queue with their KV cache
  freed and are recomputed on the new weights at the continue;
- abort: ``POST /abort_request {"rid": ...}`` (``abort_all`` aborts everything). The
  scheduler aborts every rid that *starts with* the one given (managers/scheduler.py
  ``abort_request``), so the adapter sends fixed-length rids (a hash of the call id). A
  queued call ends at once; a running one still runs one decode step first; closing the
  stream aborts the call too;
- pause in place: ``POST /pause_generation {"mode": "in_place"}`` keeps the running calls
  and their KV cache and holds new calls in the tokenizer until ``POST
  /continue_generation`` (managers/io_struct.py ``PauseGenerationReqInput``, whose
  default mode is ``abort``). While paused, an abort of a running call takes effect at
  the continue (no decode step runs before). Modes came with 0.5.6: in 0.5.5 the call
  takes no body and aborts every call, so the adapter reads the server's version
  (``GET /server_info``, or ``/get_server_info`` in 0.5.5) once started and claims
  pause in place only from 0.5.6 on;
- health: ``GET /health`` (503 while starting); by default it generates one token and
  answers after at least 1 s, and 503 after ``SGLANG_HEALTH_CHECK_TIMEOUT`` (20 s) when
  nothing comes back, which is also its answer while paused in place;
- load (``--enable-metrics``): ``sglang:num_running_reqs``, ``sglang:num_queue_reqs``,
  ``sglang:token_usage`` (observability/metrics_collector.py; gauges the scheduler of TP
  rank 0 refreshes at each prefill, every ``--decode-log-interval`` (40) decode steps and
  when idle), ``sglang:generation_tokens_total`` and ``sglang:prompt_tokens_total``
  (counted when a call ends, aborted ones included, not as it streams). With
  ``--enable-priority-scheduling`` (not passed by the adapter) the gauges also have a
  sample per priority beside the total, and the summed load counts requests twice.

Placement: ``CUDA_VISIBLE_DEVICES`` names the instance's GPUs and ``--tp-size`` its degree.
On CPU, SGLang needs an Intel AMX Xeon and its CPU build (``--device cpu`` with
``SGLANG_USE_CPU_ENGINE=1``); :func:`cpu_supported` says whether this machine has AMX.
"""

from __future__ import annotations

import contextlib
import hashlib
import re
from collections.abc import AsyncGenerator, Sequence
from pathlib import Path
from typing import Any

import aiohttp

from node_agent.engines.base import (
    CAP_PAUSE,
    CAP_PAUSE_ABORT,
    CAP_PAUSE_RECOMPUTE,
    CAP_UPDATE_WEIGHTS,
    Chunk,
    EngineFailed,
    FinishReason,
    PauseMode,
    Submission,
)
from node_agent.engines.http_engine import HttpEngine, failure, sse_events, transport_failure
from orchestrrl.logs import get_logger

log = get_logger("node_agent.engines")

# /pause_generation with {"mode": "in_place"} (before: no modes, every call aborted)
PAUSE_IN_PLACE_SINCE = (0, 5, 6)
PAUSE_MODES: dict[PauseMode, str] = {"keep": "in_place", "recompute": "retract", "abort": "abort"}


def cpu_supported(cpuinfo: Path = Path("/proc/cpuinfo")) -> bool:
    """SGLang's CPU backend needs Intel AMX (the amx_tile and amx_bf16 flags)."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return False
    flags = next(
        (line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")),
        [],
    )
    return {"amx_tile", "amx_bf16"} <= set(flags)


def rid_of(engine_request_id: str) -> str:
    """A fixed-length rid: SGLang aborts every rid that starts with the one given."""
    return hashlib.sha256(engine_request_id.encode()).hexdigest()[:32]


def version_tuple(version: str) -> tuple[int, int, int] | None:
    """``0.5.6.post1`` -> (0, 5, 6); None when it does not start with three numbers."""
    m = re.match(r"(\d+)\.(\d+)\.(\d+)", version)
    return (int(m[1]), int(m[2]), int(m[3])) if m else None


def ended(name: str, reason: object) -> EngineFailed:
    """A call that ended with another finish reason than length or stop: an abort
    (``{"type": "abort", "message", "status_code", "err_type"}``, FINISH_ABORT in
    managers/schedule_batch.py). A 4xx ``status_code`` is the scheduler refusing the
    request (``Req.set_finish_with_abort``, 400 by default: input longer than it takes,
    ...), so calling again cannot help; without one the call was aborted (by the adapter,
    or ``/pause_generation`` in mode ``abort``) and a new call continues it."""
    status = reason.get("status_code") if isinstance(reason, dict) else None
    message = reason.get("message") if isinstance(reason, dict) else None
    refused = isinstance(status, int) and 400 <= status < 500
    what = f"{message or 'aborted'} (status {status})" if status else repr(reason)
    return EngineFailed(f"{name}: the engine ended the call: {what}", retry=not refused)


class SglangServer(HttpEngine):
    kind = "sglang"
    metric_names = {
        "running": "sglang:num_running_reqs",
        "waiting": "sglang:num_queue_reqs",
        "kv_usage": "sglang:token_usage",
        "generation_tokens_total": "sglang:generation_tokens_total",
        "prompt_tokens_total": "sglang:prompt_tokens_total",
    }

    def argv(self) -> list[str]:
        s, p = self.settings, self.placement
        argv = [s.command, "-m", "sglang.launch_server", "--model-path", self.model]
        argv += ["--served-model-name", s.served_model]
        argv += ["--host", "127.0.0.1", "--port", str(p.port)]
        argv += ["--tp-size", str(p.tp), "--max-running-requests", str(s.max_num_seqs)]
        argv += ["--context-length", str(s.context), "--random-seed", str(s.seed)]
        argv += ["--skip-tokenizer-init", "--enable-metrics"]
        if p.device == "cpu":
            argv += ["--device", "cpu"]
        return argv + list(s.args)

    def environment(self) -> dict[str, str]:
        env = super().environment()
        p = self.placement
        if p.device == "cuda":
            env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, p.devices))
        else:
            env.setdefault("SGLANG_USE_CPU_ENGINE", "1")
        env.setdefault("SGLANG_RETURN_ORIGINAL_LOGPROB", "1")  # logprobs at temperature 1
        return env

    version = ""  # the server's, read once it started ("" when it would not say)
    paused: PauseMode | None = None  # how this adapter paused the server, if it did

    @property
    def modes(self) -> bool:
        """The server's /pause_generation takes a mode (0.5.6 on)."""
        v = version_tuple(self.version)
        return v is None or v >= PAUSE_IN_PLACE_SINCE

    @property
    def capabilities(self) -> frozenset[str]:
        if not self.modes:  # a pause aborts every call
            return frozenset({CAP_PAUSE_ABORT, CAP_UPDATE_WEIGHTS})
        return frozenset({CAP_PAUSE, CAP_PAUSE_RECOMPUTE, CAP_PAUSE_ABORT, CAP_UPDATE_WEIGHTS})

    async def start(self) -> None:
        await super().start()
        self.version = await self.server_version()
        if (v := version_tuple(self.version)) is not None and v < PAUSE_IN_PLACE_SINCE:
            log.warning(
                "sglang_cannot_pause_in_place",
                instance=self.name,
                version=self.version,
                why="/pause_generation aborts every call before SGLang 0.5.6; pausing this "
                "instance aborts its calls and resubmits them (KV recomputed)",
            )

    async def server_version(self) -> str:
        """``version`` of ``GET /server_info`` (``/get_server_info`` in 0.5.5)."""
        for path in ("/server_info", "/get_server_info"):
            with contextlib.suppress(aiohttp.ClientError, TimeoutError, ValueError):
                async with self.session.get(
                    self.base + path, timeout=aiohttp.ClientTimeout(total=30)
                ) as r:
                    if r.status != 200:
                        continue
                    doc = await r.json()
                    if isinstance(doc, dict):
                        return str(doc.get("version") or "")
        return ""

    async def generate(self, submission: Submission) -> AsyncGenerator[Chunk, None]:
        sp = submission.sampling
        params: dict[str, Any] = {
            "max_new_tokens": submission.max_tokens,
            "temperature": sp.temperature,
            "top_p": sp.top_p,
            "top_k": sp.top_k or -1,
            "ignore_eos": sp.ignore_eos,
        }
        if sp.stop_token_ids:
            params["stop_token_ids"] = list(sp.stop_token_ids)
        if sp.seed is not None:
            params["sampling_seed"] = sp.seed
        rid = rid_of(submission.engine_request_id)
        body: dict[str, Any] = {
            "rid": rid,
            "input_ids": list(submission.prompt),
            "sampling_params": params,
            "stream": True,
        }
        if submission.logprobs:
            body["return_logprob"] = True
        seen = 0
        finished = False
        try:
            async with self.session.post(self.base + "/generate", json=body) as r:
                if r.status != 200:
                    raise await failure(r, f"{self.name}: /generate")
                async for event in sse_events(r):
                    if "error" in event:
                        err = event["error"]
                        retry = not (isinstance(err, dict) and err.get("retryable") is False)
                        raise EngineFailed(f"{self.name}: {err}", retry=retry)
                    meta = event.get("meta_info") or {}
                    ids = event.get("output_ids") or []
                    need = int(meta.get("completion_tokens", seen + len(ids))) - seen
                    tokens = tuple(ids[-need:]) if need > 0 else ()
                    lps = self.logprobs_of(meta, tokens) if submission.logprobs else ()
                    seen += len(tokens)
                    reason = meta.get("finish_reason")
                    kind = reason.get("type") if isinstance(reason, dict) else reason
                    if kind not in (None, "length", "stop"):
                        raise ended(self.name, reason)
                    finish: FinishReason | None = kind
                    finished = finish is not None
                    yield Chunk(tokens, finish, lps)
                    if finished:
                        return
                raise EngineFailed(f"{self.name}: the stream ended without a finish reason")
        except aiohttp.ClientError as exc:
            raise transport_failure(self.name, exc) from exc
        finally:
            if not finished:
                with contextlib.suppress(Exception):
                    await self.abort_in_background([submission.engine_request_id])

    def logprobs_of(self, meta: dict[str, Any], tokens: tuple[int, ...]) -> tuple[float, ...]:
        """The logprobs of an event's new ids: the last ``len(tokens)`` entries of
        ``meta_info.output_token_logprobs`` (``[logprob, token_id, text]`` each)."""
        if not tokens:
            return ()
        entries = meta.get("output_token_logprobs")
        if not isinstance(entries, list) or len(entries) < len(tokens):
            raise EngineFailed(
                f"{self.name}: {len(tokens)} new ids and output_token_logprobs {str(entries)[:80]}"
            )
        try:
            got = [(float(e[0]), int(e[1])) for e in entries[-len(tokens) :]]
        except (TypeError, ValueError, IndexError):
            raise EngineFailed(
                f"{self.name}: malformed output_token_logprobs {str(entries)[:80]}"
            ) from None
        if tuple(t for _, t in got) != tokens:
            raise EngineFailed(
                f"{self.name}: output_token_logprobs name ids {[t for _, t in got][:8]}, the "
                f"event streamed {list(tokens)[:8]}"
            )
        return tuple(v for v, _ in got)

    async def abort(self, engine_request_ids: Sequence[str]) -> None:
        for i in engine_request_ids:
            await self.post_quietly("/abort_request", {"rid": rid_of(i)})

    async def pause(self, mode: PauseMode = "keep") -> None:
        """``keep`` is best effort (as the gateway's pause has always used it); the other
        modes fail with EngineFailed when the server does not pause."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"SGLang has no pause mode {mode!r}")
        if mode == "keep":
            await self.post_quietly("/pause_generation", {"mode": "in_place"})
        elif not self.modes:
            await self.control("/pause_generation", what="pause")
        else:
            await self.control("/pause_generation", {"mode": PAUSE_MODES[mode]}, what="pause")
        self.paused = mode

    async def resume(self) -> None:
        await self.post_quietly("/continue_generation", {})
        self.paused = None

    async def update_weights(self, path: str, *, version: str | None = None) -> None:
        """``/update_weights_from_disk``, the running calls first retracted (recomputed on
        the new weights at the continue) unless the caller paused with another mode
        than keep. SGLang reloads its old weights when the new ones fail to load."""
        paused_by_caller = self.paused
        if self.modes and paused_by_caller in (None, "keep"):
            await self.control("/pause_generation", {"mode": "retract"}, what="pause (retract)")
        body: dict[str, Any] = {"model_path": path, "flush_cache": True}
        if version is not None:
            body["weight_version"] = version
        try:
            try:
                doc = await self.control(
                    "/update_weights_from_disk", body, what=f"load the weights of {path}"
                )
            except EngineFailed as exc:
                raise EngineFailed(
                    f"{exc} (SGLang keeps the weights of {self.model})", retry=False
                ) from exc
            if not (isinstance(doc, dict) and doc.get("success")):
                raise EngineFailed(
                    f"{self.name}: /update_weights_from_disk did not succeed: {doc!r}", retry=False
                )
            self.use_model(path)
        finally:
            if paused_by_caller is None and self.modes:
                await self.resume()
