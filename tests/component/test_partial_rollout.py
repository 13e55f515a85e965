"""``PartialRollout`` against a real gateway (scripted instances) on 127.0.0.1:0.

The scripted engine continues a sequence by a fixed rule of the sequence and its weights,
so the test knows what an uninterrupted run on each sequence of weights gives; its
:class:`~sim_backends.token_engine.Hold` stops every call at a sequence position, so a
group is held unfinished across a step's end and a weight update however fast the machine
runs (no timing is relied on).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from orchestrrl import errors
from orchestrrl.rollout import AsyncRollout, PartialRollout
from sim_backends.token_engine import greedy, greedy_logprobs
from tests.component.test_gateway_http import Gateway, open_gateway
from tests.helpers import eventually

pytestmark = pytest.mark.component

SHORT = [[5, 17, 3, 99], [6, 18, 4, 98]]  # 4 + 8 tokens: end at position 12
LONG = [[7, 1, 2, 3, 4, 5, 6, 8, 9, 10], [11, 1, 2, 3, 4, 5, 6, 8, 9, 12]]  # end at 18
HOLD_AT = 14  # the long prompts' calls stop after 4 tokens, the short ones finish
MAX_TOKENS = 8


@pytest.fixture
async def gw() -> AsyncIterator[Gateway]:
    async for g in open_gateway(seqs=4):  # 8 seats: every call of a step runs at once
        yield g


async def held(gw: Gateway, calls: int) -> None:
    await eventually(lambda: len(gw.hold.held) == calls)


async def test_unfinished_groups_are_carried_resumed_on_new_weights_and_dropped_when_stale(
    gw: Gateway,
) -> None:
    gw.hold.until(HOLD_AT)
    async with AsyncRollout([gw.url]) as rollout:
        pr = rollout.partial(
            2, n=2, over_provision=2.0, max_staleness=1, max_tokens=MAX_TOKENS, temperature=0
        )
        assert pr.to_start() == 4
        # step 1 on version "0": the short groups complete, the long ones are held at 4 tokens
        first = await pr.step(
            [SHORT[0], LONG[0], SHORT[1], LONG[1]], version="0", group_ids=["s0", "l0", "s1", "l1"]
        )
        assert [g.group_id for g in first.groups] == ["s0", "s1"]
        assert first.carried_groups == ("l0", "l1") and first.dropped == ()
        await held(gw, 4)
        for g, prompt in zip(first.groups, SHORT, strict=True):
            for s in g.samples:
                assert list(s.completion_ids) == greedy(prompt, MAX_TOKENS)
                assert s.versions == ("0",) * MAX_TOKENS
        assert first.tokens_by_version == (("0", 32),) and first.offpolicy_share == 0.0
        assert {c.group_id for c in first.carried} == {"l0", "l1"} and len(first.carried) == 4
        assert pr.to_start() == 2  # two groups are open
        # the weights change under the held calls: they resume on version 2
        await rollout.update_weights("/ckpt/scripted-2", "v2", in_flight="resume")
        gw.hold.release()
        await eventually(lambda: not pr.in_flight())
        gw.hold.until(HOLD_AT)  # the next fresh long groups are held again
        second = await pr.step([LONG[0], LONG[1]], version="v2", group_ids=["l2", "l3"])
        # the carried groups completed first: they are the batch, their tokens v0 then v2
        assert [g.group_id for g in second.groups] == ["l0", "l1"]
        for g, prompt in zip(second.groups, LONG, strict=True):
            for s in g.samples:
                prefix = greedy(prompt, 4)
                rest = greedy([*prompt, *prefix], MAX_TOKENS - 4, weights=2)
                assert list(s.completion_ids) == prefix + rest  # none lost, none repeated
                assert s.versions == ("0",) * 4 + ("v2",) * 4
                assert list(s.logprobs or ()) == greedy_logprobs(
                    prompt, prefix + rest, [0] * 4 + [2] * 4
                )
        assert sorted(c.request_id for c in second.resumed) == sorted(
            s.request_id for g in second.groups for s in g.samples
        )
        assert {c.tokens_by_version for c in second.resumed} == {(("0", 4), ("v2", 4))}
        assert second.tokens_by_version == (("0", 16), ("v2", 16))
        assert second.offpolicy_share == 0.5 and second.offpolicy_tokens == 16
        assert second.carried_groups == ("l2", "l3")
        await held(gw, 4)
        # step 3 on version 3: the groups carried out of step 2 would be trained two versions
        # after their first token: dropped whole, their calls aborted on the gateway
        await rollout.update_weights("/ckpt/scripted-3", "v3", in_flight="resume")
        await held(gw, 4)
        third = await pr.step([SHORT[0], SHORT[1]], version="v3", group_ids=["s2", "s3"])
        assert [g.group_id for g in third.groups] == ["s2", "s3"]
        assert third.dropped == ("l2", "l3") and third.dropped_responses == 4
        assert third.dropped_tokens == 16 and pr.dropped_responses == 4
        assert third.tokens_by_version == (("v3", 32),) and third.carried == ()
        await eventually(lambda: not gw.engine.in_flight())  # nothing left on the gateway
        assert pr.open_groups == 0 and pr.in_flight() == []
        for g, prompt in zip(third.groups, SHORT, strict=True):
            assert {tuple(s.completion_ids) for s in g.samples} == {
                tuple(greedy(prompt, MAX_TOKENS, weights=3))
            }


async def test_a_token_budget_ends_the_step_and_close_aborts_the_rest(gw: Gateway) -> None:
    gw.hold.until(HOLD_AT)
    async with AsyncRollout([gw.url]) as rollout:
        pr = rollout.partial(
            2, n=2, over_provision=1.0, end="tokens", token_budget=16, max_tokens=MAX_TOKENS,
            temperature=0,
        )  # fmt: skip
        step = await pr.step([LONG[0], LONG[1]], version="0")
        assert step.step_tokens >= 16 and step.groups == ()
        assert len(step.carried) == 4 and sum(c.tokens for c in step.carried) >= 16
        await held(gw, 4)
        aborted = await pr.close()
        assert len(aborted) == 4 and pr.open_groups == 0
        await eventually(lambda: not gw.engine.in_flight())


async def test_bad_values_are_refused_naming_the_field(gw: Gateway) -> None:
    async with AsyncRollout([gw.url]) as rollout:
        for kwargs, says in (
            ({"over_provision": 2.5}, "rollout.over_provision=2.5"),
            ({"over_provision": 0.5}, "from 1.0 to 2.0"),
            ({"max_staleness": -1}, "rollout.max_staleness=-1"),
            ({"end": "tokens"}, "rollout.token_budget=0"),
            ({"end": "never"}, "rollout.end='never'"),
            ({"time_budget_s": 3.0}, "rollout.time_budget_s=3.0"),
            ({"over_provision": "2"}, "rollout.over_provision='2'"),
        ):
            with pytest.raises(errors.InvalidArgument, match=says.replace(".", r"\.")):
                rollout.partial(2, n=2, **kwargs)
        with pytest.raises(errors.InvalidArgument, match="groups_per_step=0"):
            rollout.partial(0, n=2)
        pr: PartialRollout = rollout.partial(2, n=2, over_provision=1.5)
        with pytest.raises(errors.InvalidArgument, match=r"prompts='2 prompts'.*: 3 "):
            await pr.step([SHORT[0], SHORT[1]], version="0")
        with pytest.raises(errors.InvalidArgument, match="group_ids"):
            await pr.step([SHORT[0]] * 3, version="0", group_ids=["a", "a", "b"])
        assert pr.open_groups == 0  # nothing was started


async def test_a_time_budget_ends_a_step_while_nothing_arrives(gw: Gateway) -> None:
    gw.hold.until(HOLD_AT)  # every call held at 4 tokens: no event comes after those
    async with AsyncRollout([gw.url]) as rollout:
        pr = rollout.partial(
            2, n=2, over_provision=1.0, end="time", time_budget_s=0.2, max_tokens=MAX_TOKENS,
            temperature=0,
        )  # fmt: skip
        step = await pr.step([LONG[0], LONG[1]], version="0")
        assert step.elapsed_s >= 0.2 and step.groups == ()
        assert len(step.carried_groups) == pr.open_groups == 2  # both carried
        assert await pr.close() and not pr.in_flight()
