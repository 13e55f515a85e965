"""The trainer/rollout split of an asynchronous RL job, planned every period.

verl's fully-async recipe asks its users to tune the split by hand from two measured
idle ratios (its README: "If rollouter/idle_ratio is high and trainer/idle_ratio is low,
Trainer resources should be increased and Rollouter resources should be reduced, and
vice versa"). This planner does it every planning period from the same evidence:

- the trainer's rate: GPU-seconds of training per trained token over the period
  (``train_busy_s x train_gpus / trained_tokens``, its collectives included), assumed to
  scale with the GPUs given to it;
- the rollout's rate: tokens generated per GPU-second while the engines had work
  (``generated_tokens / (gen_gpus x wall - rollout idle GPU-seconds)``), likewise;
- the forecast: tokens a group will generate (responses) and train (prompt and
  responses) in the coming period.

A split of ``T`` training GPUs then delivers ``min(T / (g_t x P), (total - T) x r / R)``
groups per second (``g_t`` GPU-seconds per trained token, ``P`` trained tokens per group,
``r`` generated tokens per rollout GPU-second, ``R`` generated tokens per group). The
planner takes the split of the highest rate within the bounds, moving by ``unit`` GPUs,
and only when the gain over one period beats the move's pause plus a margin
(``margin_rel`` of the period). It also requires the measured idle ratios to agree with
the move: GPUs go to the trainer only if the rollout side idled more than the trainer
did in the period, and the other way round (no move on the model's word alone).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from orchestrrl import errors


@dataclass(frozen=True)
class PeriodMeasure:
    """What one planning period measured on the current split."""

    train_gpus: int
    gen_gpus: int
    wall_s: float
    trainer_wait_s: float  # the trainer waited for complete groups
    train_busy_s: float  # the trainer trained (and pushed weights)
    trained_tokens: float  # prompt and response tokens trained
    generated_tokens: float  # tokens the engines decoded
    rollout_idle_gpu_s: float  # GPU-seconds the engines had nothing to run or were paused

    @property
    def trainer_idle(self) -> float:
        return self.trainer_wait_s / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def rollout_idle(self) -> float:
        total = self.gen_gpus * self.wall_s
        return self.rollout_idle_gpu_s / total if total > 0 else 0.0


@dataclass(frozen=True)
class SplitDecision:
    train_gpus: int
    gen_gpus: int
    changed: bool
    switch_s: float
    reason: str
    rates: tuple[tuple[int, float], ...]  # (training GPUs, predicted groups per second)


def plan_async_split(
    m: PeriodMeasure,
    *,
    unit: int,
    min_train_gpus: int,
    max_train_gpus: int,
    train_tokens_per_group: float,
    gen_tokens_per_group: float,
    period_s: float,
    switch_s: Callable[[int, int], float],
    margin_rel: float = 0.05,
) -> SplitDecision:
    """The next period's split (module doc). ``switch_s(from_train, to_train)``: the
    pause of moving between the two splits; bounds of 0 mean "any"."""
    total = m.train_gpus + m.gen_gpus
    if unit < 1 or m.train_gpus % unit or m.gen_gpus % unit:
        raise errors.field_error("unit", unit, "a positive divisor of both pools' GPUs")
    if not (train_tokens_per_group > 0 and gen_tokens_per_group > 0):
        raise errors.field_error(
            "tokens_per_group",
            (train_tokens_per_group, gen_tokens_per_group),
            "two numbers > 0",
        )
    keep = SplitDecision(m.train_gpus, m.gen_gpus, False, 0.0, "", ())
    active = m.gen_gpus * m.wall_s - m.rollout_idle_gpu_s
    if m.trained_tokens <= 0 or m.train_busy_s <= 0 or m.generated_tokens <= 0 or active <= 0:
        return _with(keep, "split kept: the period measured no training or no generation yet")
    gpu_s_per_token = m.train_busy_s * m.train_gpus / m.trained_tokens
    gen_rate = m.generated_tokens / active  # tokens per rollout GPU-second

    def rate(t: int) -> float:
        train = t / (gpu_s_per_token * train_tokens_per_group)
        gen = (total - t) * gen_rate / gen_tokens_per_group
        return min(train, gen)

    lo = max(unit, min_train_gpus or unit)
    hi = min(total - unit, max_train_gpus or total - unit)
    options = tuple((t, rate(t)) for t in range(lo, hi + 1, unit))
    if not options:
        return _with(keep, f"split kept: no split of {total} GPUs within the bounds")
    now = rate(m.train_gpus)
    best_t, best = max(options, key=lambda o: (o[1], -abs(o[0] - m.train_gpus)))
    idle = (
        f"trainer idle {m.trainer_idle:.0%}, rollout idle {m.rollout_idle:.0%} "
        f"of the last {m.wall_s:.0f} s"
    )
    cur = f"{m.gen_gpus}/{m.train_gpus}"
    if best_t == m.train_gpus or best <= now:
        return SplitDecision(
            m.train_gpus,
            m.gen_gpus,
            False,
            0.0,
            f"split {cur} (gen/train GPUs) kept: the best ({idle}; {now:.3f} groups/s)",
            options,
        )
    to_train = best_t > m.train_gpus
    if to_train and m.rollout_idle <= m.trainer_idle:
        return SplitDecision(
            m.train_gpus,
            m.gen_gpus,
            False,
            0.0,
            f"split {cur} kept: the model favours {total - best_t}/{best_t} but the rollout "
            f"side idled no more than the trainer ({idle})",
            options,
        )
    if not to_train and m.trainer_idle <= m.rollout_idle:
        return SplitDecision(
            m.train_gpus,
            m.gen_gpus,
            False,
            0.0,
            f"split {cur} kept: the model favours {total - best_t}/{best_t} but the trainer "
            f"idled no more than the rollout side ({idle})",
            options,
        )
    pause = switch_s(m.train_gpus, best_t)
    gain_s = period_s * (1.0 - now / best)  # time one period saves at the better rate
    margin = margin_rel * period_s
    if gain_s <= pause + margin:
        return SplitDecision(
            m.train_gpus,
            m.gen_gpus,
            False,
            0.0,
            f"split {cur} kept: {total - best_t}/{best_t} would save {gain_s:.1f} s a period, "
            f"not more than its {pause:.1f} s move and the {margin:.1f} s margin ({idle})",
            options,
        )
    return SplitDecision(
        best_t,
        total - best_t,
        True,
        pause,
        f"split {cur} -> {total - best_t}/{best_t} (gen/train GPUs): {idle}; predicted "
        f"{now:.3f} -> {best:.3f} groups/s, the move pauses {pause:.1f} s",
        options,
    )


def _with(d: SplitDecision, reason: str) -> SplitDecision:
    return SplitDecision(d.train_gpus, d.gen_gpus, d.changed, d.switch_s, reason, d.rates)
