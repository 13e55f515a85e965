"""TRL's own GRPOTrainer runs on the CPU with OrchestrRL's pieces: a ``rollout_func`` that
gets TRL's repeated prompts as groups (sampling with plain torch here: no engine yet), the
engines-versus-trainer logprob check, and a step-end callback that writes every new
weight version as a verified checkpoint before the next rollout."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from orchestrrl import checkpoint as ck
from orchestrrl.integrations import trl as orl_trl
from orchestrrl.rl import policy
from orchestrrl.rl.tasks import TargetStop
from tests import helpers

pytestmark = [
    pytest.mark.component,
    pytest.mark.usefixtures("torch_one_thread"),
    # transformers 5.25 deprecates `gradient_checkpointing` for `activation_checkpointing`,
    # and TRL 1.16 itself still calls the old name: their warnings, not ours
    pytest.mark.filterwarnings("ignore:.*gradient_checkpointing.*:FutureWarning"),
]

VOCAB = 64
TASK = TargetStop(VOCAB)


def test_trls_grpo_trainer_runs_with_an_orchestrrl_rollout_and_step_end_push(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func is experimental
    config = policy.llama_config(vocab_size=VOCAB, hidden_size=64)
    model = policy.new_policy(config, seed=0)
    initial = {k: v.clone() for k, v in policy.policy_tensors(model).items()}
    tokenizer = orl_trl.id_tokenizer(VOCAB)
    # text prompts ("t5 t17 ...") as a TRL dataset has them; the rollout reads their ids
    prompts = [" ".join(f"t{t}" for t in p) for p in TASK.prompts(12, seed=1)]
    seen: list[list[Any]] = []
    generate = orl_trl.torch_generate(max_tokens=24, seed=0)

    def recorded(ids: list[tuple[int, ...]], n: int, trainer: Any) -> Any:
        seen.append(ids)
        return generate(ids, n, trainer)

    rollout = orl_trl.RolloutFunc(recorded, tokenizer=tokenizer, tolerance=1e-4)
    pushed: list[ck.Checkpoint] = []
    rewards_seen: list[list[float]] = []

    def reward(completion_ids: list[list[int]], **kw: Any) -> list[float]:
        assert set(kw["weight_version"]) <= {"0", "1", "2"}  # extra fields reach rewards
        scores = [TASK.reward((), c) for c in completion_ids]
        rewards_seen.append(scores)
        return scores

    trainer = helpers.grpo_trainer(
        tmp_path / "out",
        model=model,
        tokenizer=tokenizer,
        prompts=prompts,
        reward=reward,
        rollout_func=rollout,
        callback=orl_trl.StepEndCallback(
            orl_trl.save_checkpoints(tmp_path / "ckpt", config, pushed.append),
            at_train_begin=True,
        ),
        generations=4,
        batch=16,  # 4 prompts x 4 samples per step
        steps=3,
        max_completion=24,
    )
    trainer.train()

    # one rollout per step, each of 4 distinct dataset prompts (TRL repeated each 4 times)
    assert len(seen) == 3 and all(len(ids) == 4 for ids in seen)
    texts = {tuple(tokenizer.encode(p, add_special_tokens=False)) for p in prompts}
    assert all(set(ids) <= texts for ids in seen)
    assert [len(r) for r in rewards_seen] == [16, 16, 16]
    # the rollout used exactly the weights the trainer held (torch samples: ~1e-7)
    assert [c.step for c in rollout.checks] == [0, 1, 2]
    assert max(c.max for c in rollout.checks) < 1e-4
    # version 0 before the first rollout, then one checkpoint per optimizer step
    assert [c.version for c in pushed] == ["0", "1", "2", "3"]
    assert len({c.checksum for c in pushed}) == 4
    for c in pushed:
        assert ck.verify(c.path, config, dtype="F32") == c
    final = policy.policy_tensors(trainer.model)
    assert any(not torch.equal(initial[k], final[k]) for k in initial)
    last = policy.load_policy(pushed[-1])
    assert all(torch.equal(v, final[k]) for k, v in policy.policy_tensors(last).items())
    logged = [h for h in trainer.state.log_history if "reward" in h]
    assert [h["step"] for h in logged] == [1, 2, 3]
