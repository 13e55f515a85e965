"""GRPO on the policy: the clipped policy-gradient loss and a trainer that steps it.

:func:`clipped_pg_loss` is PPO's clipped surrogate with the rollout's own (behaviour)
logprobs as the old policy: ``ratio = exp(logp_now - logp_rollout)`` per token,
``loss = -min(ratio * A, clip(ratio, 1 - eps_low, 1 + eps_high) * A)``, averaged over
every token of the batch (``token-mean``, DAPO's and TRL's default) or per sequence first
(``seq-mean``, the original GRPO). No KL term (TRL's default ``beta=0``).

:class:`PolicyTrainer.step` takes the groups of one rollout and their rewards, first
recomputes every sampled token's logprob under the weights it holds (the version it
pushed to the engines) and compares them with the logprobs the engines reported (a step
whose engines did not serve these weights shows it here: :class:`LogprobMismatch` when a
tolerance is set, before anything changes), then runs the optimizer over the batch and
advances its weight version by one. :meth:`PolicyTrainer.save` writes the weights as the
checkpoint of that version.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from transformers import LlamaForCausalLM

from orchestrrl import checkpoint, errors
from orchestrrl.rl import policy
from orchestrrl.rl.grpo import Sample, Scale, check_groups, group_advantages, percentile

Aggregation = Literal["token-mean", "seq-mean"]


class LogprobMismatch(errors.FailedPrecondition):
    """The engines' logprobs differ from the trainer's beyond the tolerance: they did not
    sample from the weights the trainer holds (an update that did not take, or another
    model). Raised before the step changes anything."""

    def __init__(self, version: int, mean: float, worst: float, tolerance: float) -> None:
        self.mean, self.max, self.tolerance = mean, worst, tolerance
        super().__init__(
            f"rollout logprobs differ from the trainer's under weight version {version}: "
            f"max |diff| {worst:.3g} > tolerance {tolerance:.3g} (mean {mean:.3g}); "
            "did every engine load this version?"
        )


def clipped_pg_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    aggregation: Aggregation = "token-mean",
) -> tuple[torch.Tensor, dict[str, float]]:
    """The clipped surrogate loss of ``[B, T]`` token logprobs against ``old_logprobs``
    (the behaviour policy's) with per-sequence ``advantages`` ``[B]``; ``mask`` ``[B, T]``
    marks real tokens. Returns the loss and ``{"clip_fraction", "ratio_mean"}``."""
    mask = mask.to(logprobs.dtype)
    ratio = torch.exp(logprobs - old_logprobs)
    adv = advantages[:, None].to(logprobs.dtype)
    clipped = torch.clamp(ratio, 1 - eps_low, 1 + eps_high)
    per_token = -torch.min(ratio * adv, clipped * adv)
    tokens = mask.sum().clamp(min=1.0)
    if aggregation == "token-mean":
        loss = (per_token * mask).sum() / tokens
    elif aggregation == "seq-mean":
        loss = ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    else:
        raise errors.field_error("aggregation", aggregation, "token-mean | seq-mean")
    with torch.no_grad():
        was_clipped = ((ratio * adv) > (clipped * adv)).to(mask.dtype) * mask
        stats = {
            "clip_fraction": float(was_clipped.sum() / tokens),
            "ratio_mean": float((ratio * mask).sum() / tokens),
        }
    return loss, stats


@dataclass(frozen=True)
class TrainConfig:
    learning_rate: float = 1e-3
    eps_low: float = 0.2
    eps_high: float = 0.28  # DAPO's clip-higher
    aggregation: Aggregation = "token-mean"
    scale: Scale = "group"
    minibatches: int = 1  # optimizer steps per rollout
    max_grad_norm: float = 1.0
    temperature: float = 1.0  # the rollout's sampling temperature
    logprob_tolerance: float | None = None  # raise LogprobMismatch above it
    # earlier weight versions kept to check the tokens they sampled (partial rollout's
    # carried responses: its max_staleness); 0: every token is checked under the current
    keep_versions: int = 0
    micro_batch: int = 64
    weight_decay: float = 0.0

    def __post_init__(self) -> None:
        p = errors.Problems()
        for name in ("learning_rate", "max_grad_norm", "temperature"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
                p.add(str(errors.field_error(name, value, "a number > 0")))
        for name in ("eps_low", "eps_high"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and 0 <= value < 10):
                p.add(str(errors.field_error(name, value, "a number in [0, 10)")))
        if self.aggregation not in ("token-mean", "seq-mean"):
            p.add(str(errors.field_error("aggregation", self.aggregation, "token-mean | seq-mean")))
        if self.scale not in ("group", "batch", "none"):
            p.add(str(errors.field_error("scale", self.scale, "group | batch | none")))
        kv = self.keep_versions
        if not isinstance(kv, int) or isinstance(kv, bool) or not 0 <= kv <= 16:
            p.add(str(errors.field_error("keep_versions", kv, "an integer 0..16")))
        for name in ("minibatches", "micro_batch"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= 4096:
                p.add(str(errors.field_error(name, value, "an integer 1..4096")))
        tol = self.logprob_tolerance
        if tol is not None and not (isinstance(tol, int | float) and tol > 0):
            p.add(str(errors.field_error("logprob_tolerance", tol, "a number > 0, or None")))
        if p:
            raise p.error()


@dataclass(frozen=True)
class StepReport:
    """What one GRPO step did, from the weight version it trained to the next."""

    version: int  # the weights the rollout should have used
    new_version: int
    samples: int
    tokens: int
    reward_mean: float
    reward_std: float
    length_mean: float
    length_p50: float
    length_p99: float
    stop_fraction: float  # samples that ended with end-of-sequence
    logprob_diff_mean: float  # |engine - trainer| over every sampled token
    logprob_diff_max: float
    loss: float
    clip_fraction: float
    grad_norm: float
    seconds: float
    # tokens of an earlier version than ``version`` (checked under the weights kept for it)
    offpolicy_tokens: int = 0

    def row(self) -> dict[str, float | int]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


class PolicyTrainer:
    """GRPO on one policy. ``version`` counts weight updates: the weights it holds are
    version ``version``; each :meth:`step` makes the next one."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        model_config: Mapping[str, Any],
        config: TrainConfig | None = None,
        *,
        version: int = 0,
    ) -> None:
        self.model = model
        self.model_config = dict(model_config)
        self.config = config or TrainConfig()
        self.version = version
        self._kept: dict[int, dict[str, torch.Tensor]] = {}  # version -> its weights
        self._scratch: LlamaForCausalLM | None = None  # a model to load kept weights into
        self.optimizer = torch.optim.AdamW(
            model.parameters(),
            lr=self.config.learning_rate,
            weight_decay=self.config.weight_decay,
        )

    @classmethod
    def from_checkpoint(
        cls, ckpt: checkpoint.Checkpoint, config: TrainConfig | None = None
    ) -> PolicyTrainer:
        """The trainer of a checkpoint whose version label is a number (optimizer state
        starts fresh: a checkpoint holds weights only)."""
        if not ckpt.version.isdigit():
            raise errors.field_error("version", ckpt.version, "a number (the trainer's count)")
        model = policy.load_policy(ckpt)
        return cls(model, checkpoint.read_config(ckpt), config, version=int(ckpt.version))

    def save(self, root: Path) -> checkpoint.Checkpoint:
        """The current weights as checkpoint ``str(version)`` under ``root``."""
        return policy.save_policy(self.model, root, str(self.version), self.model_config)

    def logprobs(self, samples: Sequence[Sample]) -> tuple[torch.Tensor, torch.Tensor]:
        return policy.token_logprobs(
            self.model,
            [s.prompt_ids for s in samples],
            [s.completion_ids for s in samples],
            temperature=self.config.temperature,
            micro_batch=self.config.micro_batch,
        )

    def step(
        self, groups: Sequence[Sequence[Sample]], rewards: Sequence[Sequence[float]]
    ) -> StepReport:
        started = time.perf_counter()
        check_groups(groups, rewards)
        cfg = self.config
        flat = [s for g in groups for s in g]
        width = max(len(s.completion_ids) for s in flat)
        old = torch.zeros(len(flat), width)
        for i, s in enumerate(flat):
            old[i, : len(s.logprobs)] = torch.tensor(s.logprobs)
        self.model.train()
        with torch.no_grad():
            now, mask = self.logprobs(flat)
            offpolicy = self._under_kept_versions(flat, now)
        diff = (now - old).abs()[mask]
        diff_mean = float(diff.mean()) if diff.numel() else 0.0
        diff_max = float(diff.max()) if diff.numel() else 0.0
        if cfg.logprob_tolerance is not None and diff_max > cfg.logprob_tolerance:
            raise LogprobMismatch(self.version, diff_mean, diff_max, cfg.logprob_tolerance)
        advantages = torch.tensor(
            [a for g in group_advantages(rewards, cfg.scale) for a in g], dtype=torch.float32
        )
        order = torch.randperm(len(flat), generator=torch.Generator().manual_seed(self.version))
        chunks = [c for c in order.chunk(cfg.minibatches) if c.numel()]
        before = (
            {k: v.detach().clone() for k, v in self.model.state_dict().items()}
            if cfg.keep_versions
            else None
        )
        losses, clips, norms = [], [], []
        for chunk in chunks:
            idx = chunk.tolist()
            logp, m = self.logprobs([flat[i] for i in idx])
            loss, stats = clipped_pg_loss(
                logp,
                old[idx, : logp.shape[1]],
                advantages[idx],
                m,
                eps_low=cfg.eps_low,
                eps_high=cfg.eps_high,
                aggregation=cfg.aggregation,
            )
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()  # type: ignore[no-untyped-call]
            norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.max_grad_norm)
            self.optimizer.step()
            losses.append(float(loss.detach()))
            clips.append(stats["clip_fraction"])
            norms.append(float(norm))
        trained_from = self.version
        self.version += 1
        if before is not None:
            self._kept[trained_from] = before
            for v in sorted(self._kept)[: -cfg.keep_versions]:
                del self._kept[v]
        flat_rewards = [r for g in rewards for r in g]
        mean = sum(flat_rewards) / len(flat_rewards)
        lengths = [float(len(s.completion_ids)) for s in flat]
        return StepReport(
            version=trained_from,
            new_version=self.version,
            samples=len(flat),
            tokens=int(mask.sum()),
            reward_mean=mean,
            reward_std=math.sqrt(sum((r - mean) ** 2 for r in flat_rewards) / len(flat_rewards)),
            length_mean=sum(lengths) / len(lengths),
            length_p50=percentile(lengths, 50),
            length_p99=percentile(lengths, 99),
            stop_fraction=sum(s.finish == "stop" for s in flat) / len(flat),
            logprob_diff_mean=diff_mean,
            logprob_diff_max=diff_max,
            loss=sum(losses) / len(losses),
            clip_fraction=sum(clips) / len(clips),
            grad_norm=max(norms),
            seconds=time.perf_counter() - started,
            offpolicy_tokens=offpolicy,
        )

    @property
    def kept_versions(self) -> tuple[int, ...]:
        """The earlier weight versions held to check the tokens they sampled."""
        return tuple(sorted(self._kept))

    def _under_kept_versions(self, flat: Sequence[Sample], now: torch.Tensor) -> int:
        """Replace, in ``now``, the logprob of every token sampled by a kept earlier
        version with its recomputation under that version's weights; the number of such
        tokens. Tokens labelled otherwise stay checked under the current weights."""
        by_version: dict[int, list[int]] = {}
        labels = [s.token_versions() for s in flat]
        for i, versions in enumerate(labels):
            for label in set(versions):
                if label.isdigit() and int(label) in self._kept:
                    by_version.setdefault(int(label), []).append(i)
        count = 0
        for v, rows in sorted(by_version.items()):
            scratch = self._scratch_model()
            scratch.load_state_dict(self._kept[v])
            recomputed, _ = policy.token_logprobs(
                scratch,
                [flat[i].prompt_ids for i in rows],
                [flat[i].completion_ids for i in rows],
                temperature=self.config.temperature,
                micro_batch=self.config.micro_batch,
            )
            for r, i in enumerate(rows):
                at = torch.tensor([label == str(v) for label in labels[i]], dtype=torch.bool)
                now[i, : len(at)][at] = recomputed[r, : len(at)][at]
                count += int(at.sum())
        return count

    def _scratch_model(self) -> LlamaForCausalLM:
        if self._scratch is None:
            self._scratch = copy.deepcopy(self.model)
            self._scratch.train(False)
        return self._scratch
