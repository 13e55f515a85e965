"""``orl-sim``: run one scenario, or reproduce the paper's experiments.

orl-sim run SCENARIO.toml [--json PATH]
orl-sim reproduce [--out DIR] [--quick] [--seed N]
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
    args = parser.parse_args(argv)
    try:
        if args.command == "run":
            return _run(args)
        return _reproduce(args)
    except errors.OrlError as exc:
        print(f"orl-sim: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
