"""The requests real RL frameworks send to an inference server, replayed against the
gateway (scripted instances on 127.0.0.1:0), and the answers read the way each framework
reads them. The bodies are copied from their sources, at these commits:

- slime (github.com/THUDM/slime @ 624b824a898ab0ec1fcb4d373004c7f3852bf515):
  ``slime/rollout/sglang_rollout.py`` (``GenerateState.sampling_params``, ``generate``)
  and ``slime/rollout/sglang_streaming_rollout.py`` (``generate_streaming``) POST
  ``/generate`` to the sglang-router; ``slime/utils/types.py``
  (``Sample.append_response_tokens``) reads ``meta_info``.
- AReaL (github.com/inclusionAI/AReaL @ 4aef98d8d818af55b43621aaadba047ae10f4e77):
  ``areal/engine/vllm_remote.py`` (``VLLMBackend``: ``/v1/completions`` with
  ``return_tokens_as_token_ids``) and ``areal/engine/sglang_remote.py`` (``SGLangBackend``:
  ``/generate``, ``/update_weights_from_disk``), with the defaults of
  ``GenerationHyperparameters`` and ``ModelRequest`` (``areal/api/cli_args.py``,
  ``areal/api/io_struct.py``).
- verl (github.com/volcengine/verl @ b178a3cd56f58b2d502255daba591e92833930a7): its
  ``AsyncLLMServerManager`` (``verl/experimental/agent_loop/agent_loop.py``) calls a Ray
  actor's ``generate(prompt_ids, sampling_params, request_id, ...)`` (no HTTP); the SGLang
  one (``verl/workers/rollout/sglang_rollout/async_sglang_server.py``) turns it into the
  ``GenerateReqInput`` below and reads ``output_token_logprobs`` as triples. A verl
  adapter is such an actor POSTing that body to ``/generate``.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest

from sim_backends.token_engine import greedy, greedy_logprobs
from tests.component.test_gateway_http import PROMPT, Gateway, open_gateway

pytestmark = pytest.mark.component

MAX_NEW = 24


@pytest.fixture
async def gw() -> AsyncIterator[Gateway]:
    async for g in open_gateway():
        yield g


# -- slime ---------------------------------------------------------------------------


def slime_sampling_params() -> dict[str, Any]:
    """``GenerateState.sampling_params`` with slime's argument defaults (``--rollout-top-p``
    1.0, ``--rollout-top-k`` -1, no stop strings or stop ids)."""
    return dict(
        temperature=1.0,
        top_p=1.0,
        top_k=-1,
        max_new_tokens=MAX_NEW,
        stop=None,
        stop_token_ids=None,
        skip_special_tokens=True,
        no_stop_trim=True,
        spaces_between_special_tokens=False,
    )


def slime_payload(prompt_ids: list[int], sampling_params: dict[str, Any]) -> dict[str, Any]:
    payload: dict[str, Any] = {"sampling_params": sampling_params, "return_logprob": True}
    payload["input_ids"] = prompt_ids
    return payload


def slime_reads(output: dict[str, Any]) -> tuple[list[int], list[float], str, list[str]]:
    """What ``generate`` and ``append_response_tokens`` take from an answer: tokens and
    logprobs, the status's finish type, the weight versions; and prefix-cache figures."""
    meta = output["meta_info"]
    tokens = [item[1] for item in meta["output_token_logprobs"]]
    logprobs = [item[0] for item in meta["output_token_logprobs"]]
    assert isinstance(output["text"], str)
    assert isinstance(meta.get("cached_tokens", 0), int)
    assert meta.get("prompt_tokens", 0) == len(PROMPT)
    versions = [meta["weight_version"]] if "weight_version" in meta else []
    return tokens, logprobs, meta["finish_reason"]["type"], versions


async def test_slimes_generate_through_the_router_shape(gw: Gateway) -> None:
    params = slime_sampling_params()
    params["sampling_seed"] = 1234 + 0  # --sglang-enable-deterministic-inference: seed + i
    session = str(uuid.uuid4())
    status, output = await gw.post(
        "/generate",
        slime_payload(list(PROMPT), params.copy()),
        headers={"X-SMG-Routing-Key": session},  # router_policy consistent_hashing
    )
    assert status == 200, output
    tokens, logprobs, finish, versions = slime_reads(output)
    assert tokens == greedy(PROMPT, MAX_NEW)
    assert logprobs == pytest.approx(greedy_logprobs(PROMPT, tokens))
    assert finish == "length" and versions == ["0"]


async def test_slimes_streaming_rollout_shape(gw: Gateway) -> None:
    payload = {**slime_payload(list(PROMPT), slime_sampling_params()), "stream": True}
    call_tokens: list[int] = []
    call_log_probs: list[float] = []
    last_meta: dict[str, Any] = {}
    async with gw.http.post(gw.url + "/generate", json=payload) as r:
        assert r.status == 200, await r.text()
        async for raw in r.content:  # as generate_streaming reads the SSE lines
            line = raw.decode().strip()
            if not line or not line.startswith("data:"):
                continue
            data = line[len("data:") :].strip()
            if not data or data == "[DONE]":
                continue
            chunk = json.loads(data)
            last_meta = chunk.get("meta_info") or {}
            if "output_token_logprobs" in last_meta:  # cumulative within the call
                call_tokens = [item[1] for item in last_meta["output_token_logprobs"]]
                call_log_probs = [item[0] for item in last_meta["output_token_logprobs"]]
    assert call_tokens == greedy(PROMPT, MAX_NEW)
    assert call_log_probs == pytest.approx(greedy_logprobs(PROMPT, call_tokens))
    assert last_meta["finish_reason"]["type"] == "length"


async def test_slimes_top_p_replay_request_is_refused_naming_the_field(gw: Gateway) -> None:
    params = {**slime_sampling_params(), "top_p": 0.9}
    params["custom_params"] = {"return_top_p_token_ids": True}  # slime sets it when top_p != 1
    status, answer = await gw.post("/generate", slime_payload(list(PROMPT), params))
    assert status == 400
    assert answer["error"]["param"] == "sampling_params.custom_params"
    assert "return_top_p_token_ids" in answer["error"]["message"]


# -- AReaL ---------------------------------------------------------------------------

# GenerationHyperparameters' defaults, with stop ids as new_with_stop_and_pad_token_ids adds
AREAL_TOP_K = int(1e8)


def areal_vllm_payload(input_ids: list[int], stop_token_ids: list[int]) -> dict[str, Any]:
    """``VLLMBackend.build_generation_request`` (text only, no LoRA)."""
    payload = {
        "top_p": 1.0,
        "top_k": AREAL_TOP_K,
        "max_tokens": MAX_NEW,
        "temperature": 1.0,
        "stop_token_ids": stop_token_ids,
        "ignore_eos": False,
        "skip_special_tokens": True,
        "return_tokens_as_token_ids": True,
        "logprobs": 0,
        "use_beam_search": False,
        "stream": False,
    }
    payload["prompt"] = input_ids.copy()
    return payload


def areal_vllm_reads(response: dict[str, Any]) -> tuple[list[int], list[float], str]:
    """``VLLMBackend.parse_generation_response``."""
    meta_info = response["choices"][0]
    output_tokens = [int(t.split(":")[1]) for t in meta_info["logprobs"]["tokens"]]
    return output_tokens, meta_info["logprobs"]["token_logprobs"], meta_info["finish_reason"]


def areal_sglang_payload(input_ids: list[int], stop_token_ids: list[int]) -> dict[str, Any]:
    """``SGLangBackend.build_generation_request`` (no stop strings, no LoRA; ``image_data``
    is ``ModelRequest``'s default, an empty list)."""
    sample_params = {
        "top_p": 1.0,
        "top_k": AREAL_TOP_K,
        "max_new_tokens": MAX_NEW,
        "temperature": 1.0,
        "stop_token_ids": stop_token_ids,
        "ignore_eos": False,
        "skip_special_tokens": True,
        "frequency_penalty": 0.0,
    }
    return {
        "input_ids": input_ids.copy(),
        "image_data": [],
        "sampling_params": sample_params,
        "return_logprob": True,
        "stream": False,
    }


def areal_sglang_reads(response: dict[str, Any]) -> tuple[list[int], list[float], str]:
    """``SGLangBackend.parse_generation_response``."""
    meta_info = response["meta_info"]
    finish_reason = meta_info["finish_reason"]
    finish_reason.get("message", "")
    tokens = [x[1] for x in meta_info["output_token_logprobs"]]
    logprobs = [x[0] for x in meta_info["output_token_logprobs"]]
    return tokens, logprobs, finish_reason["type"]


async def test_areals_remote_vllm_engine_shape(gw: Gateway) -> None:
    full = greedy(PROMPT, MAX_NEW)
    status, answer = await gw.post("/v1/completions", areal_vllm_payload(list(PROMPT), []))
    assert status == 200, answer
    tokens, logprobs, finish = areal_vllm_reads(answer)
    assert tokens == full and finish == "length"
    assert logprobs == pytest.approx(greedy_logprobs(PROMPT, tokens))
    # pad and eos in stop_token_ids (new_with_stop_and_pad_token_ids): stops there
    stop = full[7]
    status, answer = await gw.post("/v1/completions", areal_vllm_payload(list(PROMPT), [0, stop]))
    assert status == 200, answer
    tokens, logprobs, finish = areal_vllm_reads(answer)
    assert tokens == full[: full.index(stop) + 1] and finish == "stop"
    assert len(logprobs) == len(tokens)


@pytest.mark.parametrize(
    ("field", "value", "why"),
    [
        ("return_tokens_as_token_ids", False, "does not detokenize"),
        ("use_beam_search", True, "beam search is not supported"),
    ],
)
async def test_vllm_fields_the_gateway_cannot_honour_are_refused(
    gw: Gateway, field: str, value: object, why: str
) -> None:
    status, answer = await gw.post(
        "/v1/completions", {**areal_vllm_payload(list(PROMPT), []), field: value}
    )
    assert status == 400 and answer["error"]["param"] == field
    assert why in answer["error"]["message"]


async def test_areals_remote_sglang_engine_shape_and_its_weight_update(gw: Gateway) -> None:
    full = greedy(PROMPT, MAX_NEW)
    status, answer = await gw.post("/generate", areal_sglang_payload(list(PROMPT), []))
    assert status == 200, answer
    tokens, logprobs, finish = areal_sglang_reads(answer)
    assert tokens == full and finish == "length"
    assert logprobs == pytest.approx(greedy_logprobs(PROMPT, tokens))
    # build_disk_weight_update_requests (full model): the path names the new weights
    status, answer = await gw.post(
        "/update_weights_from_disk",
        {"model_path": "/ckpt/scripted-1", "abort_all_requests": True},
    )
    assert status == 200 and answer["success"], answer
    status, answer = await gw.post("/generate", areal_sglang_payload(list(PROMPT), []))
    assert status == 200, answer
    tokens, logprobs, finish = areal_sglang_reads(answer)
    assert tokens == greedy(PROMPT, MAX_NEW, weights=1)
    assert logprobs == pytest.approx(greedy_logprobs(PROMPT, tokens, 1))
    assert answer["meta_info"]["weight_version"] == "/ckpt/scripted-1"


async def test_areals_stop_strings_are_refused_naming_the_field(gw: Gateway) -> None:
    body = areal_sglang_payload(list(PROMPT), [])
    body["sampling_params"]["stop"] = ["</answer>"]  # if gconfig.stop: ...
    status, answer = await gw.post("/generate", body)
    assert status == 400 and answer["error"]["param"] == "sampling_params.stop"


# -- verl ----------------------------------------------------------------------------


def verl_request(prompt_ids: list[int], logprobs: bool) -> dict[str, Any]:
    """What verl's SGLang server makes of ``AsyncLLMServerManager.generate``: the agent
    loop's ``sampling_params`` (temperature, top_p, top_k, repetition_penalty 1.0,
    logprobs), ``max_new_tokens`` set, ``logprobs`` popped into ``return_logprob``; the
    request id is ``uuid4().hex``."""
    sampling_params: dict[str, Any] = dict(
        temperature=1.0, top_p=1.0, top_k=-1, repetition_penalty=1.0, logprobs=logprobs
    )
    sampling_params["max_new_tokens"] = MAX_NEW
    return_logprob = sampling_params.pop("logprobs", False)
    return {
        "rid": uuid.uuid4().hex,
        "input_ids": prompt_ids,
        "sampling_params": sampling_params,
        "return_logprob": return_logprob,
        "image_data": None,
    }


@pytest.mark.parametrize("logprobs", [True, False])
async def test_verls_sglang_server_request_shape(gw: Gateway, logprobs: bool) -> None:
    status, output = await gw.post("/generate", verl_request(list(PROMPT), logprobs))
    assert status == 200, output
    full = greedy(PROMPT, MAX_NEW)
    if logprobs:  # exactly as verl unpacks them: triples
        output_token_logprobs = output["meta_info"]["output_token_logprobs"]
        log_probs, token_ids = zip(
            *[(log_prob, token_ids) for log_prob, token_ids, _ in output_token_logprobs],
            strict=True,
        )
        assert list(token_ids) == full
        assert list(log_probs) == pytest.approx(greedy_logprobs(PROMPT, full))
    else:
        assert output["output_ids"] == full
