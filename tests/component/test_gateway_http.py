"""The HTTP gateway (/v1/completions and friends) over scripted instances, on 127.0.0.1:0."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest

from node_agent.engines.base import Placement
from node_agent.gateway.engine import GatewayConfig, GatewayEngine
from node_agent.gateway.http import GatewayServer, GatewaySettings
from sim_backends.token_engine import Hold, ScriptedEngine, greedy
from tests.helpers import eventually

pytestmark = pytest.mark.component

PROMPT = [5, 17, 3, 99, 42]


@dataclass
class Gateway:
    url: str
    engine: GatewayEngine
    http: aiohttp.ClientSession
    servers: list[ScriptedEngine]
    hold: Hold  # holds nothing until a test says where

    async def post(self, path: str, body: Any, **kw: Any) -> tuple[int, Any]:
        data = body if isinstance(body, str | bytes) else json.dumps(body)
        async with self.http.post(self.url + path, data=data, **kw) as r:
            return r.status, await r.json()

    async def stream(self, body: dict[str, Any]) -> list[dict[str, Any]]:
        events = []
        async with self.http.post(self.url + "/v1/completions", json=body) as r:
            assert r.status == 200, await r.text()
            assert r.headers["Content-Type"].startswith("text/event-stream")
            async for line in r.content:
                text = line.decode().strip()
                if not text:
                    continue
                assert text.startswith("data: ")
                if text == "data: [DONE]":
                    events.append({"done": True})
                    continue
                events.append(json.loads(text[6:]))
        return events


async def open_gateway(
    *,
    api_key: str | None = None,
    max_queue: int = 1000,
    delay: float = 0.001,
    in_place: bool = False,
    seqs: int = 2,
) -> AsyncIterator[Gateway]:
    servers: list[ScriptedEngine] = []
    hold = Hold()

    def make(p: Placement) -> ScriptedEngine:
        servers.append(
            ScriptedEngine(
                p, max_num_seqs=seqs, token_delay_s=delay, in_place_updates=in_place, hold=hold
            )
        )
        return servers[-1]

    engine = GatewayEngine(
        "scripted",
        2,
        (1, 1),
        make,
        lambda p: 0,
        node="n0",
        config=GatewayConfig(max_queue=max_queue),
    )
    await engine.start()
    server = GatewayServer(engine, GatewaySettings("tiny", max_context=512, api_key=api_key))
    address = await server.start("127.0.0.1:0")
    async with aiohttp.ClientSession() as http:
        yield Gateway(f"http://{address}", engine, http, servers, hold)
    await server.stop()
    await engine.close()


@pytest.fixture
async def gw() -> AsyncIterator[Gateway]:
    async for g in open_gateway():
        yield g


def tokens_of(events: list[dict[str, Any]]) -> list[int]:
    return [t for e in events if e.get("choices") for t in e["choices"][0]["token_ids"]]


async def test_streamed_tokens_are_exactly_what_the_engine_generated(gw: Gateway) -> None:
    events = await gw.stream(
        {
            "model": "tiny",
            "prompt": PROMPT,
            "max_tokens": 40,
            "temperature": 0,
            "stream": True,
            "return_token_ids": True,
            "stream_options": {"include_usage": True},
        }
    )
    assert events[-1] == {"done": True}
    assert tokens_of(events) == greedy(PROMPT, 40)
    finals = [e for e in events if e.get("choices") and e["choices"][0]["finish_reason"]]
    assert len(finals) == 1 and finals[0]["choices"][0]["finish_reason"] == "length"
    assert finals[0]["orl"]["nodes"] == ["n0"] and finals[0]["orl"]["weight_versions"] == [[0, "0"]]
    usage = events[-2]
    assert usage["choices"] == [] and usage["usage"] == {
        "prompt_tokens": 5,
        "completion_tokens": 40,
        "total_tokens": 45,
    }
    assert all(e["choices"][0]["text"] == "" for e in events[:-2])


async def test_a_whole_answer(gw: Gateway) -> None:
    status, body = await gw.post(
        "/v1/completions",
        {"prompt": [PROMPT], "max_tokens": 12, "temperature": 0},
        headers={"X-Request-Id": "mine-1"},
    )
    assert status == 200
    assert body["id"] == "mine-1" and body["object"] == "text_completion"
    assert body["choices"][0]["token_ids"] == greedy(PROMPT, 12)
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 12
    assert gw.engine.request("mine-1") is None  # answered: forgotten


@pytest.mark.parametrize("group", ["prompt-17", None])
async def test_a_request_names_its_sample_group(gw: Gateway, group: str | None) -> None:
    body = {"prompt": PROMPT, "max_tokens": 400, "temperature": 0, "stream": True}
    task = asyncio.create_task(gw.stream({**body, "request_id": "grouped", "group": group}))
    await eventually(lambda: gw.engine.request("grouped") is not None)
    progress = {p.request_id: p.group for p in gw.engine.progress().requests}
    assert progress["grouped"] == (group or "")  # null: no group
    assert tokens_of(await task) == greedy(PROMPT, 400)


@pytest.mark.parametrize(
    ("body", "status", "param", "says"),
    [
        ("{not json", 400, None, "not JSON"),
        ([1, 2], 400, None, "JSON object"),
        ({"prompt": PROMPT, "max_tokenz": 3}, 400, "max_tokenz", "not a field"),
        ({"prompt": "hello"}, 400, "prompt", "does not tokenize"),
        ({"prompt": []}, 400, "prompt", "at least one"),
        ({"prompt": [1, -2]}, 400, "prompt", "token ids"),
        ({"prompt": [1, True]}, 400, "prompt", "token ids"),
        ({"prompt": [[1], [2]]}, 400, "prompt", "one prompt"),
        ({"prompt": PROMPT, "max_tokens": 0}, 400, "max_tokens", "1.."),
        ({"prompt": PROMPT, "max_tokens": -5}, 400, "max_tokens", "1.."),
        ({"prompt": PROMPT, "max_tokens": 508}, 400, "max_tokens", "context of 512"),
        ({"prompt": PROMPT, "temperature": "hot"}, 400, "temperature", "a number"),
        ({"prompt": PROMPT, "top_p": 0}, 400, "top_p", "a number"),
        ({"prompt": PROMPT, "n": 0}, 400, "n", "1..64"),
        ({"prompt": PROMPT, "n": 65}, 400, "n", "1..64"),
        ({"prompt": PROMPT, "n": 2.5}, 400, "n", "1..64"),
        ({"prompt": PROMPT, "logprobs": 3}, 400, "logprobs", "null or 0"),
        ({"prompt": PROMPT, "logprobs": True}, 400, "logprobs", "null or 0"),
        ({"prompt": PROMPT, "stop": ["\n"]}, 400, "stop", "use stop_token_ids"),
        ({"prompt": PROMPT, "on_weight_update": "x"}, 400, "on_weight_update", "resume"),
        ({"prompt": PROMPT, "stream": "yes"}, 400, "stream", "true or false"),
        ({"prompt": PROMPT, "request_id": "a b"}, 400, "request_id", "1-128 characters"),
        ({"prompt": PROMPT, "model": "other"}, 404, "model", "not served"),
        ({"prompt": PROMPT, "group": 7}, 400, "group", "at most 128 characters"),
        ({"prompt": PROMPT, "group": "p" * 129}, 400, "group", "at most 128 characters"),
    ],
)
async def test_bad_requests_get_an_openai_error_and_touch_nothing_else(
    gw: Gateway, body: Any, status: int, param: str | None, says: str
) -> None:
    bystander = asyncio.create_task(
        gw.stream({"prompt": PROMPT, "max_tokens": 60, "temperature": 0, "stream": True})
    )
    await asyncio.sleep(0.01)
    got, answer = await gw.post("/v1/completions", body)
    assert got == status
    assert answer["error"]["param"] == param and says in answer["error"]["message"]
    assert tokens_of(await bystander) == greedy(PROMPT, 60)


async def test_abort_by_id_is_all_or_nothing(gw: Gateway) -> None:
    gw.hold.until(len(PROMPT) + 10)  # the victim runs, held at 10 tokens, until aborted
    body = {"prompt": PROMPT, "max_tokens": 500, "stream": True, "temperature": 0}
    task = asyncio.create_task(gw.stream({**body, "request_id": "victim"}))
    await eventually(lambda: len(gw.hold.held) == 1)
    status, answer = await gw.post("/orl/v1/abort", {"request_ids": ["victim", "ghost"]})
    assert status == 404 and "'ghost'" in answer["error"]["message"]
    assert gw.engine.request("victim") is not None  # untouched
    status, answer = await gw.post("/orl/v1/abort", {"request_ids": "victim"})
    assert status == 400 and answer["error"]["param"] == "request_ids"
    status, answer = await gw.post("/orl/v1/abort", {"request_ids": ["victim"], "all": True})
    assert status == 400 and answer["error"]["param"] == "all"  # an unknown field
    assert "not a field; allowed: request_ids" in answer["error"]["message"]
    assert gw.engine.request("victim") is not None  # untouched
    status, answer = await gw.post("/orl/v1/abort", {"request_ids": ["victim"]})
    assert status == 200 and answer == {"aborted": ["victim"]}
    events = await task
    assert events[-1] == {"done": True}
    assert events[-2]["error"]["type"] == "request_aborted"
    assert tokens_of(events) == greedy(PROMPT, 10)


async def test_a_client_that_goes_away_aborts_its_request(gw: Gateway) -> None:
    async with gw.http.post(
        gw.url + "/v1/completions",
        json={"prompt": PROMPT, "max_tokens": 500, "stream": True, "request_id": "gone"},
    ) as r:
        await r.content.readline()
        assert gw.engine.request("gone") is not None
    await eventually(lambda: gw.engine.request("gone") is None)
    assert gw.engine.stats().running_requests == 0


async def test_api_key_models_health_request_and_weight_version() -> None:
    async for gw in open_gateway(api_key="s3cret"):
        status, answer = await gw.post("/v1/completions", {"prompt": PROMPT})
        assert status == 401 and answer["error"]["type"] == "authentication_error"
        auth = {"Authorization": "Bearer s3cret"}
        async with gw.http.get(gw.url + "/v1/models", headers=auth) as r:
            assert (await r.json())["data"][0]["id"] == "tiny"
        async with gw.http.get(gw.url + "/health") as r:
            health = await r.json()
            assert r.status == 200 and health["instances"] == ["up", "up"]
        status, answer = await gw.post(
            "/orl/v1/weight_version", {"version": "step-7", "path": "/x"}, headers=auth
        )
        assert status == 400 and answer["error"]["param"] == "path"  # an unknown field
        assert "not a field; allowed: version" in answer["error"]["message"]
        assert gw.engine.weight_version == "0"  # unchanged
        status, answer = await gw.post(
            "/orl/v1/weight_version", {"version": "step-7"}, headers=auth
        )
        assert status == 200 and answer == {"version": "step-7", "previous": "0"}
        status, body = await gw.post(
            "/v1/completions", {"prompt": PROMPT, "max_tokens": 3}, headers=auth
        )
        assert body["orl"]["weight_versions"] == [[0, "step-7"]]
        async with gw.http.get(gw.url + "/orl/v1/requests/nope", headers=auth) as r:
            assert r.status == 404


async def test_a_full_queue_answers_429() -> None:
    async for gw in open_gateway(max_queue=1):
        gw.hold.until(len(PROMPT) + 1)  # the seated requests run on, held at one token
        body = {"prompt": PROMPT, "max_tokens": 500, "stream": True}
        tasks = [asyncio.create_task(gw.stream(body)) for _ in range(5)]  # 4 seats + 1 queued
        await eventually(
            lambda: len(gw.hold.held) == 4 and gw.engine.stats().queued_requests == 1  # noqa: B023
        )
        status, answer = await gw.post("/v1/completions", {"prompt": PROMPT})
        assert status == 429 and "queue is full" in answer["error"]["message"]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
