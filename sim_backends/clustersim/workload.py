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
    # partial rollout: the GRPO group's name across steps ("" : "p<prompt>", one step's)
    # and the tokens already generated in earlier steps (carried with their prefix)
    group: str = ""
    generated: int = 0


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
    reqs = [r for d in group_draws(cfg, seed, step) for r in group_requests(cfg, d, step)]
    return StepWorkload(step, tuple(reqs))


@dataclass(frozen=True)
class GroupDraw:
    """One prompt group as drawn, before the policy's drift is applied: the ``index``-th
    prompt of chunk ``chunk`` (the prompts of simulated step ``chunk`` under full
    rollout), its prompt tokens, and per sample the log of its length over the median
    (prompt term + sample term)."""

    chunk: int
    index: int
    prompt_tokens: int
    log_terms: tuple[float, ...]
    dataset_prompt: int | None = None
    previous: PromptHistory | None = None


def _length(cfg: WorkloadConfig, median: float, log_term: float) -> int:
    return max(1, min(cfg.max_response_tokens, round(median * math.exp(log_term))))


@functools.lru_cache(maxsize=64)
def group_draws(cfg: WorkloadConfig, seed: int, chunk: int) -> tuple[GroupDraw, ...]:
    """The ``prompts_per_step`` groups of chunk ``chunk``: a stream of prompts cut into
    steps' worth (partial rollout takes them at its own pace)."""
    if cfg.dataset_prompts > 0:
        run_step = cfg.start_step + chunk
        return tuple(
            GroupDraw(
                chunk,
                i,
                tokens,
                terms,
                p,
                previous_occurrence(cfg, seed, p, run_step) if cfg.prompt_history else None,
            )
            for i, (p, tokens, terms) in enumerate(_run_step_terms(cfg, seed, run_step))
        )
    rng = random.Random(f"orl-sim/{seed}/{chunk}")
    out = []
    for i in range(cfg.prompts_per_step):
        prompt_tokens = max(
            1, round(cfg.prompt_tokens * math.exp(rng.gauss(0.0, cfg.prompt_sigma)))
        )
        difficulty = rng.gauss(0.0, cfg.prompt_sigma_response)
        terms = tuple(
            difficulty + rng.gauss(0.0, cfg.sample_sigma) for _ in range(cfg.samples_per_prompt)
        )
        out.append(GroupDraw(chunk, i, prompt_tokens, terms))
    return tuple(out)


def group_requests(
    cfg: WorkloadConfig, draw: GroupDraw, step: int, *, group: str = ""
) -> tuple[RolloutRequest, ...]:
    """A group's requests when simulated step ``step`` starts it: lengths at that step's
    median (so a prompt drawn for a later chunk gets the policy of the step that runs it).
    Ids name the chunk: ``s<chunk>-p<index>-r<sample>``."""
    median = median_at(cfg, step)
    return tuple(
        RolloutRequest(
            f"s{draw.chunk}-p{draw.index}-r{j}",
            draw.index,
            draw.prompt_tokens,
            _length(cfg, median, term),
            draw.dataset_prompt,
            draw.previous,
            group,
        )
        for j, term in enumerate(draw.log_terms)
    )


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
def _run_step_terms(
    cfg: WorkloadConfig, seed: int, run_step: int
) -> tuple[tuple[int, int, tuple[float, ...]], ...]:
    """Run step ``run_step`` (absolute, >= 0): per prompt of the step, in order, its
    dataset id, its prompt tokens and its samples' log lengths over the median."""
    per_epoch = steps_per_epoch(cfg)
    epoch, index = divmod(run_step, per_epoch)
    order, _ = _epoch_order(cfg.dataset_prompts, seed, epoch)
    rows = []
    n = cfg.prompts_per_step
    for p in order[index * n : (index + 1) * n]:
        tokens, difficulty = _prompt_at(cfg, seed, p, epoch)
        rng = random.Random(f"orl-sim/{seed}/prompt{p}/epoch{epoch}")
        terms = tuple(
            difficulty + rng.gauss(0.0, cfg.sample_sigma) for _ in range(cfg.samples_per_prompt)
        )
        rows.append((p, tokens, terms))
    return tuple(rows)


@functools.lru_cache(maxsize=64)
def _run_step(
    cfg: WorkloadConfig, seed: int, run_step: int
) -> tuple[tuple[int, int, tuple[int, ...]], ...]:
    """Run step ``run_step`` (absolute, >= 0): per prompt of the step, in order, its
    dataset id, its prompt tokens and its samples' response lengths."""
    median = median_at(cfg, run_step - cfg.start_step)
    return tuple(
        (p, tokens, tuple(_length(cfg, median, t) for t in terms))
        for p, tokens, terms in _run_step_terms(cfg, seed, run_step)
    )


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
