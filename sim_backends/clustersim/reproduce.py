"""``orl-sim reproduce``: the paper's experiments in the simulator, and their figures.

1. compute: 64 H800 (16 train / 48 generate), Qwen2.5-14B and 32B, one-step-async GRPO:
   every uniform static TP layout, then the compute planner's policies (proactive only,
   reactive only, both) starting from the best static layout. Paper: up to 1.42x
   (1.40x / 1.34x for 14B / 32B) end-to-end throughput over the best static layout.
2. network: 1024 and 2048 H800, Qwen2.5-72B, every fabric: step time, network cost and
   perf/cost normalised to the non-blocking Fat-Tree. Weak scaling: prompts per step
   grow with the GPU count from the 64-GPU experiment's batch (the same load per GPU).
   Generation is the same on every fabric (it has no inter-node traffic in this model),
   so it is simulated once per size with the best static layout.
2b. regime map (:mod:`.regimes`): dense 72B under Megatron and FSDP and MoE Qwen3-235B-A22B
   with expert parallelism, at 1024 and 2048 GPUs, contiguous and scattered placement,
   every fabric: training + weight sync timed in closed form on the fabric; perf/cost
   with and without host links; where RFabric beats the best static fabric.
1d. asynchronous RL (:mod:`.replay`, :mod:`.propagation`): verl's published fully-async
   runs (H20) with a model of verl's mode, OrchestrRL's asynchronous mode on the same GPUs
   and each of its mechanisms alone, a rollout-bound split of the 7B row, and the
   version-propagation figure (32B to 64 rollout GPUs on a 4:1 core, leases vs static).
3. sensitivity: OCS switching time (10 us .. 50 ms) on RFabric at 1024 GPUs; the
   generation/training split of the default and the DAPO-like suite scenarios (64 GPUs,
   1-4 training nodes): where the pipeline is generation- or training-bound, which split
   ``split.choose = "auto"`` picks, and the adaptive policy's speedups at each; and the
   engines' cap on sequences per instance (``max_num_seqs`` 64..512) on the same two,
   against the same ceilings (the best static layout and every speedup move with it).

Every compute result gives two speedups over the best static layout: in generation time
(the policy's own effect) and end to end (the pipeline's step time,
``max(generation, training) + weight sync``, which a faster generation shortens only while
the pipeline is generation-bound), with the split and which side bounds the pipeline.

Every figure comes from the model; nothing is tuned toward the paper. Results are a
pure function of the seed (wall-clock times go to the progress output only).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

from scheduler.rollout import FULL, RolloutMode, RolloutRule, StepEnd
from sim_backends.clustersim import propagation, regimes, replay
from sim_backends.clustersim.generation import GenStepResult, decode_time
from sim_backends.clustersim.pipeline import (
    RunResult,
    SplitOutcome,
    best_static,
    candidate_tps,
    ceilings,
    choose_split,
    end_to_end,
    make_fabric,
    outcome,
    perf_model,
    resolve_split,
    run_best_static,
    run_generation,
    run_pipeline,
    step_bounds,
    with_max_num_seqs,
    with_split,
)
from sim_backends.clustersim.rollout import RLRun, run_rl
from sim_backends.clustersim.scenario import (
    FABRIC_KINDS,
    Scenario,
    SplitConfig,
    WorkloadConfig,
    load_scenario,
    parse_scenario,
)
from sim_backends.clustersim.workload import step_workload

PAPER = {
    "compute": "up to 1.42x end-to-end throughput over static baselines on 64 H800 "
    "(1.40x for Qwen2.5-14B, 1.34x for Qwen2.5-32B; v1: 1.40x on 48 GPUs)",
    "network": "RFabric ahead of a non-blocking Fat-Tree in performance per network cost "
    "at 1024-2048 H800 (2.2x-3.2x; secondary sources quote 1.5x-3.2x), with a 72B model "
    "and in v2 a MoE (Qwen3-235B-A22B); also compared with an oversubscribed Fat-Tree, a "
    "rail-optimised fabric and TopoOpt",
}
POLICIES = ("proactive", "reactive", "adaptive")
SWITCHING_S = (10e-6, 1e-3, 10e-3, 25e-3, 50e-3)
SUITE_DIR = Path(__file__).resolve().parents[2] / "examples" / "sim" / "suite"
QUICK_SUITE = ("default-14b", "dapo-14b")  # the --quick run's subset, shrunk
SPLIT_SWEEP = ("default-14b", "dapo-14b")  # suite scenarios swept over the split
SEQS_SWEEP = ("default-14b", "dapo-14b")  # ... and over max_num_seqs
OP_SWEEP = ("default-14b", "dapo-14b")  # ... and over the partial rollout's over-provisioning
# Partial rollout as the suite runs it: RollPacker's over-provisioning (1.25, arXiv
# 2509.21009), a step ends once the trainer's groups are complete, a response spans at
# most one weight version more than the pipeline's own lag (the default)
PARTIAL = RolloutRule(RolloutMode.PARTIAL, 1.25, 1, StepEnd.GROUPS)
OVER_PROVISION = (1.1, 1.25, 1.5, 2.0)
# Seer's divided rollout (arXiv 2511.14617, section 3.2): the paper's body gives no chunk
# size; secondary summaries of it report chunks of 8K tokens. The DAPO-like study also
# runs a quarter of it.
DIVIDED_CHUNK = 8192
DIVIDED_CHUNKS = (2048, 8192)
# the RL-throughput rows, in report order: (key, policy, rule, the step planner's split,
# divided rollout's chunk)
RL_ROWS = (
    ("baseline", "static", FULL, False, 0),
    ("tp", "adaptive", FULL, False, 0),
    ("split", "static", FULL, True, 0),
    ("partial", "static", PARTIAL, False, 0),
    ("partial_split", "static", PARTIAL, True, 0),
    ("adaptive_partial", "adaptive", PARTIAL, True, 0),
    ("divided", "static", FULL, False, DIVIDED_CHUNK),
)
# the DAPO-like study (REPORT section 1c): what moves the suite's DAPO-like load toward
# the 1.4x, each mechanism measured on its own
DAPO_STUDY = ("dapo-14b",)
# a split by pairs of GPUs (each with its NIC: split.unit_gpus), swept over these
# generation-pool sizes
GRANULAR_UNIT = 2
GRANULAR_GEN_GPUS = (36, 38, 40, 42, 44, 46, 48)


@dataclass(frozen=True)
class Plan:
    """Sizes of the reproduction (``quick``: a smoke run of a few seconds)."""

    quick: bool
    seed: int = 1

    @property
    def steps(self) -> int:
        return 2 if self.quick else 3

    @property
    def workload(self) -> WorkloadConfig:
        if self.quick:
            return WorkloadConfig(
                prompts_per_step=8, samples_per_prompt=4, max_response_tokens=4096
            )
        return WorkloadConfig(prompts_per_step=128, samples_per_prompt=16)

    @property
    def compute_models(self) -> tuple[str, ...]:
        return ("Qwen2.5-14B",) if self.quick else ("Qwen2.5-14B", "Qwen2.5-32B")

    @property
    def network_nodes(self) -> tuple[int, ...]:
        return (16,) if self.quick else (128, 256)

    @property
    def regime_nodes(self) -> tuple[int, ...]:
        """Cluster sizes of the regime map (quick: 512 GPUs, two pods)."""
        return (64,) if self.quick else (128, 256)

    @property
    def suite(self) -> tuple[Scenario, ...]:
        """The scenario suite (examples/sim/suite/*.toml, in name order); ``quick``: two of
        them at a tenth of the prompts, 2 steps and a 4,096-token cap."""
        out = []
        for path in sorted(SUITE_DIR.glob("*.toml")):
            s = load_scenario(path)
            if self.quick:
                if s.name not in QUICK_SUITE:
                    continue
                wl = replace(
                    s.workload,
                    prompts_per_step=max(4, s.workload.prompts_per_step // 16),
                    max_response_tokens=4096,
                )
                s = replace(s, steps=2, workload=wl)
            out.append(replace(s, seed=s.seed + self.seed - 1))
        return tuple(out)

    @property
    def splits(self) -> tuple[int, ...]:
        """Training nodes of the split sweep (of the scenario's pool, 8 nodes in the
        swept scenarios; a split that leaves no generation node is skipped)."""
        return (1, 2) if self.quick else (1, 2, 3, 4)

    @property
    def rl_steps(self) -> tuple[int, int]:
        """Steps of the RL-throughput runs and the warm-up left out of their means: a
        partial step trains the batch of the step before, which carried responses only
        from the third step on (quick: 4 steps, 2 left out)."""
        return (4, 2) if self.quick else (5, 3)

    @property
    def seqs(self) -> tuple[int, ...]:
        """``max_num_seqs`` values of the sweep (sequences per instance at every TP)."""
        return (64, 256) if self.quick else (64, 128, 256, 512)


def compute_scenario(plan: Plan, model: str, train_nodes: int = 2) -> Scenario:
    nodes = 8
    return replace(
        parse_scenario(
            {
                "name": f"compute-{model}",
                "seed": plan.seed,
                "steps": plan.steps,
                "cluster": {"nodes": nodes},
                "model": {"name": model},
                "fabric": {"kind": "fat-tree"},
            }
        ),
        workload=plan.workload,
        split=SplitConfig(train_nodes * 8, (nodes - train_nodes) * 8),
    )


def network_scenario(plan: Plan, nodes: int) -> Scenario:
    base = plan.workload
    scale = nodes * 8 / 64  # weak scaling from the 64-GPU experiment
    wl = replace(base, prompts_per_step=max(1, round(base.prompts_per_step * scale)))
    return replace(
        parse_scenario(
            {
                "name": f"network-{nodes * 8}",
                "seed": plan.seed,
                "steps": plan.steps,
                "cluster": {"nodes": nodes},
                "model": {"name": "Qwen2.5-72B" if not plan.quick else "Qwen2.5-14B"},
                "generation": {"policy": "static"},
            }
        ),
        workload=wl,
    )


Task = tuple[str, Callable[[], None]]


def tasks(plan: Plan, out: dict[str, Any], runs: dict[str, RunResult]) -> Iterator[Task]:
    """The reproduction as a sequence of labelled steps (for the progress bar)."""
    out["compute"] = {}
    for model in plan.compute_models:
        s = compute_scenario(plan, model)
        row: dict[str, Any] = {"model": model, "gpus": 64, "train_gpus": s.split.train_gpus}
        out["compute"][model] = row
        holder: dict[str, Any] = {}

        def statics(s: Scenario = s, row: dict[str, Any] = row, h: dict[str, Any] = holder) -> None:
            perf = perf_model(s)
            per_tp = {t: run_generation(s, perf, "static", t) for t in candidate_tps(s, perf)}
            totals = {t: sum(g.seconds for g in gens) for t, gens in per_tp.items()}
            tp = min(totals, key=lambda t: (totals[t], t))  # best_static's choice
            gens = per_tp[tp]
            h["tp"] = tp
            row["static_done_s"] = {str(t): _done_s(g) for t, g in per_tp.items()}
            row["static_step_gen_s"] = {
                str(t): _mean_steady([x.seconds for x in g]) for t, g in per_tp.items()
            }
            fabric = make_fabric(s, perf)
            res = run_pipeline(s, perf, gens, fabric, policy="static", static_tp=tp)
            runs[f"compute/{s.model.name}/static"] = res
            row["static_tp"] = tp
            row["tail_floor_s"] = _tail_floor(s, res)
            row["static_gen_over_floor"] = res.mean_gen_s / row["tail_floor_s"]
            row["static_gen_total_s"] = {str(k): v for k, v in totals.items()}
            row["static"] = _summary(res)

        yield f"compute {model}: static TP layouts", statics
        for policy in POLICIES:

            def adaptive(
                s: Scenario = s,
                policy: str = policy,
                row: dict[str, Any] = row,
                h: dict[str, Any] = holder,
            ) -> None:
                perf = perf_model(s)
                tp = h["tp"]
                gens = run_generation(s, perf, policy, tp)
                res = run_pipeline(s, perf, gens, make_fabric(s, perf), policy=policy, static_tp=tp)
                runs[f"compute/{s.model.name}/{policy}"] = res
                row[policy] = _summary(res)
                row[policy]["speedup"] = row["static"]["mean_step_s"] / res.mean_step_s
                row[policy]["gen_speedup"] = row["static"]["mean_gen_s"] / res.mean_gen_s
                firsts = [res.gens[x.step].predicted[0][1] for x in res.steady]
                row[policy]["predicted_at_start_s"] = sum(firsts) / len(firsts)
                row[policy]["layout_changes"] = sum(
                    1 for x in res.steady if res.gens[x.step].reshards
                )

            yield f"compute {model}: {policy}", adaptive

        def oracle(s: Scenario = s, row: dict[str, Any] = row) -> None:
            perf = perf_model(s)
            gens = run_generation(s, perf, "oracle", row["static_tp"])
            res = run_pipeline(
                s, perf, gens, make_fabric(s, perf), policy="oracle", static_tp=row["static_tp"]
            )
            runs[f"compute/{s.model.name}/oracle"] = res
            row["oracle"] = _summary(res)
            row["oracle"]["speedup"] = row["static"]["mean_step_s"] / res.mean_step_s
            row["oracle"]["gen_speedup"] = row["static"]["mean_gen_s"] / res.mean_gen_s
            statics = {int(t): v for t, v in row["static_step_gen_s"].items()}
            bounds = step_bounds(s, perf)
            row["ceilings"] = ceilings(
                statics,
                row["adaptive"]["mean_gen_s"],
                res.mean_gen_s,
                _mean_steady(list(bounds)),
            )
            row["ceilings"].update(
                end_to_end(
                    runs[f"compute/{s.model.name}/static"],
                    runs[f"compute/{s.model.name}/adaptive"],
                    res,
                    bounds,
                ),
                split_choose=s.split.choose,
            )

        yield f"compute {model}: oracle and bound", oracle

    out["suite"] = {}
    for s in plan.suite:

        def suite_one(s: Scenario = s) -> None:
            out["suite"][s.name] = suite_row(s)

        yield f"suite {s.name}: static TPs, adaptive, oracle, bound", suite_one

    out["rl"] = {}
    for s in plan.suite:

        def rl_one(s: Scenario = s) -> None:
            out["rl"][s.name] = rl_row(s, plan)

        yield f"RL throughput {s.name}: full and partial rollout, split, TP", rl_one

    asyn: dict[str, Any] = {"replay": {"source": replay.SOURCE, "rows": {}}, "stress": {}}
    out["async"] = asyn
    for pub in replay.PUBLISHED:

        def one_replay(pub: replay.Published = pub) -> None:
            asyn["replay"]["rows"][pub.key] = replay.replay_row(pub, plan.quick, plan.seed)

        yield (
            f"async replay {pub.key}: verl's mode, OrchestrRL's and each mechanism alone",
            one_replay,
        )

    def one_stress() -> None:
        asyn["stress"]["7b-128 rollout-bound (96:32)"] = replay.stress_row(plan.quick, plan.seed)

    yield "async: a rollout-bound split of the 7B row", one_stress

    def one_propagation() -> None:
        asyn["propagation"] = propagation.propagation_figure()

    yield "async: version propagation, 32B to 64 rollout GPUs on a 4:1 core", one_propagation

    out["network"] = {}
    for nodes in plan.network_nodes:
        s = network_scenario(plan, nodes)
        gens_box: dict[str, Any] = {}

        def net_gen(s: Scenario = s, box: dict[str, Any] = gens_box) -> None:
            perf = perf_model(s)
            tp, gens, _ = best_static(s, perf)
            box["tp"], box["gens"] = tp, gens

        yield f"network {nodes * 8} GPUs: generation", net_gen
        table: dict[str, Any] = {}
        out["network"][str(nodes * 8)] = table

        def fabrics(
            s: Scenario = s, box: dict[str, Any] = gens_box, table: dict[str, Any] = table
        ) -> None:
            perf = perf_model(s)
            for kind in FABRIC_KINDS:
                res = run_pipeline(
                    s,
                    perf,
                    box["gens"],
                    make_fabric(s, perf, kind),
                    policy="static",
                    static_tp=box["tp"],
                )
                runs[f"network/{s.cluster.nodes * 8}/{kind}"] = res
                table[kind] = _summary(res)
            ref = table["fat-tree"]
            for row in table.values():
                row["step_norm"] = row["mean_step_s"] / ref["mean_step_s"]
                row["cost_norm"] = row["cost_usd"] / ref["cost_usd"]
                row["perf_per_cost_norm"] = row["perf_per_cost"] / ref["perf_per_cost"]

        yield f"network {nodes * 8} GPUs: {len(FABRIC_KINDS)} fabrics", fabrics

        if nodes == plan.network_nodes[0]:
            sens: dict[str, Any] = {}
            out["sensitivity_switching"] = sens

            def switching(
                s: Scenario = s, box: dict[str, Any] = gens_box, sens: dict[str, Any] = sens
            ) -> None:
                perf = perf_model(s)
                for sw in SWITCHING_S:
                    fabric = make_fabric(s, perf, "rfabric", ocs_switching_s=sw)
                    res = run_pipeline(
                        s, perf, box["gens"], fabric, policy="static", static_tp=box["tp"]
                    )
                    row = _summary(res)
                    row["rewired_syncs"] = sum(1 for x in res.steps if x.sync_reconfigured)
                    row["syncs"] = len(res.steps)
                    row["syncs_without_window"] = sum(1 for x in res.steps if x.sync_window_s <= 0)
                    row["reconfig_charged_s"] = sum(
                        x.sync_reconfig_s + x.train_reconfig_s for x in res.steps
                    )
                    sens[f"{sw:g}"] = row

            yield f"sensitivity: OCS switching time at {nodes * 8} GPUs", switching

    regime: dict[str, Any] = {
        "settings": {
            "train_share": regimes.TRAIN_SHARE,
            "overlap": regimes.OVERLAP,
            "ep_gpus": regimes.EP_GPUS,
            "workloads": {
                w.label: {"model": w.model, "layout": asdict(w.layout)} for w in regimes.WORKLOADS
            },
        },
        "rows": [],
    }
    out["regimes"] = regime
    for nodes in plan.regime_nodes:

        def regime_size(nodes: int = nodes, regime: dict[str, Any] = regime) -> None:
            for _, cell in regimes.cells((nodes,), plan.workload, plan.seed):
                regime["rows"] += cell()
            regime["verdicts"] = regimes.verdicts(regime["rows"])

        yield (
            f"regime map {nodes * 8} GPUs: {len(regimes.WORKLOADS)} workloads x "
            f"{len(regimes.PLACEMENTS)} placements x {len(FABRIC_KINDS)} fabrics",
            regime_size,
        )

    ops: dict[str, Any] = {}
    out["sensitivity_over_provision"] = ops
    for s in plan.suite:
        if s.name not in OP_SWEEP:
            continue

        def one_op(s: Scenario = s) -> None:
            ops[s.name] = over_provision_rows(s, plan, out["rl"][s.name])

        yield f"over-provisioning sweep {s.name}: {len(OVER_PROVISION)} budgets", one_op

    study: dict[str, Any] = {}
    out["dapo_study"] = study
    for s in plan.suite:
        if s.name not in DAPO_STUDY:
            continue

        def one_study(s: Scenario = s) -> None:
            study[s.name] = dapo_study(s, plan, out["rl"][s.name])

        yield f"DAPO-like study {s.name}: split by GPU pairs, divided rollout, bounds", one_study

    sweeps: dict[str, Any] = {}
    out["sensitivity_split"] = sweeps
    for s in plan.suite:
        if s.name not in SPLIT_SWEEP:
            continue
        sweep: dict[str, Any] = {"scenario": s.name, "splits": {}, "chosen": None}
        sweeps[s.name] = sweep
        g = s.cluster.gpus_per_node
        total = s.split.total_gpus
        for train_nodes in plan.splits:
            if train_nodes * g >= total:
                continue
            one = with_split(s, train_nodes * g, total - train_nodes * g)

            def one_split(s: Scenario = one, sweep: dict[str, Any] = sweep) -> None:
                sweep["splits"][f"{s.split.gen_gpus}/{s.split.train_gpus}"] = split_row(s)
                sweep["chosen"] = _chosen(sweep["splits"])

            yield (
                f"split sweep {s.name}: {one.split.gen_gpus} gen / {one.split.train_gpus} train",
                one_split,
            )

    seqs: dict[str, Any] = {}
    out["sensitivity_max_num_seqs"] = seqs
    for s in plan.suite:
        if s.name not in SEQS_SWEEP:
            continue
        rows: dict[str, Any] = {}
        seqs[s.name] = rows
        for cap in plan.seqs:
            one = with_max_num_seqs(s, cap)

            def one_cap(s: Scenario = one, rows: dict[str, Any] = rows) -> None:
                rows[str(s.generation.max_num_seqs)] = suite_row(s, prompt_oracle=False)

            yield f"max_num_seqs sweep {s.name}: {cap} sequences per instance", one_cap


def split_row(s: Scenario) -> dict[str, Any]:
    """One split of the sweep: the best static layout's pipeline (what ``split.choose =
    "auto"`` compares) and the adaptive policy's from it, with both speedups."""
    perf = perf_model(s)
    static = run_best_static(s, perf)
    gens = run_generation(s, perf, "adaptive", static.static_tp)
    adaptive = run_pipeline(
        s, perf, gens, make_fabric(s, perf), policy="adaptive", static_tp=static.static_tp
    )
    return {
        **asdict(outcome(static)),
        "adaptive_gen_s": adaptive.mean_gen_s,
        "adaptive_step_s": adaptive.mean_step_s,
        "adaptive_bound": adaptive.bound,
        "adaptive_gen_speedup": static.mean_gen_s / adaptive.mean_gen_s,
        "adaptive_e2e_speedup": static.mean_step_s / adaptive.mean_step_s,
    }


def _chosen(rows: dict[str, Any]) -> str:
    """The key of the row :func:`choose_split` picks (``split.choose = "auto"``'s rule)."""
    keys = [f.name for f in fields(SplitOutcome)]
    best = choose_split([SplitOutcome(**{k: v[k] for k in keys}) for v in rows.values()])
    return f"{best.gen_gpus}/{best.train_gpus}"


def suite_row(s: Scenario, prompt_oracle: bool = True) -> dict[str, Any]:
    """One scenario against its ceilings: every static TP, adaptive (from the best static
    layout), prompt-oracle (adaptive told every prompt's difficulty), oracle and the fluid
    bound (``prompt_oracle`` False: not run, as in the ``max_num_seqs`` sweep, which does
    not report it), in mean generation seconds per steady step; and
    the same runs end to end through the pipeline (training and weight sync) on the
    scenario's split (``split.choose = "auto"``: the one :func:`resolve_split` picks)."""
    chooser = s.split.choose
    s, sweep = resolve_split(s)
    perf = perf_model(s)
    per_tp = {t: run_generation(s, perf, "static", t) for t in candidate_tps(s, perf)}
    statics = {t: _mean_steady([g.seconds for g in gens]) for t, gens in per_tp.items()}
    tp = min(statics, key=lambda t: (statics[t], t))
    adaptive = run_generation(s, perf, "adaptive", tp)
    told = run_generation(s, perf, "prompt-oracle", tp) if prompt_oracle else None
    oracle = run_generation(s, perf, "oracle", tp)
    bounds = step_bounds(s, perf)
    row = ceilings(
        statics,
        _mean_steady([g.seconds for g in adaptive]),
        _mean_steady([g.seconds for g in oracle]),
        _mean_steady(list(bounds)),
        prompt_oracle_s=None if told is None else _mean_steady([g.seconds for g in told]),
    )

    def pipe(gens: tuple[GenStepResult, ...], policy: str) -> RunResult:
        return run_pipeline(s, perf, gens, make_fabric(s, perf), policy=policy, static_tp=tp)

    row.update(
        end_to_end(
            pipe(per_tp[tp], "static"), pipe(adaptive, "adaptive"), pipe(oracle, "oracle"), bounds
        )
    )
    row.update(
        model=s.model.name,
        gen_gpus=s.split.gen_gpus,
        split_choose=chooser,
        split_sweep=[asdict(o) for o in sweep],
        requests_per_step=s.workload.requests_per_step,
        steps=s.steps,
        seed=s.seed,
        # sequences an instance of each TP runs at most (the engine cap; its KV cache
        # may hold fewer)
        max_num_seqs={str(t): perf.max_num_seqs(t) for t in sorted(statics)},
        adaptive_reshards=sum(g.reshards for g in adaptive),
        adaptive_moves=sum(g.migrations for g in adaptive),
        oracle_reshards=sum(g.reshards for g in oracle),
        oracle_moves=sum(g.migrations for g in oracle),
    )
    return row


def rl_row(s: Scenario, plan: Plan) -> dict[str, Any]:
    """RL throughput end to end on one scenario (its own split): the best static TP with
    full rollout (the baseline, best of every uniform TP), then each mechanism from it
    alone and together (:data:`RL_ROWS`): adaptive TP, the step planner's split, partial
    rollout, both, and everything (adaptive TP, partial rollout, the planner's split and
    budget); and the fluid bound on generation with the baseline's training and sync.
    Each row: :meth:`.rollout.RLRun.summary` plus its speedups over the baseline in
    trained samples and tokens per second."""
    steps, warmup = plan.rl_steps
    s, _ = resolve_split(replace(s, steps=steps))
    perf = perf_model(s)

    def run(policy: str, tp: int, rule: RolloutRule, split: bool, chunk: int = 0) -> RLRun:
        sc = replace(s, generation=replace(s.generation, chunk_tokens=chunk))
        return run_rl(sc, perf, policy, tp, rule, plan_split=split, warmup=warmup)

    statics = {t: run("static", t, FULL, False) for t in candidate_tps(s, perf)}
    tp = min(statics, key=lambda t: (statics[t].mean_step_s, t))
    runs: dict[str, RLRun] = {}
    for key, policy, rule, split, chunk in RL_ROWS:
        runs[key] = statics[tp] if key == "baseline" else run(policy, tp, rule, split, chunk)
    base = runs["baseline"]
    bounds = step_bounds(s, perf)
    window = base.steady_steps
    bound_step = sum(max(bounds[x.step], x.train_s) + x.sync_s for x in window) / len(window)
    rows: dict[str, Any] = {}
    for key, r in runs.items():
        row = r.summary()
        row["samples_speedup"] = r.samples_per_s / base.samples_per_s
        row["tokens_speedup"] = r.tokens_per_s / base.tokens_per_s
        rows[key] = row
    return {
        "model": s.model.name,
        "train_gpus": s.split.train_gpus,
        "gen_gpus": s.split.gen_gpus,
        "steps": steps,
        "warmup": warmup,
        "best_static_tp": tp,
        "static_step_s": {str(t): r.mean_step_s for t, r in sorted(statics.items())},
        "rows": rows,
        "bound_step_s": bound_step,
        "bound_speedup": base.mean_step_s / bound_step,
    }


def over_provision_rows(s: Scenario, plan: Plan, rl: Mapping[str, Any]) -> dict[str, Any]:
    """The static TP of ``rl`` (the scenario's :func:`rl_row`) with partial rollout and
    the planner's split at every over-provisioning of :data:`OVER_PROVISION`: throughput
    against off-policy tokens and dropped responses, speedups over ``rl``'s baseline."""
    steps, warmup = plan.rl_steps
    s, _ = resolve_split(replace(s, steps=steps))
    perf = perf_model(s)
    tp = rl["best_static_tp"]
    base = rl["rows"]["baseline"]
    rows: dict[str, Any] = {}
    for op in OVER_PROVISION:
        rule = replace(PARTIAL, over_provision=op)
        r = run_rl(s, perf, "static", tp, rule, plan_split=True, warmup=warmup)
        row = r.summary()
        row["samples_speedup"] = r.samples_per_s / base["samples_per_s"]
        row["tokens_speedup"] = r.tokens_per_s / base["tokens_per_s"]
        rows[f"{op:g}"] = row
    return {"best_static_tp": tp, "rows": rows}


def dapo_study(s: Scenario, plan: Plan, rl: Mapping[str, Any]) -> dict[str, Any]:
    """What moves a training-bound load toward the issue's 1.4x, each mechanism on its
    own, all with partial rollout and static TP (``rl``'s best static TP): the step
    planner's split by pairs of GPUs (``split.unit_gpus``), every such split fixed from
    the first step (the best one found with hindsight), divided rollout on the planner's
    whole-node split and on the best fixed split, each with :data:`DIVIDED_CHUNKS`. And two
    bounds from the best fixed split's steady steps: its generation and training
    GPU-seconds spread over every GPU (a split as fine as one likes, what a perfectly
    balanced pipeline would take), and the weight sync, which a sync overlapped with the
    next training would take off the step at most."""
    steps, warmup = plan.rl_steps
    s, _ = resolve_split(replace(s, steps=steps))
    perf = perf_model(s)
    tp = rl["best_static_tp"]
    base = rl["rows"]["baseline"]
    total = s.split.total_gpus

    def run(sc: Scenario, split: bool, chunk: int = 0) -> RLRun:
        sc = replace(sc, generation=replace(sc.generation, chunk_tokens=chunk))
        return run_rl(sc, perf, "static", tp, PARTIAL, plan_split=split, warmup=warmup)

    def row(r: RLRun) -> dict[str, Any]:
        out = r.summary()
        out["samples_speedup"] = r.samples_per_s / base["samples_per_s"]
        out["tokens_speedup"] = r.tokens_per_s / base["tokens_per_s"]
        return out

    granular = replace(s, split=replace(s.split, unit_gpus=GRANULAR_UNIT))
    rows: dict[str, Any] = {"granular_plan": row(run(granular, True))}
    fixed: dict[str, RLRun] = {}
    for g in GRANULAR_GEN_GPUS:
        if 0 < g < total:
            fixed[f"{g}/{total - g}"] = run(with_split(granular, total - g, g), False)
    best_key = max(fixed, key=lambda k: (fixed[k].samples_per_s, k))
    best = fixed[best_key]
    rows["granular_best"] = row(best)
    for chunk in DIVIDED_CHUNKS:
        rows[f"divided_{chunk}"] = row(run(s, True, chunk))
        g = int(best_key.split("/")[0])
        rows[f"divided_{chunk}_granular_best"] = row(
            run(with_split(granular, total - g, g), False, chunk)
        )
    st = best.steady_steps
    gpu_s = [x.gen_s * x.gen_gpus + x.train_s * x.train_gpus for x in st]
    balanced = sum(w / total + x.sync_s for w, x in zip(gpu_s, st, strict=True)) / len(st)
    per_step = best.samples_per_s * best.mean_step_s
    return {
        "best_static_tp": tp,
        "unit_gpus": GRANULAR_UNIT,
        "fixed": {k: row(v) for k, v in fixed.items()},
        "best_fixed": best_key,
        "rows": rows,
        "balanced_step_s": balanced,
        "balanced_speedup": per_step / balanced / base["samples_per_s"],
        "sync_s": sum(x.sync_s for x in st) / len(st),
        "best_step_s": best.mean_step_s,
    }


DONE_FRACTIONS = (0.5, 0.75, 0.9)


def _mean_steady(values: list[float]) -> float:
    """Mean over the steady steps (all but the first when there are several)."""
    steady = values[1:] if len(values) > 1 else values
    return sum(steady) / len(steady)


def _done_s(gens: tuple[GenStepResult, ...]) -> dict[str, float]:
    """Per fraction of ``DONE_FRACTIONS``, the mean over the steady steps of the time by
    which that fraction of the step's responses is done: how fast a layout gets through
    the bulk of the step, before its tail."""
    out: dict[str, float] = {}
    for f in DONE_FRACTIONS:
        times = []
        for g in gens:
            n = len(g.completions)
            times.append(g.completions[max(0, math.ceil(f * n) - 1)] if n else 0.0)
        out[f"{f:g}"] = _mean_steady(times)
    return out


def _tail_floor(s: Scenario, r: RunResult) -> float:
    """Mean over the steady steps of the longest response alone on the widest instance
    (prefill plus decode at batch 1): no layout or placement can finish a step sooner."""
    perf = perf_model(s)
    tp = max(candidate_tps(s, perf))
    floors = []
    for x in r.steady:
        longest = max(
            step_workload(s.workload, s.seed, x.step).requests,
            key=lambda q: (q.prompt_tokens + q.response_tokens, q.id),
        )
        p, n = longest.prompt_tokens, longest.response_tokens
        floors.append(perf.prefill_time(tp, p) + decode_time(perf, tp, 1, p, n))
    return sum(floors) / len(floors)


def _summary(r: RunResult) -> dict[str, Any]:
    steady = r.steady
    n = len(steady)
    gens: tuple[GenStepResult, ...] = r.gens
    return {
        "policy": r.policy,
        "fabric": r.fabric,
        "static_tp": r.static_tp,
        "train_gpus": r.train_gpus,
        "gen_gpus": r.gen_gpus,
        "bound": r.bound,
        "mean_step_s": r.mean_step_s,
        "mean_gen_s": r.mean_gen_s,
        "mean_train_s": sum(x.train_s for x in steady) / n,
        "mean_train_comm_s": sum(x.train_comm_s for x in steady) / n,
        "mean_sync_s": sum(x.sync_s for x in steady) / n,
        "tokens_per_s": r.tokens_per_s,
        "cost_usd": r.cost.total,
        "cost_items": {k: list(v) for k, v in r.cost.items.items()},
        "perf_per_cost": r.perf_per_cost,
        "reshards": sum(g.reshards for g in gens),
        "migrations": sum(g.migrations for g in gens),
        "plans": sum(g.plans for g in gens),
        "link_utilisation": {k: dict(v) for k, v in r.link_utilisation.items()},
        "steps": [
            {
                "step": x.step,
                "gen_s": x.gen_s,
                "train_s": x.train_s,
                "sync_s": x.sync_s,
                "step_s": x.step_s,
                "sync_window_s": x.sync_window_s,
                "sync_reconfig_s": x.sync_reconfig_s,
                "sync_reason": x.sync_reason,
            }
            for x in r.steps
        ],
    }


def headline(out: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(experiment, this model, paper) rows for the terminal and the report."""
    rows: list[tuple[str, str, str]] = []
    for model, row in out.get("compute", {}).items():
        if "adaptive" not in row:
            continue
        got = ", ".join(
            f"{p} {row[p]['speedup']:.2f}x (gen {row[p]['gen_speedup']:.2f}x)"
            for p in (*POLICIES, "oracle")
            if p in row
        )
        paper = {"Qwen2.5-14B": "1.40x", "Qwen2.5-32B": "1.34x"}.get(model, "")
        rows.append(
            (
                f"compute 64 GPUs {model} end to end vs best static TP{row['static_tp']}",
                got,
                f"{paper} (up to 1.42x)",
            )
        )
    rl = out.get("rl", {})
    if rl:
        full = {n: c["rows"]["adaptive_partial"]["samples_speedup"] for n, c in rl.items()}
        dapo = f"; dapo-14b {full['dapo-14b']:.2f}x" if "dapo-14b" in full else ""
        rows.append(
            (
                f"RL throughput, suite ({len(rl)} scenarios): adaptive TP + partial rollout + "
                "split vs best static TP, full rollout",
                f"{min(full.values()):.2f}x-{max(full.values()):.2f}x{dapo}",
                "1.42x (up to; paper's end-to-end figure)",
            )
        )
    async_rows = out.get("async", {}).get("replay", {}).get("rows", {})
    if async_rows:
        got = ", ".join(
            f"{k} {r['variants']['orchestrrl']['speedup']:.2f}x (model of verl {r['error']:+.0%} "
            "vs published)"
            for k, r in async_rows.items()
        )
        rows.append(
            (
                "async RL: OrchestrRL's mode vs a model of verl's fully-async on the same GPUs",
                got,
                ">= 1.3x on 7b-128 and 30b-a3b-128 (issue 32's target)",
            )
        )
    fig = out.get("async", {}).get("propagation")
    if fig:
        rows.append(
            (
                "version propagation, 32B to 64 rollout GPUs, 4:1 core, circuit leases",
                f"{fig['leased_s']:.2f} s ({fig['ratio']:.2f}x faster than the static optical "
                f"core; stall {fig['stall_s']:.2f} s)",
                "<= 2 s, stall <= 0.2 s (issue 32's target)",
            )
        )
    for gpus, table in out.get("network", {}).items():
        if "rfabric" not in table:
            continue
        got = ", ".join(f"{k} {v['perf_per_cost_norm']:.2f}" for k, v in table.items())
        rows.append((f"network {gpus} GPUs perf/cost vs Fat-Tree", got, "RFabric > 1 (1.5x-3.2x)"))
    verdicts = out.get("regimes", {}).get("verdicts", [])
    if verdicts:
        vs_ft = [v["rfabric_vs_fat_tree"] for v in verdicts]
        vs_best = [v["rfabric_vs_best"] for v in verdicts]
        wins = sum(1 for v in vs_best if v > 1.0)
        rows.append(
            (
                f"regime map ({len(verdicts)} cells) RFabric perf/cost",
                f"vs Fat-Tree {min(vs_ft):.2f}-{max(vs_ft):.2f}x; vs best static fabric "
                f"{min(vs_best):.2f}-{max(vs_best):.2f}x (ahead in {wins} of {len(verdicts)})",
                "2.2-3.2x vs non-blocking Fat-Tree",
            )
        )
    return rows


__all__ = ["PAPER", "Plan", "headline", "suite_row", "tasks"]


def run_all(
    plan: Plan, progress: Callable[[int, int, str], None] | None = None
) -> tuple[dict[str, Any], dict[str, RunResult]]:
    """Run every task; ``progress(i, n, label)`` is called before each."""
    out: dict[str, Any] = {"seed": plan.seed, "quick": plan.quick, "paper": PAPER}
    runs: dict[str, RunResult] = {}
    todo = list(tasks(plan, out, runs))
    for i, (label, fn) in enumerate(todo):
        if progress is not None:
            progress(i, len(todo), label)
        fn()
    if progress is not None:
        progress(len(todo), len(todo), "done")
    out["headline"] = [list(r) for r in headline(out)]
    return out, runs
