"""SGLang's native protocol as pure functions: what /generate, /abort_request and
/update_weights_from_disk accept (and refuse, naming the field), and the shapes of the
answers (SGLang 0.5.8's ``meta_info``, ``finish_reason``, loads)."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from node_agent.engine import EngineProgress, EngineStats, RequestProgress
from node_agent.engines.base import Sampling
from node_agent.gateway.http import MAX_N, GatewaySettings, HttpError
from node_agent.gateway.requests import Request, Where
from node_agent.gateway.sglang_api import (
    MAX_NEW_TOKENS_DEFAULT,
    finish_reason,
    get_load,
    loads,
    matching,
    meta_info,
    model_info,
    output,
    parse_abort,
    parse_generate,
    parse_loads_query,
    parse_update_from_disk,
    server_info,
)

pytestmark = pytest.mark.unit

SETTINGS = GatewaySettings("tiny", max_context=512)
P = [5, 17, 3, 99, 42]
Q = [8, 8, 1, 2]

# What sglang-router 0.3.2 forwards for {"input_ids": P, "sampling_params": {...}}: its
# GenerateRequest re-serialized (protocols/generate.rs), defaults included.
ROUTER_BODY: dict[str, Any] = {
    "model": None,
    "input_ids": P,
    "sampling_params": {"temperature": 0.0, "max_new_tokens": 8},
    "return_logprob": True,
    "return_text_in_logprobs": False,
    "stream": False,
    "log_metrics": True,
    "return_hidden_states": False,
    "background": False,
    "no_logs": False,
    "return_bytes": False,
    "return_entropy": False,
    "rid": "r1",
}


def test_what_the_router_forwards_is_one_request() -> None:
    g = parse_generate(ROUTER_BODY, SETTINGS)
    assert not g.batch and not g.stream and g.on_weight_update == ""
    (s,) = g.samples
    assert (s.request_id, s.prompt, s.max_tokens, s.logprobs, s.group) == (
        "r1",
        tuple(P),
        8,
        True,
        "",
    )
    assert s.sampling == Sampling(temperature=0.0)


def test_sglang_defaults() -> None:
    (s,) = parse_generate({"input_ids": P}, SETTINGS, "fresh").samples
    assert s.request_id == "fresh" and s.max_tokens == MAX_NEW_TOKENS_DEFAULT
    assert s.sampling == Sampling() and not s.logprobs
    (s,) = parse_generate(
        {"input_ids": P, "sampling_params": {"max_new_tokens": None}}, SETTINGS
    ).samples
    assert s.max_tokens == 512 - len(P)  # null: up to the context length, as SGLang


def test_slimes_sampling_params_are_accepted() -> None:
    # slime's GenerateState.sampling_params (rollout/sglang_rollout.py), top_p = 1
    params = {
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": -1,
        "max_new_tokens": 16,
        "stop": None,
        "stop_token_ids": [2, 7],
        "skip_special_tokens": False,
        "no_stop_trim": True,
        "spaces_between_special_tokens": False,
        "sampling_seed": 1234,
    }
    (s,) = parse_generate({"input_ids": P, "sampling_params": params}, SETTINGS).samples
    assert s.sampling == Sampling(1.0, 1.0, 0, 1234, False, (2, 7))


def test_ids_seeds_and_groups_of_n_samples_and_batches() -> None:
    g = parse_generate(
        {"input_ids": P, "sampling_params": {"n": 3, "sampling_seed": 10}, "rid": "g"}, SETTINGS
    )
    assert g.batch
    assert [s.request_id for s in g.samples] == ["g_0", "g_1", "g_2"]
    assert [s.sampling.seed for s in g.samples] == [10, 11, 12]
    assert {s.group for s in g.samples} == {"g"}  # one prompt's samples: one group
    g = parse_generate({"input_ids": [P, Q], "rid": "b"}, SETTINGS)
    assert [(s.request_id, s.prompt, s.group) for s in g.samples] == [
        ("b_0", tuple(P), ""),
        ("b_1", tuple(Q), ""),
    ]
    g = parse_generate(
        {"input_ids": [P, Q], "rid": ["x", "y"], "sampling_params": {"n": 2}}, SETTINGS
    )
    assert [(s.request_id, s.prompt, s.group) for s in g.samples] == [  # prompt-major
        ("x_0", tuple(P), "x"),
        ("x_1", tuple(P), "x"),
        ("y_0", tuple(Q), "y"),
        ("y_1", tuple(Q), "y"),
    ]
    g = parse_generate(
        {
            "input_ids": [P, Q],
            "sampling_params": [{"max_new_tokens": 3}, {"max_new_tokens": 4}],
            "return_logprob": [True, False],
        },
        SETTINGS,
        "u",
    )
    assert [(s.request_id, s.max_tokens, s.logprobs) for s in g.samples] == [
        ("u_0", 3, True),
        ("u_1", 4, False),
    ]
    (s,) = parse_generate({"input_ids": P, "group": "prompt-7"}, SETTINGS).samples
    assert s.group == "prompt-7"


@given(
    prompts=st.lists(
        st.lists(st.integers(0, 1000), min_size=1, max_size=6), min_size=1, max_size=5
    ),
    n=st.integers(1, 4),
    single=st.booleans(),
)
@settings(max_examples=60)
def test_every_prompt_gets_n_distinct_requests_in_prompt_major_order(
    prompts: list[list[int]], n: int, single: bool
) -> None:
    body = {"input_ids": prompts[0] if single else prompts, "sampling_params": {"n": n}}
    g = parse_generate(body, SETTINGS, "base")
    used = prompts[:1] if single else prompts
    assert [s.prompt for s in g.samples] == [tuple(p) for p in used for _ in range(n)]
    assert len({s.request_id for s in g.samples}) == len(g.samples)
    assert g.batch == (not single or n > 1)


@pytest.mark.parametrize(
    ("body", "status", "param", "says"),
    [
        ([1], 400, None, "JSON object"),
        ({"text": "hello"}, 400, "text", "does not tokenize"),
        ({"input_ids": P, "text": "hi"}, 400, "text", "send input_ids"),
        ({}, 400, "input_ids", "token ids"),
        ({"input_ids": []}, 400, "input_ids", "at least one"),
        ({"input_ids": [[]]}, 400, "input_ids", "at least one"),
        ({"input_ids": [1, -2]}, 400, "input_ids", "token ids"),
        ({"input_ids": [1, True]}, 400, "input_ids", "token ids"),
        ({"input_ids": P, "image_data": "x.png"}, 400, "image_data", "not supported"),
        ({"input_ids": P, "inputs_ids": P}, 400, "inputs_ids", "not a field"),
        ({"input_ids": P, "model": "other"}, 404, "model", "not served"),
        ({"input_ids": P, "stream": "yes"}, 400, "stream", "true or false"),
        ({"input_ids": P, "return_logprob": 1}, 400, "return_logprob", "true or false"),
        ({"input_ids": P, "top_logprobs_num": 5}, 400, "top_logprobs_num", "top logprobs"),
        ({"input_ids": P, "logprob_start_len": 0}, 400, "logprob_start_len", "sampled"),
        ({"input_ids": P, "return_text_in_logprobs": True}, 400, "return_text_in_logprobs", ""),
        ({"input_ids": P, "log_metrics": "no"}, 400, "log_metrics", "true or false"),
        ({"input_ids": P, "lora_path": "/l"}, 400, "lora_path", "not supported"),
        ({"input_ids": P, "sampling_params": 3}, 400, "sampling_params", "an object"),
        (
            {"input_ids": P, "sampling_params": {"stop": ["\n"]}},
            400,
            "sampling_params.stop",
            "stop_token_ids",
        ),
        (
            {"input_ids": P, "sampling_params": {"stop_regex": "a+"}},
            400,
            "sampling_params.stop_regex",
            "",
        ),
        (
            {"input_ids": P, "sampling_params": {"max_new_token": 3}},
            400,
            "sampling_params.max_new_token",
            "not a field",
        ),
        (
            {"input_ids": P, "sampling_params": {"max_new_tokens": 0}},
            400,
            "sampling_params.max_new_tokens",
            "1..",
        ),
        (
            {"input_ids": P, "sampling_params": {"max_new_tokens": 508}},
            400,
            "sampling_params.max_new_tokens",
            "context of 512",
        ),
        (
            {"input_ids": P, "sampling_params": {"temperature": -1}},
            400,
            "sampling_params.temperature",
            "a number",
        ),
        (
            {"input_ids": P, "sampling_params": {"top_p": 0}},
            400,
            "sampling_params.top_p",
            "a number",
        ),
        ({"input_ids": P, "sampling_params": {"top_k": 0}}, 400, "sampling_params.top_k", "-1"),
        (
            {"input_ids": P, "sampling_params": {"n": MAX_N + 1}},
            400,
            "sampling_params.n",
            f"1..{MAX_N}",
        ),
        (
            {"input_ids": P, "sampling_params": {"sampling_seed": 1.5}},
            400,
            "sampling_params.sampling_seed",
            "integer",
        ),
        (
            {"input_ids": P, "sampling_params": {"frequency_penalty": 0.5}},
            400,
            "sampling_params.frequency_penalty",
            "not supported",
        ),
        (
            {"input_ids": P, "sampling_params": {"repetition_penalty": 1.1}},
            400,
            "sampling_params.repetition_penalty",
            "",
        ),
        ({"input_ids": P, "sampling_params": {"regex": "a"}}, 400, "sampling_params.regex", ""),
        (
            {"input_ids": P, "sampling_params": {"custom_params": {"x": 1}}},
            400,
            "sampling_params.custom_params",
            "custom",
        ),
        (
            {"input_ids": P, "sampling_params": {"stop_token_ids": [-1]}},
            400,
            "sampling_params.stop_token_ids",
            "",
        ),
        (
            {"input_ids": P, "sampling_params": {"ignore_eos": 1}},
            400,
            "sampling_params.ignore_eos",
            "",
        ),
        ({"input_ids": [P, Q], "sampling_params": [{}]}, 400, "sampling_params", "one per prompt"),
        (
            {"input_ids": [P, Q], "sampling_params": [{}, {"top_k": 0}]},
            400,
            "sampling_params[1].top_k",
            "-1",
        ),
        (
            {"input_ids": [P, Q], "sampling_params": [{"n": 2}, {}]},
            400,
            "sampling_params",
            "same n",
        ),
        ({"input_ids": [P, Q], "return_logprob": [True]}, 400, "return_logprob", "one per prompt"),
        ({"input_ids": P, "rid": ["a"]}, 400, "rid", "a request id"),
        ({"input_ids": [P, Q], "rid": ["a"]}, 400, "rid", "list of 2"),
        ({"input_ids": [P, Q], "rid": ["a", "a"]}, 400, "rid", "distinct"),
        ({"input_ids": P, "rid": "a b"}, 400, "rid", "1-128 characters"),
        ({"input_ids": P, "rid": "r" * 128, "sampling_params": {"n": 2}}, 400, "rid", "suffix"),
        ({"input_ids": [P, Q], "group": "g"}, 400, "group", "null"),
        ({"input_ids": P, "group": 7}, 400, "group", "at most 128"),
        ({"input_ids": P, "on_weight_update": "now"}, 400, "on_weight_update", "resume"),
        ({"input_ids": [512 * [1]]}, 400, "input_ids", "shorter than the engine's context"),
    ],
)
def test_bad_generate_bodies_are_refused_naming_the_field(
    body: Any, status: int, param: str | None, says: str
) -> None:
    with pytest.raises(HttpError) as caught:
        parse_generate(body, SETTINGS)
    assert caught.value.status == status
    assert caught.value.param == param, caught.value.message
    assert says in caught.value.message
    if param:
        assert caught.value.message.startswith(f"{param}=")


def request(**kw: Any) -> Request:
    req = Request("r1", 0, tuple(P), 10, kw.pop("sampling", Sampling()), 0.0, **kw)
    req.created_wall = 100.0
    return req


def test_finish_reasons_in_sglangs_shape() -> None:
    req = request()
    assert finish_reason(req) is None  # running
    req.append([4, 5], "0")
    req.end(Where.FINISHED, "length")
    assert finish_reason(req) == {"type": "length", "length": 2}
    req = request(sampling=Sampling(stop_token_ids=(7,)))
    req.append([4, 7], "0")
    req.end(Where.FINISHED, "stop")
    assert finish_reason(req) == {"type": "stop", "matched": 7}
    req = request()
    req.append([4], "0")
    req.end(Where.FINISHED, "stop")  # the engine's own EOS, not in the output
    assert finish_reason(req) == {"type": "stop", "matched": None}
    req = request()
    req.end(Where.ABORTED, error="request 'r1' aborted by /abort_request")
    assert finish_reason(req) == {
        "type": "abort",
        "message": "request 'r1' aborted by /abort_request",
        "status_code": None,
        "err_type": None,
    }


def test_an_output_across_a_weight_update() -> None:
    req = request(want_logprobs=True, hops=["n0"])
    req.append([4, 5], "v1", [-0.5, -1.5])
    req.append([6], "v2", [-0.25])
    running = output(req, "v2", 101.0)
    assert running["text"] == "" and running["output_ids"] == [4, 5, 6]
    meta = running["meta_info"]
    assert meta == {
        "id": "r1",
        "finish_reason": None,
        "prompt_tokens": 5,
        "completion_tokens": 3,
        "weight_version": "v2",  # the last token's
        "output_token_logprobs": [[-0.5, 4, None], [-1.5, 5, None], [-0.25, 6, None]],
        "orl": {
            "request_id": "r1",
            "weight_versions": [[0, "v1"], [2, "v2"]],
            "nodes": ["n0"],
            "node_starts": [0],
        },
    }
    req.end(Where.FINISHED, "length")
    meta = meta_info(req, "v3", 102.5)
    assert meta["finish_reason"] == {"type": "length", "length": 3}
    assert meta["e2e_latency"] == 2.5 and meta["weight_version"] == "v2"
    fresh = meta_info(request(), "v3", 100.0)  # no token yet: the weights served now
    assert fresh["weight_version"] == "v3" and "output_token_logprobs" not in fresh


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ({"rid": "a"}, (("a",), False, "")),
        ({"rid": ["a", "b"], "abort_message": "step over"}, (("a", "b"), False, "step over")),
        ({"abort_all": True}, ((), True, "")),
        ({"rid": "", "abort_all": True}, ((), True, "")),
    ],
)
def test_abort_bodies(body: dict[str, Any], expected: tuple[Any, ...]) -> None:
    a = parse_abort(body)
    assert (a.rids, a.abort_all, a.message) == expected


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({}, "rid"),
        ({"rid": 3}, "rid"),
        ({"rid": ["a", ""]}, "rid"),
        ({"abort_all": "yes"}, "abort_all"),
        ({"rid": "a", "finished_reason": {"type": "abort"}}, "finished_reason"),
        ({"rid": "a", "everything": True}, "everything"),
        ({"rid": "a", "abort_message": 5}, "abort_message"),
    ],
)
def test_bad_abort_bodies(body: dict[str, Any], param: str) -> None:
    with pytest.raises(HttpError) as caught:
        parse_abort(body)
    assert caught.value.param == param


def test_an_abort_names_a_rid_and_what_was_made_from_it() -> None:
    ids = ["g", "g_0", "g_1", "g_0_1", "gg_0", "h", "g-0"]
    assert matching(ids, ["g"]) == ["g", "g_0", "g_1", "g_0_1"]
    assert matching(ids, ["g_0", "h"]) == ["g_0", "g_0_1", "h"]
    assert matching(ids, ["nope"]) == []


def test_weight_update_bodies() -> None:
    u = parse_update_from_disk({"model_path": "/ckpt/7"})
    assert (u.path, u.version, u.in_flight, u.abort_all, u.drain_timeout_s) == (
        "/ckpt/7",
        "/ckpt/7",  # no weight_version: the path names it
        "finish",  # SGLang lets running requests end first
        False,
        None,
    )
    u = parse_update_from_disk(
        {
            "model_path": "/ckpt/8",
            "weight_version": "step-8",
            "abort_all_requests": True,
            "load_format": "auto",
            "flush_cache": True,
            "torch_empty_cache": False,
            "token_step": 8,
            "in_flight": "resume",
            "drain_timeout_s": 30,
        }
    )
    assert (u.version, u.abort_all, u.in_flight, u.drain_timeout_s) == (
        "step-8",
        True,
        "resume",
        30.0,
    )


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({}, "model_path"),
        ({"model_path": ""}, "model_path"),
        ({"model_path": "/c", "weight_version": ""}, "weight_version"),
        ({"model_path": "/c", "load_format": "gguf"}, "load_format"),
        ({"model_path": "/c", "is_async": True}, "is_async"),
        ({"model_path": "/c", "keep_pause": True}, "keep_pause"),
        ({"model_path": "/c", "abort_all_requests": "yes"}, "abort_all_requests"),
        ({"model_path": "/c", "in_flight": "later"}, "in_flight"),
        ({"model_path": "/c", "drain_timeout_s": 0}, "drain_timeout_s"),
        ({"model_path": "/c", "token_step": "7"}, "token_step"),
        ({"model_path": "/c", "names": ["w"]}, "names"),
    ],
)
def test_bad_weight_update_bodies(body: dict[str, Any], param: str) -> None:
    with pytest.raises(HttpError) as caught:
        parse_update_from_disk(body)
    assert caught.value.param == param


def test_loads_count_running_and_queued_requests() -> None:
    stats = EngineStats(
        queued_requests=1, running_requests=2, tokens_per_s=40.0, kv_cache_usage=0.25
    )
    progress = EngineProgress(
        3,
        (
            RequestProgress("a", 0, 5, 10, 64),
            RequestProgress("b", 1, 4, 1, 64),
            RequestProgress("c", -1, 7, 0, 64),
        ),
    )
    assert get_load(stats, progress, 9.5) == [
        {"dp_rank": 0, "num_reqs": 3, "num_waiting_reqs": 1, "num_tokens": 27, "ts_tic": 9.5}
    ]
    body = loads(stats, progress, 8, "v", "2026-01-01T00:00:00Z")
    (row,) = body["loads"]
    assert row["num_running_reqs"] == 2 and row["num_total_reqs"] == 3
    assert row["num_used_tokens"] == 20 and row["utilization"] == 0.25
    assert body["aggregate"]["total_reqs"] == 3 and body["dp_rank_count"] == 1
    parse_loads_query({"include": "core,disagg,queues"})  # what slime asks for
    for query, param in [
        ({"format": "prometheus"}, "format"),
        ({"dp_rank": "1"}, "dp_rank"),
        ({"include": "everything"}, "include"),
        ({"x": "1"}, "x"),
    ]:
        with pytest.raises(HttpError) as caught:
            parse_loads_query(query)
        assert caught.value.param == param


def test_server_and_model_info_name_no_path_a_router_would_load_a_tokenizer_from() -> None:
    info = server_info(SETTINGS, "vllm", (2, 1, 1), 12, "v3", "x")
    assert info["model_path"] is None and info["tokenizer_path"] is None
    assert info["served_model_name"] == "tiny" and info["skip_tokenizer_init"] is True
    assert (info["tp_size"], info["dp_size"], info["max_running_requests"]) == (2, 1, 12)
    assert "model" not in info  # the router reads "model" as model_id too: one of them only
    model = model_info(SETTINGS, "v3")
    assert model["model_path"] is None and model["weight_version"] == "v3"
