"""The official ``openai`` Python client drives the gateway's ``/v1/completions`` as an RL
framework would: token-id prompts, ``n`` samples, each sampled token's logprob, a seed,
the gateway's own fields through ``extra_body``, streaming, and the gateway's errors as
openai's ``BadRequestError``. Over scripted instances here (their exact tokens and
logprobs are known); over llama.cpp in tests/engines/test_rl_llamacpp_gateway.py.

The gateway reports the logprob of each sampled token only: ``logprobs=0`` asks for it
(as in vLLM); ``logprobs=1`` (one top alternative) is refused naming the field."""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from typing import Any

import openai
import pytest

from sim_backends.token_engine import greedy, greedy_logprobs
from tests.component.test_gateway_http import PROMPT, Gateway, open_gateway

pytestmark = pytest.mark.component


@pytest.fixture
async def gw() -> AsyncIterator[Gateway]:
    async for g in open_gateway():
        yield g


def client(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


def orl(choice: Any) -> dict[str, Any]:
    """The gateway's ``orl`` block of a choice (an extra field to openai's models)."""
    block = (choice.model_extra or {})["orl"]
    assert isinstance(block, dict)
    return block


async def n_samples(
    url: str, prompt: list[int], *, n: int, max_tokens: int, version: str, **kw: Any
) -> list[tuple[list[int], list[float]]]:
    """One call for ``n`` samples with logprobs: every field checked that the gateway
    promises; each sample's token ids and logprobs, by index."""
    async with client(url) as c:
        answer = await c.completions.create(
            model="tiny",
            prompt=prompt,
            n=n,
            logprobs=0,
            max_tokens=max_tokens,
            seed=7,
            extra_body={"request_id": "oa1", "ignore_eos": True, "group": "g-oa", **kw},
        )
    assert answer.id == "oa1" and answer.object == "text_completion"
    assert sorted(c.index for c in answer.choices) == list(range(n))
    out = []
    for choice in sorted(answer.choices, key=lambda c: c.index):
        tokens = (choice.model_extra or {})["token_ids"]
        assert choice.logprobs is not None and choice.logprobs.token_logprobs is not None
        logprobs = choice.logprobs.token_logprobs
        assert len(tokens) == len(logprobs) == max_tokens and choice.finish_reason == "length"
        assert all(math.isfinite(x) and x <= 0 for x in logprobs)
        assert choice.logprobs.tokens == [f"token_id:{t}" for t in tokens]
        assert orl(choice)["request_id"] == f"oa1-{choice.index}"
        assert orl(choice)["weight_versions"] == [[0, version]]  # every token's version
        out.append((tokens, logprobs))
    assert answer.usage is not None
    assert answer.usage.completion_tokens == n * max_tokens
    assert answer.usage.prompt_tokens == len(prompt)
    return out


async def streamed(url: str, prompt: list[int], *, n: int, max_tokens: int) -> dict[int, Any]:
    """``n`` samples streamed: per index its tokens, logprobs, finish reasons and orl block
    (the last event of each index carries it)."""
    got: dict[int, dict[str, Any]] = {}
    async with client(url) as c:
        stream = await c.completions.create(
            model="tiny", prompt=prompt, n=n, logprobs=0, max_tokens=max_tokens, stream=True,
            seed=7, extra_body={"ignore_eos": True},
        )  # fmt: skip
        async for chunk in stream:
            for choice in chunk.choices:
                one = got.setdefault(choice.index, {"tokens": [], "logprobs": [], "finals": []})
                one["tokens"] += (choice.model_extra or {})["token_ids"]
                assert choice.logprobs is not None and choice.logprobs.token_logprobs is not None
                one["logprobs"] += choice.logprobs.token_logprobs
                if choice.finish_reason is not None:
                    one["finals"].append(choice.finish_reason)
                    one["orl"] = orl(choice)
    assert sorted(got) == list(range(n))
    for one in got.values():
        assert len(one["tokens"]) == len(one["logprobs"]) == max_tokens
        assert all(math.isfinite(x) for x in one["logprobs"]) and one["finals"] == ["length"]
    return got


async def refused(url: str, prompt: list[int]) -> None:
    """``n`` above the cap and top-logprobs: openai's BadRequestError naming the field."""
    async with client(url) as c:
        with pytest.raises(openai.BadRequestError) as info:
            await c.completions.create(model="tiny", prompt=prompt, n=65, max_tokens=4)
        assert info.value.status_code == 400 and info.value.param == "n"
        assert "n=65 is not valid: an integer in 1..64" in info.value.message
        with pytest.raises(openai.BadRequestError) as info:
            await c.completions.create(model="tiny", prompt=prompt, logprobs=1, max_tokens=4)
        assert info.value.param == "logprobs" and "null or 0" in info.value.message
        with pytest.raises(openai.NotFoundError) as missing:
            await c.completions.create(model="other", prompt=prompt, max_tokens=4)
        assert missing.value.param == "model"


async def test_n_samples_with_logprobs_versions_and_ids(gw: Gateway) -> None:
    samples = await n_samples(gw.url, PROMPT, n=4, max_tokens=12, version="0", temperature=0)
    expected = greedy(PROMPT, 12)  # the scripted engine's continuation, and its logprobs
    assert samples == [(expected, greedy_logprobs(PROMPT, expected))] * 4
    assert gw.engine.progress().completed_groups == ("g-oa",) * 4  # extra_body's group
    seeds = {sub.sampling.seed for s in gw.servers for _, sub in s.record.submissions}
    assert seeds == {7, 8, 9, 10}  # each sample its own seed


async def test_streamed_samples(gw: Gateway) -> None:
    got = await streamed(gw.url, PROMPT, n=3, max_tokens=20)
    for one in got.values():
        assert one["tokens"] == greedy(PROMPT, 20)
        assert one["logprobs"] == greedy_logprobs(PROMPT, one["tokens"])
        assert one["orl"]["weight_versions"] == [[0, "0"]]


async def test_bad_requests_raise_openais_errors_naming_the_field(gw: Gateway) -> None:
    await refused(gw.url, PROMPT)
    assert gw.engine.progress().completed_groups == ()  # nothing ran
