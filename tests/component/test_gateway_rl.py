"""What an RL framework needs from the gateway, over scripted instances on 127.0.0.1:0:
``n`` samples per prompt, the sampled tokens' logprobs, and new weights loaded into the
running engines with every token tagged by the weights that made it.

The scripted engine continues a sequence by a fixed rule of the sequence *and its
weights* (``weights_of(path)``), and reports a fixed "logprob" per step, so each test
knows exactly what an uninterrupted run on each sequence of weights gives.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from sim_backends.token_engine import greedy, greedy_logprobs
from tests.component.test_gateway_http import PROMPT, Gateway, open_gateway
from tests.helpers import eventually

pytestmark = pytest.mark.component

OTHER = [8, 8, 1, 2]


@pytest.fixture
async def gw() -> AsyncIterator[Gateway]:
    async for g in open_gateway():
        yield g


@pytest.fixture
async def gw_in_place() -> AsyncIterator[Gateway]:
    async for g in open_gateway(in_place=True, delay=0.002):
        yield g


def choices(events: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """Per choice index: its tokens, logprobs, finish events and orl block."""
    out: dict[int, dict[str, Any]] = {}
    for e in events:
        for c in e.get("choices") or []:
            got = out.setdefault(c["index"], {"tokens": [], "logprobs": [], "finals": []})
            got["tokens"] += c["token_ids"]
            if c["logprobs"] is not None:
                got["logprobs"] += c["logprobs"]["token_logprobs"]
            if c["finish_reason"] is not None:
                got["finals"].append(c["finish_reason"])
                got["orl"] = c["orl"]
    return out


async def test_n_samples_with_their_logprobs_in_one_answer(gw: Gateway) -> None:
    body = {"prompt": PROMPT, "max_tokens": 20, "n": 4, "logprobs": 0, "request_id": "g1"}
    status, answer = await gw.post("/v1/completions", {**body, "temperature": 0})
    assert status == 200, answer
    assert answer["id"] == "g1" and len(answer["choices"]) == 4
    expected = greedy(PROMPT, 20)
    for i, c in enumerate(answer["choices"]):
        assert c["index"] == i and c["token_ids"] == expected
        assert c["logprobs"]["tokens"] == [f"token_id:{t}" for t in expected]
        assert c["logprobs"]["token_logprobs"] == greedy_logprobs(PROMPT, expected)
        assert c["orl"] == {
            "request_id": f"g1-{i}",
            "weight_versions": [[0, "0"]],
            "nodes": ["n0"],
            "node_starts": [0],
        }
    assert answer["usage"] == {"prompt_tokens": 5, "completion_tokens": 80, "total_tokens": 85}
    # the samples are one group (the completion's id), as the compute planner sees them
    assert gw.engine.progress().completed_groups == ("g1",) * 4


async def test_n_samples_streamed_each_with_one_final_event(gw: Gateway) -> None:
    body = {"prompt": PROMPT, "max_tokens": 30, "n": 3, "logprobs": 0, "stream": True}
    events = await gw.stream({**body, "stream_options": {"include_usage": True}})
    got = choices(events)
    assert sorted(got) == [0, 1, 2]
    for c in got.values():
        assert c["tokens"] == greedy(PROMPT, 30) and c["finals"] == ["length"]
        assert c["logprobs"] == greedy_logprobs(PROMPT, c["tokens"])
        assert c["orl"]["weight_versions"] == [[0, "0"]]
    assert events[-2]["usage"]["completion_tokens"] == 90 and events[-1] == {"done": True}


async def test_a_seed_gives_each_sample_its_own(gw: Gateway) -> None:
    status, _ = await gw.post(
        "/v1/completions", {"prompt": PROMPT, "max_tokens": 3, "n": 3, "seed": 41}
    )
    assert status == 200
    seeds = {sub.sampling.seed for s in gw.servers for _, sub in s.record.submissions}
    assert seeds == {41, 42, 43}


async def update(gw: Gateway, **body: Any) -> tuple[int, Any]:
    return await gw.post("/orl/v1/update_weights", body)


async def test_an_update_lets_running_requests_finish_on_the_old_weights(
    gw_in_place: Gateway,
) -> None:
    gw = gw_in_place
    gw.hold.until(len(PROMPT) + 50)  # the old request runs, held, until the update waits
    body = {"prompt": PROMPT, "max_tokens": 300, "temperature": 0, "logprobs": 0}
    old = asyncio.create_task(gw.post("/v1/completions", body))
    await eventually(lambda: len(gw.hold.held) == 1)
    upd = asyncio.create_task(update(gw, path="/ckpt/scripted-1", version="v1"))
    await eventually(lambda: gw.engine.core.updating == "v1")
    gw.hold.release()
    new = asyncio.create_task(
        gw.post("/v1/completions", {**body, "prompt": OTHER, "max_tokens": 10})
    )
    status, answer = await upd
    assert status == 200, answer
    assert answer["finished_on_old_weights"] == 1 and answer["resumed_requests"] == 0
    assert answer["how"] == "in place" and answer["instances"] == 2
    _, first = await old
    (c,) = first["choices"]
    assert c["token_ids"] == greedy(PROMPT, 300) and c["orl"]["weight_versions"] == [[0, "0"]]
    _, second = await new
    (c,) = second["choices"]
    assert c["token_ids"] == greedy(OTHER, 10, weights=1)
    assert c["logprobs"]["token_logprobs"] == greedy_logprobs(OTHER, c["token_ids"], 1)
    assert c["orl"]["weight_versions"] == [[0, "v1"]]
    assert all(s.updates == ["/ckpt/scripted-1"] for s in gw.servers)


@pytest.mark.parametrize("how", ["per call", "per request"])
async def test_an_update_resumes_running_requests_on_the_new_weights(gw: Gateway, how: str) -> None:
    """Restart-based (llama.cpp's way): the instances restart on the new weights and the
    request goes on from its output so far; each token says which weights made it."""
    body: dict[str, Any] = {"prompt": PROMPT, "max_tokens": 400, "temperature": 0, "logprobs": 0}
    if how == "per request":
        body["on_weight_update"] = "resume"
    k = 50  # the request is held at 50 tokens: running when the update comes, and after
    gw.hold.until(len(PROMPT) + k)
    running = asyncio.create_task(gw.stream({**body, "stream": True}))
    await eventually(lambda: len(gw.hold.held) == 1)
    in_flight = "resume" if how == "per call" else "finish"
    status, answer = await update(gw, path="/ckpt/scripted-2", version="v2", in_flight=in_flight)
    assert status == 200, answer
    assert answer["resumed_requests"] == 1 and answer["how"] == "restart"
    gw.hold.release()
    got = choices(await running)[0]
    runs = got["orl"]["weight_versions"]
    assert runs == [[0, "0"], [k, "v2"]]
    out = got["tokens"]
    assert len(out) == 400
    assert out[:k] == greedy(PROMPT, k)
    assert out[k:] == greedy([*PROMPT, *out[:k]], 400 - k, weights=2)
    assert got["logprobs"] == greedy_logprobs(PROMPT, out, [0] * k + [2] * (400 - k))
    assert [s.model for s in gw.servers if s.alive] == ["/ckpt/scripted-2"] * 2


async def test_a_failed_update_keeps_the_old_weights_everywhere(gw_in_place: Gateway) -> None:
    gw = gw_in_place
    gw.servers[1].fail_updates = 1
    status, answer = await update(gw, path="/ckpt/scripted-3", version="v3")
    assert status == 500
    assert "instance 1 (TP1) could not load it" in answer["error"]["message"]
    assert "the node serves '0' again" in answer["error"]["message"]
    assert gw.servers[0].updates == ["/ckpt/scripted-3", "scripted-0"]  # rolled back
    assert gw.engine.weight_version == "0"
    status, answer = await gw.post(
        "/v1/completions", {"prompt": PROMPT, "max_tokens": 8, "temperature": 0}
    )
    assert answer["choices"][0]["token_ids"] == greedy(PROMPT, 8)
    assert answer["orl"]["weight_versions"] == [[0, "0"]]


async def test_weights_that_do_not_start_leave_the_old_ones_serving(gw: Gateway) -> None:
    status, answer = await update(gw, path="missing-weights", version="v9")
    assert status == 500 and "could not load it" in answer["error"]["message"]
    assert gw.engine.weight_version == "0" and gw.engine.instance_health() == ("up", "up")
    _, answer = await gw.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 5})
    assert answer["choices"][0]["token_ids"] == greedy(PROMPT, 5)


async def test_one_update_at_a_time_and_a_bounded_wait(gw: Gateway) -> None:
    gw.hold.until(len(PROMPT) + 20)  # the long request runs, held, until the test is done
    long = asyncio.create_task(
        gw.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 500, "temperature": 0})
    )
    await eventually(lambda: len(gw.hold.held) == 1)
    status, answer = await update(gw, path="scripted-4", version="v4", drain_timeout_s=0.05)
    assert status == 504 and "still running on the old weights" in answer["error"]["message"]
    assert "on instance " in answer["error"]["message"]  # which request holds the seat
    assert gw.engine.weight_version == "0" and not gw.engine.core.updating
    first = asyncio.create_task(update(gw, path="scripted-4", version="v4"))
    await eventually(lambda: gw.engine.core.updating == "v4")
    status, answer = await update(gw, path="scripted-5", version="v5")
    assert status == 409 and "'v4' are being loaded" in answer["error"]["message"]
    gw.hold.release()
    assert (await first)[0] == 200
    _, done = await long
    assert done["choices"][0]["token_ids"] == greedy(PROMPT, 500)  # untouched by the wait


@pytest.mark.parametrize(
    ("body", "param", "says"),
    [
        ({"version": "v"}, "path", "path of the new weights"),
        ({"path": "x"}, "version", "1-128 characters"),
        ({"path": "x", "version": "v", "in_flight": "now"}, "in_flight", "resume"),
        ({"path": "x", "version": "v", "drain_timeout_s": -1}, "drain_timeout_s", "(0, 86400]"),
        ({"path": "x", "version": "v", "force": True}, "force", "not a field"),
    ],
)
async def test_bad_updates_are_refused_naming_the_field(
    gw: Gateway, body: dict[str, Any], param: str, says: str
) -> None:
    status, answer = await update(gw, **body)
    assert status == 400
    assert answer["error"]["param"] == param and says in answer["error"]["message"]
    assert gw.engine.weight_version == "0"


async def test_instances_started_after_an_update_serve_the_new_weights(gw: Gateway) -> None:
    status, _ = await update(gw, path="/ckpt/scripted-6", version="v6")
    assert status == 200
    await gw.engine.reshard((2,))  # a new TP2 instance, started from the factory's model
    assert [s.model for s in gw.servers if s.alive] == ["/ckpt/scripted-6"]
    _, answer = await gw.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 7})
    assert answer["choices"][0]["token_ids"] == greedy(PROMPT, 7, weights=6)
    assert answer["orl"]["weight_versions"] == [[0, "v6"]]


async def test_an_update_stops_the_requests_beyond_their_staleness_bound(gw: Gateway) -> None:
    """Three requests held at token k while new weights land: the two whose bound the new
    version exceeds (OpenAI and SGLang endpoints) stop there, finish reason "stale", with
    their k tokens; the one within its bound goes on; the gateway counts them."""
    k = 40
    gw.hold.until(len(PROMPT) + k)
    body: dict[str, Any] = {
        "prompt": PROMPT, "max_tokens": 300, "temperature": 0, "logprobs": 0,
        "on_weight_update": "resume", "stream": True,
    }  # fmt: skip
    over = asyncio.create_task(gw.stream({**body, "max_staleness": 0, "request_id": "over"}))
    within = asyncio.create_task(gw.stream({**body, "max_staleness": 1, "request_id": "in"}))
    native = asyncio.create_task(
        gw.post(
            "/generate",
            {
                "input_ids": PROMPT,
                "rid": "native",
                "max_staleness": 0,
                "on_weight_update": "resume",
                "sampling_params": {"max_new_tokens": 300, "temperature": 0},
            },
        )
    )
    await eventually(lambda: len(gw.hold.held) == 3)  # each at exactly k tokens
    status, answer = await update(gw, path="/ckpt/scripted-1", version="1")
    assert status == 200, answer
    assert answer["resumed_requests"] == 3 and answer["stale_stopped_requests"] == 2
    gw.hold.release()
    stopped = choices(await over)[0]
    assert stopped["finals"] == ["stale"] and stopped["tokens"] == greedy(PROMPT, k)
    assert stopped["orl"]["weight_versions"] == [[0, "0"]]
    status, out = await native
    assert status == 200, out
    assert out["output_ids"] == greedy(PROMPT, k)
    assert out["meta_info"]["finish_reason"] == {"type": "stale", "length": k}
    assert out["meta_info"]["orl"]["weight_versions"] == [[0, "0"]]
    went_on = choices(await within)[0]
    assert went_on["finals"] == ["length"] and went_on["orl"]["weight_versions"] == [
        [0, "0"],
        [k, "1"],
    ]
    tokens = went_on["tokens"]  # none lost or repeated at the update
    assert tokens[:k] == greedy(PROMPT, k)
    assert tokens[k:] == greedy([*PROMPT, *tokens[:k]], 300 - k, weights=1)
    assert went_on["logprobs"] == greedy_logprobs(PROMPT, tokens, [0] * k + [1] * (300 - k))
    async with gw.http.get(gw.url + "/health") as r:
        health = await r.json()
    async with gw.http.get(gw.url + "/server_info") as r:
        info = await r.json()
    assert health["stale_stopped"] == 2 and info["orl"]["stale_stopped"] == 2
    assert gw.engine.core.seats_taken() == 0


@pytest.mark.parametrize("value", [-1, 65, 1.5, "1", True])
@pytest.mark.parametrize("path", ["/v1/completions", "/generate"])
async def test_a_bad_max_staleness_is_refused_naming_the_field(
    gw: Gateway, path: str, value: object
) -> None:
    body: dict[str, Any] = (
        {"prompt": PROMPT} if path == "/v1/completions" else {"input_ids": PROMPT}
    )
    status, answer = await gw.post(path, {**body, "max_staleness": value})
    assert status == 400, answer
    assert answer["error"]["param"] == "max_staleness"
    assert "0..64" in answer["error"]["message"] and repr(value) in answer["error"]["message"]
    assert gw.engine.in_flight() == []
