"""``orchestrrl.rl.async_groups`` against real gateways (scripted instances) on 127.0.0.1:0:
the producer keeps within the staleness bound, the trainer gets complete groups, and
groups that went stale while the new weights were on their way are dropped at once and
replaced (never handed to the trainer, never a stall)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from orchestrrl import errors
from orchestrrl.rl.async_groups import AsyncGroups
from orchestrrl.rollout import AsyncRollout
from tests.component.test_gateway_http import Gateway, open_gateway
from tests.helpers import eventually

pytestmark = pytest.mark.component


@pytest.fixture
async def gateway() -> AsyncIterator[Gateway]:
    gen = open_gateway(in_place=True)
    yield await anext(gen)
    with pytest.raises(StopAsyncIteration):
        await anext(gen)


def prompt_of(k: int) -> list[int]:
    return [5 + k, 17, 3, 99]


async def test_stale_groups_are_dropped_and_replaced_until_the_weights_land(
    gateway: Gateway,
) -> None:
    async with (
        AsyncRollout([gateway.url]) as rollout,
        AsyncGroups(
            rollout, prompt_of, batch_groups=2, n=2, max_staleness=0, max_tokens=6,
            temperature=0.0,
        ) as groups,
    ):  # fmt: skip
        first = await groups.take(0)
        assert [g.group_id for g in first.groups] == ["g0", "g1"] and first.lags == (0, 0)
        assert groups.started <= 4  # the bound: (1 + 0) x 2 groups past the 2 consumed
        # the trainer holds version 1, but the engines still run version 0: every group
        # that completes now is one version behind, dropped as it is seen, and replaced
        second = asyncio.create_task(groups.take(1))
        await eventually(lambda: len(groups.dropped) >= 4, within_s=30)
        assert not second.done()
        await rollout.update_weights("/ckpt/scripted-1", "1")
        batch = await asyncio.wait_for(second, 30)
    assert batch.lags == (0, 0) and len(batch.dropped) >= 4
    for g in batch.groups:
        assert all(s.versions == ("1",) * 6 for s in g.samples)
    for g in groups.dropped:
        assert all("0" in s.versions for s in g.samples)
    trained = {g.group_id for g in groups.trained}
    assert trained.isdisjoint(g.group_id for g in groups.dropped)
    counts = groups.accounting()
    assert counts["lost"] == 0 and counts["trained"] == 4


async def test_a_group_the_gateway_stops_as_stale_is_dropped_and_counted(
    gateway: Gateway,
) -> None:
    """Every request carries ``max_staleness = max_lag``: a group held at token 3 while
    version 1 lands is stopped by the gateway ("stale"), dropped and replaced; the
    replacement, on version 1, is what the trainer gets."""
    gateway.hold.until(len(prompt_of(0)) + 3)
    async with (
        AsyncRollout([gateway.url]) as rollout,
        AsyncGroups(
            rollout, prompt_of, batch_groups=1, n=2, max_staleness=0, max_tokens=6,
            temperature=0.0, on_weight_update="resume",
        ) as groups,
    ):  # fmt: skip
        await eventually(lambda: len(gateway.hold.held) == 2)  # g0's samples, at token 3
        await rollout.update_weights("/ckpt/scripted-1", "1")
        gateway.hold.release()
        groups.set_version(1)
        batch = await asyncio.wait_for(groups.take(1), 30)
    (stopped,) = groups.dropped
    assert stopped.group_id == "g0" and [g.group_id for g in batch.dropped] == ["g0"]
    assert [s.finish_reason for s in stopped.samples] == ["stale", "stale"]
    assert all(s.versions == ("0",) * 3 for s in stopped.samples)
    (trained,) = batch.groups
    assert trained.group_id == "g1" and batch.lags == (0,)
    assert all(s.versions == ("1",) * 6 for s in trained.samples)
    assert gateway.engine.stale_stopped == 2
    counts = groups.accounting()
    assert counts["lost"] == 0 and counts["dropped"] == 1 and counts["trained"] == 1


async def test_bad_settings_are_named(gateway: Gateway) -> None:
    async with AsyncRollout([gateway.url]) as rollout:
        with pytest.raises(errors.InvalidArgument) as info:
            AsyncGroups(rollout, prompt_of, batch_groups=0, n=65, max_staleness=-1)
    message = str(info.value)
    assert "batch_groups=0 is not valid: an integer in 1..1024" in message
    assert "n=65 is not valid: an integer in 1..64" in message
    assert "max_staleness=-1 is not valid: an integer in 0..64" in message
