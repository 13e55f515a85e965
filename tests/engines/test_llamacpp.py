"""The gateway over real llama.cpp servers (``llama-server``) with a tiny random GGUF, on CPU.

What a rollout client relies on, checked against the engine itself: the tokens it reads
are the engine's; a request cut off by a migration, a reshard or a crash goes on to the
same greedy output an uninterrupted call gives; nothing is lost or duplicated.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest

from node_agent.engine import Destination
from node_agent.engines.base import InstanceLoad
from node_agent.engines.http_engine import HttpEngine
from node_agent.gateway.requests import RequestFailed, Where
from tests.engines.conftest import (
    GREEDY,
    Nodes,
    freeze_mid_response,
    read_all,
    settings_for,
    stream_http,
)
from tests.helpers import eventually, until

pytestmark = pytest.mark.engine

PROMPTS = [[5 + i, 17, 3 + 2 * i, 99, 42 + i, 7] for i in range(6)]
N = 96
N_FULL = 1000  # most of a slot's context of 1024
LONG = 900  # outputs to cut off mid-response: several times longer than a cut point
ENDLESS = 10**9  # with --context-shift, a request that runs until it is aborted


@pytest.fixture
async def nodes(llama_binary: Path, gguf_model: Path, tmp_path: Path) -> AsyncIterator[Nodes]:
    nodes = Nodes("llamacpp", settings_for(llama_binary, gguf_model, tmp_path))
    yield nodes
    await nodes.close()


async def direct(server: HttpEngine, prompt: list[int], n: int) -> list[int]:
    """One call straight to the engine (no gateway): the reference output."""
    body = {
        "prompt": prompt,
        "n_predict": n,
        "temperature": 0,
        "ignore_eos": True,
        "return_tokens": True,
        "cache_prompt": False,
    }
    url = server.base + "/completion"
    async with aiohttp.ClientSession() as http, http.post(url, json=body) as r:
        assert r.status == 200
        doc = await r.json()
    return list(doc["tokens"])


@pytest.fixture
async def reference(nodes: Nodes) -> dict[int, list[int]]:
    """Uninterrupted greedy outputs of PROMPTS, from the engine itself."""
    ref = await nodes.add("ref", (1,))
    server = ref.servers[0]
    assert isinstance(server, HttpEngine)
    return {i: await direct(server, p, N) for i, p in enumerate(PROMPTS)}


async def test_the_gateway_streams_exactly_the_engines_tokens(
    nodes: Nodes, reference: dict[int, list[int]]
) -> None:
    node = await nodes.add("a", (1, 1), http=True)
    got = await asyncio.gather(
        *(
            stream_http(
                node.url, {"prompt": p, "max_tokens": N, "temperature": 0, "ignore_eos": True}
            )
            for p in PROMPTS
        )
    )
    assert got == [reference[i] for i in range(len(PROMPTS))]


async def test_load_and_progress_match_the_engine(
    llama_binary: Path, gguf_model: Path, tmp_path: Path
) -> None:
    # With context shift (a full slot drops the older half of its context and goes on),
    # a request for ENDLESS tokens runs until it is aborted: the figures are read while
    # four requests run that cannot finish meanwhile, however fast the engine is.
    args = ("--context-shift",)
    nodes = Nodes("llamacpp", settings_for(llama_binary, gguf_model, tmp_path, args=args))
    try:
        node = await nodes.add("a", (1, 1))
        servers = node.live()

        async def generated_since(before: list[InstanceLoad]) -> float:
            """Tokens the engine counted since ``before`` (a slot counts when it is freed)."""
            now = [await s.load() for s in servers]
            return sum(
                (a.generation_tokens_total or 0) - (b.generation_tokens_total or 0)
                for a, b in zip(now, before, strict=True)
            )

        async def running_everywhere(n: int) -> bool:
            """The engine's gauges and the gateway's figures both say ``n`` running."""
            gauges = sum([(await s.load()).running or 0 for s in servers])
            return gauges == node.engine.stats().running_requests == n

        start = [await s.load() for s in servers]
        endless = [node.engine.submit(p, ENDLESS, GREEDY) for p in PROMPTS[:4]]
        await eventually(lambda: all(len(r.output) > 20 for r in endless), within_s=60)
        progress = {r.request_id: r for r in node.engine.progress().requests}
        assert set(progress) == {r.id for r in endless}
        for r in endless:
            assert progress[r.id].instance in (0, 1)
            assert progress[r.id].generated_tokens <= len(r.output)
            assert progress[r.id].prompt_tokens == len(PROMPTS[0])
            assert progress[r.id].max_tokens == ENDLESS
        # llama-server's gauges lag its slots by a loop iteration on a busy machine: the
        # engine's figures and the gateway's (from the engine's metrics) come to agree
        await until(lambda: running_everywhere(4))
        assert not any(r.done for r in endless)

        # aborted: the engine frees their slots, having made at least what was read
        assert node.engine.abort([r.id for r in endless]) == []
        await until(lambda: running_everywhere(0))
        assert node.engine.progress().requests == ()
        assert await generated_since(start) >= sum(len(r.output) for r in endless)

        # four requests run to their end: the engine counted exactly the tokens read
        before = [await s.load() for s in servers]
        reqs = [node.engine.submit(p, N_FULL, GREEDY) for p in PROMPTS[:4]]
        await asyncio.gather(*(read_all(r) for r in reqs))

        async def counted() -> bool:
            return await generated_since(before) >= 4 * N_FULL

        await until(counted)  # (the slots are freed, and counted, right after the last token)
        generated = await generated_since(before)
        assert generated == sum(len(r.output) for r in reqs) == 4 * N_FULL
        assert sorted(node.engine.progress().completed_lengths) == [N_FULL] * 4
    finally:
        await nodes.close()


async def test_drain_stops_admission(nodes: Nodes, reference: dict[int, list[int]]) -> None:
    node = await nodes.add("a", (1,))
    await node.engine.drain()
    req = node.engine.submit(PROMPTS[0], N, GREEDY)
    await asyncio.sleep(0.5)
    assert req.where is Where.QUEUED and req.output == []
    load = await node.live()[0].load()
    assert load.running == 0
    await node.engine.resume()
    assert await read_all(req) == reference[0]


@pytest.fixture
async def long_reference(nodes: Nodes) -> dict[int, list[int]]:
    """Uninterrupted greedy outputs of LONG tokens of PROMPTS[:3], from the engine."""
    ref = await nodes.add("ref", (1,))
    server = ref.servers[0]
    assert isinstance(server, HttpEngine)
    return {i: await direct(server, p, LONG) for i, p in enumerate(PROMPTS[:3])}


@pytest.mark.parametrize("cut", [1, 17, 60])
async def test_migration_mid_response_gives_the_uninterrupted_output(
    nodes: Nodes, long_reference: dict[int, list[int]], cut: int
) -> None:
    a = await nodes.add("a", (1,))
    b = await nodes.add("b", (1,))
    refs = [long_reference[i] for i in range(3)]
    # Paused (the gateway stops the calls; the requests wait with their output so far)
    # once the first has ``cut`` tokens: from then on nothing changes. This engine runs
    # a request's LONG tokens in a blink, so the first may have finished before the
    # pause: then the attempt runs to its end, checked, and is made again.
    for _attempt in range(3):
        reqs = [a.engine.submit(p, LONG, GREEDY) for p in PROMPTS[:3]]
        readers = [asyncio.create_task(read_all(r)) for r in reqs]
        await eventually(lambda: len(reqs[0].output) >= cut, within_s=60)  # noqa: B023
        await a.engine.pause()
        if not reqs[0].done:
            break
        await a.engine.unpause()
        assert await asyncio.gather(*readers) == refs
    else:
        pytest.fail("llama-server finished the first request before every pause")
    try:
        moving = [r for r in reqs if not r.done]
        exported, missing = await a.engine.export_requests([r.id for r in moving])
    finally:
        await a.engine.unpause()
    # stopped and paused, every request not finished is held mid-response at the gateway
    assert not missing and [e.request_id for e in exported] == [r.id for r in moving]
    assert exported[0].request_id == reqs[0].id and exported[0].generated_tokens >= cut
    result = await b.engine.import_requests(exported, 0, recompute=True)
    assert set(result.admitted) == {r.id for r in moving}
    await a.engine.release_requests(exported, Destination("b", "in-process"))
    outs = await asyncio.gather(*readers)
    assert outs == refs
    assert all(r.hops == (["a", "b"] if r in moving else ["a"]) for r in reqs)


async def test_reshard_with_requests_in_flight_loses_nothing(
    nodes: Nodes, reference: dict[int, list[int]]
) -> None:
    node = await nodes.add("a", (1, 1))
    reqs = [node.engine.submit(p, N, GREEDY) for p in PROMPTS]
    readers = [asyncio.create_task(read_all(r)) for r in reqs]
    for layout in [(2,), (1, 1)]:
        await eventually(lambda: sum(len(r.output) for r in reqs) > 60, within_s=60)
        result = await node.engine.reshard(layout)
        assert result.new_layout == layout
        assert {s.stage for s in result.stages} >= {"stop_instances", "start_instances"}
        assert [p.tp for p in node.engine.instances] == list(layout)
    outs = await asyncio.gather(*readers)
    assert outs == [reference[i] for i in range(len(PROMPTS))]
    assert sorted(node.engine.progress().completed_lengths) == [N] * len(PROMPTS)


async def test_a_killed_engine_is_restarted_and_its_requests_resume(nodes: Nodes) -> None:
    node = await nodes.add("a", (1,))
    server = node.live()[0]
    assert isinstance(server, HttpEngine) and server.process.pid is not None
    pid = server.process.pid
    long = 900  # of a context of 1024: long enough to freeze it mid-response
    reference = {i: await direct(server, p, long) for i, p in enumerate(PROMPTS[:3])}
    # The kill must land while the requests are unfinished as the gateway sees them.
    _, readers = await freeze_mid_response(
        lambda: [node.engine.submit(p, long, GREEDY) for p in PROMPTS[:3]],
        lambda sig: os.kill(pid, sig),
        [reference[i] for i in range(3)],
        min_tokens=11,
    )
    os.kill(pid, signal.SIGKILL)
    assert await asyncio.gather(*readers) == [reference[i] for i in range(3)]
    assert node.engine.failures == 1 and node.engine.instance_health() == ("up",)


async def test_an_engine_that_cannot_restart_fails_its_requests_clearly(
    llama_binary: Path, gguf_model: Path, tmp_path: Path
) -> None:
    model = tmp_path / "doomed.gguf"
    shutil.copyfile(gguf_model, model)
    # with context shift, a request for ENDLESS tokens is still running when it is killed
    settings = settings_for(llama_binary, model, tmp_path, args=("--context-shift",))
    nodes = Nodes("llamacpp", settings)
    try:
        node = await nodes.add("a", (1,))
        req = node.engine.submit(PROMPTS[0], ENDLESS, GREEDY)
        await eventually(lambda: len(req.output) > 5, within_s=60)
        model.unlink()  # the restart cannot load it
        server = node.live()[0]
        assert isinstance(server, HttpEngine) and server.process.pid is not None
        os.kill(server.process.pid, signal.SIGKILL)
        with pytest.raises(RequestFailed, match="exited with status -9 and did not restart"):
            await asyncio.wait_for(read_all(req), 120)
        assert node.engine.instance_health()[0].startswith("failed:")
    finally:
        await nodes.close()
