"""SGLang's native protocol on the gateway over HTTP, on scripted instances on 127.0.0.1:0:
what the router test cannot reach (bad input leaving everything else untouched, aborts by
``rid``, stop tokens, failed and concurrent weight updates, health, loads, a full queue,
a client that goes away)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest

from sim_backends.token_engine import greedy, greedy_logprobs
from tests.component.test_gateway_http import PROMPT, Gateway, open_gateway
from tests.helpers import eventually

pytestmark = pytest.mark.component


@pytest.fixture
async def gw() -> AsyncIterator[Gateway]:
    async for g in open_gateway(delay=0.005):
        yield g


async def stream(gw: Gateway, body: dict[str, Any]) -> list[Any]:
    events: list[Any] = []
    async with gw.http.post(gw.url + "/generate", json={**body, "stream": True}) as r:
        assert r.status == 200, await r.text()
        async for line in r.content:
            text = line.decode().strip()
            if text:
                events.append("DONE" if text == "data: [DONE]" else json.loads(text[6:]))
    return events


def long(rid: str, **more: Any) -> dict[str, Any]:
    return {
        "input_ids": PROMPT,
        "sampling_params": {"max_new_tokens": 500, "temperature": 0, **more},
        "return_logprob": True,
        "rid": rid,
    }


async def running(gw: Gateway, rid: str) -> None:
    await eventually(lambda: (r := gw.engine.request(rid)) is not None and bool(r.output), 30)


@contextlib.contextmanager
def frozen(gw: Gateway) -> Iterator[None]:
    """The calls in flight get no more tokens (their next one is an hour away) until they
    are cancelled, however busy the machine; calls made afterwards run as usual."""
    for s in gw.servers:
        s.token_delay_s = 3600.0
    try:
        yield
    finally:
        for s in gw.servers:
            s.token_delay_s = 0.005


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"text": "Hello"}, "text"),
        ({"input_ids": PROMPT, "sampling_params": {"stop": "\n"}}, "sampling_params.stop"),
        ({"input_ids": [PROMPT, PROMPT], "rid": ["x", "bystander"]}, "rid"),  # in use: all or none
        ({"input_ids": [PROMPT, PROMPT], "sampling_params": [{}, {"top_k": 0}]}, None),
        ("{not json", None),
    ],
)
async def test_bad_input_is_refused_and_touches_nothing(
    gw: Gateway, body: Any, param: str | None
) -> None:
    bystander = asyncio.create_task(stream(gw, long("bystander", max_new_tokens=60)))
    await running(gw, "bystander")
    status, answer = await gw.post("/generate", body)
    assert status == 400, answer
    assert answer["error"]["param"] == param or param is None
    assert answer["error"]["message"]
    assert set(gw.engine.in_flight()) <= {"bystander"}  # nothing of the refused call stays
    events = await bystander
    assert events[-2]["output_ids"] == greedy(PROMPT, 60)


async def test_abort_by_rid_aborts_its_samples_and_answers_their_output_so_far(
    gw: Gateway,
) -> None:
    group = asyncio.create_task(gw.post("/generate", long("grp", n=2)))
    await running(gw, "grp_0")
    await running(gw, "grp_1")
    with frozen(gw):
        status, answer = await gw.post("/abort_request", {"rid": "grp"})
    assert status == 200 and sorted(answer["aborted"]) == ["grp_0", "grp_1"]
    status, outs = await group
    assert status == 200
    for i, o in enumerate(outs):
        meta = o["meta_info"]
        assert meta["id"] == f"grp_{i}" and meta["finish_reason"]["type"] == "abort"
        assert "aborted by /abort_request" in meta["finish_reason"]["message"]
        out = o["output_ids"]
        assert 0 < len(out) < 500 and out == greedy(PROMPT, len(out))
        assert [lp for lp, _, _ in meta["output_token_logprobs"]] == greedy_logprobs(PROMPT, out)
    status, answer = await gw.post("/abort_request", {"rid": "gone"})  # as SGLang: a no-op
    assert status == 200 and answer == {"aborted": []}


async def test_a_stop_token_ends_the_output_and_is_named(gw: Gateway) -> None:
    full = greedy(PROMPT, 30)
    stop = full[9]
    status, out = await gw.post(
        "/generate",
        {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 30, "stop_token_ids": [stop]}},
    )
    assert status == 200, out
    assert out["output_ids"] == full[: full.index(stop) + 1]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}


async def test_weights_that_do_not_load_leave_the_old_ones(gw: Gateway) -> None:
    status, answer = await gw.post(
        "/update_weights_from_disk", {"model_path": "missing-weights", "weight_version": "v9"}
    )
    assert status == 400 and answer["success"] is False
    assert "could not load it" in answer["message"]
    async with gw.http.get(gw.url + "/model_info") as r:
        assert (await r.json())["weight_version"] == "0"
    status, out = await gw.post("/generate", {"input_ids": PROMPT})
    assert out["output_ids"] == greedy(PROMPT, 128)


async def test_an_update_that_aborts_what_runs_then_serves_the_new_weights(gw: Gateway) -> None:
    old = asyncio.create_task(stream(gw, long("old")))
    await running(gw, "old")
    with frozen(gw):
        status, answer = await gw.post(
            "/update_weights_from_disk",
            {"model_path": "/ckpt/scripted-3", "weight_version": "v3", "abort_all_requests": True},
        )
    assert status == 200 and answer["success"] is True, answer
    assert answer["orl"]["aborted_requests"] == 1 and answer["orl"]["version"] == "v3"
    events = await old
    assert events[-1] == "DONE" and events[-2]["meta_info"]["finish_reason"]["type"] == "abort"
    assert events[-2]["meta_info"]["weight_version"] == "0"
    status, out = await gw.post(
        "/generate", {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 6}}
    )
    assert out["output_ids"] == greedy(PROMPT, 6, weights=3)
    assert out["meta_info"]["weight_version"] == "v3"


async def test_one_update_at_a_time(gw: Gateway) -> None:
    old = asyncio.create_task(gw.post("/generate", long("old")))
    await running(gw, "old")
    with frozen(gw):  # the first update waits for "old" to finish on the old weights
        first = asyncio.create_task(
            gw.post(
                "/update_weights_from_disk", {"model_path": "scripted-4", "weight_version": "v4"}
            )
        )
        await eventually(lambda: gw.engine.core.updating == "v4")
        status, answer = await gw.post(
            "/update_weights_from_disk", {"model_path": "scripted-5", "weight_version": "v5"}
        )
        assert status == 400 and answer["success"] is False
        assert "'v4' are being loaded" in answer["message"]
        assert not first.done()
        await gw.post("/abort_request", {"rid": "old"})  # now the first one can go on
    status, answer = await first
    assert status == 200 and answer["orl"]["finished_on_old_weights"] == 1, answer
    status, done = await old
    assert done["meta_info"]["finish_reason"]["type"] == "abort"
    assert done["meta_info"]["weight_version"] == "0"
    status, out = await gw.post("/generate", {"input_ids": PROMPT})
    assert out["meta_info"]["weight_version"] == "v4"
    assert out["output_ids"] == greedy(PROMPT, 128, weights=4)


async def test_health_generate_needs_a_generating_instance(gw: Gateway) -> None:
    async with gw.http.get(gw.url + "/health_generate") as r:
        assert r.status == 200 and (await r.json())["generating"] is False  # probed
    assert all(
        any(sub.engine_request_id.startswith("health-") for _, sub in s.record.submissions)
        for s in gw.servers
    )
    assert gw.engine.progress().completed_lengths == ()  # the probes are not requests
    for s in gw.servers:
        s.fail_starts = 100
        s.crash()
    await eventually(lambda: "up" not in gw.engine.instance_health())
    async with gw.http.get(gw.url + "/health_generate") as r:
        assert r.status == 503 and "no engine instance is up" in (await r.json())["message"]


async def test_loads_while_a_request_runs(gw: Gateway) -> None:
    task = asyncio.create_task(gw.post("/generate", long("busy")))
    await running(gw, "busy")
    with frozen(gw):
        await loads_of_one_running_request(gw)
        await gw.post("/abort_request", {"abort_all": True})
    status, out = await task
    assert status == 200 and out["meta_info"]["finish_reason"]["type"] == "abort"


async def loads_of_one_running_request(gw: Gateway) -> None:
    async with gw.http.get(gw.url + "/get_load") as r:
        (row,) = await r.json()
        assert row["num_reqs"] == 1 and row["num_tokens"] > len(PROMPT)
    async with gw.http.get(gw.url + "/v1/loads?include=core,disagg,queues") as r:
        body = await r.json()
        assert body["loads"][0]["num_running_reqs"] == 1 and body["loads"][0]["num_total_reqs"] == 1
    async with gw.http.get(gw.url + "/v1/loads?format=prometheus") as r:
        assert r.status == 400 and (await r.json())["error"]["param"] == "format"


async def test_a_batch_too_big_for_the_queue_is_refused_whole() -> None:
    async for gw in open_gateway(max_queue=2, delay=0.05):
        status, answer = await gw.post(
            "/generate",
            {"input_ids": [PROMPT] * 8, "sampling_params": {"max_new_tokens": 50}},
        )
        assert status == 429 and "queue is full" in answer["error"]["message"]
        assert gw.engine.in_flight() == []


async def test_a_client_that_goes_away_aborts_its_requests(gw: Gateway) -> None:
    async with gw.http.post(gw.url + "/generate", json={**long("gone", n=2), "stream": True}) as r:
        await r.content.readline()
        assert gw.engine.request("gone_0") is not None
    await eventually(lambda: gw.engine.in_flight() == [])
    assert gw.engine.request("gone_1") is None
