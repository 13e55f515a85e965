"""GRPO-style rollout workload: prompts x samples, long-tailed, capped, drifting.

Deterministic for a seed: step ``k`` draws from its own ``random.Random`` seeded by
``(seed, k)``, so a step's requests do not depend on how many steps were drawn before.

Response length of sample ``j`` of prompt ``i`` in step ``k``::

    median_k * exp(sigma_p * Z_i + sigma_s * Z_ij),   capped at max_response_tokens

with ``median_k = median_response_tokens * (1 + drift_per_step) ** k``: the prompt term
makes the samples of a hard prompt long together (as GRPO groups are), the sample term
spreads them, and the log-normal gives the long tail; the cap is the generation limit.
Parameters and their basis: :class:`~sim_backends.clustersim.scenario.WorkloadConfig`.

With ``dataset_prompts = N > 0`` the prompts come from a finite dataset, walked as a
DataLoader with ``shuffle=True, drop_last=True`` does: epoch ``e`` is a seeded
permutation of the ``N`` prompts, cut into ``N // prompts_per_step`` steps. Prompt ``p``
keeps its prompt length and its difficulty ``Z_p`` across epochs (seeded by ``(seed,
p)``); in epoch ``e`` its prompt term is ``sigma_p * Z_p + difficulty_drift_sigma *
Z_pe`` (the policy changes between epochs) and its samples are drawn afresh (seeded by
``(seed, p, e)``). The simulated steps are ``start_step, start_step + 1, ...`` of the
run, and ``median_response_tokens`` is the median at ``start_step`` (earlier steps, met
as a prompt's previous occurrence, have the drift taken back). Every request then carries
its prompt's id and, when ``prompt_history`` is on and the prompt was met before, its
:class:`PromptHistory` (what a real RL loop knows from its previous epoch).
"""

from __future__ import annotations

import functools
import math
import random
from dataclasses import dataclass

from sim_backends.clustersim.scenario import WorkloadConfig


@dataclass(frozen=True)
class PromptHistory:
    """A prompt's previous occurrence (in an earlier epoch), as the RL loop saw it."""

    lengths: tuple[int, ...]  # the response lengths of its samples then
    step_log_mean: float  # log-mean response length of every request of that step
    steps_ago: int


@dataclass(frozen=True)
class RolloutRequest:
    id: str
    prompt: int  # prompt index within the step (the GRPO group)
    prompt_tokens: int
    response_tokens: int  # what the policy will generate (unknown to the scheduler)
    dataset_prompt: int | None = None  # the prompt's id in the dataset (None: fresh)
    previous: PromptHistory | None = None  # None: not seen before, or not passed on


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
    """The median response length of simulated step ``step`` (0: the first simulated
    step, the run's ``start_step``; negative: a step before it)."""
    return cfg.median_response_tokens * (1.0 + cfg.drift_per_step) ** step


def steps_per_epoch(cfg: WorkloadConfig) -> int:
    """Steps of one pass over the dataset (drop_last: the remainder is skipped)."""
    return cfg.dataset_prompts // cfg.prompts_per_step


def step_workload(cfg: WorkloadConfig, seed: int, step: int) -> StepWorkload:
    """The requests of simulated RL step ``step`` (0-based; the run's step
    ``cfg.start_step + step``)."""
    if cfg.dataset_prompts > 0:
        return _dataset_step_workload(cfg, seed, step)
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


# -- a finite dataset walked over epochs --


@functools.lru_cache(maxsize=8)
def _epoch_order(prompts: int, seed: int, epoch: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The shuffled prompt order of an epoch, and each prompt's position in it."""
    order = list(range(prompts))
    random.Random(f"orl-sim/{seed}/epoch{epoch}").shuffle(order)
    position = [0] * prompts
    for i, p in enumerate(order):
        position[p] = i
    return tuple(order), tuple(position)


def _prompt_at(cfg: WorkloadConfig, seed: int, prompt: int, epoch: int) -> tuple[int, float]:
    """A prompt's prompt tokens (fixed) and its prompt term in ``epoch``."""
    rng = random.Random(f"orl-sim/{seed}/prompt{prompt}")
    tokens = max(1, round(cfg.prompt_tokens * math.exp(rng.gauss(0.0, cfg.prompt_sigma))))
    difficulty = rng.gauss(0.0, cfg.prompt_sigma_response)
    if cfg.difficulty_drift_sigma > 0:
        change = random.Random(f"orl-sim/{seed}/prompt{prompt}/epoch{epoch}/difficulty")
        difficulty += change.gauss(0.0, cfg.difficulty_drift_sigma)
    return tokens, difficulty


@functools.lru_cache(maxsize=64)
def _run_step(
    cfg: WorkloadConfig, seed: int, run_step: int
) -> tuple[tuple[int, int, tuple[int, ...]], ...]:
    """Run step ``run_step`` (absolute, >= 0): per prompt of the step, in order, its
    dataset id, its prompt tokens and its samples' response lengths."""
    per_epoch = steps_per_epoch(cfg)
    epoch, index = divmod(run_step, per_epoch)
    order, _ = _epoch_order(cfg.dataset_prompts, seed, epoch)
    median = median_at(cfg, run_step - cfg.start_step)
    rows = []
    n = cfg.prompts_per_step
    for p in order[index * n : (index + 1) * n]:
        tokens, difficulty = _prompt_at(cfg, seed, p, epoch)
        rng = random.Random(f"orl-sim/{seed}/prompt{p}/epoch{epoch}")
        lengths = tuple(
            max(
                1,
                min(
                    cfg.max_response_tokens,
                    round(median * math.exp(difficulty + rng.gauss(0.0, cfg.sample_sigma))),
                ),
            )
            for _ in range(cfg.samples_per_prompt)
        )
        rows.append((p, tokens, lengths))
    return tuple(rows)


@functools.lru_cache(maxsize=64)
def _run_step_log_mean(cfg: WorkloadConfig, seed: int, run_step: int) -> float:
    logs = [math.log(x) for _, _, lengths in _run_step(cfg, seed, run_step) for x in lengths]
    return sum(logs) / len(logs)


def previous_occurrence(
    cfg: WorkloadConfig, seed: int, prompt: int, run_step: int
) -> PromptHistory | None:
    """Prompt ``prompt``'s latest occurrence before run step ``run_step`` (in an earlier
    epoch; one dropped by drop_last is skipped), or None if it never occurred."""
    per_epoch = steps_per_epoch(cfg)
    epoch = run_step // per_epoch
    for e in range(epoch - 1, -1, -1):
        _, position = _epoch_order(cfg.dataset_prompts, seed, e)
        index = position[prompt] // cfg.prompts_per_step
        if index >= per_epoch:
            continue
        then = e * per_epoch + index
        rows = _run_step(cfg, seed, then)
        lengths = next(ls for p, _, ls in rows if p == prompt)
        return PromptHistory(lengths, _run_step_log_mean(cfg, seed, then), run_step - then)
    return None


def _dataset_step_workload(cfg: WorkloadConfig, seed: int, step: int) -> StepWorkload:
    run_step = cfg.start_step + step
    reqs: list[RolloutRequest] = []
    for i, (p, tokens, lengths) in enumerate(_run_step(cfg, seed, run_step)):
        previous = previous_occurrence(cfg, seed, p, run_step) if cfg.prompt_history else None
        reqs.extend(
            RolloutRequest(f"s{step}-p{i}-r{j}", i, tokens, length, p, previous)
            for j, length in enumerate(lengths)
        )
    return StepWorkload(step, tuple(reqs))
