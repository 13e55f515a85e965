"""The whole RL step: the generation/training split, the TP to run and the rollout budget.

The compute planner (:mod:`scheduler.compute`) re-plans the generation pool inside a
step. Across steps (the paper's "across steps"), this planner chooses, from the length
forecast it already has and what the last step measured, how many GPUs train and how
many generate, and how much partial rollout to use. Pure: it takes the evidence and
returns a frozen plan.

Prediction (one-step-asynchronous pipeline, :func:`scheduler.rollout.step_seconds`):

- generation on ``G`` GPUs at TP ``t``: the compute planner's instance model
  (:func:`scheduler.compute_problem.tp_costs`: ``a_t * max(q, M / slots_t) + c_t * M +
  p_t * prefill`` per instance) with the step's expected work spread evenly over the
  ``G / t`` instances, ``M`` = responses x the forecast's mean length, at the context
  the tokens are decoded at (averaged over tokens, from the forecast's second moment).
  The critical path ``q``: full rollout waits for the step's longest response, the
  ``N/(N+1)`` quantile of a response's length
  (:func:`scheduler.compute_problem.critical_level`); partial rollout carries the tail,
  so ``q`` = 0 and the shape is the bulk's, ``1 / G`` (in the simulator a DAPO-like
  partial step took 1.25x as long on 40 GPUs as on 48, the GPU ratio being 1.2; taking
  instead the ``(1 / over_provision) ** (1 / n)`` quantile, where the ``N``-th of
  ``over_provision x N`` groups of ``n`` independent samples completes, predicted a
  step nearly flat in ``G`` and moved GPUs to training that generation needed). The
  level is then scaled by what the last step measured against its own prediction at the
  current split (a partial step's measurement corrects partial predictions, a full
  one's every prediction). The best TP of each split is the one the prediction
  favours.
- training on ``T`` GPUs: the last batch's measured compute GPU-seconds per token,
  scaled to the tokens of the batch the step trains (known: the last step collected it;
  else the forecast's expectation) and spread over ``T`` GPUs, plus its
  measured exposed communication (ring all-reduce: per-GPU traffic about independent
  of the data-parallel size).
- weight sync: the last one measured.

Decision: the split of the shortest predicted step, ``max(generation, training) + sync``
(equal steps go to more generation GPUs, as ``split.choose = "auto"`` does), taken
only when one step's predicted gain beats the pause of moving nodes between the pools
(:func:`split_switch_s`) by the compute planner's own switching margin
(``PlannerConfig.switch_margin_s`` / ``switch_margin_rel``: 0.5 s or 5 % of the step).
The rollout budget: with a partial rule, over-provisioning only pays when generation
bounds the step; when the predicted full-rollout generation (tail
included) fits inside the predicted training, the step runs with ``over_provision`` 1.0
(no response needs carrying, so none goes off-policy).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from orchestrrl import errors
from scheduler.compute_problem import DEFAULT_CONFIG, PlannerConfig, critical_level, tp_costs
from scheduler.forecast import LengthForecast, remaining_square_groups
from scheduler.perf_model import PerfModel
from scheduler.rollout import RolloutRule

# bytes per parameter a node joining the training pool receives: its share of the
# bf16 weights and gradients and the fp32 master weights and two Adam moments
# (Megatron's distributed optimizer: 2 + 2 + 4 + 4 + 4; Rajbhandari et al. 2020,
# arXiv 1910.02054, section 3: 16 bytes per parameter under mixed precision with Adam)
TRAIN_STATE_BYTES_PER_PARAM = 16.0


@dataclass(frozen=True)
class TrainingRate:
    """What the last training step measured: compute GPU-seconds per trained token (prompt
    and response) and its exposed communication."""

    gpu_s_per_token: float
    comm_s: float = 0.0

    def seconds(self, tokens: float, gpus: int) -> float:
        if gpus <= 0:
            raise errors.field_error("train_gpus", gpus, "a positive number of GPUs")
        return self.gpu_s_per_token * tokens / gpus + self.comm_s


@dataclass(frozen=True)
class StepLoad:
    """The next step's load: responses the trainer takes, their mean prompt tokens, and
    the forecast of response lengths. ``train_tokens``: the tokens (prompt and response)
    of the batch the trainer trains during the step, when known (one step asynchronous:
    the batch the last step collected); None: the forecast's expectation."""

    responses: int
    prompt_tokens: float
    forecast: LengthForecast
    train_tokens: float | None = None

    @property
    def training_tokens(self) -> float:
        if self.train_tokens is not None:
            return self.train_tokens
        return self.responses * (self.prompt_tokens + self.forecast.mean_length())


@dataclass(frozen=True)
class StepPrediction:
    train_gpus: int
    gen_gpus: int
    tp: int
    gen_s: float  # with the rule's tail handling (partial: the bulk only)
    full_gen_s: float  # full rollout's (the longest response included)
    train_s: float
    sync_s: float

    @property
    def step_s(self) -> float:
        return max(self.gen_s, self.train_s) + self.sync_s


@dataclass(frozen=True)
class StepPlan:
    chosen: StepPrediction
    current: StepPrediction
    switch_s: float  # pause of moving nodes between the pools (0: no change)
    over_provision: float
    reason: str
    options: tuple[StepPrediction, ...]

    @property
    def changes_split(self) -> bool:
        return self.chosen.train_gpus != self.current.train_gpus


def generation_seconds(
    perf: PerfModel,
    gen_gpus: int,
    gpus_per_node: int,
    tps: Sequence[int],
    load: StepLoad,
    max_num_seqs: int,
) -> dict[int, tuple[float, float]]:
    """Per TP degree, the predicted (partial: the bulk, full: with the longest response)
    generation seconds of the step on ``gen_gpus`` GPUs, uncorrected (module doc)."""
    f = load.forecast
    mean = f.mean_length()
    if load.responses < 1 or mean <= 0 or gen_gpus <= 0:
        return {}
    square = float(remaining_square_groups(f, [0], [None])[0])
    prompt = load.prompt_tokens
    token_ctx = prompt + square / (2.0 * mean)
    costs = tp_costs(perf, tps, token_ctx, prompt + mean / 2.0, prompt + mean, max_num_seqs)
    longest = f.remaining_quantile(0, critical_level(load.responses, 0.5))
    out: dict[int, tuple[float, float]] = {}
    for t, c in costs.items():
        # the GPUs of a node shared with training count at their share (a few of them)
        whole = (gen_gpus // gpus_per_node) * (gpus_per_node // t)
        instances = gen_gpus / t if gen_gpus % gpus_per_node and whole else whole
        if instances <= 0:
            continue
        work = load.responses * mean / instances
        prefill = load.responses * prompt / instances
        out[t] = (c.run(0.0, work, prefill), c.run(longest, work, prefill))
    return out


def split_switch_s(
    perf: PerfModel, to_train_nodes: int, to_gen_nodes: int, node_gbps: float
) -> float:
    """Pause of moving whole nodes between the pools at a step boundary: a node joining
    generation receives the weights and starts its engines; a node joining training
    receives its share of the training state (:data:`TRAIN_STATE_BYTES_PER_PARAM`); both
    over the node's NICs, plus the communicator and CUDA-graph setup of a reshard
    (``Efficiency.reshard_fixed_s``). 0 when nothing moves."""
    if to_train_nodes <= 0 and to_gen_nodes <= 0:
        return 0.0
    bandwidth = node_gbps * 1e9 / 8.0
    params = perf.model.params
    joining_gen = perf.model.weight_bytes if to_gen_nodes > 0 else 0.0
    joining_train = params * TRAIN_STATE_BYTES_PER_PARAM if to_train_nodes > 0 else 0.0
    moved = max(joining_gen, joining_train)
    return perf.efficiency.reshard_fixed_s + perf.network_transfer_time(moved, bandwidth=bandwidth)


def predict(
    perf: PerfModel,
    train_gpus: int,
    gen_gpus: int,
    *,
    rule: RolloutRule,
    load: StepLoad,
    training: TrainingRate,
    sync_s: float,
    gpus_per_node: int,
    tps: Sequence[int],
    max_num_seqs: int,
    correction: tuple[float, float] = (1.0, 1.0),
) -> StepPrediction | None:
    """The predicted step at one split (None: no TP fits its generation pool); partial
    and full generation seconds times ``correction``'s two factors."""
    raw = generation_seconds(perf, gen_gpus, gpus_per_node, tps, load, max_num_seqs)
    if not raw:
        return None
    cp, cf = correction
    gens = {t: (a * cp, b * cf) for t, (a, b) in raw.items()}
    train_s = training.seconds(load.training_tokens, train_gpus)

    def gen_of(t: int) -> float:
        bulk, full = gens[t]
        return bulk if rule.partial else full

    tp = min(gens, key=lambda t: (max(gen_of(t), train_s), gen_of(t), t))
    return StepPrediction(train_gpus, gen_gpus, tp, gen_of(tp), gens[tp][1], train_s, sync_s)


def plan_step(
    perf: PerfModel,
    splits: Sequence[tuple[int, int]],
    current: tuple[int, int],
    *,
    rule: RolloutRule,
    load: StepLoad,
    training: TrainingRate,
    sync_s: float,
    gpus_per_node: int,
    tps: Sequence[int],
    max_num_seqs: int,
    node_gbps: float,
    measured_gen_s: float | None = None,
    measured_rule: RolloutRule | None = None,
    config: PlannerConfig = DEFAULT_CONFIG,
) -> StepPlan:
    """The next step's split, TP and over-provisioning (see the module doc). ``splits``:
    the (train GPUs, generation GPUs) pairs allowed, ``current`` among them;
    ``measured_gen_s``: the last step's generation at ``current`` under
    ``measured_rule`` (default ``rule``), which corrects the model's level."""
    if current not in splits:
        raise errors.field_error("current", current, f"one of the allowed splits {list(splits)}")
    correction = (1.0, 1.0)
    then_rule = measured_rule or rule
    partial_then = then_rule.partial and then_rule.over_provision > 1.0
    if measured_gen_s is not None and measured_gen_s > 0:
        then = predict(
            perf,
            current[0],
            current[1],
            rule=then_rule,
            load=load,
            training=training,
            sync_s=sync_s,
            gpus_per_node=gpus_per_node,
            tps=tps,
            max_num_seqs=max_num_seqs,
        )
        if then is not None and then.gen_s > 0:
            factor = measured_gen_s / then.gen_s
            correction = (factor, 1.0) if partial_then else (factor, factor)

    def pred(split: tuple[int, int]) -> StepPrediction | None:
        return predict(
            perf,
            split[0],
            split[1],
            rule=rule,
            load=load,
            training=training,
            sync_s=sync_s,
            gpus_per_node=gpus_per_node,
            tps=tps,
            max_num_seqs=max_num_seqs,
            correction=correction,
        )

    options = tuple(p for p in (pred(x) for x in splits) if p is not None)
    now = pred(current)
    if now is None:
        raise errors.FailedPrecondition(f"no TP degree fits the current split {current}")
    best = min(options, key=lambda p: (p.step_s, -p.gen_gpus))
    moved_gpus = abs(best.train_gpus - now.train_gpus)
    moved = moved_gpus // gpus_per_node
    part = moved_gpus % gpus_per_node != 0  # GPUs of a shared node move (unit_gpus)
    count = max(1, moved) if part else moved
    to_train = count if best.train_gpus > now.train_gpus else 0
    to_gen = count if best.train_gpus < now.train_gpus else 0
    # the GPUs that move receive over their own NICs: a whole node's, or fewer
    gbps = node_gbps * min(moved_gpus, gpus_per_node) / gpus_per_node if part else node_gbps
    switch = split_switch_s(perf, to_train, to_gen, gbps)
    what = f"{moved_gpus} GPU(s)" if part else f"{moved} node(s)"
    move = f"{moved_gpus}-GPU move" if part else f"{moved}-node move"
    gain = now.step_s - best.step_s
    margin = max(config.switch_margin_s, config.switch_margin_rel * now.step_s)
    if best.train_gpus != now.train_gpus and gain > switch + margin:
        chosen = best
        reason = (
            f"split {now.gen_gpus}/{now.train_gpus} -> {best.gen_gpus}/{best.train_gpus} "
            f"(gen/train GPUs): predicted step {now.step_s:.1f} -> {best.step_s:.1f} s, "
            f"moving {what} pauses {switch:.1f} s"
        )
    else:
        reason = f"split {now.gen_gpus}/{now.train_gpus} kept: predicted step {now.step_s:.1f} s"
        if best.train_gpus != now.train_gpus:
            reason += (
                f" (best {best.step_s:.1f} s at {best.gen_gpus}/{best.train_gpus} does not beat "
                f"it by the {move}'s {switch:.1f} s and the {margin:.1f} s margin)"
            )
        chosen, switch = now, 0.0
    op = rule.over_provision
    if rule.partial and op > 1.0 and chosen.full_gen_s <= chosen.train_s:
        op = 1.0
        reason += (
            f"; over-provisioning off: full rollout's {chosen.full_gen_s:.1f} s fits in "
            f"training's {chosen.train_s:.1f} s"
        )
    if measured_gen_s is not None and correction[0] != 1.0:
        kind = "partial" if partial_then else "every"
        reason += f" ({kind} generation prediction x{correction[0]:.2f}, from the last step)"
    return StepPlan(chosen, now, switch, op, reason, options)
