"""Forecast of response lengths: within a step and across steps.

Within a step the planner needs, for a request that has generated ``g`` tokens, the
distribution of its *remaining* length given that it is still running. We estimate the
survival function ``S(l) = P(L > l)`` of the response length ``L`` with the
Kaplan-Meier estimator over a pooled, weighted sample:

- responses completed in this step (events);
- requests still running in this step (right-censored at the tokens generated so far:
  early in a step only the short responses have finished, and censoring is what keeps
  that from biasing the estimate short);
- the completed lengths of recent steps, rescaled by the predicted drift (below), as a
  prior whose total weight equals the number of requests seen in this step times
  ``prior_strength`` (each past step weighted by ``history_decay ** age``).

Beyond the largest observation the survival function continues as an exponential tail
whose mean is the mean residual length above the 90th percentile of the estimate, and is
cut at ``max_tokens`` (the generation limit: a request that reaches it stops there).
Then ``E[L - g | L > g] = (integral of S from g to max) / S(g)`` and the q-quantile of the
remaining length solves ``S(g + r) = (1 - q) S(g)``.

Across steps, response lengths drift (they typically grow as RL training proceeds). We
follow the per-step log-mean (geometric mean) of completed lengths with Holt's linear
exponential smoothing (level + trend; Holt 1957, see Hyndman & Athanasopoulos,
*Forecasting: Principles and Practice*, 3rd ed., section 8.2) and rescale each past
step's lengths by ``exp(predicted log-mean - that step's log-mean)``, i.e. we assume the
shape of the distribution is stable and its scale drifts. The factor is clamped to
``[1/max_drift, max_drift]``.

Within a sample group (the GRPO samples of one prompt) lengths are correlated: a hard
prompt makes all its samples long. Seer (arXiv 2511.14617) schedules on exactly this
signal, probing a group with its first requests. We model the log length of a sample as
``mu + d_p + e`` (a one-way random-effects model: ``d_p`` the prompt's difficulty, ``e``
the sample's own spread) and estimate ``d_p`` by its best linear predictor (the shrunk
group mean, the variance components by the ANOVA method of moments; Searle, Casella &
McCulloch, *Variance Components*, 1992, section 3.5). A completed sample contributes its
log length; a running one at ``g`` tokens contributes ``log E[L | L > g]`` under the
pooled forecast (a censored observation imputed, so that groups whose samples are still
running after many tokens look long). Early in a step every sample runs at about the
same ``g``: the imputed values agree, the between-group variance is estimated at zero
and no group is scaled. A request of group ``p`` then has its length distribution scaled
by ``exp(d_p)`` (:func:`predict_remaining_groups`).

Across epochs: an RL run walks a finite dataset many times (DAPO-17k at 512 prompts per
step comes back to a prompt every ~34 steps), so from the second epoch on the loop knows
the lengths of a prompt's samples at its previous occurrence. :func:`prior_log_scales`
turns them into a prior for ``d_p``: the prompt's previous log-mean relative to the
log-mean of the whole step it was in (which removes the length drift between the two
occurrences), shrunk by its own best linear predictor (the previous samples' variance
components, as above) and multiplied by ``ForecastConfig.epoch_prior_weight``, the
assumed correlation of a prompt's difficulty between epochs (the policy changes in
between). Within the step the siblings then update it: the group's shrunk estimate is
taken toward its prior instead of toward zero, ``d_p = prior_p + s_p (m_p - prior_p)``
with ``m_p`` the group's mean log length less the grand mean and ``s_p`` the same
shrinkage factor as without a prior (the BLUP with a known prior mean); when the step
shows no between-group signal yet (its start) ``d_p = prior_p``.

The simulator passes both signals (groups and priors). The controller's compute loop
(``fabric_controller.scheduling.decide``) passes neither yet: the engines' request
telemetry carries a request's tokens and instance but no prompt identity, so it cannot
tell siblings apart nor look up a prompt's previous epoch; a rollout driver that tags
each request with its prompt id (and keeps its lengths per epoch) would supply both.
"""

from __future__ import annotations

import bisect
import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from orchestrrl import errors


@dataclass(frozen=True)
class ForecastConfig:
    holt_alpha: float = 0.5
    holt_beta: float = 0.3
    history_decay: float = 0.5
    prior_strength: float = 1.0
    max_points_per_step: int = 512
    max_drift: float = 2.0
    tail_quantile: float = 0.9
    # Used only when nothing at all is known (no history, nothing completed): an
    # exponential distribution with this mean.
    fallback_mean_tokens: float = 1024.0
    # a group's length scale exp(d_p) is clamped to exp(+-group_max_log_scale)
    group_max_log_scale: float = 2.0
    # how much of a prompt's difficulty at its previous occurrence (previous epoch) is
    # assumed to carry over: the correlation of the prompt term between epochs. 0.8 is an
    # assumption (the policy is retrained between two occurrences, ~34 steps apart in
    # DAPO), not fitted to any result; 0 ignores the previous epoch.
    epoch_prior_weight: float = 0.8

    def __post_init__(self) -> None:
        for name in ("holt_alpha", "holt_beta", "history_decay", "tail_quantile"):
            v = getattr(self, name)
            if not 0.0 < v < 1.0 and not (name == "history_decay" and v == 1.0):
                raise errors.field_error(f"forecast.{name}", v, "a fraction in (0, 1)")
        if self.prior_strength < 0:
            raise errors.field_error("forecast.prior_strength", self.prior_strength, ">= 0")
        if self.max_points_per_step < 1:
            raise errors.field_error(
                "forecast.max_points_per_step", self.max_points_per_step, ">= 1"
            )
        if self.max_drift < 1.0:
            raise errors.field_error("forecast.max_drift", self.max_drift, ">= 1")
        if self.fallback_mean_tokens <= 0:
            raise errors.field_error(
                "forecast.fallback_mean_tokens", self.fallback_mean_tokens, "> 0"
            )
        if not 0.0 <= self.epoch_prior_weight <= 1.0:
            raise errors.field_error(
                "forecast.epoch_prior_weight", self.epoch_prior_weight, "a fraction in [0, 1]"
            )
        if self.group_max_log_scale < 0:
            raise errors.field_error(
                "forecast.group_max_log_scale", self.group_max_log_scale, ">= 0"
            )


@dataclass(frozen=True)
class Drift:
    """Holt's smoothing of per-step log-mean lengths, and its one-step-ahead prediction."""

    level: float
    trend: float
    steps: int

    @property
    def predicted_log_mean(self) -> float:
        return self.level + self.trend

    @property
    def predicted_mean_tokens(self) -> float:
        """exp of the predicted log-mean: the predicted geometric mean length."""
        return math.exp(self.predicted_log_mean)


def holt(series: Sequence[float], alpha: float = 0.5, beta: float = 0.3) -> Drift:
    """Holt's linear method over ``series`` (oldest first)."""
    if not series:
        return Drift(0.0, 0.0, 0)
    level = float(series[0])
    trend = float(series[1] - series[0]) if len(series) > 1 else 0.0
    for x in series[1:]:
        prev = level
        level = alpha * x + (1 - alpha) * (level + trend)
        trend = beta * (level - prev) + (1 - beta) * trend
    return Drift(level, trend, len(series))


def log_mean(lengths: Sequence[int]) -> float:
    if min(lengths) >= 1:  # the usual case, without a max() per length: the same sum
        return sum(map(math.log, lengths)) / len(lengths)
    return sum(math.log(max(1, x)) for x in lengths) / len(lengths)


@dataclass(frozen=True)
class LengthForecast:
    """The survival function of response length, as a step function plus a tail.

    ``knots[i]`` are the distinct event lengths (ascending) and ``survival[i]`` is
    ``S`` just after ``knots[i]``; ``area[i]`` is the integral of ``S`` from 0 to
    ``knots[i]``. ``S`` is 1 before the first knot.
    """

    knots: tuple[float, ...]
    survival: tuple[float, ...]
    area: tuple[float, ...]
    tail_mean: float
    max_tokens: int | None
    drift: Drift
    observations: int
    # per sample group, the log of its length scale (groups not listed: 0)
    group_log_scale: Mapping[str, float] = field(default_factory=dict, compare=False)
    # finished lengths behind it (recent steps' and this step's): 0 means a prior only
    events: int = 0

    # -- the distribution --

    def survival_at(self, length: float) -> float:
        if self.max_tokens is not None and length >= self.max_tokens:
            return 0.0
        i = bisect.bisect_right(self.knots, length)
        if i == 0:
            return 1.0
        last = self.knots[-1]
        if length <= last or i < len(self.knots):
            return self.survival[i - 1]
        return self.survival[-1] * math.exp(-(length - last) / self.tail_mean)

    def _integral_to(self, length: float) -> float:
        """Integral of S from 0 to ``length``."""
        if self.max_tokens is not None:
            length = min(length, float(self.max_tokens))
        if length <= 0:
            return 0.0
        knots = self.knots
        if not knots or length <= knots[0]:
            return length
        i = bisect.bisect_right(knots, length)
        if i < len(knots):
            return self.area[i - 1] + self.survival[i - 1] * (length - knots[i - 1])
        last = knots[-1]
        s = self.survival[-1]
        return self.area[-1] + s * self.tail_mean * (
            1.0 - math.exp(-(length - last) / self.tail_mean)
        )

    def _total_area(self) -> float:
        if self.max_tokens is not None:
            return self._integral_to(float(self.max_tokens))
        if not self.knots:
            return self.tail_mean
        return self.area[-1] + self.survival[-1] * self.tail_mean

    def mean_length(self) -> float:
        return self._total_area()

    def remaining_mean(self, generated: int) -> float:
        """Expected tokens still to come for a request running after ``generated`` tokens."""
        g = float(max(0, generated))
        if self.max_tokens is not None and g >= self.max_tokens:
            return 0.0
        s = self.survival_at(g)
        if s <= 1e-12:
            return self._tail_remaining_mean(g)
        return max(0.0, (self._total_area() - self._integral_to(g)) / s)

    def _tail_remaining_mean(self, g: float) -> float:
        """Memoryless tail beyond every observation (and past the survival floor)."""
        theta = self.tail_mean
        if self.max_tokens is None:
            return theta
        return theta * (1.0 - math.exp(-(self.max_tokens - g) / theta))

    def remaining_quantile(self, generated: int, q: float) -> float:
        """The ``q`` quantile of the remaining tokens for a request at ``generated``."""
        if not 0.0 < q < 1.0:
            raise errors.field_error("q", q, "a fraction in (0, 1)")
        g = float(max(0, generated))
        if self.max_tokens is not None and g >= self.max_tokens:
            return 0.0
        s_g = self.survival_at(g)
        target = (1.0 - q) * s_g
        cap = math.inf if self.max_tokens is None else float(self.max_tokens)
        if s_g <= 1e-12:
            return min(cap - g, -self.tail_mean * math.log(1.0 - q))
        knots, surv = self.knots, self.survival
        start = bisect.bisect_right(knots, g)
        # first knot at or after g whose survival is at or below the target
        lo, hi = start, len(knots)
        while lo < hi:
            mid = (lo + hi) // 2
            if surv[mid] <= target:
                hi = mid
            else:
                lo = mid + 1
        if lo < len(knots):
            return min(cap, knots[lo]) - g
        last = knots[-1] if knots else 0.0
        s_last = surv[-1] if surv else 1.0
        base = max(g, last)
        s_base = s_last if base == last else s_g
        length = base + self.tail_mean * math.log(s_base / target)
        return min(cap, length) - g


def build_forecast(
    history: Sequence[Sequence[int]] = (),
    completed: Sequence[int] = (),
    running: Sequence[int] = (),
    *,
    max_tokens: int | None = None,
    config: ForecastConfig = ForecastConfig(),
    completed_groups: Sequence[str | None] = (),
    running_groups: Sequence[str | None] = (),
    group_prior: Mapping[str, float] | None = None,
) -> LengthForecast:
    """The length forecast for the current step.

    ``history``: completed response lengths of recent steps, oldest first.
    ``completed``: lengths of responses finished in this step.
    ``running``: tokens generated so far by each request still running in this step.
    ``completed_groups`` / ``running_groups``: the sample group of each of those (empty:
    no groups known); with them the forecast carries every group's length scale.
    ``group_prior``: per group, a prior for its log length scale (from the prompt's
    previous epoch: :func:`prior_log_scales`); the siblings in this step update it.
    """
    if max_tokens is not None and max_tokens <= 0:
        raise errors.field_error("max_tokens", max_tokens, "a positive integer or None")
    for name, groups, values in (
        ("completed_groups", completed_groups, completed),
        ("running_groups", running_groups, running),
    ):
        if groups and len(groups) != len(values):
            raise errors.field_error(
                name, f"{len(groups)} entries", f"one per entry of the lengths ({len(values)})"
            )
    past = _past_steps(history, config)
    drift = past.drift

    # observations (length, weight, is_event) as arrays: this step's completed responses
    # (events), its running requests (censored), then recent steps' lengths (events)
    xs: list[np.ndarray] = [
        np.asarray(completed, dtype=np.float64),
        np.asarray(running, dtype=np.float64),
    ]
    ws: list[np.ndarray] = [np.ones(len(completed)), np.ones(len(running))]
    evs: list[np.ndarray] = [np.ones(len(completed), np.bool_), np.zeros(len(running), np.bool_)]
    current = len(completed) + len(running)

    if past.points:
        prior_total = config.prior_strength * max(current, 1)
        ages = range(len(past.points) - 1, -1, -1)
        decays = [config.history_decay**age for age in ages]
        norm = sum(decays)
        predicted = drift.predicted_log_mean
        for pts, lm, decay in zip(past.points, past.log_means, decays, strict=True):
            factor = math.exp(predicted - lm)
            factor = min(config.max_drift, max(1.0 / config.max_drift, factor))
            w = prior_total * decay / norm / len(pts)
            length = pts * factor
            if max_tokens is not None:
                length = np.minimum(length, float(max_tokens))
            xs.append(length)
            ws.append(np.full(len(pts), w))
            evs.append(np.ones(len(pts), np.bool_))

    x_a, w_a, ev_a = np.concatenate(xs), np.concatenate(ws), np.concatenate(evs)
    # by length; censored observations at the same length as events are at risk at that
    # length, so events first (a stable sort: ties keep their order)
    order = np.lexsort((~ev_a, x_a))
    x_a, w_a, ev_a = x_a[order], w_a[order], ev_a[order]
    knots, survival, area = _kaplan_meier(x_a, w_a, ev_a)
    tail = _tail_mean(knots, survival, area, x_a, w_a, config)
    if not knots:  # nothing known: exponential from zero
        knots, survival, area = [0.0], [1.0], [0.0]
        tail = config.fallback_mean_tokens
    pooled = LengthForecast(
        knots=tuple(knots),
        survival=tuple(survival),
        area=tuple(area),
        tail_mean=max(1.0, tail),
        max_tokens=max_tokens,
        drift=drift,
        observations=len(x_a),
        events=int(np.count_nonzero(ev_a)),
    )
    if not (completed_groups or running_groups or group_prior):
        return pooled
    scales = group_scales(
        pooled,
        completed,
        completed_groups or [None] * len(completed),
        running,
        running_groups or [None] * len(running),
        config.group_max_log_scale,
        group_prior or {},
    )
    return replace(pooled, group_log_scale=scales)


def group_scales(
    pooled: LengthForecast,
    completed: Sequence[int],
    completed_groups: Sequence[str | None],
    running: Sequence[int],
    running_groups: Sequence[str | None],
    max_log_scale: float = 2.0,
    prior: Mapping[str, float] | None = None,
) -> dict[str, float]:
    """Per sample group, the predicted log of its length scale ``d_p`` (module docstring:
    the shrunk group mean of log lengths, running samples imputed by ``pooled``), clamped
    to ``+-max_log_scale``. Groups with no between-group signal are left out (scale 1).

    ``prior``: per group, a prior for ``d_p`` (:func:`prior_log_scales`): the estimate is
    shrunk toward it rather than toward zero, and without a between-group signal in this
    step it is the prior itself (groups of the prior that this step does not list too)."""
    prior = prior or {}
    fallback = {g: min(max_log_scale, max(-max_log_scale, v)) for g, v in prior.items() if v != 0.0}
    parts = [np.log(np.maximum(1.0, np.asarray(completed, np.float64)))]
    if len(running):
        mean, _ = predict_remaining_arrays(pooled, running, 0.5)
        parts.append(np.log(np.maximum(1.0, np.asarray(running, np.float64) + mean)))
    obs = np.concatenate(parts)
    labels = [*completed_groups, *running_groups]
    known = np.array([g is not None for g in labels], dtype=np.bool_)
    if not known.any():
        return fallback
    names, code = np.unique(np.array([g for g in labels if g is not None]), return_inverse=True)
    x = obs[known]
    k, n = len(names), len(x)
    if k < 2 or n <= k:
        return fallback
    size = np.bincount(code, minlength=k).astype(np.float64)
    means = np.bincount(code, weights=x, minlength=k) / size
    grand = float(x.sum()) / n
    within = float(((x - means[code]) ** 2).sum()) / (n - k)
    ssb = float((size * (means - grand) ** 2).sum())
    n0 = (n - float((size**2).sum()) / n) / (k - 1)
    between = max(0.0, (ssb / (k - 1) - within) / n0) if n0 > 0 else 0.0
    if between <= 0.0:
        return fallback
    shrink = size * between / (size * between + within) if within > 0 else np.ones(k)
    if not prior:
        d = np.clip((means - grand) * shrink, -max_log_scale, max_log_scale)
        return dict(zip(names.tolist(), d.tolist(), strict=True))
    base = np.array([prior.get(g, 0.0) for g in names.tolist()], dtype=np.float64)
    d = np.clip(base + (means - grand - base) * shrink, -max_log_scale, max_log_scale)
    out = dict(fallback)
    out.update(zip(names.tolist(), d.tolist(), strict=True))
    return out


@dataclass(frozen=True)
class PriorLengths:
    """What the RL loop knows of a prompt from its previous occurrence: the response
    lengths of its samples then, and the log-mean length of every response of that step
    (the reference that removes the drift of lengths between the two occurrences)."""

    lengths: tuple[int, ...]
    step_log_mean: float

    def __post_init__(self) -> None:
        if not self.lengths or min(self.lengths) < 1:
            raise errors.field_error(
                "prior.lengths", self.lengths, "a non-empty list of lengths >= 1"
            )
        if not math.isfinite(self.step_log_mean):
            raise errors.field_error("prior.step_log_mean", self.step_log_mean, "a finite number")


def prior_log_scales(
    priors: Mapping[str, PriorLengths], config: ForecastConfig = ForecastConfig()
) -> dict[str, float]:
    """Per group, the prior for its log length scale ``d_p`` from the previous epoch.

    ``r_p`` = mean log length of the group's previous samples less that step's log-mean;
    its best linear predictor of the previous difficulty is ``r_p * B / (B + W / n_p)``
    (``B``, ``W``: between- and within-group variances of the previous samples by the
    method of moments over every group given, ``E[r_p] = 0`` by construction), and the
    prior is that times ``config.epoch_prior_weight``, clamped to
    ``+-config.group_max_log_scale``. Fewer than two groups, or no between-group
    variance, or a weight of 0: no prior (an empty mapping).
    """
    weight = config.epoch_prior_weight
    if len(priors) < 2 or weight == 0.0:
        return {}
    names = sorted(priors)
    rel = np.empty(len(names))
    size = np.empty(len(names))
    ss = 0.0
    for i, g in enumerate(names):
        logs = np.log(np.asarray(priors[g].lengths, dtype=np.float64))
        mean = float(logs.mean())
        rel[i] = mean - priors[g].step_log_mean
        size[i] = len(logs)
        ss += float(((logs - mean) ** 2).sum())
    dof = float((size - 1).sum())
    within = ss / dof if dof > 0 else 0.0
    between = max(0.0, float((rel**2).mean()) - within * float((1.0 / size).mean()))
    if between <= 0.0:
        return {}
    shrink = between / (between + within / size)
    cap = config.group_max_log_scale
    d = np.clip(weight * shrink * rel, -cap, cap)
    return dict(zip(names, d.tolist(), strict=True))


def group_factors(forecast: LengthForecast, groups: Sequence[str | None]) -> np.ndarray:
    """Per request, its group's length scale ``exp(d_p)`` (1 for groups not listed in
    ``forecast.group_log_scale`` and for requests without a group)."""
    scales = forecast.group_log_scale
    logs = [scales.get(g, 0.0) if g is not None else 0.0 for g in groups]
    factors: np.ndarray = np.exp(np.array(logs, dtype=np.float64))
    return factors


def survival_arrays(forecast: LengthForecast, lengths: np.ndarray) -> np.ndarray:
    """``forecast.survival_at`` of many lengths at once (the same values, up to the
    rounding of numpy's exponential in the tail)."""
    x = np.asarray(lengths, dtype=np.float64)
    knots = np.asarray(forecast.knots, dtype=np.float64)
    surv = np.asarray(forecast.survival, dtype=np.float64)
    out = np.ones(len(x))
    if len(knots):
        i = np.searchsorted(knots, x, side="right")
        inside = i > 0
        out[inside] = surv[i[inside] - 1]
        beyond = x > knots[-1]
        out[beyond] = surv[-1] * np.exp(-(x[beyond] - knots[-1]) / forecast.tail_mean)
    if forecast.max_tokens is not None:
        out[x >= forecast.max_tokens] = 0.0
    return out


def reach_probability_groups(
    forecast: LengthForecast,
    generated: Sequence[int],
    groups: Sequence[str | None],
    remaining: np.ndarray,
) -> np.ndarray:
    """Per request, the probability that its remaining tokens reach ``remaining`` (at
    least ``remaining - 1``), its length scaled by its group's ``exp(d_p)`` as in
    :func:`predict_remaining_groups`. A quantile sits where the survival function steps
    down: at a capped distribution's cap this is the cap's whole mass, not ``1 - q``."""
    gen = np.asarray(generated, dtype=np.float64)
    if len(gen) == 0:
        return np.zeros(0)
    f = group_factors(forecast, groups)
    here = survival_arrays(forecast, gen / f)
    there = survival_arrays(forecast, (gen + np.asarray(remaining) - 1.0) / f)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(here > 0, np.minimum(1.0, there / here), 0.0)


def remaining_square_groups(
    forecast: LengthForecast, generated: Sequence[int], groups: Sequence[str | None]
) -> np.ndarray:
    """Per request, ``E[R^2]``, the second moment of its remaining tokens ``R``, its
    length scaled by its group's ``exp(d_p)`` as in :func:`predict_remaining_groups`.

    ``E[R^2 | L > g] = 2 * int_g^cap (x - g) S(x) dx / S(g)``, from the step function's
    first two moments and the exponential tail in closed form. The attention cost of a
    token grows with its context, so the context a token is decoded at, averaged over
    the tokens still to come, is ``sum_r (ctx_r m_r + E[R_r^2] / 2) / sum_r m_r``:
    under a long tail about twice the average over requests (the long ones hold most
    tokens).
    """
    gen = np.asarray(generated, dtype=np.float64)
    if len(gen) == 0:
        return np.zeros(0)
    f = group_factors(forecast, groups)
    g_s = gen / f
    cap = math.inf if forecast.max_tokens is None else float(forecast.max_tokens)
    # a scaled length f L is capped too: L up to cap / f counts
    upper = np.minimum(cap, cap / f)
    area, first = _moments_to(forecast, upper)
    area_g, first_g = _moments_to(forecast, g_s)
    s_g = survival_arrays(forecast, g_s)
    with np.errstate(divide="ignore", invalid="ignore"):
        square = 2.0 * ((first - first_g) - g_s * (area - area_g)) / s_g
    # past the survival floor: the memoryless tail (E[R^2] = 2 theta^2) within the cap
    theta = forecast.tail_mean
    floor = np.minimum(2.0 * theta * theta, np.square(np.maximum(0.0, upper - g_s)))
    out: np.ndarray = f * f * np.where(s_g > 1e-12, np.maximum(square, 0.0), floor)
    return out


def finish_probability_groups(
    forecast: LengthForecast,
    generated: Sequence[int],
    groups: Sequence[str | None],
    within: float,
) -> np.ndarray:
    """Per request, the probability that it finishes within ``within`` more tokens,
    ``P(R <= within)``, its length scaled by its group's ``exp(d_p)`` as in
    :func:`predict_remaining_groups` (a request whose ``generated + within`` reaches the
    cap surely finishes)."""
    gen = np.asarray(generated, dtype=np.float64)
    if len(gen) == 0:
        return np.zeros(0)
    f = group_factors(forecast, groups)
    here = survival_arrays(forecast, gen / f)
    there = survival_arrays(forecast, (gen + within) / f)
    with np.errstate(divide="ignore", invalid="ignore"):
        p = np.where(here > 0, 1.0 - np.minimum(1.0, there / here), 1.0)
    if forecast.max_tokens is not None:
        p = np.where(gen + within >= forecast.max_tokens, 1.0, p)
    out: np.ndarray = p
    return out


def truncated_remaining_groups(
    forecast: LengthForecast,
    generated: Sequence[int],
    groups: Sequence[str | None],
    within: float,
) -> tuple[np.ndarray, np.ndarray]:
    """Per request, the first two moments of ``min(R, within)``: the tokens it decodes
    in the next ``within`` decode iterations (it stops when it finishes), ``E[min(R,
    w)]`` and ``E[min(R, w)^2]``, its length scaled by its group's ``exp(d_p)`` as in
    :func:`remaining_square_groups` (which is the second moment at ``within`` = inf).

    ``E[min(R, w)] = int_g^(g+w) S(x) dx / S(g)`` and ``E[min(R, w)^2] = 2 int_g^(g+w)
    (x - g) S(x) dx / S(g)``, up to the cap; past the survival floor the memoryless
    tail, ``theta (1 - exp(-w / theta))`` and its second moment bounded by ``w^2``.
    Partial rollout scores a step on these: the step ends after about ``w`` iterations
    (:func:`scheduler.compute_problem.goal_tokens`), and what a request would decode
    after that is carried into the next step."""
    gen = np.asarray(generated, dtype=np.float64)
    if len(gen) == 0:
        return np.zeros(0), np.zeros(0)
    f = group_factors(forecast, groups)
    g_s = gen / f
    cap = math.inf if forecast.max_tokens is None else float(forecast.max_tokens)
    upper = np.minimum(np.minimum(cap, cap / f), (gen + max(0.0, within)) / f)
    upper = np.maximum(upper, g_s)
    area, first = _moments_to(forecast, upper)
    area_g, first_g = _moments_to(forecast, g_s)
    s_g = survival_arrays(forecast, g_s)
    with np.errstate(divide="ignore", invalid="ignore"):
        mean = (area - area_g) / s_g
        square = 2.0 * ((first - first_g) - g_s * (area - area_g)) / s_g
    theta = forecast.tail_mean
    span = upper - g_s  # in scaled tokens
    tail_mean = theta * (1.0 - np.exp(-span / theta))
    tail_square = np.minimum(2.0 * theta * theta, np.square(span))
    live = s_g > 1e-12
    mean_out: np.ndarray = f * np.where(live, np.clip(mean, 0.0, span), tail_mean)
    square_out: np.ndarray = f * f * np.where(live, np.maximum(square, 0.0), tail_square)
    return mean_out, square_out


def _moments_to(forecast: LengthForecast, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``int_0^y S(x) dx`` (what ``forecast._integral_to`` gives) and ``int_0^y x S(x)
    dx`` for each ``y``, capped at ``max_tokens``; with no knot at all, the exponential
    tail from 0, as ``_total_area`` takes it."""
    y = np.asarray(lengths, dtype=np.float64)
    if forecast.max_tokens is not None:
        y = np.minimum(y, float(forecast.max_tokens))
    y = np.maximum(y, 0.0)
    theta = forecast.tail_mean
    knots = np.asarray(forecast.knots, dtype=np.float64)
    if not len(knots):  # S = exp(-x / theta)
        return theta * (1.0 - np.exp(-y / theta)), theta * (theta - _tail_weight(y, 0.0, theta))
    surv = np.asarray(forecast.survival, dtype=np.float64)
    area = np.asarray(forecast.area, dtype=np.float64)
    # the first moment at each knot: S is 1 up to the first, surv[i - 1] between knots
    # i - 1 and i
    steps = surv[:-1] * (knots[1:] ** 2 - knots[:-1] ** 2) / 2.0
    first = np.concatenate(([knots[0] ** 2 / 2.0], knots[0] ** 2 / 2.0 + np.cumsum(steps)))
    last, s = knots[-1], surv[-1]
    beyond = y > last
    inside = np.where(beyond, last, y)
    i = np.searchsorted(knots, inside, side="right")  # knots[:i] <= y
    prev = np.maximum(i - 1, 0)
    known = i > 0
    area_y = np.where(known, area[prev] + surv[prev] * (inside - knots[prev]), inside)
    first_y = np.where(
        known, first[prev] + surv[prev] * (inside**2 - knots[prev] ** 2) / 2.0, inside**2 / 2.0
    )
    if beyond.any():  # past the last knot, S decays exponentially (its whole mass at infinity)
        yb = y[beyond]
        area_y[beyond] = area[-1] + s * theta * (1.0 - np.exp(-(yb - last) / theta))
        first_y[beyond] = first[-1] + s * theta * ((last + theta) - _tail_weight(yb, last, theta))
    return area_y, first_y


def _tail_weight(y: np.ndarray, start: float, theta: float) -> np.ndarray:
    """``(y + theta) exp(-(y - start) / theta)``, 0 at infinity."""
    out = np.zeros(len(y))
    finite = np.isfinite(y)
    out[finite] = (y[finite] + theta) * np.exp(-(y[finite] - start) / theta)
    return out


def predict_remaining_groups(
    forecast: LengthForecast,
    generated: Sequence[int],
    groups: Sequence[str | None],
    q: float,
) -> tuple[np.ndarray, np.ndarray]:
    """Mean and ``q``-quantile of the remaining tokens per request, each request's length
    distribution scaled by its group's ``exp(d_p)`` (``forecast.group_log_scale``): the
    pooled prediction at ``g / f`` tokens, times ``f``, less ``g``, within the cap.
    Requests of unscaled groups get :func:`predict_remaining_arrays` exactly."""
    scales = forecast.group_log_scale
    if not scales:
        return predict_remaining_arrays(forecast, generated, q)
    gen = np.asarray(generated, dtype=np.int64)
    f = group_factors(forecast, groups)
    scaled = np.floor(gen / f + 0.5).astype(np.int64)
    mean, quant = predict_remaining_arrays(forecast, scaled, q)
    cap = math.inf if forecast.max_tokens is None else float(forecast.max_tokens)
    g_f = gen.astype(np.float64)
    room = np.maximum(0.0, cap - g_f)
    mean = np.minimum(room, np.maximum(0.0, f * (scaled + mean) - g_f))
    quant = np.minimum(room, np.maximum(0.0, f * (scaled + quant) - g_f))
    return mean, quant


@dataclass(frozen=True)
class _PastSteps:
    """What the forecast takes from the completed steps: per step its log-mean length and
    its thinned, sorted lengths; and the drift the log-means predict."""

    log_means: tuple[float, ...]
    points: tuple[np.ndarray, ...]  # float64
    drift: Drift


def forget_past_steps() -> None:
    """Empty the memo of past steps' summaries (benchmarks time a step's first forecast)."""
    _past_summary.cache_clear()


def _past_steps(history: Sequence[Sequence[int]], config: ForecastConfig) -> _PastSteps:
    steps = tuple(tuple(s) for s in history if len(s) > 0)
    return _past_summary(steps, config.holt_alpha, config.holt_beta, config.max_points_per_step)


# The history of past steps does not change during a step, while the forecast is built at
# every re-plan: its summary is kept.
@functools.lru_cache(maxsize=16)
def _past_summary(
    steps: tuple[tuple[int, ...], ...], alpha: float, beta: float, max_points: int
) -> _PastSteps:
    log_means = tuple(log_mean(s) for s in steps)
    points = tuple(_thin(np.sort(np.asarray(s, dtype=np.int64)), max_points) for s in steps)
    return _PastSteps(log_means, points, holt(log_means, alpha, beta))


def _thin(values: np.ndarray, limit: int) -> np.ndarray:
    """At most ``limit`` evenly spaced order statistics of the sorted ``values`` (keeps min
    and max), as float64."""
    n = len(values)
    if n > limit:
        if limit == 1:
            values = values[n // 2 : n // 2 + 1]
        else:
            # round(i * (n - 1) / (limit - 1)): true division, then half to even
            values = values[np.rint(np.arange(limit) * (n - 1) / (limit - 1)).astype(np.int64)]
    return values.astype(np.float64)


def _kaplan_meier(
    x: np.ndarray, w: np.ndarray, ev: np.ndarray
) -> tuple[list[float], list[float], list[float]]:
    """Weighted Kaplan-Meier over observations (length, weight, is_event), sorted by
    length with events first at equal lengths: knots at event lengths, S after each, area
    up to each.

    Vectorised with the operations of the sequential estimator, in its order (sums and
    products accumulate one term at a time, as ``np.bincount``, ``cumsum``, ``cumprod``
    and ``subtract.accumulate`` do), so the values are the same bit for bit.
    """
    n = len(x)
    if n == 0:
        return [], [], []
    new = np.empty(n, dtype=np.bool_)
    new[0] = True
    np.not_equal(x[1:], x[:-1], out=new[1:])
    group = np.cumsum(new) - 1
    xg = x[new]
    groups = len(xg)
    events = np.bincount(group, weights=np.where(ev, w, 0.0), minlength=groups)
    removed = np.bincount(group, weights=w, minlength=groups)
    # at risk before each group: the total, less what earlier groups removed
    total = float(np.cumsum(w)[-1])
    at_risk = np.subtract.accumulate(np.concatenate(([total], removed[:-1])))
    knot = (events > 0) & (at_risk > 0)
    kx = xg[knot]
    factor = np.maximum(0.0, 1.0 - events[knot] / at_risk[knot])
    s_after = np.cumprod(factor)
    s_before = np.concatenate(([1.0], s_after[:-1]))
    prev_x = np.concatenate(([0.0], kx[:-1]))
    area_a = np.cumsum(s_before * (kx - prev_x))
    knots: list[float] = kx.tolist()
    survival: list[float] = s_after.tolist()
    area: list[float] = area_a.tolist()
    # the estimate is known flat up to the longest observation (a request still running at
    # g says its length is above g); the tail starts there
    last = float(x[-1])
    if not knots or last > knots[-1]:
        s = survival[-1] if survival else 1.0
        acc = area[-1] if area else 0.0
        acc += s * (last - (knots[-1] if knots else 0.0))
        knots.append(last)
        survival.append(s)
        area.append(acc)
    return knots, survival, area


def _tail_mean(
    knots: list[float],
    survival: list[float],
    area: list[float],
    x: np.ndarray,
    w: np.ndarray,
    config: ForecastConfig,
) -> float:
    """Mean of the exponential tail beyond the longest observation.

    The mean residual length above the ``tail_quantile`` point of the estimate; when the
    estimate never falls that low (most requests are still running), the weighted mean
    of every observation (running ones count at their current length, a lower bound).
    """
    if not knots:
        return config.fallback_mean_tokens
    target = 1.0 - config.tail_quantile
    i = next((k for k, s in enumerate(survival) if s <= target), -1)
    if i < 0:
        # sums over the (sorted) observations, one term at a time
        total = float(np.cumsum(w)[-1]) if len(x) else 0.0
        mean = float(np.cumsum(x * w)[-1]) / total if total > 0 else 0.0
        return max(1.0, mean)
    s_i = survival[i]
    if s_i <= 1e-12:
        # the estimate reaches zero: the spread of the top of the sample
        lo = knots[max(0, i - 1)]
        return max(1.0, (knots[-1] - lo) / 2.0)
    residual = (area[-1] - area[i]) / s_i
    if residual <= 0:
        residual = knots[-1] * (1.0 - config.tail_quantile)
    return max(1.0, residual)


def predict_remaining(
    forecast: LengthForecast, generated: Sequence[int], q: float
) -> tuple[list[float], list[float]]:
    """Mean and ``q``-quantile of the remaining tokens for many requests at once (see
    :func:`predict_remaining_arrays`), as lists."""
    mean, quant = predict_remaining_arrays(forecast, generated, q)
    return mean.tolist(), quant.tolist()


def predict_remaining_arrays(
    forecast: LengthForecast, generated: Sequence[int], q: float
) -> tuple[np.ndarray, np.ndarray]:
    """Mean and ``q``-quantile of the remaining tokens for many requests at once.

    The same values as ``remaining_mean``/``remaining_quantile`` per request (the same
    float operations, so bit for bit), computed with numpy over the distinct
    ``generated`` values: one ``searchsorted`` finds each value's knot and another the
    first knot whose survival is at or below the quantile's target (the survival
    function is non-increasing). The few values beyond the knots or past the survival
    floor take the scalar path.
    """
    if not 0.0 < q < 1.0:
        raise errors.field_error("q", q, "a fraction in (0, 1)")
    if len(generated) == 0:
        return np.zeros(0), np.zeros(0)
    knots = np.asarray(forecast.knots, dtype=np.float64)
    surv = np.asarray(forecast.survival, dtype=np.float64)
    area = np.asarray(forecast.area, dtype=np.float64)
    k_n = len(knots)
    cap = forecast.max_tokens
    cap_f = math.inf if cap is None else float(cap)
    total = forecast._total_area()
    gen = np.asarray(generated, dtype=np.int64)
    uniq, inverse = np.unique(gen, return_inverse=True)
    g = np.maximum(uniq, 0).astype(np.float64)
    i = np.searchsorted(knots, g, side="right")  # knots[:i] <= g
    inside = i > 0
    prev = np.maximum(i - 1, 0)
    s_g = np.where(inside, surv[prev] if k_n else 1.0, 1.0)
    integral = np.where(inside, (area[prev] if k_n else 0.0) + s_g * (g - knots[prev]), g)
    with np.errstate(divide="ignore", invalid="ignore"):
        mean = np.maximum((total - integral) / s_g, 0.0)
    target = (1.0 - q) * s_g
    # first knot with survival <= target (any knot before i has survival >= s_g > target)
    j = np.searchsorted(-surv, -target, side="left")
    jc = np.minimum(j, max(k_n - 1, 0))
    quant = np.minimum(knots[jc] if k_n else g, cap_f) - g
    capped = g >= cap_f
    mean[capped] = 0.0
    quant[capped] = 0.0
    # the scalar path: beyond every knot, or past the survival floor, or no knot below
    # the quantile's target
    slow = ~capped & ((i >= k_n) | (s_g <= 1e-12) | (j >= k_n))
    for u in np.flatnonzero(slow).tolist():
        g_int = int(uniq[u])
        beyond = bool(i[u] >= k_n)
        if beyond:
            mean[u] = forecast.remaining_mean(g_int)
        elif float(s_g[u]) <= 1e-12:
            mean[u] = forecast._tail_remaining_mean(float(g[u]))
        quant[u] = forecast.remaining_quantile(g_int, q)
    return mean[inverse], quant[inverse]
