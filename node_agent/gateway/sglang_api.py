"""SGLang's native HTTP protocol on the gateway, beside the OpenAI one (``http.py``).

slime and AReaL drive their rollout engines through ``sglang-router`` with SGLang's own
endpoints; pointed at node agents instead of SGLang servers, they get the same answers,
from whatever engines the agents run, with the gateway's migration, resharding and
per-token weight versions underneath. The shapes follow SGLang 0.5.8 (the release of
``sglang-router`` 0.3.2, which this project pins and tests against):

- ``POST /generate``: ``GenerateReqInput`` (``managers/io_struct.py``) with ``input_ids``
  (one prompt or a batch), ``sampling_params`` (a dict, or one per prompt), ``rid``,
  ``return_logprob``, ``stream``; the answer of ``TokenizerManager._handle_batch_output``:
  ``{"text", "output_ids", "meta_info"}`` (a list for a batch or ``n > 1``, prompt-major),
  ``meta_info`` with ``id``, ``finish_reason`` (``FINISH_LENGTH`` / ``FINISH_MATCHED_TOKEN``
  / ``FINISH_ABORT.to_json()`` of ``managers/schedule_batch.py``), ``prompt_tokens``,
  ``completion_tokens``, ``weight_version``, ``e2e_latency`` and, asked for,
  ``output_token_logprobs`` as ``[logprob, token_id, null]`` triples. Streamed: one
  ``data: {...}`` event per change with the output so far (SGLang's default, without
  ``--stream-output``), ``"index"`` in a batch, then ``data: [DONE]``. The gateway never
  tokenizes: ``text`` is always ``""`` and ``text`` prompts are refused. Each output's
  ``meta_info.orl`` says which weights made which tokens (``weight_versions``: runs of
  ``[first index, version]``) and on which nodes it ran; ``weight_version`` is the last
  token's. OrchestrRL's ``max_staleness`` (0..64) stops a request whose oldest token is
  that many versions behind new weights when they land: ``finish_reason {"type":
  "stale", "length"}`` with its output so far (``/server_info``'s ``orl.stale_stopped``
  counts them).
- ``POST /abort_request`` ``{"rid"}`` or ``{"abort_all": true}``: the aborted requests
  answer ``finish_reason {"type": "abort", ...}`` with their output so far (200), as
  SGLang's do; a ``rid`` also aborts the samples and batch items made from it
  (``<rid>_<k>``).
- ``POST /update_weights_from_disk`` ``{"model_path", "weight_version", ...}``: new weights
  into every engine instance (``GatewayEngine.update_weights``), answered
  ``{"success", "message", "num_paused_requests"}`` (400 when it failed: the old weights
  still serve).
- ``GET /health_generate``, ``/model_info`` (``/get_model_info``), ``/server_info``
  (``/get_server_info``), ``/get_load`` (what ``sglang-router`` 0.3.2 polls), ``/v1/loads``
  (what slime polls after an abort), ``POST /flush_cache``; ``GET /health`` is
  ``http.py``'s.

What the gateway cannot honour is refused, naming the field: ``stop`` strings (use
``stop_token_ids``), penalties, constrained decoding, prompt or top-k logprobs, LoRA,
multimodal inputs (``image_data`` and the like are accepted null or empty), slime's
``custom_params``. Unknown fields are refused too, except those ``sglang-router`` always
forwards at their defaults. ``sampling_seed`` with ``n > 1`` gives sample ``j`` the seed
``s + j`` (as ``/v1/completions`` does with ``seed``). The bodies slime, AReaL and verl
build are replayed in tests/component/test_framework_shapes.py.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from node_agent.engine import MAX_GROUP_CHARS, EngineProgress, EngineStats, check_group
from node_agent.engines.base import Sampling
from node_agent.gateway.engine import WeightUpdate
from node_agent.gateway.http import (
    MAX_ABORT_IDS,
    MAX_TOKEN_ID,
    REQUEST_ID_RE,
    HttpError,
    _float,
    _int,
    bad,
    parse_max_staleness,
    update_answer,
)
from node_agent.gateway.requests import UPDATE_POLICIES, Request, Where
from orchestrrl import errors

if TYPE_CHECKING:
    from node_agent.gateway.http import GatewaySettings

SGLANG_VERSION = "0.5.8"  # the SGLang release whose protocol this module speaks
MAX_NEW_TOKENS_DEFAULT = 128  # SGLang's SamplingParams default
MAX_BATCH = 10_000  # requests one /generate may make (prompts x n)
HEALTH_TIMEOUT_S = 20.0  # SGLang's HEALTH_CHECK_TIMEOUT

_ABSENT = object()

# GenerateReqInput fields accepted only at these values (sglang-router always forwards
# some of them, at their defaults)
_GENERATE_NOOP: dict[str, tuple[object, ...]] = {
    "text": (None,),
    "input_embeds": (None,),
    "image_data": (None, []),  # AReaL sends its ModelRequest's default, []
    "video_data": (None, []),
    "audio_data": (None, []),
    "logprob_start_len": (None, -1),
    "top_logprobs_num": (None, 0),
    "token_ids_logprob": (None, []),
    "return_text_in_logprobs": (False,),
    "return_hidden_states": (False,),
    "return_routed_experts": (False,),
    "routed_experts_start_len": (0,),
    "modalities": (None,),
    "session_params": (None,),
    "lora_path": (None,),
    "lora_id": (None,),
    "custom_logit_processor": (None,),
    "bootstrap_host": (None,),
    "bootstrap_port": (None,),
    "bootstrap_room": (None,),
    "bootstrap_pair_key": (None,),
    "decode_tp_size": (None,),
    "data_parallel_rank": (None, 0),
    "background": (False,),
    "conversation_id": (None,),
    "priority": (None,),
    "extra_key": (None,),
    "return_bytes": (False,),
    "return_entropy": (False,),
    "require_reasoning": (False,),
    "http_worker_ipc": (None,),
}
_GENERATE_WHY = {
    "text": "null: the gateway does not tokenize; send input_ids",
    "return_text_in_logprobs": "false: the gateway does not detokenize",
    "logprob_start_len": "null or -1: the gateway reports the sampled tokens' logprobs only",
    "top_logprobs_num": "null or 0: top logprobs are not reported",
    "token_ids_logprob": "null: only the sampled tokens' logprobs are reported",
}
# fields with no effect on what the gateway generates, accepted with any value of a type
_GENERATE_IGNORED: dict[str, tuple[type, ...]] = {
    "log_metrics": (bool,),
    "no_logs": (bool,),
    "routing_key": (str, type(None)),
    "custom_labels": (dict, type(None)),
    "external_trace_header": (dict, type(None)),
}
_GENERATE_FIELDS = frozenset(
    {
        "input_ids",
        "sampling_params",
        "rid",
        "return_logprob",
        "stream",
        "model",
        "group",  # OrchestrRL: the sample group of a single prompt (n = 1)
        "on_weight_update",  # OrchestrRL: "finish" or "resume" at a weight update
        "max_staleness",  # OrchestrRL: stop it ("stale") beyond this weight-version lag
        *_GENERATE_NOOP,
        *_GENERATE_IGNORED,
    }
)

# SamplingParams (sampling/sampling_params.py) fields accepted only at these values
_SAMPLING_NOOP: dict[str, tuple[object, ...]] = {
    "stop": (None, "", []),
    "stop_regex": (None, "", []),
    "min_p": (0,),
    "frequency_penalty": (0,),
    "presence_penalty": (0,),
    "repetition_penalty": (1,),
    "min_new_tokens": (None, 0),
    "json_schema": (None,),
    "regex": (None,),
    "ebnf": (None,),
    "structural_tag": (None,),
    "custom_params": (None,),
    "logit_bias": (None,),
}
_SAMPLING_WHY = {
    "stop": "null: the gateway does not tokenize; use stop_token_ids",
    "stop_regex": "null: the gateway does not tokenize; use stop_token_ids",
    "custom_params": "null: custom logit processors' parameters (and slime's "
    "return_top_p_token_ids, sent with top_p < 1) are not supported",
}
# they only change the text, which the gateway does not produce, or the stream's pacing
_SAMPLING_IGNORED: dict[str, tuple[type, ...]] = {
    "skip_special_tokens": (bool,),
    "spaces_between_special_tokens": (bool,),
    "no_stop_trim": (bool,),
    "stream_interval": (int, type(None)),
}
_SAMPLING_FIELDS = frozenset(
    {
        "max_new_tokens",
        "temperature",
        "top_p",
        "top_k",
        "n",
        "stop_token_ids",
        "ignore_eos",
        "sampling_seed",
        *_SAMPLING_NOOP,
        *_SAMPLING_IGNORED,
    }
)


@dataclass(frozen=True)
class Sample:
    """One request a /generate makes: a prompt (one of a batch), one of its ``n`` samples."""

    request_id: str
    prompt: tuple[int, ...]
    max_tokens: int
    sampling: Sampling
    logprobs: bool
    group: str = ""


@dataclass(frozen=True)
class Generate:
    """A validated /generate body."""

    samples: tuple[Sample, ...]
    batch: bool  # answer a list (input_ids was a batch, or n > 1)
    stream: bool
    on_weight_update: str = ""
    max_staleness: int | None = None


def _check_fields(
    body: Mapping[str, Any],
    allowed: frozenset[str],
    noop: Mapping[str, tuple[object, ...]],
    ignored: Mapping[str, tuple[type, ...]],
    why: Mapping[str, str],
    where: str,
) -> None:
    unknown = sorted(set(body) - allowed)
    if unknown:
        name = unknown[0]
        raise bad(
            name,
            body[name],
            f"not a field of {where} the gateway knows; allowed: {', '.join(sorted(allowed))}",
        )
    for name, values in noop.items():
        value = body.get(name, _ABSENT)
        if value is _ABSENT or any(_same(value, v) for v in values):
            continue
        shown = " or ".join("null" if v is None else repr(v) for v in values)
        raise bad(name, value, why.get(name, f"{shown}: not supported by the gateway"))
    for name, types in ignored.items():
        if name in body and (
            not isinstance(body[name], types)
            or (bool not in types and isinstance(body[name], bool))
        ):
            raise bad(name, body[name], " or ".join(_type_name(t) for t in types))


def _same(value: object, allowed: object) -> bool:
    """``value`` is ``allowed`` (numbers by value, not bool for a number)."""
    if isinstance(allowed, bool) or isinstance(value, bool):
        return type(value) is type(allowed) and value == allowed
    if isinstance(allowed, int | float) and isinstance(value, int | float):
        return float(value) == float(allowed)
    return type(value) is type(allowed) and value == allowed


def _type_name(t: type) -> str:
    return {bool: "true or false", str: "a string", dict: "an object", int: "an integer"}.get(
        t, "null"
    )


def _prompt(value: object, name: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= MAX_TOKEN_ID for t in value
    ):
        raise bad(name, value, "a list of token ids (integers >= 0), or a list of such lists")
    if not value:
        raise bad(name, value, "at least one token id")
    return tuple(value)


def _per_prompt(value: object, count: int, name: str, single: bool) -> list[object]:
    """One value per prompt: a list (one each, for a batch) or one value for all."""
    if isinstance(value, list) and not single:
        if len(value) != count:
            raise bad(name, f"{len(value)} values", f"one per prompt ({count}) or one for all")
        return list(value)
    return [value] * count


def parse_sampling(
    raw: object, prompt_len: int, settings: GatewaySettings, name: str
) -> tuple[int, Sampling, int]:
    """``(max_tokens, sampling, n)`` of one ``sampling_params`` object."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise bad(name, raw, "an object of sampling parameters (or a list, one per prompt)")
    if prompt_len >= settings.max_context:
        raise bad(
            "input_ids",
            f"{prompt_len} tokens",
            f"a prompt shorter than the engine's context of {settings.max_context} tokens",
        )
    try:
        _check_fields(
            raw,
            _SAMPLING_FIELDS,
            _SAMPLING_NOOP,
            _SAMPLING_IGNORED,
            _SAMPLING_WHY,
            "sampling_params",
        )
        return _sampling(raw, prompt_len, settings)
    except HttpError as exc:  # name the field inside sampling_params
        if exc.param is not None:
            exc.message = f"{name}.{exc.message}"
            exc.param = f"{name}.{exc.param}"
        raise


def _sampling(
    raw: Mapping[str, Any], prompt_len: int, settings: GatewaySettings
) -> tuple[int, Sampling, int]:
    room = settings.max_context - prompt_len
    if "max_new_tokens" in raw and raw["max_new_tokens"] is None:
        max_tokens = room  # SGLang: up to the context length
    else:
        max_tokens = _int(raw, "max_new_tokens", 1, 2**31 - 1, MAX_NEW_TOKENS_DEFAULT) or 0
    if max_tokens > room:
        raise bad(
            "max_new_tokens",
            max_tokens,
            f"the prompt ({prompt_len} tokens) + max_new_tokens must fit the engine's context "
            f"of {settings.max_context} tokens (at most {room})",
        )
    top_k = raw.get("top_k", -1)
    if isinstance(top_k, bool) or not isinstance(top_k, int) or (top_k != -1 and top_k < 1):
        raise bad("top_k", top_k, "-1 (the whole vocabulary) or an integer >= 1")
    stops = raw.get("stop_token_ids")
    if stops is None:
        stops = []
    if not isinstance(stops, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= MAX_TOKEN_ID for t in stops
    ):
        raise bad("stop_token_ids", stops, "a list of token ids (integers >= 0)")
    ignore_eos = raw.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise bad("ignore_eos", ignore_eos, "true or false")
    sampling = Sampling(
        temperature=_float(raw, "temperature", 0.0, 100.0, 1.0),
        top_p=_float(raw, "top_p", 1e-9, 1.0, 1.0),
        top_k=0 if top_k == -1 else top_k,
        seed=_int(raw, "sampling_seed", -(2**63), 2**63 - 1, None),
        ignore_eos=ignore_eos,
        stop_token_ids=tuple(stops),
    )
    n = _int(raw, "n", 1, settings.max_n, 1) or 1
    return max_tokens, sampling, n


def _seeded(sampling: Sampling, j: int) -> Sampling:
    if sampling.seed is None or j == 0:
        return sampling
    seed = (sampling.seed + j + 2**63) % 2**64 - 2**63
    return Sampling(
        sampling.temperature,
        sampling.top_p,
        sampling.top_k,
        seed,
        sampling.ignore_eos,
        sampling.stop_token_ids,
    )


def parse_generate(body: object, settings: GatewaySettings, new_id: str = "") -> Generate:
    """Validate a /generate body; HttpError naming the first bad field. ``new_id``: the
    id base when no ``rid`` is given (a fresh one when empty)."""
    if not isinstance(body, dict):
        raise HttpError(400, "invalid_request_error", "the body must be a JSON object")
    _check_fields(
        body, _GENERATE_FIELDS, _GENERATE_NOOP, _GENERATE_IGNORED, _GENERATE_WHY, "/generate"
    )
    model = body.get("model")
    if model is not None and model != settings.served_model:
        raise HttpError(
            404,
            "not_found_error",
            f"model={model!r} is not served here; the model is {settings.served_model!r}",
            "model",
        )
    raw = body.get("input_ids")
    if raw is None:
        raise bad("input_ids", raw, "token ids (a list of integers, or a list of such lists)")
    single = not (isinstance(raw, list) and raw and isinstance(raw[0], list))
    prompts = [_prompt(raw, "input_ids")] if single else [_prompt(p, "input_ids") for p in raw]
    count = len(prompts)
    if count > MAX_BATCH:
        raise bad("input_ids", f"{count} prompts", f"at most {MAX_BATCH} prompts per call")
    params = _per_prompt(body.get("sampling_params"), count, "sampling_params", single)
    wants = _per_prompt(body.get("return_logprob"), count, "return_logprob", single)
    for w in wants:
        if w is not None and not isinstance(w, bool):
            raise bad("return_logprob", w, "true or false (or a list, one per prompt)")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise bad("stream", stream, "true or false")
    policy = body.get("on_weight_update")
    if policy is not None and policy not in UPDATE_POLICIES:
        raise bad(
            "on_weight_update",
            policy,
            '"finish" (on the old weights) or "resume" (on the new ones) at a weight update',
        )
    max_staleness = parse_max_staleness(body)
    parsed = [
        parse_sampling(
            p,
            len(prompt),
            settings,
            "sampling_params"
            if single or not isinstance(body.get("sampling_params"), list)
            else f"sampling_params[{b}]",
        )
        for b, (prompt, p) in enumerate(zip(prompts, params, strict=True))
    ]
    n = parsed[0][2]
    if any(x[2] != n for x in parsed):
        raise bad("sampling_params", [x[2] for x in parsed], "the same n for every prompt")
    if count * n > MAX_BATCH:
        raise bad("sampling_params.n", n, f"at most {MAX_BATCH} requests per call (prompts x n)")
    bases = _prompt_ids(body.get("rid"), count, single, new_id or uuid.uuid4().hex)
    group = body.get("group")
    if group is not None:
        if not single or n > 1:
            raise bad("group", group, "null: a batch's or n samples' groups are their prompts")
        try:
            check_group(group)
        except errors.InvalidArgument:
            raise bad(
                "group",
                group,
                f"a string of at most {MAX_GROUP_CHARS} characters (the sample group, e.g. "
                "the prompt's dataset index)",
            ) from None
    samples: list[Sample] = []
    for b, (prompt, (max_tokens, sampling, _), want) in enumerate(
        zip(prompts, parsed, wants, strict=True)
    ):
        for j in range(n):
            rid = bases[b] if n == 1 else f"{bases[b]}_{j}"
            if not REQUEST_ID_RE.match(rid):
                raise bad(
                    "rid",
                    rid,
                    "1-128 characters of A-Z a-z 0-9 . _ : - (with the _<k> suffix of a batch "
                    "item or sample)",
                )
            samples.append(
                Sample(
                    rid,
                    prompt,
                    max_tokens,
                    _seeded(sampling, j),
                    bool(want),
                    group or ("" if n == 1 else bases[b]),
                )
            )
    return Generate(tuple(samples), not single or n > 1, stream, policy or "", max_staleness)


def _prompt_ids(rid: object, count: int, single: bool, fresh: str) -> list[str]:
    """Each prompt's id: ``rid`` (one prompt), ``rid[b]`` (a list, one per prompt) or
    ``<rid>_<b>`` (a batch under one rid), as SGLang's ``_normalize_rid`` names them."""
    if rid is None:
        return [fresh] if single else [f"{fresh}_{b}" for b in range(count)]
    if isinstance(rid, str) and rid:
        return [rid] if single else [f"{rid}_{b}" for b in range(count)]
    if (
        isinstance(rid, list)
        and not single
        and len(rid) == count
        and all(isinstance(r, str) and r for r in rid)
    ):
        if len(set(rid)) != len(rid):
            raise bad("rid", rid, "distinct request ids")
        return list(rid)
    raise bad(
        "rid",
        rid,
        f"a request id (string){'' if single else f', or a list of {count}, one per prompt'}",
    )


# -- answers ------------------------------------------------------------------------------


def finish_reason(req: Request) -> dict[str, Any] | None:
    """SGLang's ``finish_reason`` of a request that ended (None while it runs)."""
    if req.where is Where.ABORTED:
        return {
            "type": "abort",
            "message": req.error or "Aborted",
            "status_code": None,
            "err_type": None,
        }
    if req.where is not Where.FINISHED:
        return None
    if req.finish == "stale":  # stopped beyond its max_staleness (OrchestrRL)
        return {"type": "stale", "length": len(req.output)}
    if req.finish == "stop":
        last = req.output[-1] if req.output else None
        # the stop token when it is one the client named (an engine's own end-of-sequence
        # token is not always in its output)
        matched = last if last in req.sampling.stop_token_ids else None
        return {"type": "stop", "matched": matched}
    return {"type": "length", "length": len(req.output)}


def meta_info(req: Request, now_version: str, now_wall: float) -> dict[str, Any]:
    """``meta_info`` of a request as it stands (the whole output so far)."""
    version = req.versions[-1][1] if req.versions else now_version
    info: dict[str, Any] = {
        "id": req.id,
        "finish_reason": finish_reason(req),
        "prompt_tokens": len(req.prompt),
        "completion_tokens": len(req.output),
        "weight_version": version,
    }
    if req.want_logprobs:
        info["output_token_logprobs"] = [
            [lp, t, None] for lp, t in zip(req.logprobs, req.output, strict=False)
        ]
    if req.done:
        info["e2e_latency"] = round(max(0.0, now_wall - req.created_wall), 6)
    info["orl"] = {
        "request_id": req.id,
        "weight_versions": [list(v) for v in req.versions],
        "nodes": list(req.hops),
        "node_starts": list(req.hop_starts),
    }
    return info


def output(req: Request, now_version: str, now_wall: float) -> dict[str, Any]:
    """One output of /generate: ``{"text": "", "output_ids", "meta_info"}``."""
    info = meta_info(req, now_version, now_wall)
    return {"text": "", "output_ids": list(req.output), "meta_info": info}


def server_info(
    settings: GatewaySettings,
    kind: str,
    layout: Sequence[int],
    seats: int,
    weight_version: str,
    version: str,
    stale_stopped: int = 0,
) -> dict[str, Any]:
    """``/server_info``: the ``ServerArgs`` fields a router reads, as the gateway has them.
    ``model_path`` is null: a router would load a tokenizer from it (``sglang-router``
    0.3.2's registration does, downloading it when it is not a local directory), and the
    gateway needs none."""
    return {
        "model_path": None,
        "tokenizer_path": None,
        "served_model_name": settings.served_model,
        "skip_tokenizer_init": True,  # token ids in, token ids out
        "context_length": settings.max_context,
        "tp_size": max(layout, default=0),
        "dp_size": 1,
        "max_running_requests": seats,
        "disaggregation_mode": "null",
        "weight_version": weight_version,
        "version": version,
        "orl": {"engine": kind, "tp_layout": list(layout), "stale_stopped": stale_stopped},
    }


def model_info(settings: GatewaySettings, weight_version: str) -> dict[str, Any]:
    """``/model_info`` (``model_path`` null, see :func:`server_info`)."""
    return {
        "model_path": None,
        "tokenizer_path": None,
        "served_model_name": settings.served_model,
        "is_generation": True,
        "preferred_sampling_params": None,
        "weight_version": weight_version,
        "has_image_understanding": False,
        "has_audio_understanding": False,
        "model_type": None,
        "architectures": None,
    }


def tokens_in_use(progress: EngineProgress) -> tuple[int, int]:
    """``(running, all)``: tokens of the running requests, and of those and the queued
    (prompt + output so far each)."""
    running = sum(
        r.prompt_tokens + r.generated_tokens for r in progress.requests if r.instance >= 0
    )
    total = sum(r.prompt_tokens + r.generated_tokens for r in progress.requests)
    return running, total


def get_load(stats: EngineStats, progress: EngineProgress, ts_tic: float) -> list[dict[str, Any]]:
    """``/get_load``: ``GetLoadReqOutput`` per DP rank (the gateway is one)."""
    return [
        {
            "dp_rank": 0,
            "num_reqs": stats.running_requests + stats.queued_requests,
            "num_waiting_reqs": stats.queued_requests,
            "num_tokens": tokens_in_use(progress)[1],
            "ts_tic": ts_tic,
        }
    ]


def loads(
    stats: EngineStats, progress: EngineProgress, seats: int, version: str, now_iso: str
) -> dict[str, Any]:
    """``/v1/loads``: the core figures of ``GetLoadsReqOutput`` the gateway has."""
    used, _ = tokens_in_use(progress)
    row = {
        "dp_rank": 0,
        "num_running_reqs": stats.running_requests,
        "num_waiting_reqs": stats.queued_requests,
        "num_total_reqs": stats.running_requests + stats.queued_requests,
        "num_used_tokens": used,
        "token_usage": round(stats.kv_cache_usage, 4),
        "gen_throughput": round(stats.tokens_per_s, 2),
        "utilization": round(stats.running_requests / seats, 4) if seats else 0.0,
        "max_running_requests": seats,
    }
    return {
        "timestamp": now_iso,
        "version": version,
        "dp_rank_count": 1,
        "loads": [row],
        "aggregate": {
            "total_running_reqs": row["num_running_reqs"],
            "total_waiting_reqs": row["num_waiting_reqs"],
            "total_reqs": row["num_total_reqs"],
            "avg_token_usage": row["token_usage"],
            "avg_throughput": row["gen_throughput"],
            "avg_utilization": row["utilization"],
        },
    }


LOADS_SECTIONS = frozenset({"core", "memory", "spec", "lora", "disagg", "queues", "all"})


def parse_loads_query(query: Mapping[str, str]) -> None:
    """``/v1/loads`` query: ``include`` (sections; the gateway has the core ones),
    ``dp_rank`` (0), ``format`` (json)."""
    unknown = sorted(set(query) - {"include", "dp_rank", "format"})
    if unknown:
        allowed = "not a parameter; allowed: dp_rank, format, include"
        raise bad(unknown[0], query[unknown[0]], allowed)
    sections = [s.strip() for s in query.get("include", "all").split(",")]
    wrong = [s for s in sections if s not in LOADS_SECTIONS]
    if wrong:
        raise bad("include", wrong[0], f"sections among {', '.join(sorted(LOADS_SECTIONS))}")
    if query.get("dp_rank", "0") != "0":
        raise bad("dp_rank", query["dp_rank"], "0 (the gateway is one data-parallel rank)")
    if query.get("format", "json") != "json":
        raise bad("format", query["format"], "json")


@dataclass(frozen=True)
class Abort:
    rids: tuple[str, ...]
    abort_all: bool
    message: str


def parse_abort(body: object) -> Abort:
    """``AbortReq``: ``rid`` (one id or a list) or ``abort_all``, ``abort_message``."""
    if not isinstance(body, dict):
        raise HttpError(400, "invalid_request_error", "the body must be a JSON object")
    allowed = {"rid", "abort_all", "abort_message", "finished_reason", "http_worker_ipc"}
    unknown = sorted(set(body) - allowed)
    if unknown:
        listed = ", ".join(sorted(allowed))
        raise bad(unknown[0], body[unknown[0]], f"not a field; allowed: {listed}")
    for name in ("finished_reason", "http_worker_ipc"):
        if body.get(name) is not None:
            raise bad(name, body[name], "null (set by SGLang internally)")
    abort_all = body.get("abort_all", False)
    if not isinstance(abort_all, bool):
        raise bad("abort_all", abort_all, "true or false")
    rid = body.get("rid")
    rids: list[str]
    if rid is None or rid == "":
        rids = []
    elif isinstance(rid, str):
        rids = [rid]
    elif (
        isinstance(rid, list)
        and len(rid) <= MAX_ABORT_IDS
        and all(isinstance(r, str) and r for r in rid)
    ):
        rids = list(rid)
    else:
        raise bad("rid", rid, f"a request id, or a list of at most {MAX_ABORT_IDS}")
    if not rids and not abort_all:
        raise bad("rid", rid, 'a request id (or "abort_all": true)')
    message = body.get("abort_message")
    if message is not None and (not isinstance(message, str) or len(message) > 500):
        raise bad("abort_message", message, "a string of at most 500 characters")
    return Abort(tuple(rids), abort_all, message or "")


def matching(ids: Sequence[str], rids: Sequence[str]) -> list[str]:
    """The ids a ``/abort_request`` of ``rids`` names: each rid and the batch items or
    samples made from it (``<rid>_<k>``, ``<rid>_<b>_<j>``)."""
    wanted = set(rids)
    prefixes = tuple(f"{r}_" for r in rids)
    return [i for i in ids if i in wanted or i.startswith(prefixes)]


@dataclass(frozen=True)
class DiskUpdate:
    path: str
    version: str
    in_flight: str
    abort_all: bool
    drain_timeout_s: float | None


def parse_update_from_disk(body: object) -> DiskUpdate:
    """``UpdateWeightFromDiskReqInput``: ``model_path``, ``weight_version`` (absent: the
    path names the new version), ``abort_all_requests``, ``load_format`` (null or
    "auto": the engines load their own format); GPU-only switches accepted as they have
    no effect here. OrchestrRL's ``in_flight`` ("finish", as SGLang drains, or "resume")
    and ``drain_timeout_s`` choose what running requests do."""
    if not isinstance(body, dict):
        raise HttpError(400, "invalid_request_error", "the body must be a JSON object")
    ignored_bools = ("torch_empty_cache", "recapture_cuda_graph", "flush_cache")
    allowed = {
        "model_path",
        "load_format",
        "abort_all_requests",
        "weight_version",
        "is_async",
        "keep_pause",
        "token_step",
        "in_flight",
        "drain_timeout_s",
        *ignored_bools,
    }
    unknown = sorted(set(body) - allowed)
    if unknown:
        listed = ", ".join(sorted(allowed))
        raise bad(unknown[0], body[unknown[0]], f"not a field; allowed: {listed}")
    path = body.get("model_path")
    if not isinstance(path, str) or not 1 <= len(path) <= 4096:
        raise bad("model_path", path, "the new weights' path on this node (1-4096 characters)")
    version = body.get("weight_version")
    if version is None:
        version = path
    if not isinstance(version, str) or not 1 <= len(version) <= 128:
        raise bad("weight_version", version, "a label of 1-128 characters (or null: model_path)")
    fmt = body.get("load_format")
    if fmt not in (None, "auto"):
        raise bad("load_format", fmt, 'null or "auto": each engine loads its own format')
    for name in ("is_async", "keep_pause"):
        if body.get(name, False) is not False:
            raise bad(name, body[name], "false: the update ends when every instance serves it")
    for name in ("abort_all_requests", *ignored_bools):
        if not isinstance(body.get(name, False), bool):
            raise bad(name, body[name], "true or false")
    step = body.get("token_step", 0)
    if isinstance(step, bool) or not isinstance(step, int):
        raise bad("token_step", step, "an integer")
    in_flight = body.get("in_flight", "finish")
    if in_flight not in UPDATE_POLICIES:
        raise bad(
            "in_flight",
            in_flight,
            '"finish" (running requests end on the old weights) or "resume" (they stop and '
            "go on with the new ones)",
        )
    timeout = body.get("drain_timeout_s")
    if timeout is not None:
        timeout = _float(body, "drain_timeout_s", 1e-3, 86400.0, 0.0)
    return DiskUpdate(path, version, in_flight, bool(body.get("abort_all_requests")), timeout)


def update_result(done: WeightUpdate, aborted: int) -> dict[str, Any]:
    """SGLang's answer to a weight update that worked (and ``orl``: what it did)."""
    return {
        "success": True,
        "message": f"Succeeded to update model weights. Weight version updated to {done.version}.",
        "num_paused_requests": done.resumed,
        "orl": {**update_answer(done), "aborted_requests": aborted},
    }
