"""The real ``sglang-router`` (PyPI, its Rust binary) in front of two gateways speaking
SGLang's native protocol, as slime and AReaL drive their rollout: ``/generate`` with token
ids through the router (one prompt, ``n`` samples, a batch; streamed and not; with
logprobs), aborts and weight updates on each worker the router lists, and the metadata
and load endpoints the router itself calls.

The router refuses port 0, so it gets a random port from a range below the kernel's
ephemeral ports and is started again on another when that one is taken; it is known to
be ours when it lists our two gateways (their ports are ephemeral). It must not reach
the network: the gateways report no ``model_path`` (the router would load a tokenizer
from it), and the hub address points at a closed local port all the same.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import subprocess
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio

from sim_backends.token_engine import greedy, greedy_logprobs
from tests.component.test_gateway_http import PROMPT, Gateway, open_gateway
from tests.helpers import eventually

pytestmark = [pytest.mark.component, pytest.mark.asyncio(loop_scope="module")]

OTHER = [8, 8, 1, 2]
ROUTER_START_S = 60.0


@dataclass
class Router:
    url: str
    http: aiohttp.ClientSession
    gateways: list[Gateway]
    log: Path

    async def post(self, url: str, body: Any) -> tuple[int, Any]:
        async with self.http.post(url, json=body) as r:
            text = await r.text()
            return r.status, json.loads(text) if text else None

    async def get(self, path: str) -> tuple[int, Any]:
        async with self.http.get(self.url + path) as r:
            text = await r.text()
            try:
                return r.status, json.loads(text)
            except json.JSONDecodeError:
                return r.status, text

    async def generate(self, body: dict[str, Any]) -> tuple[int, Any]:
        return await self.post(self.url + "/generate", body)

    async def stream(self, body: dict[str, Any]) -> list[Any]:
        events: list[Any] = []
        async with self.http.post(self.url + "/generate", json={**body, "stream": True}) as r:
            assert r.status == 200, await r.text()
            async for line in r.content:
                text = line.decode().strip()
                if text:
                    assert text.startswith("data: ")
                    events.append("DONE" if text == "data: [DONE]" else json.loads(text[6:]))
        return events

    async def workers(self) -> list[str]:
        """The worker URLs the router lists (what slime reads before it aborts)."""
        status, body = await self.get("/workers")
        assert status == 200, body
        return [w["url"] for w in body["workers"]]

    def work(self) -> list[int]:
        """Generation calls each gateway's instances got (not health probes)."""
        return [
            sum(
                1
                for s in gw.servers
                for _, sub in s.record.submissions
                if not sub.engine_request_id.startswith("health-")
            )
            for gw in self.gateways
        ]


def _launch(port: int, workers: list[str], log: Path) -> subprocess.Popen[bytes]:
    argv = [
        sys.executable,
        "-m",
        "sglang_router.launch_router",
        "--worker-urls",
        *workers,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--prometheus-host",
        "127.0.0.1",
        "--prometheus-port",
        str(port + 1),
        "--policy",
        "round_robin",
        "--worker-startup-timeout-secs",
        "30",
        "--log-level",
        "warn",
    ]
    env = {
        **os.environ,
        "HF_ENDPOINT": "http://127.0.0.1:9",  # a closed port: never the network
        "HF_HUB_OFFLINE": "1",
        "NO_PROXY": "*",
    }
    with log.open("ab") as out:
        return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env)


async def _ready(
    proc: subprocess.Popen[bytes], url: str, workers: list[str], http: aiohttp.ClientSession
) -> bool:
    """True once the router at ``url`` is ours and routes to both workers; False when
    it exited (its port was taken)."""
    async with asyncio.timeout(ROUTER_START_S):
        while proc.poll() is None:
            with contextlib.suppress(aiohttp.ClientError, json.JSONDecodeError):
                async with http.get(url + "/workers") as r:
                    listed = {w["url"] for w in (await r.json())["workers"]}
                if listed == set(workers):
                    async with http.get(url + "/readiness") as r:
                        if r.status == 200 and (await r.json())["healthy_workers"] == 2:
                            return True
            await asyncio.sleep(0.1)
    return False


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def router(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Router]:
    log = tmp_path_factory.mktemp("router") / "router.log"
    async with contextlib.AsyncExitStack() as stack:
        gateways = []
        for _ in range(2):
            agen = open_gateway(delay=0.01)
            gateways.append(await anext(agen))
            stack.push_async_callback(anext, agen, None)  # runs its cleanup
        workers = [gw.url for gw in gateways]
        http = await stack.enter_async_context(aiohttp.ClientSession())
        for _ in range(5):
            port = random.randrange(20000, 32000, 2)
            proc = _launch(port, workers, log)
            try:
                if await _ready(proc, f"http://127.0.0.1:{port}", workers, http):
                    break
            except BaseException:
                proc.kill()
                proc.wait()
                raise
            proc.wait()
        else:
            pytest.fail(f"sglang-router did not start; its log:\n{log.read_text()[-3000:]}")
        try:
            yield Router(f"http://127.0.0.1:{port}", http, gateways, log)
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def triples(prompt: list[int], out: list[int], weights: int = 0) -> list[list[Any]]:
    return [[lp, t, None] for lp, t in zip(greedy_logprobs(prompt, out, weights), out, strict=True)]


async def test_the_router_registered_both_gateways_without_a_tokenizer(router: Router) -> None:
    status, body = await router.get("/workers")
    assert status == 200
    assert sorted(w["url"] for w in body["workers"]) == sorted(gw.url for gw in router.gateways)
    for w in body["workers"]:  # what the router read from each gateway's /server_info
        assert w["model_id"] == "tiny" and w["is_healthy"] is True
        assert w["metadata"]["served_model_name"] == "tiny" and w["metadata"]["tp_size"] == "1"
    status, info = await router.get("/get_model_info")  # proxied to a worker
    assert status == 200 and info["is_generation"] is True and info["model_path"] is None
    status, loads = await router.get("/get_loads")  # the router polls each /get_load
    assert status == 200 and len(loads["workers"]) == 2
    assert all(w["load"] >= 0 for w in loads["workers"]), loads  # -1: it could not read one
    log = router.log.read_text()
    assert "No tokenizer_path or model_path found" in log
    assert "Failed to load tokenizer" not in log


async def test_one_prompt_with_logprobs_through_the_router(router: Router) -> None:
    body = {
        "input_ids": PROMPT,
        "sampling_params": {"max_new_tokens": 12, "temperature": 0},
        "return_logprob": True,
        "rid": "one-1",
    }
    status, out = await router.generate(body)
    assert status == 200, out
    expected = greedy(PROMPT, 12)
    assert out["text"] == "" and out["output_ids"] == expected
    meta = out["meta_info"]
    assert meta["id"] == "one-1" and meta["finish_reason"] == {"type": "length", "length": 12}
    assert meta["prompt_tokens"] == 5 and meta["completion_tokens"] == 12
    assert meta["output_token_logprobs"] == triples(PROMPT, expected)
    assert meta["weight_version"] == "0" and meta["orl"]["weight_versions"] == [[0, "0"]]


async def test_n_samples_and_a_batch_spread_over_both_gateways(router: Router) -> None:
    before = router.work()
    status, outs = await router.generate(
        {
            "input_ids": PROMPT,
            "sampling_params": {"max_new_tokens": 8, "temperature": 0, "n": 3},
            "return_logprob": True,
            "rid": "grp",
        }
    )
    assert status == 200, outs
    assert [o["meta_info"]["id"] for o in outs] == ["grp_0", "grp_1", "grp_2"]
    for o in outs:
        assert o["output_ids"] == greedy(PROMPT, 8)
        assert o["meta_info"]["output_token_logprobs"] == triples(PROMPT, greedy(PROMPT, 8))
    status, outs = await router.generate(
        {"input_ids": [PROMPT, OTHER], "sampling_params": {"max_new_tokens": 6, "temperature": 0}}
    )
    assert status == 200, outs
    assert [o["output_ids"] for o in outs] == [greedy(PROMPT, 6), greedy(OTHER, 6)]
    after = router.work()
    assert all(a > b for a, b in zip(after, before, strict=True)), (before, after)


async def test_a_streamed_batch_through_the_router(router: Router) -> None:
    events = await router.stream(
        {
            "input_ids": [PROMPT, OTHER],
            "sampling_params": {"max_new_tokens": 10, "temperature": 0, "n": 2},
            "return_logprob": True,
        }
    )
    assert events[-1] == "DONE"
    last: dict[int, dict[str, Any]] = {}
    for e in events[:-1]:
        seen = last.get(e["index"])
        if seen is not None:  # cumulative: each event has the output so far
            assert e["output_ids"][: len(seen["output_ids"])] == seen["output_ids"]
        last[e["index"]] = e
    prompts = [PROMPT, PROMPT, OTHER, OTHER]  # prompt-major, as SGLang orders them
    assert sorted(last) == [0, 1, 2, 3]
    for i, p in enumerate(prompts):
        out = last[i]
        assert out["output_ids"] == greedy(p, 10)
        assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 10}
        assert out["meta_info"]["output_token_logprobs"] == triples(p, greedy(p, 10))


async def test_abort_on_every_worker_the_router_lists(router: Router) -> None:
    long = asyncio.create_task(
        router.stream(
            {
                "input_ids": PROMPT,
                "sampling_params": {"max_new_tokens": 500, "temperature": 0},
                "return_logprob": True,
                "rid": "long-1",
            }
        )
    )
    await eventually(
        lambda: any((r := gw.engine.request("long-1")) and r.output for gw in router.gateways),
        within_s=30,
    )
    servers = [s for gw in router.gateways for s in gw.servers]
    for s in servers:  # it cannot finish before the abort, however busy the machine
        s.token_delay_s = 3600.0
    try:
        for url in await router.workers():  # what slime's abort does
            status, answer = await router.post(url + "/abort_request", {"abort_all": True})
            assert status == 200, answer
    finally:
        for s in servers:
            s.token_delay_s = 0.01
    events = await long
    assert events[-1] == "DONE"
    final = events[-2]
    out = final["output_ids"]
    assert final["meta_info"]["finish_reason"]["type"] == "abort"
    assert 0 < len(out) < 500 and out == greedy(PROMPT, len(out))
    assert final["meta_info"]["output_token_logprobs"] == triples(PROMPT, out)


async def test_new_weights_on_every_worker_then_a_rollout_on_them(router: Router) -> None:
    for url in await router.workers():
        status, answer = await router.post(
            url + "/update_weights_from_disk",
            {"model_path": "/ckpt/scripted-2", "weight_version": "v2"},
        )
        assert status == 200, answer
        assert answer["success"] is True and "v2" in answer["message"]
    status, outs = await router.generate(
        {
            "input_ids": [PROMPT, OTHER],
            "sampling_params": {"max_new_tokens": 7, "temperature": 0},
            "return_logprob": True,
        }
    )
    assert status == 200, outs
    for p, o in zip([PROMPT, OTHER], outs, strict=True):
        assert o["output_ids"] == greedy(p, 7, weights=2)
        assert o["meta_info"]["weight_version"] == "v2"
        assert o["meta_info"]["output_token_logprobs"] == triples(p, o["output_ids"], 2)
    status, info = await router.get("/get_model_info")
    assert info["weight_version"] == "v2"


async def test_health_generate_on_each_worker_and_flush_cache_through_the_router(
    router: Router,
) -> None:
    for url in await router.workers():  # slime checks each worker before it aborts
        async with router.http.get(url + "/health_generate") as r:
            assert r.status == 200, await r.text()
    async with router.http.post(router.url + "/flush_cache") as r:  # fanned out to both
        assert r.status == 200, await r.text()
        assert (await r.json())["workers_flushed"] == 2
