"""RL steps under a rollout rule: full or partial rollout, end to end.

The driver of :mod:`scheduler.rollout` in the simulator. Per step ``k`` (weight version
``k``):

1. the trainer's batch of step ``k-1`` is timed on the fabric (:class:`.StepTimer`);
   that is the earliest the step may end;
2. the step starts fresh prompt groups up to ``over_provision x N`` open groups
   (:func:`scheduler.rollout.groups_to_start`), taken in order from the workload's
   prompt stream (:func:`.workload.group_draws`: chunk ``c`` holds the prompts full
   rollout runs at step ``c``; a group's lengths follow the policy of the step that
   starts it); the carried responses go first, with their prefix (their KV cache is
   recomputed on admission: a prefill of prompt and prefix);
3. generation runs under the rule (:class:`.generation.StepStop`); full rollout runs
   until every request is done;
4. :func:`scheduler.rollout.close_step` decides what the trainer gets, what waits,
   what is carried and what is dropped; the trained groups' tokens are the next step's
   training batch;
5. the weight sync, and the step: :func:`scheduler.rollout.step_seconds`.

Full rollout through this driver is the same simulation as
:func:`.pipeline.run_generation` + :func:`.pipeline.run_pipeline` (one chunk per step).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from scheduler.forecast import build_forecast
from scheduler.perf_model import PerfModel
from scheduler.rollout import (
    GroupState,
    Piece,
    ResponseState,
    RolloutRule,
    StepClose,
    close_step,
    groups_to_start,
)
from scheduler.step_plan import StepLoad, TrainingRate, plan_step
from sim_backends.clustersim.fabrics import Fabric
from sim_backends.clustersim.generation import (
    GenStepResult,
    Pattern,
    StepStop,
    group_name,
    simulate_step,
)
from sim_backends.clustersim.pipeline import (
    SIM_PLANNER,
    RunResult,
    StepTimer,
    StepTiming,
    candidate_tps,
    gen_layout,
    make_fabric,
    pipeline_bound,
    with_split,
)
from sim_backends.clustersim.scenario import Scenario
from sim_backends.clustersim.workload import RolloutRequest, group_draws, group_requests


@dataclass(frozen=True)
class RolloutStep:
    """One step's rollout bookkeeping (responses and response tokens)."""

    step: int
    started_groups: int  # fresh groups started this step
    carried_in: int  # responses resumed from earlier steps
    generated_tokens: int  # tokens generated in this step (dropped ones included)
    trained_groups: int
    trained_responses: int
    trained_tokens: int
    offpolicy_tokens: int  # trained tokens generated under an older version
    dropped_groups: int
    dropped_responses: int
    dropped_tokens: int
    carried_out: int  # responses carried into the next step
    waiting_groups: int  # complete groups waiting for the next batch
    ready_s: float | None  # when the rule was met (None: only at the end)
    # the batch the trainer trained during this step (the previous step's): responses,
    # response tokens, and those of its tokens generated under an older version
    consumed_responses: int = 0
    consumed_tokens: int = 0
    consumed_offpolicy: int = 0


@dataclass(frozen=True)
class RLRun:
    """A run end to end with its rollout bookkeeping; throughput over the steady steps
    (all but the first)."""

    run: RunResult
    rule: RolloutRule
    rollout: tuple[RolloutStep, ...]
    samples_per_step: int = 0
    warmup: int = 1  # steps left out of every mean
    plans: tuple[str, ...] = ()  # the step planner's reason per planned step
    extra: Mapping[str, object] = field(default_factory=dict)

    def _window(self) -> slice:
        return slice(min(self.warmup, len(self.rollout) - 1), None)

    @property
    def steady(self) -> tuple[RolloutStep, ...]:
        return self.rollout[self._window()]

    @property
    def steady_steps(self) -> tuple[StepTiming, ...]:
        return self.run.steps[self._window()]

    @property
    def mean_step_s(self) -> float:
        return self._time() / len(self.steady_steps)

    @property
    def mean_gen_s(self) -> float:
        st = self.steady_steps
        return sum(x.gen_s for x in st) / len(st)

    def _time(self) -> float:
        return sum(x.step_s for x in self.steady_steps)

    @property
    def samples_per_s(self) -> float:
        """Responses the trainer trained per second, end to end (a step trains the batch
        the previous step collected)."""
        return sum(x.consumed_responses for x in self.steady) / self._time()

    @property
    def tokens_per_s(self) -> float:
        """Response tokens the trainer trained per second, end to end."""
        return sum(x.consumed_tokens for x in self.steady) / self._time()

    @property
    def offpolicy_token_share(self) -> float:
        """Share of the trained response tokens generated under an older weight version
        than their batch's (beyond the pipeline's one-step lag)."""
        trained = sum(x.consumed_tokens for x in self.steady)
        return sum(x.consumed_offpolicy for x in self.steady) / trained if trained else 0.0

    @property
    def dropped_share(self) -> float:
        """Dropped responses over dropped and trained responses."""
        dropped = sum(x.dropped_responses for x in self.steady)
        total = dropped + sum(x.trained_responses for x in self.steady)
        return dropped / total if total else 0.0

    @property
    def dropped_token_share(self) -> float:
        """Tokens generated for dropped responses over all tokens generated."""
        generated = sum(x.generated_tokens for x in self.steady)
        return sum(x.dropped_tokens for x in self.steady) / generated if generated else 0.0

    def summary(self) -> dict[str, object]:
        """The results.json row of this run."""
        r = self.run
        st = self.steady_steps
        return {
            "policy": r.policy,
            "mode": self.rule.mode.value,
            "static_tp": r.static_tp,
            "splits": [f"{x.gen_gpus}/{x.train_gpus}" for x in r.steps],
            "mean_step_s": self.mean_step_s,
            "mean_gen_s": self.mean_gen_s,
            "mean_train_s": sum(x.train_s for x in st) / len(st),
            "mean_sync_s": sum(x.sync_s for x in st) / len(st),
            "switch_s": sum(x.switch_s for x in st),
            "bound": pipeline_bound(st),
            "steady_steps": [x.step for x in st],
            "samples_per_s": self.samples_per_s,
            "tokens_per_s": self.tokens_per_s,
            "offpolicy_token_share": self.offpolicy_token_share,
            "dropped_share": self.dropped_share,
            "dropped_token_share": self.dropped_token_share,
            "over_provision": self.rule.over_provision,
            "max_staleness": self.rule.max_staleness,
            "end": self.rule.end.value,
            "carried_out": [x.carried_out for x in self.rollout],
            "plans": list(self.plans),
            **self.extra,
        }


@dataclass
class _Response:
    request: RolloutRequest
    pieces: list[Piece]
    done: bool = False

    @property
    def generated(self) -> int:
        return sum(p.tokens for p in self.pieces)


@dataclass
class _Group:
    name: str
    order: int
    responses: dict[str, _Response]

    def state(self, size: int) -> GroupState:
        return GroupState(
            self.name,
            size,
            self.order,
            tuple(ResponseState(rid, tuple(r.pieces), r.done) for rid, r in self.responses.items()),
        )


def run_rl(
    s: Scenario,
    perf: PerfModel,
    policy: str,
    tp: int,
    rule: RolloutRule,
    *,
    plan_split: bool = False,
    warmup: int = 1,
) -> RLRun:
    """Every step of ``s`` under ``rule`` with the generation ``policy`` starting from a
    uniform TP ``tp`` layout (adaptive policies carry their layout across steps), on the
    scenario's split and fabric. From the third step on (once a training step and a
    step's lengths are measured) :func:`scheduler.step_plan.plan_step` chooses each
    step's over-provisioning under a partial rule, and with ``plan_split`` its split too.
    ``warmup``: steps left out of the means."""
    base = s
    fabrics: dict[tuple[int, int], Fabric] = {}

    def fabric_of(sc: Scenario) -> Fabric:
        key = (sc.split.train_gpus, sc.split.gen_gpus)
        if key not in fabrics:
            fabrics[key] = make_fabric(sc, perf)
        return fabrics[key]

    timer = StepTimer(s, perf, fabric_of(s), rule.mode)
    splits = [(c.split.train_gpus, c.split.gen_gpus) for c in _all_splits(s)]
    plans: list[str] = []
    measured: TrainingRate | None = None
    last_sync = 0.0
    prompt_mean = float(s.workload.prompt_tokens)
    last_gen: float | None = None
    cfg = s.workload
    n_groups = cfg.prompts_per_step
    size = cfg.samples_per_prompt
    layout: Mapping[str, Pattern] = gen_layout(s, tp)
    config = replace(SIM_PLANNER, max_num_seqs=s.generation.max_num_seqs, carry_tail=rule.partial)
    history: list[tuple[int, ...]] = []
    groups: dict[str, _Group] = {}  # open: carried unfinished and complete waiting
    next_group = 0
    batch_tokens: int | None = None
    gens: list[GenStepResult] = []
    steps: list[RolloutStep] = []
    step_rule = rule
    previous_close: StepClose | None = None
    for k in range(s.steps):
        switch_s = 0.0
        if (plan_split or rule.partial) and measured is not None and history:
            current = (s.split.train_gpus, s.split.gen_gpus)
            plan = plan_step(
                perf,
                splits if plan_split else [current],
                current,
                rule=rule,
                load=StepLoad(
                    n_groups * size,
                    prompt_mean,
                    build_forecast(history[-4:], max_tokens=cfg.max_response_tokens),
                    train_tokens=batch_tokens,
                ),
                training=measured,
                sync_s=last_sync,
                gpus_per_node=s.cluster.gpus_per_node,
                tps=candidate_tps(s, perf),
                max_num_seqs=s.generation.max_num_seqs,
                node_gbps=s.cluster.nics_per_node * s.cluster.nic_gbps,
                measured_gen_s=last_gen,
                measured_rule=step_rule,
            )
            plans.append(f"step {k}: {plan.reason}")
            step_rule = replace(rule, over_provision=plan.over_provision)
            if plan.changes_split:
                s = with_split(base, plan.chosen.train_gpus, plan.chosen.gen_gpus)
                timer.use(s, fabric_of(s))
                switch_s = plan.switch_s
                layout = _resize(layout, s, plan.chosen.tp)
        train = timer.train(batch_tokens)
        if batch_tokens and train.compute_s > 0:
            measured = TrainingRate(
                train.compute_s * s.split.train_gpus / batch_tokens, train.comm_s
            )
        fresh = groups_to_start(step_rule, n_groups, len(groups))
        carried_in = [
            replace(r.request, generated=r.generated)
            for g in groups.values()
            for r in g.responses.values()
            if not r.done
        ]
        requests = list(carried_in)
        for idx in range(next_group, next_group + fresh):
            chunk, index = divmod(idx, n_groups)
            draw = group_draws(cfg, s.seed, chunk)[index]
            name = f"s{chunk}-p{index}" if rule.partial else ""
            reqs = group_requests(cfg, draw, k, group=name)
            g = _Group(group_name(reqs[0]), idx, {r.id: _Response(r, []) for r in reqs})
            groups[g.name] = g
            requests += reqs
        next_group += fresh
        stop = None
        if rule.partial:
            need = {
                g.name: sum(1 for r in g.responses.values() if not r.done) for g in groups.values()
            }
            waiting = sum(1 for v in need.values() if v == 0)
            stop = StepStop(step_rule, n_groups, train.train_s, need, waiting)
        res = simulate_step(
            perf,
            requests,
            layout,
            step=k,
            gpus_per_node=s.cluster.gpus_per_node,
            policy=policy,
            replan_interval_s=s.generation.replan_interval_s,
            config=config,
            max_response_tokens=cfg.max_response_tokens,
            history=history,
            stop=stop,
            chunk_tokens=s.generation.chunk_tokens,
        )
        history.append(res.lengths)
        last_gen = res.ready_s if res.ready_s is not None else res.seconds
        prompt_mean = sum(r.prompt_tokens for r in requests) / max(1, len(requests))
        if policy != "static":
            layout = res.layout_end
        generated = _record(groups, k, requests, res)
        close = close_step(rule, k, n_groups, [g.state(size) for g in groups.values()])
        trained = [groups[name] for name in close.trained]
        batch_tokens = sum(
            r.request.prompt_tokens + r.generated for g in trained for r in g.responses.values()
        )
        keep = set(close.waiting) | set(close.carried_groups)
        groups = {name: g for name, g in groups.items() if name in keep}
        consumed = previous_close
        previous_close = close
        gen = replace(
            res,
            response_tokens=sum(r.generated for g in trained for r in g.responses.values()),
            prompt_tokens=sum(
                r.request.prompt_tokens for g in trained for r in g.responses.values()
            ),
        )
        gens.append(gen)
        last_sync = timer.finish(k, res.seconds, train, switch_s).sync_s
        steps.append(
            RolloutStep(
                step=k,
                started_groups=fresh,
                carried_in=len(carried_in),
                generated_tokens=generated,
                trained_groups=len(close.trained),
                trained_responses=close.trained_responses,
                trained_tokens=close.trained_tokens,
                offpolicy_tokens=close.offpolicy_tokens,
                dropped_groups=len(close.dropped),
                dropped_responses=close.dropped_responses,
                dropped_tokens=close.dropped_tokens,
                carried_out=len(close.carried),
                waiting_groups=len(close.waiting),
                ready_s=res.ready_s,
                consumed_responses=consumed.trained_responses if consumed else 0,
                consumed_tokens=consumed.trained_tokens if consumed else 0,
                consumed_offpolicy=consumed.offpolicy_tokens if consumed else 0,
            )
        )
    run = timer.result(gens, policy=policy, static_tp=tp)
    return RLRun(run, rule, tuple(steps), n_groups * size, warmup, tuple(plans))


def _all_splits(s: Scenario) -> tuple[Scenario, ...]:
    """Every split of the pool by whole nodes, or by ``split.unit_gpus`` (both pools keep
    some GPUs)."""
    u, total = s.split.unit(s.cluster.gpus_per_node), s.split.total_gpus
    return tuple(with_split(s, t, total - t) for t in range(u, total, u))


def _resize(layout: Mapping[str, Pattern], s: Scenario, tp: int) -> dict[str, Pattern]:
    """The generation layout on ``s``'s generation nodes: nodes kept (with as many GPUs
    generating) keep their patterns, new ones start uniform at ``tp``."""
    fresh = gen_layout(s, tp)
    return {
        n: layout[n] if n in layout and sum(layout[n]) == sum(p) else p for n, p in fresh.items()
    }


def _record(
    groups: Mapping[str, _Group],
    version: int,
    requests: Sequence[RolloutRequest],
    res: GenStepResult,
) -> int:
    """Tag this step's tokens with its version; returns the tokens generated."""
    by_id = {rid: r for g in groups.values() for rid, r in g.responses.items()}
    now_generated = dict(res.unfinished)
    finished = set(res.finished)
    for rid in finished:
        now_generated[rid] = by_id[rid].request.response_tokens
    total = 0
    for r in requests:
        resp = by_id[r.id]
        before = resp.generated
        after = now_generated.get(r.id, before)
        if after > before:
            resp.pieces.append(Piece(version, after - before))
            total += after - before
        if r.id in finished:
            resp.done = True
    return total


def run_scenario_rl(s: Scenario) -> RLRun:
    """``orl-sim run`` with a ``[rollout]`` rule or ``split.choose = "plan"``: the
    scenario's policy and rule (``static_tp`` 0: the best uniform layout under full
    rollout, which adaptive policies start from), the step planner's split with
    ``plan``."""
    from sim_backends.clustersim.pipeline import best_static, perf_model

    perf = perf_model(s)
    tp = s.generation.static_tp or best_static(s, perf)[0]
    start = s.generation.initial_tp or tp if s.generation.policy != "static" else tp
    return run_rl(
        s, perf, s.generation.policy, start, s.rollout.rule, plan_split=s.split.choose == "plan"
    )
