"""One-step-asynchronous GRPO on a disaggregated cluster: generation, training, weight sync.

Step ``k`` (``S_k`` its start)::

    generation of step k          [S_k, S_k + G_k]           (weights of step k-1)
    training on step k-1's batch  [S_k, S_k + T_{k-1}]       (overlaps; none at k = 0)
    weight sync                   [S_k + max(G_k, T_{k-1}), S_{k+1}]

so a step lasts ``max(G_k, T_{k-1}) + W_k`` (verl's one-step-off-policy pipeline;
generation pauses during the sync). ``G_k`` comes from :mod:`.generation`. Training:
``mini_batches`` optimizer steps and a log-prob pass under the scenario's
``[parallelism]`` layout (:mod:`.parallel`: compute at the performance model's training
MFU; the layout's collectives, by default Megatron's data-parallel ring all-reduce of the
gradients, each timed on the fabric, ``flow`` by default or the ``bottleneck`` closed
form; exposed communication ``max(0, comm - overlap x compute)``, overlap 0 by default:
a conservative assumption). The training traffic is idle during a mini-batch's
compute, and that window is what RFabric may use to rewire for the training phase: it
plans its circuits for all of the step's training collectives together
(``Fabric.prepare_phase``).
Weight sync: ``Fabric.run_phase("weight-sync", weight_sync_transfers(...))`` with the
network's idle window before it: the time the training pool has been done while the
generation pool still ran (all of the step's generation time at step 0).

Node indexes on the fabric (``split.placement``): ``contiguous``, training nodes first
(0..T-1), generation nodes after (T..T+G-1); pods are consecutive blocks of nodes, so the
training pool fills whole pods first. ``scattered``: the training pool's ranks are dealt
round-robin over the pods used (rank i in pod i mod P), as a shared cluster's scheduler
hands out free nodes, and generation takes the remaining nodes of those pods; each pool's
rank order is the order :func:`pools` returns. Nodes of neither pool stay idle.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from scheduler.compute_problem import PlannerConfig
from scheduler.perf_model import ModelShape, PerfModel, default_model
from scheduler.rollout import RolloutMode, StepPhases, step_seconds
from sim_backends.clustersim.collectives import weight_sync_transfers
from sim_backends.clustersim.cost import CostBreakdown
from sim_backends.clustersim.fabrics import (
    ClusterSpec,
    Fabric,
    FabricKind,
    FabricOptions,
    Transfer,
    build_fabric,
)
from sim_backends.clustersim.generation import (
    GenStepResult,
    Pattern,
    gen_node_names,
    simulate_step,
    uniform_layout,
    uniform_pattern,
)
from sim_backends.clustersim.models import shape
from sim_backends.clustersim.parallel import (
    TrainingTraffic,
    time_training,
    training_traffic,
)
from sim_backends.clustersim.scenario import Scenario, SplitConfig
from sim_backends.clustersim.workload import workload

# The compute planner's configuration inside the simulator: its defaults, except that
# reactive balancing looks at the least-loaded instances of each TP degree instead of
# trying every instance and pairwise swaps on small clusters (the planner's own scale
# mode; the exhaustive mode took seconds per re-plan at 8,192 requests).
SIM_PLANNER = PlannerConfig(all_candidates_limit=0)


@dataclass(frozen=True)
class StepTiming:
    step: int
    start_s: float
    gen_s: float
    train_s: float  # training of the previous step's batch (0 at step 0)
    train_compute_s: float
    train_comm_s: float
    sync_s: float
    step_s: float
    sync_window_s: float  # idle window of the network before the weight sync
    train_reconfig_s: float
    sync_reconfig_s: float
    sync_reconfigured: bool
    sync_reason: str
    switch_s: float = 0.0  # pause of moving nodes between the pools before the step
    train_gpus: int = 0  # the step's split (0: the run's)
    gen_gpus: int = 0


@dataclass(frozen=True)
class RunResult:
    name: str
    policy: str
    static_tp: int
    fabric: str
    gpus: int
    steps: tuple[StepTiming, ...]
    gens: tuple[GenStepResult, ...]
    cost: CostBreakdown
    link_utilisation: Mapping[str, Mapping[str, float]]  # phase -> link class -> mean
    train_gpus: int = 0
    gen_gpus: int = 0
    algorithms: Mapping[str, str] = field(default_factory=dict)  # collective -> algorithm

    @property
    def steady(self) -> tuple[StepTiming, ...]:
        """Steps with training overlapped (all but the first when there are several)."""
        return self.steps[1:] if len(self.steps) > 1 else self.steps

    @property
    def mean_step_s(self) -> float:
        s = self.steady
        return sum(x.step_s for x in s) / len(s)

    @property
    def mean_gen_s(self) -> float:
        s = self.steady
        return sum(self.gens[x.step].seconds for x in s) / len(s)

    @property
    def tokens_per_s(self) -> float:
        s = self.steady
        tokens = sum(self.gens[x.step].response_tokens for x in s)
        return tokens / sum(x.step_s for x in s)

    @property
    def mean_train_s(self) -> float:
        s = self.steady
        return sum(x.train_s for x in s) / len(s)

    @property
    def mean_sync_s(self) -> float:
        s = self.steady
        return sum(x.sync_s for x in s) / len(s)

    @property
    def bound(self) -> str:
        """Which side sets the steady steps' length: :func:`pipeline_bound`."""
        return pipeline_bound(self.steady)

    @property
    def perf_per_cost(self) -> float:
        """(1 / step time) / network cost (TopoOpt's cost-efficiency), per MUSD."""
        return (1.0 / self.mean_step_s) / (self.cost.total / 1e6) if self.cost.total else 0.0


def perf_model(s: Scenario) -> PerfModel:
    """The model's performance model on the scenario's hardware, its engines capped at
    ``generation.max_num_seqs`` sequences per instance at every TP (stated in reports:
    results swing with it)."""
    m = default_model(s.model.name, s.cluster.hardware)
    cap = s.generation.max_num_seqs
    if cap == m.efficiency.max_num_seqs:
        return m
    return replace(m, efficiency=replace(m.efficiency, max_num_seqs=cap))


def with_max_num_seqs(s: Scenario, cap: int) -> Scenario:
    """``s`` with its engines capped at ``cap`` sequences per instance."""
    return replace(s, generation=replace(s.generation, max_num_seqs=cap))


def cluster_spec(s: Scenario) -> ClusterSpec:
    c = s.cluster
    extra = {"nodes_per_pod": c.nodes_per_pod} if c.nodes_per_pod else {}
    return ClusterSpec(c.nodes, c.gpus_per_node, c.nics_per_node, c.nic_gbps, **extra)


def pools(s: Scenario) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Training and generation node indexes, each in rank order (see the module doc)."""
    t, g = s.train_nodes, s.gen_nodes
    if s.split.placement != "scattered":
        return tuple(range(t)), tuple(range(t, t + g))
    return scattered_pools(t, g, cluster_spec(s).nodes_per_pod)


def scattered_pools(
    train: int, gen: int, nodes_per_pod: int
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The ``scattered`` placement: ``train + gen`` nodes fill as few pods as they can;
    the training ranks are dealt round-robin over those pods, generation takes the rest."""
    total = train + gen
    pods = -(-total // nodes_per_pod)
    slots = [
        [p * nodes_per_pod + i for i in range(min(nodes_per_pod, total - p * nodes_per_pod))]
        for p in range(pods)
    ]
    out: list[int] = []
    k = 0
    while len(out) < train:
        pod = slots[k % pods]
        if pod:
            out.append(pod.pop(0))
        k += 1
    taken = set(out)
    return tuple(out), tuple(x for x in range(total) if x not in taken)


def train_shape(s: Scenario, perf: PerfModel) -> ModelShape:
    """The model trained: ``training.model``, or the generation model's shape."""
    return shape(s.training.model) if s.training.model else shape(perf.model.name)


def training_step(s: Scenario, perf: PerfModel, tokens: int) -> TrainingTraffic:
    """One RL step's training (compute and collectives) for a batch of ``tokens``."""
    train, _ = pools(s)
    c = cluster_spec(s)
    return training_traffic(
        train_shape(s, perf),
        s.parallelism,
        train,
        c.gpus_per_node,
        c.pod_of,
        tokens=tokens,
        mini_batches=s.training.mini_batches,
        flops_per_gpu=perf.hardware.peak_flops * perf.efficiency.training_mfu,
        grad_bytes_per_param=s.training.grad_bytes_per_param,
        reference_model=s.training.reference_model,
        gpus=s.split.train_gpus if s.split.train_gpus % c.gpus_per_node else 0,
        old_logprob=s.training.old_logprob,
    )


def candidate_tps(s: Scenario, perf: PerfModel) -> tuple[int, ...]:
    g = s.cluster.gpus_per_node
    return tuple(
        t
        for t in (1, 2, 4, 8, 16)
        if t <= g and g % t == 0 and perf.model.heads % t == 0 and perf.fits(t)
    )


def gen_layout(s: Scenario, tp: int) -> dict[str, Pattern]:
    """The generation pool at a uniform TP ``tp``: ``gen000``.. its whole nodes, and after
    them the GPUs it has on a node shared with training (``SplitConfig.unit_gpus``), at
    ``tp`` or the largest TP dividing them."""
    g = s.cluster.gpus_per_node
    whole = s.gen_nodes
    names = gen_node_names(whole + (1 if s.shared_gen_gpus else 0))
    layout = uniform_layout(names[:whole], g, tp)
    if s.shared_gen_gpus:
        layout[names[-1]] = uniform_pattern(s.shared_gen_gpus, tp)
    return layout


def run_generation(s: Scenario, perf: PerfModel, policy: str, tp: int) -> tuple[GenStepResult, ...]:
    """Every step's generation; the layout and the length history carry across steps."""
    layout: Mapping[str, Pattern] = gen_layout(s, tp)
    history: list[tuple[int, ...]] = []
    config = replace(SIM_PLANNER, max_num_seqs=s.generation.max_num_seqs)
    out: list[GenStepResult] = []
    for wl in workload(s.workload, s.seed, s.steps):
        res = simulate_step(
            perf,
            wl.requests,
            layout,
            step=wl.step,
            gpus_per_node=s.cluster.gpus_per_node,
            policy=policy,
            replan_interval_s=s.generation.replan_interval_s,
            config=config,
            max_response_tokens=s.workload.max_response_tokens,
            history=history,
            chunk_tokens=s.generation.chunk_tokens,
        )
        out.append(res)
        history.append(res.lengths)
        if policy != "static":
            layout = res.layout_end
    return tuple(out)


def best_static(
    s: Scenario, perf: PerfModel
) -> tuple[int, tuple[GenStepResult, ...], dict[int, float]]:
    """The uniform TP layout with the shortest total generation time (and every one's)."""
    totals: dict[int, float] = {}
    best: tuple[int, tuple[GenStepResult, ...]] | None = None
    for tp in candidate_tps(s, perf):
        gens = run_generation(s, perf, "static", tp)
        totals[tp] = sum(g.seconds for g in gens)
        if best is None or totals[tp] < totals[best[0]]:
            best = (tp, gens)
    assert best is not None, "no TP degree fits the model"  # scenario validation prevents
    return best[0], best[1], totals


def make_fabric(s: Scenario, perf: PerfModel, kind: str | None = None, **opts: object) -> Fabric:
    """The scenario's fabric; an optical one plans its static circuits for one step's
    training traffic (a representative batch: every request at the workload's median
    length) plus the weight sync."""
    cluster = cluster_spec(s)
    train, gen = pools(s)
    f = s.fabric
    options = FabricOptions(
        oversubscription=f.oversubscription,
        ocs_switching_s=f.ocs_switching_s,
        ocs_ports=f.ocs_ports,
        reconfigure=f.reconfigure,
        optical_oversubscription=f.optical_oversubscription,
    )
    if opts:
        options = replace(options, **opts)  # type: ignore[arg-type]
    k = FabricKind(kind or f.kind)
    w = s.workload
    tokens = int(w.requests_per_step * (w.prompt_tokens + w.median_response_tokens))
    demand = training_step(s, perf, tokens).demand(s.parallelism.algorithm)
    job = [*demand, *_sync_transfers(s, perf, cluster, None)]
    return build_fabric(k, cluster, options, train, gen, job)


def _sync_transfers(
    s: Scenario, perf: PerfModel, cluster: ClusterSpec, fabric: Fabric | None
) -> list[Transfer]:
    train, gen = pools(s)
    return weight_sync_transfers(train, gen, train_shape(s, perf).weight_bytes, cluster, fabric)


def train_compute_s(s: Scenario, perf: PerfModel, tokens: int) -> float:
    """Training FLOPs of one RL step's batch over the training pool at the model's MFU
    (8 x active params x tokens, 10 with a reference model; :mod:`.parallel`)."""
    factor = 6.0 + (2.0 if s.training.old_logprob else 0.0)
    factor += 2.0 if s.training.reference_model else 0.0
    h, e = perf.hardware, perf.efficiency
    return (
        factor
        * train_shape(s, perf).active_params
        * tokens
        / (s.split.train_gpus * h.peak_flops * e.training_mfu)
    )


@dataclass(frozen=True)
class TrainTiming:
    """Training of one batch: compute, exposed communication (reconfiguration included)."""

    train_s: float = 0.0
    compute_s: float = 0.0
    comm_s: float = 0.0
    reconfig_s: float = 0.0


class StepTimer:
    """Training and weight sync of consecutive RL steps on one fabric: what
    :func:`run_pipeline` and the partial-rollout driver compose with generation. Call
    :meth:`train` (the previous batch's tokens; None at the first step), then
    :meth:`finish` with the step's generation seconds; :meth:`result` at the end."""

    def __init__(
        self, s: Scenario, perf: PerfModel, fabric: Fabric, mode: RolloutMode = RolloutMode.FULL
    ) -> None:
        self.perf, self.mode = perf, mode
        self.use(s, fabric)
        self.util_sum: dict[str, dict[str, float]] = {}
        self.util_n: dict[str, int] = {}
        self.steps: list[StepTiming] = []
        self.algorithms: dict[str, str] = {}
        self.start = 0.0

    def use(self, s: Scenario, fabric: Fabric) -> None:
        """Time the next steps on ``s``'s split and this fabric (the split changed)."""
        self.s, self.fabric = s, fabric
        self.sync_transfers = _sync_transfers(s, self.perf, fabric.cluster, fabric)

    def train(self, tokens: int | None) -> TrainTiming:
        """Training of a batch of ``tokens`` (prompt and response) on the fabric."""
        if tokens is None:
            return TrainTiming()
        s, fabric, layout = self.s, self.fabric, self.s.parallelism
        traffic = training_step(s, self.perf, tokens)
        reconfig, _, _ = fabric.prepare_phase(
            "training", traffic.demand(layout.algorithm), traffic.update_compute_s
        )
        seen: dict[int, dict[str, float]] = {}

        def seconds_of(ts: Sequence[Transfer], seen: dict[int, dict[str, float]] = seen) -> float:
            sec, util = fabric.measure(ts, s.parallelism.timing)
            seen[id(ts)] = util
            return sec

        timing = time_training(
            traffic,
            seconds_of,
            algorithm=layout.algorithm,
            overlap=layout.overlap,
            latency_s=self.perf.efficiency.network_latency_s,
        )
        for p in traffic.patterns:
            used = seen.get(id(p.option(timing.choices[p.name]).transfers))
            if used:
                _acc(self.util_sum, self.util_n, "training", used)
        self.algorithms.update(timing.choices)
        comm = timing.exposed_s + reconfig
        return TrainTiming(timing.compute_s + comm, timing.compute_s, comm, reconfig)

    def finish(
        self, step: int, gen_s: float, train: TrainTiming, switch_s: float = 0.0
    ) -> StepTiming:
        """The weight sync after the step's generation and training, and the step
        (``switch_s``: a pause before it, nodes moving between the pools)."""
        window = max(0.0, gen_s - train.train_s)
        sync = self.fabric.run_phase("weight-sync", self.sync_transfers, idle_window_s=window)
        _acc(self.util_sum, self.util_n, "weight-sync", sync.link_utilisation)
        step_s = switch_s + step_seconds(self.mode, StepPhases(gen_s, train.train_s, sync.seconds))
        timing = StepTiming(
            step=step,
            start_s=self.start,
            gen_s=gen_s,
            train_s=train.train_s,
            train_compute_s=train.compute_s,
            train_comm_s=train.comm_s,
            sync_s=sync.seconds,
            step_s=step_s,
            sync_window_s=window,
            train_reconfig_s=train.reconfig_s,
            sync_reconfig_s=sync.reconfig_s,
            sync_reconfigured=sync.reconfigured,
            sync_reason=sync.reason,
            switch_s=switch_s,
            train_gpus=self.s.split.train_gpus,
            gen_gpus=self.s.split.gen_gpus,
        )
        self.steps.append(timing)
        self.start += step_s
        return timing

    def result(self, gens: Sequence[GenStepResult], *, policy: str, static_tp: int) -> RunResult:
        s = self.s
        util = {
            phase: {k: v / self.util_n[phase] for k, v in classes.items()}
            for phase, classes in self.util_sum.items()
        }
        return RunResult(
            name=s.name,
            policy=policy,
            static_tp=static_tp,
            fabric=self.fabric.kind.value,
            gpus=s.split.train_gpus + s.split.gen_gpus,
            steps=tuple(self.steps),
            gens=tuple(gens),
            cost=self.fabric.cost(),
            link_utilisation=util,
            train_gpus=s.split.train_gpus,
            gen_gpus=s.split.gen_gpus,
            algorithms=self.algorithms,
        )


def run_pipeline(
    s: Scenario,
    perf: PerfModel,
    gens: Sequence[GenStepResult],
    fabric: Fabric,
    *,
    policy: str,
    static_tp: int,
) -> RunResult:
    """Compose generation results with training and weight sync on ``fabric``."""
    timer = StepTimer(s, perf, fabric)
    prev: GenStepResult | None = None
    for g in gens:
        tokens = None if prev is None else prev.response_tokens + prev.prompt_tokens
        timer.finish(g.step, g.seconds, timer.train(tokens))
        prev = g
    return timer.result(gens, policy=policy, static_tp=static_tp)


def _acc(
    total: dict[str, dict[str, float]], n: dict[str, int], phase: str, util: Mapping[str, float]
) -> None:
    d = total.setdefault(phase, {})
    for k, v in util.items():
        d[k] = d.get(k, 0.0) + v
    n[phase] = n.get(phase, 0) + 1


def run_scenario(s: Scenario) -> RunResult:
    """``orl-sim run``: the scenario's policy (``static_tp`` 0: the best uniform layout,
    which adaptive policies also start from unless ``initial_tp`` says otherwise), on the
    scenario's split (``split.choose = "auto"``: :func:`resolve_split`'s)."""
    s, _ = resolve_split(s)
    perf = perf_model(s)
    gen = s.generation
    if gen.static_tp:
        tp = gen.static_tp
        static_gens = None
    else:
        tp, static_gens, _ = best_static(s, perf)
    if gen.policy == "static":
        gens = static_gens if static_gens is not None else run_generation(s, perf, "static", tp)
    else:
        gens = run_generation(s, perf, gen.policy, gen.initial_tp or tp)
    fabric = make_fabric(s, perf)
    return run_pipeline(s, perf, gens, fabric, policy=gen.policy, static_tp=tp)


def pipeline_bound(steps: Iterable[StepTiming]) -> str:
    """``generation`` when generation lasts at least as long as the training it overlaps in
    every one of ``steps`` (faster generation shortens them), ``training`` when training
    is longer in every one (faster generation gains nothing end to end), ``mixed``
    otherwise."""
    gen_longer = [x.gen_s >= x.train_s for x in steps]
    if all(gen_longer):
        return "generation"
    if not any(gen_longer):
        return "training"
    return "mixed"


@dataclass(frozen=True)
class SplitOutcome:
    """The best static layout's pipeline at one generation/training split (means over
    the steady steps)."""

    train_gpus: int
    gen_gpus: int
    static_tp: int
    gen_s: float
    train_s: float
    sync_s: float
    step_s: float
    bound: str


def choose_split(outcomes: Sequence[SplitOutcome]) -> SplitOutcome:
    """The rule of ``split.choose = "auto"``: the split whose best static layout has the
    shortest mean steady step time, ``max(generation, training) + weight sync``; equal
    step times go to the split with more generation GPUs."""
    if not outcomes:
        raise ValueError("choose_split: no split to choose from")
    return min(outcomes, key=lambda o: (o.step_s, -o.gen_gpus))


def with_split(s: Scenario, train_gpus: int, gen_gpus: int) -> Scenario:
    """``s`` with this fixed split (by the same unit)."""
    return replace(s, split=SplitConfig(train_gpus, gen_gpus, unit_gpus=s.split.unit_gpus))


def outcome(r: RunResult) -> SplitOutcome:
    return SplitOutcome(
        train_gpus=r.train_gpus,
        gen_gpus=r.gen_gpus,
        static_tp=r.static_tp,
        gen_s=r.mean_gen_s,
        train_s=r.mean_train_s,
        sync_s=r.mean_sync_s,
        step_s=r.mean_step_s,
        bound=r.bound,
    )


def run_best_static(s: Scenario, perf: PerfModel) -> RunResult:
    """The pipeline with the best uniform layout (:func:`best_static`) on ``s``'s split."""
    tp, gens, _ = best_static(s, perf)
    return run_pipeline(s, perf, gens, make_fabric(s, perf), policy="static", static_tp=tp)


def sweep_split(s: Scenario, perf: PerfModel) -> tuple[SplitOutcome, ...]:
    """The best static layout's pipeline at every split ``split.choose = "auto"`` tries."""
    return tuple(
        outcome(run_best_static(with_split(s, c.train_gpus, c.gen_gpus), perf))
        for c in s.split.candidates(s.cluster.gpus_per_node)
    )


def resolve_split(s: Scenario) -> tuple[Scenario, tuple[SplitOutcome, ...]]:
    """``s`` with its split fixed: as given (``choose = "fixed"``, no sweep), or the one
    :func:`choose_split` picks from :func:`sweep_split` (returned too)."""
    if s.split.choose != "auto":
        return s, ()
    sweep = sweep_split(s, perf_model(s))
    best = choose_split(sweep)
    return with_split(s, best.train_gpus, best.gen_gpus), sweep


def end_to_end(
    static: RunResult,
    adaptive: RunResult,
    oracle: RunResult,
    bound_gen_s: Sequence[float],
) -> dict[str, object]:
    """The pipeline view of one compute result (mean steady step seconds each): the split,
    training and weight-sync time (the same workload for every policy), the step time of
    the best static layout, adaptive and oracle, their end-to-end speedups over best
    static, which side bounds each pipeline (:func:`pipeline_bound`), and the step time
    with generation at its fluid bound (``bound_gen_s``, per step), the end-to-end
    ceiling: ``max(bound, training) + weight sync``."""
    steady = static.steady
    bound_step = sum(max(bound_gen_s[x.step], x.train_s) + x.sync_s for x in steady) / len(steady)
    return {
        "train_gpus": static.train_gpus,
        "gen_gpus": static.gen_gpus,
        "train_s": static.mean_train_s,
        "sync_s": static.mean_sync_s,
        "static_step_s": static.mean_step_s,
        "adaptive_step_s": adaptive.mean_step_s,
        "oracle_step_s": oracle.mean_step_s,
        "bound_step_s": bound_step,
        "adaptive_e2e_speedup": static.mean_step_s / adaptive.mean_step_s,
        "oracle_e2e_speedup": static.mean_step_s / oracle.mean_step_s,
        "bound_e2e_speedup": static.mean_step_s / bound_step,
        "pipeline_bound": {
            "static": static.bound,
            "adaptive": adaptive.bound,
            "oracle": oracle.bound,
        },
    }


def step_bounds(s: Scenario, perf: PerfModel) -> tuple[float, ...]:
    """The fluid lower bound (:mod:`.bound`) on every step's generation time."""
    from sim_backends.clustersim.bound import fluid_bound

    tps = candidate_tps(s, perf)
    return tuple(
        fluid_bound(
            perf,
            [(r.prompt_tokens, r.response_tokens) for r in wl.requests],
            s.split.gen_gpus,
            tps,
            s.generation.max_num_seqs,
        ).seconds
        for wl in workload(s.workload, s.seed, s.steps)
    )


def ceilings(
    static_gen_s: Mapping[int, float],
    adaptive_s: float,
    oracle_s: float,
    bound_s: float,
    prompt_oracle_s: float | None = None,
) -> dict[str, object]:
    """One compute result against its ceilings (mean generation seconds per step each):
    every static TP, the best, adaptive, oracle and bound, their speedups over the best
    static layout, and the share of the oracle's gain the adaptive policy captures,
    ``(best / adaptive - 1) / (best / oracle - 1)`` (None when the oracle gains nothing).
    ``prompt_oracle_s``, when run: the adaptive policy told every prompt's difficulty (the
    ``prompt-oracle`` policy), and the share of the oracle's gain it captures."""
    tp = min(static_gen_s, key=lambda t: (static_gen_s[t], t))
    best = static_gen_s[tp]
    gain = best / oracle_s - 1.0

    def share(s: float) -> float | None:
        return (best / s - 1.0) / gain if gain > 1e-9 else None

    return {
        "static_gen_s": {str(t): v for t, v in sorted(static_gen_s.items())},
        "best_static_tp": tp,
        "best_static_s": best,
        "adaptive_s": adaptive_s,
        "oracle_s": oracle_s,
        "bound_s": bound_s,
        "adaptive_speedup": best / adaptive_s,
        "oracle_speedup": best / oracle_s,
        "bound_speedup": best / bound_s,
        "captured": share(adaptive_s),
        "prompt_oracle_s": prompt_oracle_s,
        "prompt_oracle_speedup": None if prompt_oracle_s is None else best / prompt_oracle_s,
        "prompt_oracle_captured": None if prompt_oracle_s is None else share(prompt_oracle_s),
    }
