"""``orl-sim``: run one scenario, or reproduce the paper's experiments.

orl-sim run SCENARIO.toml [--json PATH]
orl-sim reproduce [--out DIR] [--quick] [--seed N]
orl-sim async-replay [--quick] [--seed N] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from dataclasses import asdict
from pathlib import Path
from typing import Any

from orchestrrl import add_version_flag, errors


def _run(args: argparse.Namespace) -> int:
    from sim_backends.clustersim.pipeline import resolve_split, run_scenario
    from sim_backends.clustersim.reproduce import _summary
    from sim_backends.clustersim.scenario import load_scenario

    given = load_scenario(args.scenario)  # every input error surfaces before running
    if given.rollout.mode == "async":
        return _run_async(given, args.json)
    scenario, sweep = resolve_split(given)
    if sweep:
        print(
            'split.choose = "auto": the best static layout at each split '
            "(mean steady seconds; the shortest step wins, ties to more generation GPUs)"
        )
        print(
            f"{'gen/train GPUs':>15} {'static TP':>9} {'generation s':>13} {'training s':>11} "
            f"{'sync s':>7} {'step s':>8}  bound by"
        )
        for o in sweep:
            mark = "  <- chosen" if o.train_gpus == scenario.split.train_gpus else ""
            print(
                f"{f'{o.gen_gpus}/{o.train_gpus}':>15} {f'TP{o.static_tp}':>9} {o.gen_s:>13.2f} "
                f"{o.train_s:>11.2f} {o.sync_s:>7.3f} {o.step_s:>8.2f}  {o.bound}{mark}"
            )
    rl = None
    if scenario.rollout.mode != "full" or scenario.split.choose == "plan":
        from sim_backends.clustersim.rollout import run_scenario_rl

        rl = run_scenario_rl(scenario)
        result = rl.run
    else:
        result = run_scenario(scenario)
    print(
        f"{scenario.name}: {scenario.model.name} on {result.gpus} GPUs "
        f"({scenario.split.gen_gpus} generate, {scenario.split.train_gpus} train), "
        f"policy {result.policy} (static layout TP{result.static_tp}), fabric {result.fabric}"
    )
    print(
        f"{'step':>4} {'generation s':>13} {'training s':>11} {'sync s':>8} {'step s':>8}"
        "  node layouts at the end"
    )
    for st, g in zip(result.steps, result.gens, strict=True):
        patterns = Counter("+".join(str(t) for t in p) for p in g.layout_end.values())
        layout = ", ".join(f"{n} x TP {p}" for p, n in sorted(patterns.items()))
        print(
            f"{st.step:>4} {st.gen_s:>13.2f} {st.train_s:>11.2f} {st.sync_s:>8.3f} "
            f"{st.step_s:>8.2f}  {layout}"
        )
    print(
        f"mean step {result.mean_step_s:.2f} s (steady state), {result.tokens_per_s:.0f} tokens/s, "
        f"network cost {result.cost.total / 1e6:.3f} MUSD, "
        f"perf/cost {result.perf_per_cost:.4f} steps/s per MUSD; the pipeline is "
        f"{result.bound}-bound"
    )
    if rl is not None:
        _print_rollout(rl)
    print(
        f"engines run at most {scenario.generation.max_num_seqs} sequences per instance at "
        "every TP (generation.max_num_seqs; the KV cache may hold fewer)"
    )
    reshards = sum(g.reshards for g in result.gens)
    moves = sum(g.migrations for g in result.gens)
    if result.policy != "static":
        print(
            f"planner: {sum(g.plans for g in result.gens)} plans, {reshards} reshards, "
            f"{moves} moves"
        )
    ceil: dict[str, Any] | None = None
    if rl is None and not scenario.generation.static_tp and scenario.generation.policy != "static":
        # policies compared: every static TP, adaptive, oracle and the fluid bound
        from sim_backends.clustersim.report import (
            CEILING_HEADER,
            E2E_HEADER,
            ceiling_rows,
            e2e_rows,
        )
        from sim_backends.clustersim.reproduce import suite_row

        ceil = suite_row(scenario)
        print("generation per steady step against its ceilings:")
        width = max(len(h) for h in CEILING_HEADER)
        for head, value in zip(
            CEILING_HEADER[1:], ceiling_rows({scenario.name: ceil})[0][1:], strict=True
        ):
            shown = f"{value:.2f}" if isinstance(value, float) else str(value)
            print(f"  {head:<{width}} {shown}")
        print("end to end (pipeline step time per steady step):")
        for head, value in zip(E2E_HEADER[1:], e2e_rows({scenario.name: ceil})[0][1:], strict=True):
            shown = f"{value:.2f}" if isinstance(value, float) else str(value)
            print(f"  {head:<34} {shown}")
    if args.json:
        summary: dict[str, Any] = {
            "scenario": scenario.name,
            **_summary(result),
            "split_choose": given.split.choose,
            "split_sweep": [asdict(o) for o in sweep],
        }
        if ceil is not None:
            summary["ceilings"] = ceil
        if rl is not None:
            summary["rollout"] = rl.summary()
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(summary, indent=1, sort_keys=True) + "\n")
        print(f"wrote {args.json}")
    return 0


def _print_rollout(rl: Any) -> None:
    """The rollout bookkeeping of a run under a rollout rule (an ``RLRun``)."""
    rule = rl.rule
    print(
        f"rollout {rule.mode.value}: over_provision {rule.over_provision:g}, max_staleness "
        f"{rule.max_staleness}, step end {rule.end.value}"
    )
    print(
        f"{'step':>4} {'gen/train':>9} {'started':>8} {'carried in':>10} {'trained':>8} "
        f"{'carried out':>11} {'waiting':>8} {'dropped':>8}"
    )
    for x, st in zip(rl.rollout, rl.run.steps, strict=True):
        print(
            f"{x.step:>4} {f'{st.gen_gpus}/{st.train_gpus}':>9} {x.started_groups:>8} "
            f"{x.carried_in:>10} {x.trained_responses:>8} {x.carried_out:>11} "
            f"{x.waiting_groups:>8} {x.dropped_responses:>8}"
        )
    for reason in rl.plans:
        print(f"  {reason}")
    print(
        f"RL throughput (steps {rl.steady_steps[0].step}-{rl.steady_steps[-1].step}): "
        f"{rl.samples_per_s:.2f} trained samples/s, {rl.tokens_per_s:.0f} trained tokens/s, "
        f"mean step {rl.mean_step_s:.2f} s; off-policy tokens "
        f"{rl.offpolicy_token_share:.1%}, dropped responses {rl.dropped_share:.1%}"
    )


def _run_async(scenario: Any, json_path: str | None) -> int:
    """``orl-sim run`` on a ``rollout.mode = "async"`` scenario: one row per weight
    version, then the run's throughput, lags, idle ratios and weight propagation."""
    from sim_backends.clustersim.async_rl import run_async

    run = run_async(scenario)
    rule, pol = run.rule, run.policy
    print(
        f"{scenario.name}: {scenario.model.name} on {scenario.split.total_gpus} "
        f"{scenario.cluster.hardware} GPUs, asynchronous RL (staleness bound "
        f"{rule.admission_bound:g}), weights {pol.weight_update.value}"
        + (f" (pull {pol.pull.value})" if pol.weight_update.value == "relay" else "")
        + f", repack {'on' if pol.repack else 'off'}, reshard {'on' if pol.reshard else 'off'}, "
        f"split planner {'on' if pol.plan_split else 'off'}, engines TP{run.static_tp}"
    )
    print(
        f"{'version':>7} {'gen/train':>9} {'wait s':>8} {'train s':>8} {'sync s':>7} "
        f"{'step s':>8} {'trained':>8} {'dropped':>8}  lag (p50/max)"
    )
    for v in run.versions:
        lags = sorted(v.lags)
        mid = lags[max(0, -(-len(lags) // 2) - 1)] if lags else 0
        print(
            f"{v.version:>7} {f'{v.gen_gpus}/{v.train_gpus}':>9} {v.wait_s:>8.2f} "
            f"{v.train_s:>8.2f} {v.sync_s:>7.3f} {v.step_s:>8.2f} {v.responses:>8} "
            f"{v.dropped_responses:>8}  {mid}/{lags[-1] if lags else 0}"
        )
    for line in run.plans:
        print(f"  {line}")
    d = run.summary()
    print(
        f"steady (versions {run.warmup}-{len(run.versions) - 1}): {run.samples_per_s:.2f} trained "
        f"samples/s, {run.tokens_per_s:.0f} tokens/s, step {run.mean_step_s:.2f} s "
        f"({run.mean_logged_step_s:.2f} s as verl logs it: wait + update); trainer idle "
        f"{run.trainer_idle:.0%}, rollout idle {run.rollout_idle:.0%}; version lag p50 "
        f"{d['lag_p50']:g}, p99 {d['lag_p99']:g}, max {d['lag_max']:g}; dropped "
        f"{run.dropped_share:.1%}"
    )
    print(
        f"weights: propagation (trainer end to the last engine on the version) mean "
        f"{d['propagation_s']['mean']:.2f} s, max {d['propagation_s']['max']:.2f} s; engine "
        f"stall per update mean {d['stall_s']['mean']:.3f} s; {run.aborted} requests aborted, "
        f"{run.repacks} repacks ({run.repack_moves} moves), {run.reshards} reshards"
    )
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(
            json.dumps({"scenario": scenario.name, "async": d}, indent=1, sort_keys=True) + "\n"
        )
        print(f"wrote {json_path}")
    return 0


def _async_replay(args: argparse.Namespace) -> int:
    """``orl-sim async-replay``: verl's published fully-async rows, the model of verl's
    mode, OrchestrRL's mode and each mechanism alone; the version-propagation figure."""
    from sim_backends.clustersim import async_report, propagation, replay
    from sim_backends.clustersim.report import _table

    start = time.monotonic()
    rows: dict[str, Any] = {}
    for pub in replay.PUBLISHED:
        sys.stderr.write(f"replaying {pub.key} ({time.monotonic() - start:.0f} s)\n")
        rows[pub.key] = replay.replay_row(pub, args.quick, args.seed)
    stress = {"7b-128 rollout-bound (96:32)": replay.stress_row(args.quick, args.seed)}
    out = {
        "replay": {"source": replay.SOURCE, "rows": rows},
        "stress": stress,
        "propagation": propagation.propagation_figure(),
        "quick": args.quick,
        "seed": args.seed,
    }
    print(f"verl's published fully-async runs ({replay.SOURCE}) and the model")
    print(_table(async_report.REPLAY_HEADER, async_report.replay_rows(out["replay"])))
    print()
    print("each mechanism alone: throughput over the model of verl on the same GPUs")
    print(_table(async_report.ABLATION_HEADER, async_report.ablation_rows(out["replay"], stress)))
    print()
    for line in async_report.discussion(out):
        print(f"- {line}")
    print()
    fig = out["propagation"]
    print(
        f"version propagation: {fig['model']} to {fig['rollout_gpus']} rollout GPUs on a "
        f"{fig['oversubscription']:g}:1 core (engines TP{fig['engine_tp']})"
    )
    print(_table(async_report.PROPAGATION_HEADER, async_report.propagation_rows(fig)))
    print(
        f"leased {fig['leased_s']:.2f} s vs the static optical core {fig['static_s']:.2f} s "
        f"({fig['ratio']:.2f}x); stall {fig['stall_s']:.3f} s (targets <= {fig['target_s']:g} "
        f"s and <= {fig['stall_target_s']:g} s)"
    )
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")
        print(f"wrote {args.json}")
    print(f"took {time.monotonic() - start:.1f} s")
    return 0


def _reproduce(args: argparse.Namespace) -> int:
    from sim_backends.clustersim.report import write_json, write_report
    from sim_backends.clustersim.reproduce import Plan, run_all

    plan = Plan(quick=args.quick, seed=args.seed)
    start = time.monotonic()
    bar = 30

    def progress(i: int, n: int, label: str) -> None:
        done = bar * i // max(1, n)
        elapsed = time.monotonic() - start
        sys.stderr.write(f"[{'#' * done}{'.' * (bar - done)}] {i}/{n} {elapsed:6.1f}s  {label}\n")
        sys.stderr.flush()

    out, runs = run_all(plan, progress)
    outdir = Path(args.out)
    write_json(out, outdir / "results.json")
    report = write_report(out, runs, outdir)
    print()
    rows = out["headline"]
    w0 = max((len(r[0]) for r in rows), default=10)
    w1 = max((len(r[1]) for r in rows), default=10)
    print(f"{'experiment':<{w0}}  {'this model':<{w1}}  paper")
    for exp, got, paper in rows:
        print(f"{exp:<{w0}}  {got:<{w1}}  {paper}")
    print(f"\nreport: {report}  (results.json and plots in {outdir})")
    print(f"took {time.monotonic() - start:.1f} s")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="orl-sim", description="Simulate disaggregated RL on a (re)configurable fabric."
    )
    add_version_flag(parser)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="simulate one scenario file")
    run.add_argument("scenario", help="scenario TOML (see examples/sim/)")
    run.add_argument("--json", help="also write the results as JSON to this path")
    rep = sub.add_parser("reproduce", help="run the paper's experiments; write a report")
    rep.add_argument("--out", default="sim-results", help="output directory (default sim-results)")
    rep.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run of seconds")
    rep.add_argument("--seed", type=int, default=1)
    ar = sub.add_parser(
        "async-replay",
        help="replay verl's published fully-async runs beside OrchestrRL's asynchronous mode",
    )
    ar.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run of seconds")
    ar.add_argument("--seed", type=int, default=1)
    ar.add_argument("--json", help="also write the results as JSON to this path")
    args = parser.parse_args(argv)
    try:
        if args.command == "run":
            return _run(args)
        if args.command == "async-replay":
            return _async_replay(args)
        return _reproduce(args)
    except errors.OrlError as exc:
        print(f"orl-sim: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
