"""Asynchronous RL on a real llama.cpp gateway (issue 32): a weight update lands while a
rollout producer's requests run, and the staleness bound is enforced for the trainer.

The producer (``orchestrrl.rl.async_groups.AsyncGroups``) keeps groups in flight through
the gateway's HTTP API; the test pushes version 1 with ``in_flight="resume"`` while every
request is part way, then takes batches as a trainer would. Greedy decoding makes every
token checkable: each one must be the argmax (and its logprob the one) of the weights of
the version it is tagged with, given everything before it, so a token lost, repeated or
tagged with the wrong version shows. With ``max_lag = 0`` (every request's
``max_staleness``) the gateway stops the four requests of version 0 when version 1 lands
("stale", their tokens so far), and their groups are dropped and counted, never handed to
the trainer; the groups that replace them run on version 1.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from node_agent.engines import gguf_convert
from node_agent.engines.http_engine import HttpEngine
from orchestrrl.rl.async_groups import AsyncGroups
from orchestrrl.rollout import AsyncRollout, Group
from tests.engines.conftest import (
    LOGPROB_TOL,
    TIE,
    Node,
    Nodes,
    generating_below_the_test,
    settings_for,
)
from tests.engines.reference import Reference
from tests.helpers import eventually

pytestmark = pytest.mark.engine

MAX_TOKENS = 600


@pytest.fixture
async def node(
    llama_binary: Path, hf_model: Path, hf_model_next: Path, tmp_path: Path
) -> AsyncIterator[Node]:
    first = await asyncio.to_thread(gguf_convert.convert, hf_model, tmp_path / "v0.f32.gguf")
    nodes = Nodes("llamacpp", settings_for(llama_binary, first, tmp_path, seqs=4))
    try:
        node = await nodes.add("a", (1,), http=True)
        # the next version converted ahead (as the trainer's checkpoint would be): the
        # update itself then only checks it and restarts the instance
        await node.servers[0].prepare_model(str(hf_model_next))
        yield node
    finally:
        await nodes.close()


def check_tokens(groups: list[Group], refs: dict[str, Reference]) -> set[str]:
    """Every token is its version's greedy choice with its version's logprob, given the
    tokens before it (nothing lost, repeated or mislabelled); the versions of each sample
    never go back. The labels seen."""
    seen: set[str] = set()
    for g in groups:
        for s in g.samples:
            n = len(s.completion_ids)  # all asked for, or up to where the gateway stopped it
            assert n == MAX_TOKENS or (s.finish_reason == "stale" and 0 < n < MAX_TOKENS)
            assert len(s.versions) == n and s.logprobs is not None and len(s.logprobs) == n
            assert list(s.versions) == sorted(s.versions), s.weight_versions
            for label in set(s.versions):
                rec = refs[label].recompute(g.prompt_ids, s.completion_ids)
                at = [j for j, v in enumerate(s.versions) if v == label]
                assert max(rec.argmax_gap[j] for j in at) <= TIE, (s.request_id, label)
                diff = max(abs(rec.logprobs[j] - s.logprobs[j]) for j in at)
                assert diff < LOGPROB_TOL, (s.request_id, label, diff)
            seen |= set(s.versions)
    return seen


async def test_an_update_lands_while_requests_run_and_stale_groups_are_dropped(
    node: Node, hf_model: Path, hf_model_next: Path
) -> None:
    refs = {"0": Reference(hf_model), "1": Reference(hf_model_next)}
    core = node.engine.core

    def prompt_of(k: int) -> list[int]:
        return [5 + k, 17, 3 + 2 * k, 99, 42 + k, 7]

    async with (
        AsyncRollout([node.url]) as rollout,
        AsyncGroups(
            rollout,
            prompt_of,
            batch_groups=1,
            n=2,
            max_staleness=1,  # two groups (4 requests, the instance's 4 seats) ahead
            max_lag=0,  # but only tokens of the trainer's own version are trained
            max_tokens=MAX_TOKENS,
            temperature=0.0,
            ignore_eos=True,
            logprobs=True,
            on_weight_update="resume",
        ) as groups,
    ):
        server = node.servers[0]
        assert isinstance(server, HttpEngine) and server.process.pid is not None
        pid = server.process.pid
        with generating_below_the_test(node.servers):
            await eventually(
                lambda: (
                    len(core.requests) == 4
                    and all(len(r.output) >= 1 for r in core.requests.values())
                ),
                within_s=120,
            )
        # hold the state: the engine frozen with every request part way (however fast it
        # runs), then the update sent; once the gateway has taken the requests off (they
        # will resume on the new weights) the engine may go on: it is restarted on them
        os.kill(pid, signal.SIGSTOP)
        try:
            await asyncio.sleep(0.5)  # what the engine had sent reaches the gateway
            assert not any(r.done for r in core.requests.values())
            update = asyncio.create_task(
                rollout.update_weights(str(hf_model_next), "1", in_flight="resume")
            )
            await eventually(lambda: core.updating == "1", within_s=60)
        finally:
            os.kill(pid, signal.SIGCONT)
        answers = await update
        assert [a["resumed_requests"] for a in answers.values()] == [4], answers
        # version 1 is one past the version of every request's tokens, beyond max_lag = 0:
        # the gateway stopped all four, and their groups are dropped (and replaced) at once
        assert [a["stale_stopped_requests"] for a in answers.values()] == [4], answers
        await eventually(lambda: len(groups.dropped) == 2, within_s=60)
        groups.set_version(1)
        batch = await groups.take(1)
        assert sorted(g.group_id for g in batch.dropped) == ["g0", "g1"]
        assert [g.group_id for g in batch.groups] in (["g2"], ["g3"]) and batch.lags == (0,)
        stopped = [s for g in batch.dropped for s in g.samples]
        assert [s.finish_reason for s in stopped] == ["stale"] * 4
        assert all(set(s.versions) == {"0"} for s in stopped)
        assert not {"g0", "g1"} & {g.group_id for g in groups.trained}
        counts = groups.accounting()
        assert counts["lost"] == 0 and counts["trained"] == 1 and counts["dropped"] == 2

        # every token checked, across the update: version 0's up to the stop, version 1's
        taken = [*batch.dropped, *batch.groups]
        assert check_tokens(taken, refs) == {"0", "1"}
        assert all(s.versions == ("1",) * MAX_TOKENS for s in batch.groups[0].samples)
        ids = [s.request_id for g in taken for s in g.samples]
        assert len(ids) == len(set(ids)) == 6
