"""SGLang as a rollout instance: ``python -m sglang.launch_server``.

Written against SGLang's own API (read from its source, 0.5.5 to 0.5.23):

- generation: ``POST /generate`` with ``input_ids``, ``rid``, ``sampling_params`` and
  ``stream``; each event has ``output_ids`` (all ids so far, or only the new ones with
  ``--incremental-streaming-output``: the adapter takes the last
  ``meta_info.completion_tokens - seen`` of them, which is right either way) and
  ``meta_info.finish_reason`` (``{"type": "length" | "stop" | "abort", ...}``);
- abort: ``POST /abort_request {"rid": ...}``; SGLang matches rids by prefix, so the
  adapter sends fixed-length rids (a hash of the call id);
- pause in place: ``POST /pause_generation {"mode": "in_place"}`` /
  ``POST /continue_generation``;
- load (``--enable-metrics``): ``sglang:num_running_reqs``, ``sglang:num_queue_reqs``,
  ``sglang:token_usage``, ``sglang:generation_tokens_total``, ``sglang:prompt_tokens_total``.

Placement: ``CUDA_VISIBLE_DEVICES`` names the instance's GPUs and ``--tp-size`` its degree.
On CPU, SGLang needs an Intel AMX Xeon and its CPU build (``--device cpu`` with
``SGLANG_USE_CPU_ENGINE=1``); :func:`cpu_supported` says whether this machine has AMX.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import AsyncGenerator, Sequence
from pathlib import Path
from typing import Any

import aiohttp

from node_agent.engines.base import CAP_PAUSE, Chunk, EngineFailed, FinishReason, Submission
from node_agent.engines.http_engine import HttpEngine, failure, sse_events, transport_failure


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

    @property
    def capabilities(self) -> frozenset[str]:
        return frozenset({CAP_PAUSE})

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
                    if kind in (None, "length", "stop"):
                        finish: FinishReason | None = kind
                        finished = finish is not None
                        yield Chunk(tokens, finish)
                        if finished:
                            return
                    else:
                        raise EngineFailed(f"{self.name}: the call ended with {reason!r}")
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
