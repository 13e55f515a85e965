"""The RL loop through real gateways over llama.cpp: the trainer's policy (a Hugging Face
Llama in torch) is converted to GGUF and served by two nodes' gateways, each over its
own llama-server; rollouts go through them with :mod:`orchestrrl.rollout`, and every
new weight version reaches the engines through the gateways' ``/orl/v1/update_weights``
(llama.cpp: converted to GGUF, the instance restarted on it).

- TRL's own ``GRPOTrainer`` (``use_vllm=False``) drives it: its ``rollout_func`` is
  :class:`orchestrrl.integrations.trl.RolloutFunc` over the gateways, each step end
  pushes the new checkpoint, and every rollout's tokens carry the version the trainer
  holds and pass its logprob check.
- A step whose engine did not take the new weights fails the check
  (:class:`LogprobMismatch` naming the version): a gateway not updated, and a gateway
  updated to other weights under the right label.
- A checkpoint that is missing, truncated or of another shape is refused naming the file
  and the problem; the engines keep the version they had and serve it unchanged.

Tolerance: ``LOGPROB_TOL`` (1e-3, fp32 engine against fp32 recomputation), as
tests/engines/test_llamacpp_weights.py; the figures measured are printed (``-s``).
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import torch

from node_agent.engines import gguf_convert
from orchestrrl import checkpoint as ck
from orchestrrl.integrations import trl as orl_trl
from orchestrrl.rl import policy
from orchestrrl.rl.tasks import TargetStop
from orchestrrl.rl.trainer import LogprobMismatch, PolicyTrainer, TrainConfig
from orchestrrl.rollout import AsyncRollout, Rollout
from tests import helpers
from tests.engines.conftest import LOGPROB_TOL, Node, Nodes, settings_for

pytestmark = [
    pytest.mark.engine,
    pytest.mark.usefixtures("torch_one_thread"),
    # transformers 5.25 deprecates `gradient_checkpointing` for `activation_checkpointing`,
    # and TRL 1.16 itself still calls the old name: their warnings, not ours
    pytest.mark.filterwarnings("ignore:.*gradient_checkpointing.*:FutureWarning"),
]

VOCAB, N, MAX_TOKENS = 64, 4, 16
TASK = TargetStop(VOCAB)
CONFIG = policy.llama_config(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2)


@dataclass
class Cluster:
    nodes: list[Node]
    root: Path  # the trainer's checkpoints
    model: Any  # the trainer's policy, version 0 (served by both gateways)

    @property
    def urls(self) -> list[str]:
        return [n.url for n in self.nodes]

    async def post(self, node: int, path: str, body: dict[str, Any]) -> tuple[int, Any]:
        async with (
            aiohttp.ClientSession() as http,
            http.post(self.urls[node] + path, json=body) as r,
        ):
            return r.status, json.loads(await r.text())


@pytest.fixture
async def cluster(llama_binary: Path, tmp_path: Path) -> AsyncIterator[Cluster]:
    model = policy.new_policy(CONFIG, seed=0)
    root = tmp_path / "ckpt"
    first = policy.save_policy(model, root, "0", CONFIG)
    gguf = await asyncio.to_thread(gguf_convert.convert, first.path, tmp_path / "policy-0.gguf")
    nodes = Nodes("llamacpp", settings_for(llama_binary, gguf, tmp_path / "logs", context=256))
    try:
        for k in range(2):  # one llama-server each, on its own core
            await nodes.add(f"n{k}", (1,), http=True, cpu_offset=k % (os.cpu_count() or 1))
        yield Cluster(nodes.nodes, root, model)
    finally:
        await nodes.close()


def versions(groups: Sequence[Sequence[Any]]) -> set[str]:
    return {s.version for g in groups for s in g}


async def test_trls_grpo_trainer_generates_through_the_gateways_and_pushes_each_step(
    cluster: Cluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func is experimental
    tokenizer = orl_trl.id_tokenizer(VOCAB)
    prompts = [" ".join(f"t{t}" for t in p) for p in TASK.prompts(6, seed=1)]
    seen: list[tuple[int, set[str]]] = []  # step, versions of its tokens
    pushed: list[str] = []

    def reward(completion_ids: list[list[int]], **kw: Any) -> list[float]:
        return [TASK.reward((), c) for c in completion_ids]

    def train() -> Any:
        torch.set_num_threads(1)  # this thread's own setting
        with Rollout(cluster.urls) as rollout:
            generate = orl_trl.rollout_generate(rollout, max_tokens=MAX_TOKENS, seed=5)

            def recorded(ids: list[tuple[int, ...]], n: int, trainer: Any) -> Any:
                groups = generate(ids, n, trainer)
                step = int(trainer.state.global_step)
                seen.append((step, versions(groups)))
                return groups

            def push(c: ck.Checkpoint) -> None:
                answers = rollout.update_weights(str(c.path), c.version)
                assert {a["version"] for a in answers.values()} == {c.version}
                pushed.append(c.version)

            func = orl_trl.RolloutFunc(recorded, tokenizer=tokenizer, tolerance=LOGPROB_TOL)
            trainer = helpers.grpo_trainer(
                tmp_path / "out",
                model=cluster.model,
                tokenizer=tokenizer,
                prompts=prompts,
                reward=reward,
                rollout_func=func,
                callback=orl_trl.StepEndCallback(
                    orl_trl.save_checkpoints(cluster.root, CONFIG, push)
                ),
                generations=N,
                batch=8,  # 2 prompts x 4 samples per step
                steps=3,
                max_completion=MAX_TOKENS,
            )
            trainer.train()
            return trainer, func.checks

    trainer, checks = await asyncio.to_thread(train)
    # one rollout per step, on the weights of that step: the version every token carries
    assert seen == [(0, {"0"}), (1, {"1"}), (2, {"2"})]
    # and the engines' logprobs are the trainer's under those weights
    assert [c.step for c in checks] == [0, 1, 2]
    for c in checks:
        print(f"step {c.step}: {c.tokens} tokens, |diff| mean {c.mean:.1e} max {c.max:.1e}")
    assert max(c.max for c in checks) < LOGPROB_TOL
    assert pushed == ["1", "2", "3"]  # each optimizer step's weights reached both gateways
    assert all(n.engine.weight_version == "3" for n in cluster.nodes)
    logged = [h for h in trainer.state.log_history if "reward" in h]
    assert [h["step"] for h in logged] == [1, 2, 3]


async def test_a_step_whose_engine_kept_old_weights_fails_the_logprob_check(
    cluster: Cluster,
) -> None:
    trainer = PolicyTrainer(
        cluster.model, CONFIG, TrainConfig(learning_rate=1e-2, logprob_tolerance=LOGPROB_TOL)
    )
    prompts = TASK.prompts(4, seed=3)

    async def rollout(gateways: list[str], seed: int) -> list[list[Any]]:
        async with AsyncRollout(gateways) as r:
            groups = await r.generate(prompts, n=N, max_tokens=MAX_TOKENS, seed=seed)
        assert {s.gateway for g in groups for s in g.samples} == set(gateways)  # both used
        return orl_trl.samples_of(groups)

    def rewards(groups: list[list[Any]]) -> list[list[float]]:
        return [[TASK.reward(s.prompt_ids, s.completion_ids) for s in g] for g in groups]

    def step(groups: list[list[Any]]) -> Any:
        return trainer.step(groups, rewards(groups))

    async def push(node: int, c: ck.Checkpoint) -> None:
        async with AsyncRollout([cluster.urls[node]]) as r:
            await r.update_weights(str(c.path), c.version)

    groups = await rollout(cluster.urls, seed=1)
    assert versions(groups) == {"0"}
    report = await asyncio.to_thread(step, groups)
    assert report.logprob_diff_max < LOGPROB_TOL and trainer.version == 1
    v1 = await asyncio.to_thread(trainer.save, cluster.root)

    # node 0 takes version 1, node 1 is not told: its samples fail the trainer's check
    await push(0, v1)
    groups = await rollout(cluster.urls, seed=2)
    by_node = {s.version for g in groups for s in g}
    assert by_node == {"0", "1"}
    with pytest.raises(LogprobMismatch, match="under weight version 1") as stale:
        await asyncio.to_thread(step, groups)
    fresh = [s for g in groups for s in g if s.version == "1"]
    with torch.no_grad():
        now, mask = trainer.logprobs(fresh)
    old = torch.zeros_like(now)
    for i, s in enumerate(fresh):
        old[i, : len(s.logprobs)] = torch.tensor(s.logprobs)
    assert float((now - old).abs()[mask].max()) < LOGPROB_TOL  # node 0's are right
    print(f"stale engine: max |diff| {stale.value.max:.3f} (mean {stale.value.mean:.3f})")
    assert trainer.version == 1  # the failed step changed nothing

    # node 1 takes other weights under the right label: the label says "1", the check
    # still fails (it compares what was computed, not what was claimed)
    other = policy.save_policy(
        policy.new_policy(CONFIG, seed=99), cluster.root.parent / "other", "1", CONFIG
    )
    await push(1, other)
    groups = await rollout(cluster.urls, seed=3)
    assert versions(groups) == {"1"}
    with pytest.raises(LogprobMismatch, match="under weight version 1"):
        await asyncio.to_thread(step, groups)

    # node 1 takes the real version 1: the step passes
    await push(1, v1)
    groups = await rollout(cluster.urls, seed=4)
    report = await asyncio.to_thread(step, groups)
    assert report.logprob_diff_max < LOGPROB_TOL and trainer.version == 2


async def test_a_bad_checkpoint_is_refused_naming_the_file_and_the_old_weights_serve_on(
    cluster: Cluster, tmp_path: Path
) -> None:
    greedy = {"prompt": [5, 17, 3], "max_tokens": 8, "temperature": 0, "logprobs": 0}
    _, before = await cluster.post(0, "/v1/completions", greedy)
    good = policy.save_policy(policy.new_policy(CONFIG, seed=1), tmp_path / "good", "1", CONFIG)
    truncated = tmp_path / "truncated"
    await asyncio.to_thread(_copy_truncated, good.path, truncated)
    bigger = policy.llama_config(vocab_size=VOCAB, hidden_size=128, num_hidden_layers=2)
    wrong = policy.save_policy(policy.new_policy(bigger, seed=1), tmp_path / "wrong", "1", bigger)
    cases = [
        (tmp_path / "nowhere", "nowhere/config.json: missing"),
        (truncated, "truncated/model.safetensors: truncated: tensor"),
        (wrong.path, "not of the served model's shape"),
    ]
    for path, names in cases:
        status, answer = await cluster.post(
            0, "/orl/v1/update_weights", {"path": str(path), "version": "1"}
        )
        message = answer["error"]["message"]
        print(f"{path.name}: HTTP {status}: {message}")
        assert status == 400 and names in message, message
        assert cluster.nodes[0].engine.weight_version == "0"
        _, after = await cluster.post(0, "/v1/completions", greedy)
        assert after["choices"][0]["token_ids"] == before["choices"][0]["token_ids"]
        assert after["choices"][0]["orl"]["weight_versions"] == [[0, "0"]]


def _copy_truncated(src: Path, dst: Path) -> None:
    """``src`` copied to ``dst`` with its weights file cut to half its length."""
    dst.mkdir()
    for f in src.iterdir():
        data = f.read_bytes()
        if f.name == ck.WEIGHTS:
            data = data[: len(data) // 2]
        (dst / f.name).write_bytes(data)


async def test_the_openai_client_gets_the_trainers_logprobs_from_llamacpp(
    cluster: Cluster,
) -> None:
    from tests.component.test_openai_client import n_samples, refused, streamed

    prompt = list(TASK.prompts(1, seed=9)[0])
    url = cluster.urls[0]
    samples = await n_samples(url, prompt, n=4, max_tokens=MAX_TOKENS, version="0")
    samples += [
        (s["tokens"], s["logprobs"])
        for s in (await streamed(url, prompt, n=2, max_tokens=MAX_TOKENS)).values()
    ]
    with torch.no_grad():
        now, _ = policy.token_logprobs(
            cluster.model, [prompt] * len(samples), [t for t, _ in samples]
        )
    worst = float((now - torch.tensor([lp for _, lp in samples])).abs().max())
    print(f"openai client, llama.cpp: {len(samples)} samples, max |diff| {worst:.1e}")
    assert worst < LOGPROB_TOL
    await refused(url, prompt)
