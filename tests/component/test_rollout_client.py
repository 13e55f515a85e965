"""``orchestrrl.rollout`` against real gateways (scripted instances) on 127.0.0.1:0."""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import AsyncIterator

import pytest

from orchestrrl import errors
from orchestrrl.rollout import AsyncRollout, Rollout, RolloutError
from sim_backends.token_engine import greedy, greedy_logprobs
from tests.component.test_gateway_http import Gateway, open_gateway
from tests.helpers import eventually

pytestmark = pytest.mark.component

PROMPTS = [[5 + k, 17, 3, 99 - k] for k in range(6)]


@pytest.fixture
async def two() -> AsyncIterator[list[Gateway]]:
    a = open_gateway(in_place=True)
    b = open_gateway(in_place=True)
    ga, gb = await anext(a), await anext(b)
    yield [ga, gb]
    for gen in (a, b):
        with pytest.raises(StopAsyncIteration):
            await anext(gen)


async def test_groups_come_back_in_order_spread_over_the_gateways(two: list[Gateway]) -> None:
    async with AsyncRollout([g.url for g in two]) as rollout:
        groups = await rollout.generate(
            PROMPTS, n=4, max_tokens=12, temperature=0, group_ids=[f"p{k}" for k in range(6)]
        )
    assert [g.group_id for g in groups] == [f"p{k}" for k in range(6)]
    for k, group in enumerate(groups):
        assert group.prompt_ids == tuple(PROMPTS[k]) and len(group.samples) == 4
        for s in group.samples:
            assert list(s.completion_ids) == greedy(PROMPTS[k], 12)
            assert list(s.logprobs or ()) == greedy_logprobs(PROMPTS[k], s.completion_ids)
            assert s.versions == ("0",) * 12 and s.finish_reason == "length"
            assert s.nodes == ("n0",) and s.gateway == group.samples[0].gateway
        assert len({s.request_id for s in group.samples}) == 4
    used = {g.samples[0].gateway for g in groups}
    assert used == {g.url for g in two}  # both gateways got groups


async def test_a_weight_update_reaches_every_gateway_and_tags_the_tokens(
    two: list[Gateway],
) -> None:
    async with AsyncRollout([g.url for g in two]) as rollout:
        answers = await rollout.update_weights("/ckpt/scripted-3", "v3")
        assert {a["version"] for a in answers.values()} == {"v3"}
        groups = await rollout.generate(PROMPTS[:2], n=2, max_tokens=6, temperature=0)
    for k, group in enumerate(groups):
        for s in group.samples:
            assert list(s.completion_ids) == greedy(PROMPTS[k], 6, weights=3)
            assert s.weight_versions == ("v3",)


async def test_an_unreachable_gateway_gets_no_groups(two: list[Gateway]) -> None:
    dead = "http://127.0.0.1:9"  # discard: nothing listens
    async with AsyncRollout([dead, two[0].url]) as rollout:
        groups = await rollout.generate(PROMPTS, n=2, max_tokens=4, temperature=0)
        assert {s.gateway for g in groups for s in g.samples} == {two[0].url}
        with pytest.raises(RolloutError, match="failed on 1 of 2 gateway"):
            await rollout.update_weights("/ckpt/scripted-1", "v1")
    async with AsyncRollout([dead]) as rollout:
        with pytest.raises(errors.Unavailable, match="no gateway could be reached"):
            await rollout.generate(PROMPTS[:1], max_tokens=2)


async def test_bad_input_is_refused_before_anything_is_sent(two: list[Gateway]) -> None:
    with pytest.raises(errors.InvalidArgument, match="gateways"):
        AsyncRollout([])
    with pytest.raises(errors.InvalidArgument, match="gateways"):
        AsyncRollout(["10.0.0.1:80"])
    async with AsyncRollout([two[0].url]) as rollout:
        with pytest.raises(errors.InvalidArgument, match=r"prompts\[1\]"):
            await rollout.generate([[1, 2], []])
        with pytest.raises(errors.InvalidArgument, match="n=65"):
            await rollout.generate([[1]], n=65)
        with pytest.raises(errors.InvalidArgument, match="group_ids"):
            await rollout.generate([[1]], group_ids=["a", "b"])
        with pytest.raises(RolloutError, match=r"HTTP 400.*temperature"):
            await rollout.generate([[1]], temperature=-1)
        for bad in (-1, 65, True):
            with pytest.raises(errors.InvalidArgument, match=r"max_staleness=.*0\.\.64"):
                await rollout.generate([[1]], max_staleness=bad)
            with pytest.raises(errors.InvalidArgument, match=r"max_staleness=.*0\.\.64"):
                await rollout.stream({}, "r", 1, print, print, max_staleness=bad)
    assert two[0].engine.core.requests == {}


async def test_max_staleness_reaches_the_gateway_with_each_request(two: list[Gateway]) -> None:
    async with AsyncRollout([two[0].url]) as rollout:
        two[0].hold.until(len(PROMPTS[0]) + 2)
        task = asyncio.create_task(rollout.generate(PROMPTS[:1], n=2, max_staleness=3))
        await eventually(lambda: len(two[0].hold.held) == 2)
        bounds = [r.max_staleness for r in two[0].engine.core.requests.values()]
        two[0].hold.release()
        (group,) = await task
    assert bounds == [3, 3] and [s.finish_reason for s in group.samples] == ["length"] * 2


async def test_abort_a_group_in_flight(two: list[Gateway]) -> None:
    two[0].hold.until(3 + 10)  # both samples run, held at 10 tokens, until aborted
    async with AsyncRollout([two[0].url]) as rollout:
        call = asyncio.create_task(rollout.generate([[1, 2, 3]], n=2, max_tokens=400))
        await eventually(lambda: len(two[0].hold.held) == 2)
        ids = list(rollout._where)
        assert len(ids) == 2
        assert await rollout.abort(ids) == []
        with pytest.raises(RolloutError, match="HTTP 409"):
            await call


def test_the_synchronous_client() -> None:
    """``Rollout`` blocks on its own event loop (a gateway serves from another thread)."""
    urls: queue.Queue[str] = queue.Queue()
    loop = asyncio.new_event_loop()
    stop = asyncio.Event()

    async def serve() -> None:
        gen = open_gateway()
        urls.put((await anext(gen)).url)
        await stop.wait()
        with pytest.raises(StopAsyncIteration):
            await anext(gen)

    thread = threading.Thread(target=loop.run_until_complete, args=(serve(),))
    thread.start()
    try:
        with Rollout([urls.get(timeout=30)]) as rollout:
            (group,) = rollout.generate([[4, 4, 4]], n=3, max_tokens=5, temperature=0)
        assert [list(s.completion_ids) for s in group.samples] == [greedy([4, 4, 4], 5)] * 3
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(30)
        loop.close()
