"""GRPO steps: the clipped loss, the engines-versus-trainer logprob check, one weight version
per step, and a tiny random policy that learns the toy task without any engine."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from orchestrrl import checkpoint as ck
from orchestrrl import errors
from orchestrrl.rl import policy
from orchestrrl.rl.grpo import Sample
from orchestrrl.rl.tasks import TargetStop
from orchestrrl.rl.trainer import LogprobMismatch, PolicyTrainer, TrainConfig, clipped_pg_loss

pytestmark = [pytest.mark.unit, pytest.mark.usefixtures("torch_one_thread")]

CONFIG = policy.llama_config(vocab_size=64, hidden_size=64, num_hidden_layers=2)
TASK = TargetStop(64)


def test_the_loss_is_the_clipped_surrogate() -> None:
    old = torch.log(torch.tensor([[0.5, 0.5, 0.5], [0.5, 0.5, 0.5]]))
    new = torch.log(torch.tensor([[0.5, 0.75, 0.25], [0.5, 0.75, 0.9]])).requires_grad_()
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    adv = torch.tensor([1.0, -2.0])
    loss, stats = clipped_pg_loss(new, old, adv, mask, eps_low=0.2, eps_high=0.2)
    # ratios: row 0 (A=1): 1, 1.5 -> clipped 1.2, 0.5 -> min 0.5; row 1 (A=-2): 1, 1.5 (kept)
    per_token = [-1.0, -1.2, -0.5, 2.0, 3.0]
    assert float(loss.detach()) == pytest.approx(sum(per_token) / 5)
    assert stats["clip_fraction"] == pytest.approx(1 / 5)
    loss.backward()  # type: ignore[no-untyped-call]
    assert new.grad is not None
    assert float(new.grad[0, 1]) == 0.0  # clipped: no gradient
    assert float(new.grad[1, 2]) == 0.0  # masked
    assert float(new.grad[0, 2]) != 0.0
    seq, _ = clipped_pg_loss(new, old, adv, mask, eps_low=0.2, eps_high=0.2, aggregation="seq-mean")
    assert float(seq.detach()) == pytest.approx(((-1.0 - 1.2 - 0.5) / 3 + (2.0 + 3.0) / 2) / 2)
    with pytest.raises(errors.InvalidArgument, match="aggregation='sum'"):
        clipped_pg_loss(new, old, adv, mask, aggregation="sum")  # type: ignore[arg-type]


def test_a_bad_train_config_names_each_field() -> None:
    with pytest.raises(errors.InvalidArgument) as e:
        TrainConfig(learning_rate=0, minibatches=0, logprob_tolerance=-1, scale="x")  # type: ignore[arg-type]
    text = str(e.value)
    for name in ("learning_rate=0", "minibatches=0", "logprob_tolerance=-1", "scale='x'"):
        assert name in text


def rollout(
    model: torch.nn.Module, step: int, n: int = 8
) -> tuple[list[list[Sample]], list[list[float]]]:
    groups = policy.sample(model, TASK.prompts(8, seed=step), n=n, max_tokens=24, seed=step)  # type: ignore[arg-type]
    return groups, [[TASK.reward(s.prompt_ids, s.completion_ids) for s in g] for g in groups]


def test_a_step_makes_the_next_version_and_saves_it(tmp_path: Path) -> None:
    trainer = PolicyTrainer(policy.new_policy(CONFIG, 0), CONFIG, TrainConfig(learning_rate=1e-2))
    before = {k: v.clone() for k, v in policy.policy_tensors(trainer.model).items()}
    first = trainer.save(tmp_path)
    assert first.version == "0"
    report = trainer.step(*rollout(trainer.model, 0))
    assert (report.version, report.new_version, trainer.version) == (0, 1, 1)
    assert report.samples == 64 and report.tokens > 64
    assert report.logprob_diff_max < 1e-5  # sampled by these very weights
    assert 0 <= report.stop_fraction <= 1 and report.length_p50 <= report.length_p99 <= 24
    after = policy.policy_tensors(trainer.model)
    assert any(not torch.equal(before[k], after[k]) for k in before)
    second = trainer.save(tmp_path)
    assert second.version == "1" and second.checksum != first.checksum
    resumed = PolicyTrainer.from_checkpoint(ck.verify(second.path, CONFIG))
    assert resumed.version == 1
    assert all(torch.equal(after[k], v) for k, v in policy.policy_tensors(resumed.model).items())


def test_a_rollout_from_weights_the_trainer_no_longer_holds_fails_the_check() -> None:
    """What a step whose engines kept the old version looks like: refused, nothing changed."""
    strict = TrainConfig(learning_rate=1e-2, logprob_tolerance=1e-3)
    trainer = PolicyTrainer(policy.new_policy(CONFIG, 0), CONFIG, strict)
    stale = rollout(trainer.model, 0)  # sampled from version 0
    trainer.step(*stale)  # fine: the trainer held version 0
    held = {k: v.clone() for k, v in policy.policy_tensors(trainer.model).items()}
    with pytest.raises(LogprobMismatch) as e:
        trainer.step(*stale)  # version 0's samples again, but the trainer holds version 1
    assert "under weight version 1" in str(e.value) and "did every engine load" in str(e.value)
    assert e.value.max > 1e-3
    assert trainer.version == 1
    assert all(torch.equal(held[k], v) for k, v in policy.policy_tensors(trainer.model).items())
    trainer.step(*rollout(trainer.model, 1))  # fresh samples from version 1 pass
    assert trainer.version == 2


def test_minibatches_make_several_updates_and_ratios_move_off_one() -> None:
    trainer = PolicyTrainer(
        policy.new_policy(CONFIG, 0), CONFIG, TrainConfig(learning_rate=3e-2, minibatches=4)
    )
    report = trainer.step(*rollout(trainer.model, 0))
    assert report.new_version == 1 and report.clip_fraction > 0  # later minibatches are off-policy


def test_a_tiny_random_policy_learns_the_toy_task_in_a_few_steps() -> None:
    """Twelve GRPO steps of 8 prompts x 8 samples, sampled with torch: the reward rises and
    the responses get shorter (they learn to stop near the target length)."""
    torch.manual_seed(0)
    trainer = PolicyTrainer(policy.new_policy(CONFIG, 0), CONFIG, TrainConfig(learning_rate=1e-2))
    reports = [trainer.step(*rollout(trainer.model, step)) for step in range(12)]
    first = sum(r.reward_mean for r in reports[:3]) / 3
    last = sum(r.reward_mean for r in reports[-3:]) / 3
    long_before = sum(r.length_mean for r in reports[:3]) / 3
    long_after = sum(r.length_mean for r in reports[-3:]) / 3
    assert last > first + 0.2, [round(r.reward_mean, 3) for r in reports]
    assert long_after < long_before - 5, [round(r.length_mean, 1) for r in reports]
    assert max(r.logprob_diff_max for r in reports) < 1e-4


def test_tokens_of_a_kept_earlier_version_are_checked_under_its_weights() -> None:
    """Partial rollout: a response carried across an update has tokens of the previous
    version; with keep_versions the trainer checks each token under the weights that
    sampled it, and counts them off-policy."""
    strict = TrainConfig(learning_rate=1e-2, logprob_tolerance=1e-3, keep_versions=1)
    trainer = PolicyTrainer(policy.new_policy(CONFIG, 0), CONFIG, strict)
    groups, rewards = rollout(trainer.model, 0)
    trainer.step(groups, rewards)
    assert trainer.version == 1 and trainer.kept_versions == (0,)

    def carried(labels: tuple[str, str]) -> list[list[Sample]]:
        """The same responses, their first half made by version 0, the rest by 1."""
        out = []
        for g in groups:
            batch = []
            for s in g:
                n = len(s.completion_ids)
                k = n // 2
                with torch.no_grad():
                    now, _ = policy.token_logprobs(
                        trainer.model, [s.prompt_ids], [s.completion_ids]
                    )
                lps = (*s.logprobs[:k], *now[0, k:n].tolist())
                versions = (labels[0],) * k + (labels[1],) * (n - k)
                batch.append(Sample(s.prompt_ids, s.completion_ids, lps, s.finish, "", versions))
            out.append(batch)
        return out

    with pytest.raises(LogprobMismatch):
        trainer.step(carried(("1", "1")), rewards)  # mislabelled: version 1 did not make them
    assert trainer.version == 1
    report = trainer.step(carried(("0", "1")), rewards)
    assert report.offpolicy_tokens == sum(len(s.completion_ids) // 2 for g in groups for s in g)
    assert report.logprob_diff_max < 1e-3
    assert trainer.kept_versions == (1,)  # one kept: version 0 is gone
    with pytest.raises(LogprobMismatch):
        trainer.step(carried(("0", "1")), rewards)  # version 0 is no longer held
    with pytest.raises(errors.InvalidArgument, match="keep_versions=17"):
        TrainConfig(keep_versions=17)
    with pytest.raises(errors.InvalidArgument, match="versions='3 values'"):
        Sample((1,), (2, 3), (-1.0, -1.0), "stop", "", ("0", "0", "1"))
