"""GRPO's data and its group arithmetic, pure (no torch).

A rollout answers each prompt with a *group* of ``n`` samples; GRPO scores every sample
against its own group: ``advantage = (reward - mean of the group) / (std of the group +
eps)`` (the std with Bessel's correction, as TRL's ``GRPOTrainer`` computes it), so a
group whose samples all scored the same teaches nothing (all advantages 0).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from orchestrrl import errors

Scale = Literal["group", "batch", "none"]
SCALES: tuple[Scale, ...] = ("group", "batch", "none")
FINISH = ("stop", "length", "abort")


@dataclass(frozen=True)
class Sample:
    """One sampled response: token ids in and out, and the behaviour policy's logprob of
    each output token (what the engine reported), the reason it ended and the weight
    version that produced it (``""``: not known). ``versions``: the version of each
    output token, for a response that spans several (partial rollout carries responses
    across weight updates); empty: every token is ``version``'s."""

    prompt_ids: tuple[int, ...]
    completion_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish: str = "length"
    version: str = ""
    versions: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if len(self.logprobs) != len(self.completion_ids):
            raise errors.field_error(
                "logprobs",
                f"{len(self.logprobs)} values",
                f"one per completion token ({len(self.completion_ids)})",
            )
        if self.versions and len(self.versions) != len(self.completion_ids):
            raise errors.field_error(
                "versions",
                f"{len(self.versions)} values",
                f"none, or one per completion token ({len(self.completion_ids)})",
            )
        if not self.prompt_ids:
            raise errors.field_error("prompt_ids", self.prompt_ids, "at least one token")
        if self.finish not in FINISH:
            raise errors.field_error("finish", self.finish, " | ".join(FINISH))

    def token_versions(self) -> tuple[str, ...]:
        """The version of each output token."""
        return self.versions or (self.version,) * len(self.completion_ids)


def check_groups(groups: Sequence[Sequence[Sample]], rewards: Sequence[Sequence[float]]) -> None:
    """Groups of at least two samples of one prompt each, one finite reward per sample;
    InvalidArgument naming the first bad group otherwise."""
    if not groups:
        raise errors.field_error("groups", [], "at least one group")
    if len(rewards) != len(groups):
        raise errors.field_error("rewards", f"{len(rewards)} groups", f"{len(groups)} groups")
    for g, (group, scores) in enumerate(zip(groups, rewards, strict=True)):
        if len(group) < 2:
            raise errors.field_error(f"groups[{g}]", f"{len(group)} samples", "at least 2")
        if len(scores) != len(group):
            raise errors.field_error(f"rewards[{g}]", f"{len(scores)} values", f"{len(group)}")
        if any(s.prompt_ids != group[0].prompt_ids for s in group):
            raise errors.field_error(f"groups[{g}]", "mixed prompts", "samples of one prompt")
        if not all(math.isfinite(r) for r in scores):
            raise errors.field_error(f"rewards[{g}]", list(scores), "finite numbers")


def _std(values: Sequence[float], mean: float) -> float:
    if len(values) < 2:
        return 0.0
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))


def group_advantages(
    rewards: Sequence[Sequence[float]], scale: Scale = "group", eps: float = 1e-4
) -> tuple[tuple[float, ...], ...]:
    """Each reward minus its group's mean, divided by its group's std (``group``), the
    whole batch's std (``batch``) or not at all (``none``), plus ``eps``."""
    if scale not in SCALES:
        raise errors.field_error("scale", scale, " | ".join(SCALES))
    if not eps >= 0:
        raise errors.field_error("eps", eps, "a number >= 0")
    means = [sum(g) / len(g) if g else 0.0 for g in rewards]
    flat = [r for g in rewards for r in g]
    batch_std = _std(flat, sum(flat) / len(flat)) if flat else 0.0
    out = []
    for group, mean in zip(rewards, means, strict=True):
        if scale == "none":
            out.append(tuple(r - mean for r in group))
            continue
        scale_by = (_std(group, mean) if scale == "group" else batch_std) + eps
        # a group (or batch) whose rewards are all alike carries no signal: advantage 0
        out.append(tuple((r - mean) / scale_by if scale_by > 0 else 0.0 for r in group))
    return tuple(out)


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100) by linear interpolation; 0.0 of nothing."""
    if not values:
        return 0.0
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)
