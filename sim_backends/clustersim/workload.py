"""GRPO-style rollout workload: prompts x samples, long-tailed, capped, drifting.

Deterministic for a seed: step ``k`` draws from its own ``random.Random`` seeded by
``(seed, k)``, so a step's requests do not depend on how many steps were drawn before.

Response length of sample ``j`` of prompt ``i`` in step ``k``::

    median_k * exp(sigma_p * Z_i + sigma_s * Z_ij),   capped at max_response_tokens

with ``median_k = median_response_tokens * (1 + drift_per_step) ** k``: the prompt term
makes the samples of a hard prompt long together (as GRPO groups are), the sample term
spreads them, and the log-normal gives the long tail; the cap is the generation limit.
Parameters and their basis: :class:`~sim_backends.clustersim.scenario.WorkloadConfig`.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from sim_backends.clustersim.scenario import WorkloadConfig


@dataclass(frozen=True)
class RolloutRequest:
    id: str
    prompt: int  # prompt index within the step (the GRPO group)
    prompt_tokens: int
    response_tokens: int  # what the policy will generate (unknown to the scheduler)


@dataclass(frozen=True)
class StepWorkload:
    step: int
    requests: tuple[RolloutRequest, ...]

    @property
    def response_tokens(self) -> int:
        return sum(r.response_tokens for r in self.requests)

    @property
    def total_tokens(self) -> int:
        return sum(r.response_tokens + r.prompt_tokens for r in self.requests)


def median_at(cfg: WorkloadConfig, step: int) -> float:
    return cfg.median_response_tokens * (1.0 + cfg.drift_per_step) ** step


def step_workload(cfg: WorkloadConfig, seed: int, step: int) -> StepWorkload:
    """The requests of RL step ``step`` (0-based)."""
    rng = random.Random(f"orl-sim/{seed}/{step}")
    median = median_at(cfg, step)
    reqs: list[RolloutRequest] = []
    for i in range(cfg.prompts_per_step):
        prompt_tokens = max(
            1, round(cfg.prompt_tokens * math.exp(rng.gauss(0.0, cfg.prompt_sigma)))
        )
        difficulty = rng.gauss(0.0, cfg.prompt_sigma_response)
        for j in range(cfg.samples_per_prompt):
            raw = median * math.exp(difficulty + rng.gauss(0.0, cfg.sample_sigma))
            length = max(1, min(cfg.max_response_tokens, round(raw)))
            reqs.append(RolloutRequest(f"s{step}-p{i}-r{j}", i, prompt_tokens, length))
    return StepWorkload(step, tuple(reqs))


def workload(cfg: WorkloadConfig, seed: int, steps: int) -> tuple[StepWorkload, ...]:
    return tuple(step_workload(cfg, seed, k) for k in range(steps))
