"""The gateway over SGLang's HTTP API, served by a stand-in (sim_backends/fake_sglang.py).

Real SGLang needs a GPU or an Intel AMX Xeon, which this machine lacks
(tests/engines/test_sglang.py runs the migration check on a real server where there is
one). The stand-in answers as SGLang 0.5.23's source does (streamed cumulative or
incremental ``output_ids``, abort finish reasons, pause in place, Prometheus gauges on
SGLang's cadence) over a model whose next token is a hash of the sequence so far, so the
adapter is driven through its real launch command line, HTTP calls and metrics, and a
request cut off anywhere must still give the uninterrupted output token for token.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest

from node_agent.engine import Destination
from node_agent.engines.base import CAP_PAUSE, EngineFailed, EngineServer, Submission
from node_agent.engines.checkpoint import CheckpointError
from node_agent.engines.http_engine import HttpEngine
from node_agent.engines.sglang import SglangServer
from node_agent.gateway.requests import Request, RequestFailed, Where
from sim_backends.fake_sglang import greedy, greedy_logprobs, weights_salt, write_launcher
from sim_backends.tiny_models import TinyShape, write_hf_llama
from tests.engines.conftest import (
    GREEDY,
    Node,
    Nodes,
    cpu_placement,
    generate,
    read_all,
    settings_for,
    stream_http,
)
from tests.helpers import until

pytestmark = pytest.mark.engine

VOCAB = 1000
CONTEXT = 1024
PROMPTS = [[5 + i, 17, 3 + 2 * i, 99, 42 + i, 7] for i in range(6)]
N = 96
LONG = 300  # half a second at the stand-in's rate; a test acts mid-response on calls
# that the stand-in's hold (sim_backends/fake_sglang.py) stops at a known point
FAST = {  # the stand-in's own knobs: a fast model, quick health checks and shutdowns
    "ORL_FAKE_SGLANG_TOKENS_PER_S": "600",
    "ORL_FAKE_SGLANG_HEALTH_POLL_S": "0.05",
    "ORL_FAKE_SGLANG_DRAIN_POLL_S": "0.05",
}


@pytest.fixture
def launcher(tmp_path: Path) -> Path:
    """What the adapter runs as ``<python> -m sglang.launch_server ...``."""
    return write_launcher(tmp_path / "sglang-python")


@pytest.fixture
def model(tmp_path: Path) -> Path:
    path = tmp_path / "model"
    path.mkdir()
    config = {"vocab_size": VOCAB, "eos_token_id": 2, "max_position_embeddings": 4096}
    (path / "config.json").write_text(json.dumps(config))
    return path


def make_nodes(
    launcher: Path, model: Path, tmp_path: Path, *, args: tuple[str, ...] = (), **env: str
) -> Nodes:
    settings = settings_for(
        launcher, model, tmp_path, context=CONTEXT, args=args, env={**FAST, **env}
    )
    return Nodes("sglang", settings)


@pytest.fixture
async def nodes(launcher: Path, model: Path, tmp_path: Path) -> AsyncIterator[Nodes]:
    nodes = make_nodes(launcher, model, tmp_path)
    yield nodes
    await nodes.close()


async def direct(server: HttpEngine, prompt: list[int], n: int) -> list[int]:
    """One call straight to the engine's ``/generate`` (no gateway): the reference."""
    body = {
        "input_ids": prompt,
        "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True},
    }
    async with (
        aiohttp.ClientSession() as http,
        http.post(server.base + "/generate", json=body) as r,
    ):
        assert r.status == 200, await r.text()
        doc = await r.json()
    assert doc["meta_info"]["finish_reason"] == {"type": "length", "length": n}
    return list(doc["output_ids"])


@pytest.fixture
def reference() -> dict[int, list[int]]:
    """Uninterrupted greedy outputs of PROMPTS (LONG tokens): the stand-in's rule, which
    the first test checks against the engine's own uninterrupted calls."""
    return {i: greedy(p, LONG, VOCAB) for i, p in enumerate(PROMPTS)}


def total(reqs: list[Request]) -> int:
    return sum(len(r.output) for r in reqs)


async def until_idle(server: EngineServer, within_s: float = 5) -> None:
    """Until the engine's own gauge says it runs nothing."""
    async with asyncio.timeout(within_s):
        while (await server.load()).running != 0:  # noqa: ASYNC110 - polls the engine
            await asyncio.sleep(0.02)


async def hold(server: EngineServer, at: int | None) -> None:
    """The stand-in's calls stop at sequence position ``at`` (None: they run on)."""
    assert isinstance(server, HttpEngine)
    async with (
        aiohttp.ClientSession() as http,
        http.post(server.base + "/orl_fake/hold", json={"at": at}) as r,
    ):
        assert r.status == 200, await r.text()


async def held(server: EngineServer) -> int:
    """How many calls the stand-in's hold stops now."""
    assert isinstance(server, HttpEngine)
    async with aiohttp.ClientSession() as http, http.get(server.base + "/orl_fake/hold") as r:
        assert r.status == 200, await r.text()
        return len((await r.json())["held"])


async def until_held(reqs: list[Request], n: int, *servers: EngineServer) -> None:
    """Until the servers hold every call of ``reqs`` and the gateway has read their ``n``
    tokens: nothing changes any more until the hold moves."""
    async with asyncio.timeout(30):
        while not (  # noqa: ASYNC110 - polls the engine
            all(len(r.output) == n for r in reqs)
            and sum([await held(s) for s in servers]) == len(reqs)
        ):
            await asyncio.sleep(0.02)


def sglang(node: Node, i: int = 0) -> SglangServer:
    server = node.live()[i]
    assert isinstance(server, SglangServer)
    return server


@pytest.mark.parametrize(
    "args",
    [(), ("--incremental-streaming-output", "--stream-interval", "3")],
    ids=["cumulative", "incremental-every-3"],
)
async def test_the_gateway_streams_exactly_the_engines_tokens(
    launcher: Path, model: Path, tmp_path: Path, args: tuple[str, ...]
) -> None:
    nodes = make_nodes(launcher, model, tmp_path, args=args)
    try:
        node = await nodes.add("a", (1, 1), http=True)
        uninterrupted = await asyncio.gather(*(direct(sglang(node), p, N) for p in PROMPTS))
        assert uninterrupted == [greedy(p, N, VOCAB) for p in PROMPTS]
        body = {"max_tokens": N, "temperature": 0, "ignore_eos": True}
        got = await asyncio.gather(*(stream_http(node.url, {**body, "prompt": p}) for p in PROMPTS))
        assert got == uninterrupted
        assert len({tuple(out) for out in got}) == len(PROMPTS)  # varied outputs
    finally:
        await nodes.close()


async def test_load_and_progress_match_the_engine(nodes: Nodes) -> None:
    node = await nodes.add("a", (1, 1))
    servers = node.live()
    before = [await s.load() for s in servers]
    # the calls stop at 60 tokens and run until released: SGLang refreshes its gauges
    # every 40 decode steps (and at prefills, and when idle), so the gauges have counted
    # every call by then, and nothing changes while the figures are read
    n = 60
    await asyncio.gather(*(hold(s, len(PROMPTS[0]) + n) for s in servers))
    reqs = [node.engine.submit(p, LONG, GREEDY) for p in PROMPTS[:4]]
    await until_held(reqs, n, *servers)
    progress = {p.request_id: p for p in node.engine.progress().requests}
    assert set(progress) == {r.id for r in reqs}
    for r in reqs:
        assert progress[r.id].instance in (0, 1)
        assert progress[r.id].prompt_tokens == len(PROMPTS[0])
        assert progress[r.id].generated_tokens == n
    during = [await s.load() for s in servers]
    assert sum(x.running or 0 for x in during) == node.engine.stats().running_requests == 4
    assert all(x.waiting == 0 for x in during)
    assert all(x.kv_usage is not None and 0 < x.kv_usage < 1 for x in during)
    await asyncio.gather(*(hold(s, None) for s in servers))
    await asyncio.gather(*(read_all(r) for r in reqs))
    after = [await s.load() for s in servers]
    delta = [
        (a.generation_tokens_total or 0) - (b.generation_tokens_total or 0)
        for a, b in zip(after, before, strict=True)
    ]
    assert sum(delta) == sum(len(r.output) for r in reqs) == 4 * LONG
    prompts = sum((a.prompt_tokens_total or 0) for a in after)
    assert prompts - sum((b.prompt_tokens_total or 0) for b in before) == 4 * len(PROMPTS[0])
    await asyncio.gather(*(until_idle(s) for s in servers))  # the gauges come back to 0


async def test_pause_in_place_keeps_the_calls_and_their_progress(
    nodes: Nodes, reference: dict[int, list[int]]
) -> None:
    node = await nodes.add("a", (1,))
    server = sglang(node)
    assert CAP_PAUSE in server.capabilities and server.version == "0.5.23"
    # held at 11 tokens, paused, then released: from then on only the pause stops them
    await hold(server, len(PROMPTS[0]) + 11)
    reqs = [node.engine.submit(p, LONG, GREEDY) for p in PROMPTS[:3]]
    readers = [asyncio.create_task(read_all(r)) for r in reqs]
    await until_held(reqs, 11, server)
    await node.engine.pause()
    async with aiohttp.ClientSession() as http:  # (the stand-in's hold refuses nonsense)
        for bad in (0, "11", 1.5):
            async with http.post(server.base + "/orl_fake/hold", json={"at": bad}) as r:
                assert r.status == 400 and f"at={bad!r}" in (await r.json())["error"]
    await hold(server, None)
    await asyncio.sleep(0.3)  # 180 decode steps at the stand-in's rate, if it were not paused
    assert [len(r.output) for r in reqs] == [11] * 3
    assert all(r.where is Where.RUNNING for r in reqs)  # the calls stay on the engine
    await node.engine.unpause()
    assert await asyncio.gather(*readers) == [reference[i] for i in range(3)]
    assert all(r.calls == 1 for r in reqs)  # never resubmitted


async def test_an_sglang_without_pause_modes_is_not_paused_in_place(
    launcher: Path, model: Path, tmp_path: Path, reference: dict[int, list[int]]
) -> None:
    """SGLang 0.5.5's /pause_generation aborts every call: the gateway must know."""
    nodes = make_nodes(launcher, model, tmp_path, ORL_FAKE_SGLANG_VERSION="0.5.5")
    try:
        node = await nodes.add("old", (1,))
        server = sglang(node)
        assert server.version == "0.5.5" and CAP_PAUSE not in server.capabilities
        await hold(server, len(PROMPTS[0]) + 11)  # mid-response when the pause comes
        reqs = [node.engine.submit(p, LONG, GREEDY) for p in PROMPTS[:2]]
        readers = [asyncio.create_task(read_all(r)) for r in reqs]
        await until_held(reqs, 11, server)
        await node.engine.pause()  # the gateway stops the calls itself; requests wait
        assert all(r.where is Where.QUEUED for r in reqs)
        await hold(server, None)
        await node.engine.unpause()
        assert await asyncio.gather(*readers) == [reference[i] for i in range(2)]
        assert all(r.calls == 2 and r.failures == 0 for r in reqs)
    finally:
        await nodes.close()


async def test_abort_ends_the_call_on_the_engine(nodes: Nodes) -> None:
    node = await nodes.add("a", (1,))
    server = sglang(node)
    # the calls are held at 20 tokens: an abort is what ends them
    await hold(server, len(PROMPTS[0]) + 20)
    # the adapter's own abort (/abort_request) while the stream is open: the call ends
    # with finish_reason {"type": "abort"}, which a new call would continue
    sub = Submission("direct-1", tuple(PROMPTS[0]), 900, GREEDY)
    got: list[int] = []

    async def abort_after(n: int) -> None:
        async with contextlib.aclosing(server.generate(sub)) as stream:
            async for chunk in stream:
                got.extend(chunk.token_ids)
                if n <= len(got) < n + len(chunk.token_ids):
                    await server.abort([sub.engine_request_id])

    with pytest.raises(EngineFailed, match="Aborted") as failed:
        await abort_after(20)
    assert failed.value.retry and not failed.value.instance
    assert got == greedy(PROMPTS[0], 20, VOCAB)
    # a client's abort through the gateway: the engine stops generating
    req = node.engine.submit(PROMPTS[1], 900, GREEDY)
    await until_held([req], 20, server)
    node.engine.abort([req.id])
    with pytest.raises(RequestFailed, match="aborted by the client"):
        await read_all(req)
    await until_idle(server)


@pytest.mark.parametrize(
    ("prompt_len", "max_tokens", "why"),
    [
        (CONTEXT - 5, 1, "exceeds the maximum allowed length"),  # the scheduler's abort, 400
        (CONTEXT - 24, 100, "exceeds the model's maximum context length"),  # the tokenizer's
    ],
    ids=["scheduler", "tokenizer"],
)
async def test_a_request_the_engine_refuses_fails_at_once(
    nodes: Nodes, prompt_len: int, max_tokens: int, why: str
) -> None:
    node = await nodes.add("a", (1,))
    req = node.engine.submit([7] * prompt_len, max_tokens, GREEDY)
    with pytest.raises(RequestFailed, match=why) as failed:
        await asyncio.wait_for(read_all(req), 10)
    assert failed.value.refused and req.calls == 1  # not retried


@pytest.mark.parametrize("cut", [1, 17, 60])
async def test_migration_mid_response_gives_the_uninterrupted_output(
    nodes: Nodes, reference: dict[int, list[int]], cut: int
) -> None:
    a, b = await asyncio.gather(nodes.add("a", (1,)), nodes.add("b", (1,)))
    await hold(sglang(a), len(PROMPTS[0]) + cut)  # where they are cut off on ``a``
    reqs = [a.engine.submit(p, LONG, GREEDY) for p in PROMPTS[:3]]
    readers = [asyncio.create_task(read_all(r)) for r in reqs]
    await until_held(reqs, cut, sglang(a))
    exported, missing = await a.engine.export_requests([r.id for r in reqs])
    assert not missing and [e.generated_tokens for e in exported] == [cut] * 3
    result = await b.engine.import_requests(exported, 0, recompute=True)
    assert set(result.admitted) == {r.id for r in reqs}
    await a.engine.release_requests(exported, Destination("b", "in-process"))
    assert await asyncio.gather(*readers) == [reference[i] for i in range(3)]
    assert all(r.hops == ["a", "b"] for r in reqs)


async def test_reshard_with_requests_in_flight_loses_nothing(
    launcher: Path, model: Path, tmp_path: Path, reference: dict[int, list[int]]
) -> None:
    # every instance, the ones a reshard starts too, holds its calls at 100 tokens
    first = len(PROMPTS[0]) + 100
    nodes = make_nodes(launcher, model, tmp_path, ORL_FAKE_SGLANG_HOLD_AT=str(first))
    try:
        node = await nodes.add("a", (1, 1))
        reqs = [node.engine.submit(p, LONG, GREEDY) for p in PROMPTS]
        readers = [asyncio.create_task(read_all(r)) for r in reqs]
        await until_held(reqs, 100, *node.live())
        for layout in [(2,), (1, 1)]:
            if layout == (1, 1):  # the TP2 instance's 4 seats take 4 of them on to 200
                [tp2] = node.live()
                await hold(tp2, len(PROMPTS[0]) + 200)
                seated = [r for r in reqs if r.where is Where.RUNNING]
                assert len(seated) == 4
                await until_held(seated, 200, tp2)
                assert sorted(len(r.output) for r in reqs) == [100] * 2 + [200] * 4
            result = await node.engine.reshard(layout)
            assert result.new_layout == layout
            assert {s.stage for s in result.stages} >= {"stop_instances", "start_instances"}
            assert [p.tp for p in node.engine.instances] == list(layout)
            assert not any(r.done for r in reqs)
        tp2 = node.servers[2]  # started for the layout (2,)
        assert isinstance(tp2, SglangServer) and "--tp-size 2" in " ".join(tp2.process.argv)
        await asyncio.gather(*(hold(s, None) for s in node.live()))
        assert await asyncio.gather(*readers) == [reference[i] for i in range(len(PROMPTS))]
        assert sorted(node.engine.progress().completed_lengths) == [LONG] * len(PROMPTS)
    finally:
        await nodes.close()


async def test_a_killed_engine_is_restarted_and_its_requests_resume(
    nodes: Nodes, reference: dict[int, list[int]]
) -> None:
    node = await nodes.add("a", (1,))
    server = sglang(node)
    await hold(server, len(PROMPTS[0]) + 11)  # killed mid-response; the restart holds nothing
    reqs = [node.engine.submit(p, LONG, GREEDY) for p in PROMPTS[:3]]
    readers = [asyncio.create_task(read_all(r)) for r in reqs]
    await until_held(reqs, 11, server)
    assert server.process.pid is not None
    os.kill(server.process.pid, signal.SIGKILL)
    assert await asyncio.gather(*readers) == [reference[i] for i in range(3)]
    assert node.engine.failures == 1 and node.engine.instance_health() == ("up",)


# -- logprobs and weight updates, on the adapter itself ------------------------------------


@pytest.fixture
def checkpoints(tmp_path: Path) -> tuple[Path, Path, Path]:
    """Two steps of one model and a model of another shape (real safetensors files: the
    stand-in's weights are a hash of them, the adapter checks their layout)."""
    shape = TinyShape(layers=1, hidden=64, intermediate=128, vocab=VOCAB)
    return (
        write_hf_llama(tmp_path / "step-1", shape, seed=1),
        write_hf_llama(tmp_path / "step-2", shape, seed=2),
        write_hf_llama(tmp_path / "other", dataclasses.replace(shape, layers=2), seed=3),
    )


@pytest.mark.parametrize(
    "args",
    [(), ("--incremental-streaming-output", "--stream-interval", "3")],
    ids=["cumulative", "incremental-every-3"],
)
async def test_logprobs_and_an_update_from_disk_with_a_call_in_flight(
    launcher: Path,
    tmp_path: Path,
    checkpoints: tuple[Path, Path, Path],
    args: tuple[str, ...],
) -> None:
    step1, step2, other = checkpoints
    salt1, salt2 = weights_salt(step1), weights_salt(step2)
    settings = settings_for(launcher, step1, tmp_path, context=CONTEXT, args=args, env=FAST)
    server = SglangServer(cpu_placement(), settings("n"))
    await server.start()
    try:
        tokens, lps = await generate(server, PROMPTS[0], N, GREEDY, "first")
        assert list(zip(tokens, lps, strict=True)) == greedy_logprobs(PROMPTS[0], N, VOCAB, salt1)
        with pytest.raises(CheckpointError, match="not a checkpoint of the served model"):
            await server.prepare_model(str(other))
        path = await server.prepare_model(str(step2))
        # a call in flight, held in place, then retracted and recomputed on the new weights
        got: list[int] = []
        got_lps: list[float] = []

        async def read() -> None:
            sub = Submission("across", tuple(PROMPTS[1]), LONG, GREEDY, logprobs=True)
            async for chunk in server.generate(sub):
                got.extend(chunk.token_ids)
                got_lps.extend(chunk.logprobs)

        await hold(server, len(PROMPTS[1]) + 20)  # mid-response when the pause comes
        reader = asyncio.create_task(read())

        async def held_there() -> bool:  # (with --stream-interval 3 some are not sent yet)
            return await held(server) == 1

        await until(held_there)
        await server.pause("keep")
        await hold(server, None)  # only the pause holds it now
        await server.update_weights(path, version="step-2")
        await server.resume()
        await asyncio.wait_for(reader, 60)
        old = greedy_logprobs(PROMPTS[1], LONG, VOCAB, salt1)
        cut = next((i for i, (t, (o, _)) in enumerate(zip(got, old, strict=True)) if t != o), LONG)
        assert 20 <= cut < LONG and list(zip(got[:cut], got_lps[:cut], strict=True)) == old[:cut]
        new = greedy_logprobs(PROMPTS[1] + got[:cut], LONG - cut, VOCAB, salt2)
        assert list(zip(got[cut:], got_lps[cut:], strict=True)) == new
        assert server.model == path
        # a failed load keeps the weights the engine had, and says so
        with pytest.raises(EngineFailed, match="keeps the weights") as exc:
            await server.update_weights(str(tmp_path / "nowhere"))
        assert not exc.value.retry and server.model == path
        tokens, _ = await generate(server, PROMPTS[0], N, GREEDY, "after")
        assert tokens == greedy(PROMPTS[0], N, VOCAB, salt2)
    finally:
        await server.stop()
