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

from node_agent.engines.base import CAP_PAUSE, Chunk, EngineFailed, FinishReason, Submission
from node_agent.engines.http_engine import HttpEngine, failure, sse_events, transport_failure
from orchestrrl.logs import get_logger

log = get_logger("node_agent.engines")

# /pause_generation with {"mode": "in_place"} (before: no modes, every call aborted)
PAUSE_IN_PLACE_SINCE = (0, 5, 6)


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
        argv = [s.command, "-m", "sglang.launch_server", "--model-path", s.model]
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
        return env

    version = ""  # the server's, read once it started ("" when it would not say)

    @property
    def capabilities(self) -> frozenset[str]:
        v = version_tuple(self.version)
        if v is not None and v < PAUSE_IN_PLACE_SINCE:
            return frozenset()
        return frozenset({CAP_PAUSE})

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
        body = {
            "rid": rid,
            "input_ids": list(submission.prompt),
            "sampling_params": params,
            "stream": True,
        }
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
                    seen += len(tokens)
                    reason = meta.get("finish_reason")
                    kind = reason.get("type") if isinstance(reason, dict) else reason
                    if kind not in (None, "length", "stop"):
                        raise ended(self.name, reason)
                    finish: FinishReason | None = kind
                    finished = finish is not None
                    yield Chunk(tokens, finish)
                    if finished:
                        return
                raise EngineFailed(f"{self.name}: the stream ended without a finish reason")
        except aiohttp.ClientError as exc:
            raise transport_failure(self.name, exc) from exc
        finally:
            if not finished:
                with contextlib.suppress(Exception):
                    await self.abort_in_background([submission.engine_request_id])

    async def abort(self, engine_request_ids: Sequence[str]) -> None:
        for i in engine_request_ids:
            await self.post_quietly("/abort_request", {"rid": rid_of(i)})

    async def pause(self) -> None:
        await self.post_quietly("/pause_generation", {"mode": "in_place"})

    async def resume(self) -> None:
        await self.post_quietly("/continue_generation", {})
