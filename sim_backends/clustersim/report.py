"""The reproduction's outputs: a Markdown report, PNG plots (:mod:`.plots`) and JSON."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from orchestrrl import errors
from sim_backends.clustersim.async_report import section as async_section
from sim_backends.clustersim.pipeline import SIM_PLANNER, RunResult
from sim_backends.clustersim.reproduce import PAPER, POLICIES


def write_json(out: Mapping[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")


# -- the report -------------------------------------------------------------------------


def _table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in rows:
        lines.append("| " + " | ".join(_fmt(x) for x in r) + " |")
    return "\n".join(lines)


def _fmt(x: object) -> str:
    if isinstance(x, float):
        return f"{x:.3g}" if abs(x) < 0.01 else f"{x:.2f}"
    return str(x)


CEILING_HEADER = (
    "scenario",
    "TP1 s",
    "TP2 s",
    "TP4 s",
    "TP8 s",
    "best static",
    "adaptive s",
    "oracle s",
    "bound s",
    "adaptive/best",
    "prompt-oracle/best",
    "oracle/best",
    "bound/best",
    "captured",
)


def ceiling_rows(results: Mapping[str, Mapping[str, Any]]) -> list[list[object]]:
    """Rows of :data:`CEILING_HEADER` (generation seconds per steady step; speedups over
    the best static layout; the share of the oracle's gain the adaptive policy captures;
    the prompt-oracle's speedup and share, "-" where it was not run)."""
    rows: list[list[object]] = []
    for name, c in results.items():
        st = c["static_gen_s"]
        cap = c["captured"]
        prompt = c.get("prompt_oracle_speedup")
        prompt_share = c.get("prompt_oracle_captured")
        rows.append(
            [
                name,
                *(st.get(str(t), "-") for t in (1, 2, 4, 8)),
                f"TP{c['best_static_tp']} {c['best_static_s']:.1f}",
                c["adaptive_s"],
                c["oracle_s"],
                c["bound_s"],
                f"{c['adaptive_speedup']:.3f}x",
                "-"
                if prompt is None
                else f"{prompt:.3f}x" + ("" if prompt_share is None else f" ({prompt_share:.0%})"),
                f"{c['oracle_speedup']:.3f}x",
                f"{c['bound_speedup']:.3f}x",
                "n/a (oracle gains nothing)" if cap is None else f"{cap:.0%}",
            ]
        )
    return rows


def ceiling_table(results: Mapping[str, Mapping[str, Any]], first: str = "scenario") -> str:
    """:func:`ceiling_rows` under :data:`CEILING_HEADER` (its first column named
    ``first``), without the prompt-oracle column when no row ran it."""
    header: tuple[str, ...] = (first, *CEILING_HEADER[1:])
    rows = ceiling_rows(results)
    k = header.index("prompt-oracle/best")
    if all(r[k] == "-" for r in rows):
        header = header[:k] + header[k + 1 :]
        rows = [r[:k] + r[k + 1 :] for r in rows]
    return _table(header, rows)


def seqs_caps(results: Mapping[str, Mapping[str, Any]]) -> str:
    """One sentence stating each scenario's cap on sequences per instance, per TP
    (scenarios with the same caps named together); "" when the rows carry none."""
    by_caps: dict[str, list[str]] = {}
    for name, row in results.items():
        caps = row.get("max_num_seqs")
        if not caps:
            continue
        values = set(caps.values())
        text = (
            f"{values.pop()} at every TP"
            if len(values) == 1
            else ", ".join(f"TP{t} {c}" for t, c in caps.items())
        )
        by_caps.setdefault(text, []).append(name)
    if not by_caps:
        return ""
    parts = [f"{text} ({', '.join(names)})" for text, names in by_caps.items()]
    return (
        "Sequences an instance runs at most (`generation.max_num_seqs`, the engines' cap; "
        "its KV cache may hold fewer): " + "; ".join(parts) + ". Section 3c varies it."
    )


E2E_HEADER = (
    "scenario",
    "gen/train GPUs",
    "train s",
    "sync s",
    "static step s",
    "adaptive step s",
    "oracle step s",
    "bound step s",
    "adaptive gen",
    "adaptive e2e",
    "oracle gen",
    "oracle e2e",
    "bound e2e",
    "bound by (static/adaptive/oracle)",
)


def e2e_rows(results: Mapping[str, Mapping[str, Any]]) -> list[list[object]]:
    """Rows of :data:`E2E_HEADER`: the same results as :func:`ceiling_rows` through the
    one-step-asynchronous pipeline (mean steady step seconds), each speedup over the best
    static layout in generation time and end to end, and which side bounds each run."""
    rows: list[list[object]] = []
    for name, c in results.items():
        if "static_step_s" not in c:
            continue
        auto = " (auto)" if c.get("split_choose") == "auto" else ""
        b = c["pipeline_bound"]
        rows.append(
            [
                name,
                f"{c['gen_gpus']}/{c['train_gpus']}{auto}",
                c["train_s"],
                c["sync_s"],
                c["static_step_s"],
                c["adaptive_step_s"],
                c["oracle_step_s"],
                c["bound_step_s"],
                f"{c['adaptive_speedup']:.3f}x",
                f"{c['adaptive_e2e_speedup']:.3f}x",
                f"{c['oracle_speedup']:.3f}x",
                f"{c['oracle_e2e_speedup']:.3f}x",
                f"{c['bound_e2e_speedup']:.3f}x",
                f"{b['static']} / {b['adaptive']} / {b['oracle']}",
            ]
        )
    return rows


def e2e_table(results: Mapping[str, Mapping[str, Any]]) -> str:
    return _table(E2E_HEADER, e2e_rows(results))


RL_HEADER = (
    "scenario",
    "baseline (best static, full)",
    "TP alone",
    "divided rollout alone",
    "split alone",
    "partial alone",
    "static + partial + split",
    "adaptive + partial + split",
    "off-policy tokens",
    "dropped",
    "bound (full)",
)
# the RL rows shown, in order (keys of reproduce.RL_ROWS)
RL_SHOWN = ("tp", "divided", "split", "partial", "partial_split", "adaptive_partial")


def _rl_cell(r: Mapping[str, Any]) -> str:
    """A row's speedup over the baseline in trained samples/s (and tokens/s)."""
    return f"{r['samples_speedup']:.3f}x ({r['tokens_speedup']:.2f}x)"


def rl_rows(results: Mapping[str, Mapping[str, Any]]) -> list[list[object]]:
    """Rows of :data:`RL_HEADER`: RL throughput end to end (trained samples per second,
    tokens per second in brackets) of each mechanism over the best static TP with full
    rollout, the off-policy token share and dropped responses of the whole system, and
    the fluid bound's end-to-end ceiling for full rollout on the baseline's split."""
    rows: list[list[object]] = []
    for name, c in results.items():
        rs = c["rows"]
        b = rs["baseline"]
        a = rs["adaptive_partial"]
        rows.append(
            [
                name,
                f"TP{c['best_static_tp']} {c['gen_gpus']}/{c['train_gpus']}: "
                f"{b['mean_step_s']:.1f} s, {b['samples_per_s']:.2f} samples/s",
                *(_rl_cell(rs[k]) if k in rs else "" for k in RL_SHOWN),
                f"{a['offpolicy_token_share']:.0%}",
                f"{a['dropped_share']:.1%}",
                f"{c['bound_speedup']:.3f}x",
            ]
        )
    return rows


OP_HEADER = (
    "over_provision",
    "splits",
    "step s",
    "samples/s",
    "speedup (samples, tokens)",
    "off-policy tokens",
    "dropped",
)


def op_rows(sweep: Mapping[str, Any]) -> list[list[object]]:
    """Rows of :data:`OP_HEADER` for one scenario's over-provisioning sweep."""
    return [
        [
            op,
            " ".join(r["splits"]),
            r["mean_step_s"],
            r["samples_per_s"],
            f"{r['samples_speedup']:.3f}x, {r['tokens_speedup']:.3f}x",
            f"{r['offpolicy_token_share']:.0%}",
            f"{r['dropped_share']:.1%}",
        ]
        for op, r in sweep["rows"].items()
    ]


STUDY_HEADER = (
    "mechanism (partial rollout, static TP)",
    "splits (gen/train)",
    "step s",
    "samples/s",
    "speedup (samples, tokens)",
    "off-policy tokens",
    "dropped",
)


def study_rows(study: Mapping[str, Any], rl: Mapping[str, Any]) -> list[list[object]]:
    """Rows of :data:`STUDY_HEADER`: the DAPO-like study (``reproduce.dapo_study``) with
    the whole-node rows of section 1b it builds on, then its bounds."""
    unit = study["unit_gpus"]
    best = study["best_fixed"]
    named: list[tuple[str, Mapping[str, Any]]] = [
        ("whole nodes, the step planner's split (1b)", rl["rows"]["partial_split"]),
        ("adaptive TP too (1b)", rl["rows"]["adaptive_partial"]),
        (f"split by {unit} GPUs, the step planner's", study["rows"]["granular_plan"]),
        (
            f"split by {unit} GPUs, the best fixed split ({best}, hindsight)",
            study["rows"]["granular_best"],
        ),
    ]
    for key, r in study["rows"].items():
        if key.startswith("divided_"):
            chunk = key.split("_")[1]
            where = (
                f"the best fixed {unit}-GPU split ({best})"
                if key.endswith("granular_best")
                else "the planner's whole-node split"
            )
            named.append((f"divided rollout, {chunk}-token chunks, {where}", r))
    rows: list[list[object]] = [
        [
            name,
            " ".join(r["splits"]),
            r["mean_step_s"],
            r["samples_per_s"],
            f"{r['samples_speedup']:.3f}x, {r['tokens_speedup']:.3f}x",
            f"{r['offpolicy_token_share']:.0%}",
            f"{r['dropped_share']:.1%}",
        ]
        for name, r in named
    ]
    rows.append(
        [
            f"bound: {best}'s GPU-seconds spread over every GPU (any split)",
            "",
            study["balanced_step_s"],
            "",
            f"{study['balanced_speedup']:.3f}x",
            "",
            "",
        ]
    )
    rows.append(
        [
            f"bound: the weight sync overlapped with training ({best})",
            "",
            study["best_step_s"] - study["sync_s"],
            "",
            f"at most {study['sync_s']:.2f} s a step",
            "",
            "",
        ]
    )
    return rows


def fixed_rows(study: Mapping[str, Any]) -> list[list[object]]:
    """Every fixed split of the DAPO-like study: its step, samples/s and speedups."""
    return [
        [
            key,
            r["mean_step_s"],
            r["mean_gen_s"],
            r["mean_train_s"],
            r["samples_per_s"],
            f"{r['samples_speedup']:.3f}x, {r['tokens_speedup']:.3f}x",
        ]
        for key, r in study["fixed"].items()
    ]


def rl_discussion(results: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """Observations on the RL-throughput rows (computed from the run)."""
    if not results:
        return []
    lines: list[str] = []
    full = {n: c["rows"]["adaptive_partial"]["samples_speedup"] for n, c in results.items()}
    low = min(full, key=full.__getitem__)
    lines.append(
        "Adaptive TP + partial rollout + the step planner's split: "
        f"{min(full.values()):.3f}x ({low}) to {max(full.values()):.3f}x of the best static "
        "full-rollout baseline in trained samples per second."
    )

    def pair(c: Mapping[str, Any]) -> tuple[float, float]:
        return (
            c["rows"]["adaptive_partial"]["samples_speedup"],
            c["rows"]["partial_split"]["samples_speedup"],
        )

    def differ(c: Mapping[str, Any]) -> float:
        # relative; the rounding of decode segments a re-plan splits counts as level
        a, b = pair(c)
        d = a / b - 1.0
        return d if abs(d) > 1e-9 else 0.0

    def listed(names: list[str]) -> str:
        return ", ".join(
            f"{n} ({pair(results[n])[0]:.3f}x vs {pair(results[n])[1]:.3f}x)" for n in names
        )

    behind = [n for n, c in results.items() if differ(c) < 0]
    ahead = [n for n, c in results.items() if differ(c) > 0]
    level = [n for n, c in results.items() if differ(c) == 0]
    lines.append(
        "With partial rollout on, adaptive TP (its layout chosen at each step's start for "
        "the step's goal) is behind static TP on "
        + (listed(behind) if behind else "no scenario")
        + "; ahead on "
        + (listed(ahead) if ahead else "no scenario")
        + f"; level on {len(level)} ("
        + ", ".join(level)
        + ": it kept the static layout and dispatched as static does)."
    )
    moved = [
        f"{n} ({' '.join(c['rows']['adaptive_partial']['splits'])})"
        for n, c in results.items()
        if len(set(c["rows"]["adaptive_partial"]["splits"])) > 1
    ]
    if moved:
        lines.append("The step planner moved the split on " + ", ".join(moved) + ".")
    return lines


SWEEP_HEADER = (
    "gen/train GPUs",
    "best static",
    "static gen s",
    "train s",
    "sync s",
    "static step s",
    "static bound by",
    "adaptive gen s",
    "adaptive step s",
    "adaptive bound by",
    "adaptive gen",
    "adaptive e2e",
    "auto picks",
)


def sweep_rows(sweep: Mapping[str, Any]) -> list[list[object]]:
    """Rows of :data:`SWEEP_HEADER` for one scenario's split sweep (``split_row``s keyed
    ``gen/train``; ``chosen`` the key ``split.choose = "auto"`` picks)."""
    return [
        [
            key,
            f"TP{r['static_tp']}",
            r["gen_s"],
            r["train_s"],
            r["sync_s"],
            r["step_s"],
            r["bound"],
            r["adaptive_gen_s"],
            r["adaptive_step_s"],
            r["adaptive_bound"],
            f"{r['adaptive_gen_speedup']:.3f}x",
            f"{r['adaptive_e2e_speedup']:.3f}x",
            "<- auto" if key == sweep.get("chosen") else "",
        ]
        for key, r in sweep["splits"].items()
    ]


def write_report(out: Mapping[str, Any], runs: Mapping[str, RunResult], outdir: Path) -> Path:
    try:
        from sim_backends.clustersim import plots as draw
    except ImportError as exc:  # matplotlib: the [sim] extra
        raise errors.FailedPrecondition(
            f"the report's plots need matplotlib ({exc}): pip install 'orchestrrl[sim]'"
        ) from None
    outdir.mkdir(parents=True, exist_ok=True)
    plots: list[tuple[str, str]] = []
    compute = out.get("compute", {})
    for model in compute:
        ad = runs.get(f"compute/{model}/adaptive")
        st = runs.get(f"compute/{model}/static")
        if ad is None or st is None:
            continue
        k = min(1, len(ad.gens) - 1)
        name = f"timeline-{model}.png"
        draw.plot_timeline(
            ad.gens[k], f"{model}: adaptive, step {k} (TP per GPU over time)", outdir / name
        )
        plots.append((name, f"Step {k} of {model} under the adaptive scheduler"))
        sname = f"timeline-{model}-static.png"
        draw.plot_timeline(
            st.gens[k], f"{model}: static TP{st.static_tp}, step {k}", outdir / sname
        )
        plots.append((sname, "The same step with the best static layout"))
        curves = {f"static TP{st.static_tp}": st.gens[k].completions}
        for p in POLICIES:
            r = runs.get(f"compute/{model}/{p}")
            if r is not None:
                curves[p] = r.gens[k].completions
        tname = f"tail-{model}.png"
        draw.plot_tail(curves, f"{model}: responses completed over step {k}", outdir / tname)
        plots.append((tname, "Tail completion curve"))
    network = out.get("network", {})
    for size, table in network.items():
        name = f"links-{size}.png"
        draw.plot_link_utilisation(
            table, f"{size} GPUs: mean link utilisation per phase", outdir / name
        )
        plots.append((name, f"Per-phase link utilisation at {size} GPUs"))
    if network:
        draw.plot_perf_cost(network, outdir / "perf-cost.png")
        plots.append(("perf-cost.png", "Step time, network cost and perf/cost"))
    regime_rows = out.get("regimes", {}).get("rows", [])
    if regime_rows:
        draw.plot_regimes(regime_rows, outdir / "regime-map.png")
        plots.append(("regime-map.png", "Regime map: perf/cost per fabric per workload"))

    md: list[str] = ["# orl-sim reproduction of OrchestrRL's results", ""]
    quick = " (quick run: tiny sizes, not the experiments)" if out.get("quick") else ""
    md.append(
        f"Seed {out.get('seed')}{quick}. "
        "Every figure below is what the simulator's model gives; no constant was tuned "
        "toward the paper's numbers. `results.json` holds every figure."
    )
    md += ["", "## Headline", ""]
    md.append(_table(["experiment", "this model", "paper"], out.get("headline", [])))
    md += ["", "## 1. Compute: adaptive TP scheduling (64 H800)", ""]
    md.append(f"Paper: {PAPER['compute']}.")
    md.append("")
    rows = []
    for model, row in compute.items():
        statics = ", ".join(
            f"TP{k} {v:.0f} s" for k, v in row.get("static_gen_total_s", {}).items()
        )
        rows.append([model, "static (all TPs)", statics, "", "", "", "", ""])
        for p in ("static", *POLICIES, "oracle"):
            if p not in row:
                continue
            r = row[p]
            rows.append(
                [
                    model,
                    p if p != "static" else f"static TP{row['static_tp']} (best)",
                    r["mean_step_s"],
                    r["mean_gen_s"],
                    r["mean_train_s"],
                    r["tokens_per_s"],
                    f"{r.get('gen_speedup', 1.0):.3f}x",
                    f"{r.get('speedup', 1.0):.3f}x",
                ]
            )
    md.append(
        _table(
            [
                "model",
                "policy",
                "step s (steady)",
                "generation s",
                "training s",
                "tokens/s",
                "gen speedup",
                "e2e speedup",
            ],
            rows,
        )
    )
    md += [
        "",
        "Static TP rows give the total generation time of all steps per uniform layout; the "
        "best is the baseline. Policies start from the best static layout; `proactive` is "
        "the planner with reactive moves disabled, `reactive` keeps the layout and only "
        "moves requests, `adaptive` does both; `oracle` knows every response length. "
        "`gen speedup` is over the best static layout's generation time, `e2e speedup` over "
        "its step time (one-step-asynchronous pipeline: max(generation, training of the "
        "previous batch) + weight sync); split "
        + ", ".join(
            f"{m} {r['static']['gen_gpus']} generation / {r['static']['train_gpus']} "
            f"training GPUs ({r['static']['bound']}-bound at best static)"
            for m, r in compute.items()
            if "static" in r
        )
        + ".",
        "",
    ]
    ceil = {m: r["ceilings"] for m, r in compute.items() if "ceilings" in r}
    suite = out.get("suite", {})
    if ceil or suite:
        md += ["### Generation time against its ceilings", ""]
        md.append(
            "Mean generation seconds per steady step. `oracle` knows every response length "
            "(sim_backends/clustersim/oracle.py: a clairvoyant baseline charged the same "
            "reshard and move costs); `bound` is the fluid lower bound no scheduler can beat "
            "under the performance model (bound.py). Speedups are over the best static "
            "layout; `captured` = (best/adaptive - 1) / (best/oracle - 1), the share of the "
            "oracle's gain the adaptive policy captures. `prompt-oracle` (suite only) is the "
            "adaptive policy told every prompt's difficulty, as if this very step had been "
            "each prompt's previous epoch (generation.py `perfect_priors`), with its share of "
            "the oracle's gain in brackets: what the adaptive policy makes, at best, of "
            "group-level length information (the epoch prior, the siblings); short of each "
            "response's own length, which no real scheduler has at the step start."
        )
        md.append("")
        if ceil:
            md.append(ceiling_table({f"compute {m}": c for m, c in ceil.items()}))
            md.append("")
        if suite:
            md += ["#### Scenario suite (examples/sim/suite)", ""]
            md.append(ceiling_table(suite))
            shares = [c["captured"] for c in suite.values() if c["captured"] is not None]
            if shares:
                md.append("")
                prompt_shares = [
                    c["prompt_oracle_captured"]
                    for c in suite.values()
                    if c.get("prompt_oracle_captured") is not None
                ]
                told = (
                    f"; the prompt-oracle's: {sum(prompt_shares) / len(prompt_shares):.0%} "
                    f"over {len(prompt_shares)}"
                    if prompt_shares
                    else ""
                )
                md.append(
                    f"Mean captured share over {len(shares)} scenario(s) where the oracle "
                    f"gains: {sum(shares) / len(shares):.0%}{told}."
                )
            caps = seqs_caps(suite)
            if caps:
                md.append("")
                md.append(caps)
            md.append("")
        md += ["### End to end: the same results through the pipeline", ""]
        md.append(
            "Mean steady step seconds, `max(generation, training of the previous batch) + "
            "weight sync`, on each scenario's split (`(auto)`: chosen by `split.choose = "
            '"auto"`). Training and sync take the same time under every policy (same '
            "batch, same fabric), so a faster generation shortens the step only while the "
            "pipeline is generation-bound; `bound by` says which side set the steady steps "
            "(`mixed`: some of each). `gen` speedups are the generation-time ones above; "
            "`e2e` are step time over the best static layout's; `bound e2e` is the step with "
            "generation at its fluid bound, the end-to-end ceiling."
        )
        md.append("")
        md.append(e2e_table({**{f"compute {m}": c for m, c in ceil.items()}, **suite}))
        md.append("")
    md += ["## 2. Network: fabrics at 1024 and 2048 H800 (Qwen2.5-72B)", ""]
    md.append(f"Paper: {PAPER['network']}.")
    md.append("")
    for size, table in network.items():
        md.append(f"### {size} GPUs")
        md.append("")
        md.append(
            _table(
                [
                    "fabric",
                    "step s",
                    "train comm s",
                    "sync s",
                    "cost MUSD",
                    "step (norm)",
                    "cost (norm)",
                    "perf/cost (norm)",
                ],
                [
                    [
                        k,
                        v["mean_step_s"],
                        v["mean_train_comm_s"],
                        v["mean_sync_s"],
                        v["cost_usd"] / 1e6,
                        v["step_norm"],
                        v["cost_norm"],
                        v["perf_per_cost_norm"],
                    ]
                    for k, v in table.items()
                ],
            )
        )
        md.append("")
    md += regime_section(out.get("regimes", {}))
    sw = out.get("sensitivity_switching", {})
    if sw:
        md += ["## 3a. Sensitivity: OCS switching time (RFabric)", ""]
        md.append(
            _table(
                ["switching s", "step s", "sync s", "syncs rewired", "reconfig charged s"],
                [
                    [
                        k,
                        v["mean_step_s"],
                        v["mean_sync_s"],
                        v["rewired_syncs"],
                        v["reconfig_charged_s"],
                    ]
                    for k, v in sw.items()
                ],
            )
        )
        md.append("")
    rl = out.get("rl", {})
    if rl:
        any_rl = next(iter(rl.values()))
        md += ["## 1b. RL throughput end to end: partial rollout, the split, adaptive TP", ""]
        md.append(
            "Trained samples per second (response tokens per second in brackets) over the "
            "best static TP with full rollout on the scenario's split (the baseline), with "
            "each mechanism alone and together: adaptive TP (`TP alone`), the step "
            "planner's generation/training split from the third step on (`split alone`), "
            "partial rollout (over-provisioning 1.25, a step ends once the trainer's groups "
            "are complete, max staleness 1; the planner turns over-provisioning off when "
            "full rollout fits inside training), and all of them. A step trains the batch "
            "the step before collected, so every mean leaves out the first "
            f"{any_rl['warmup']} of {any_rl['steps']} steps (partial rollout's carry-over "
            "reaches the trainer from the third step on). Off-policy tokens: trained "
            "tokens generated under an older weight version than their batch's (beyond "
            "the pipeline's one-step lag); dropped: responses dropped for staleness (with "
            "their groups) over dropped and trained. `bound (full)`: generation at its "
            "fluid bound with the baseline's training and sync, full rollout. `divided "
            "rollout alone`: the baseline with Seer's divided rollout, full rollout."
        )
        md.append("")
        md.append(_table(RL_HEADER, rl_rows(rl)))
        md.append("")
        md += [f"- {line}" for line in rl_discussion(rl)]
        md.append("")
    studies = out.get("dapo_study", {})
    for name, study in studies.items():
        md += [f"## 1c. {name}: what moves it toward 1.4x", ""]
        md.append(
            "Each mechanism on its own, on top of partial rollout with static TP (the "
            "baseline is section 1b's). A split by pairs of GPUs (`split.unit_gpus = "
            f"{study['unit_gpus']}`: with one NIC per GPU, each pool's GPUs on a shared node "
            "bring their own NICs), chosen by the step planner, and every such split fixed "
            "from the first step (the best found with hindsight); Seer's divided rollout "
            "(a request goes on, after each chunk, on the instance with the most room, its "
            "KV cache moved or recomputed at a migration's cost); and two bounds: the best "
            "fixed split's generation and training GPU-seconds spread over every GPU (no "
            "split, however fine, balances the pools better), and the weight sync, which "
            "overlapping it with the next training would take off the step at most."
        )
        md.append("")
        md.append(_table(STUDY_HEADER, study_rows(study, out["rl"][name])))
        md.append("")
        md.append(
            _table(
                (
                    "fixed split (gen/train)",
                    "step s",
                    "gen s",
                    "train s",
                    "samples/s",
                    "speedup (samples, tokens)",
                ),
                fixed_rows(study),
            )
        )
        md.append("")
    md += async_section(out, _table, outdir, plots)
    ops = out.get("sensitivity_over_provision", {})
    if ops:
        md += ["### Over-provisioning (partial rollout, static TP, the planner's split)", ""]
        for name, sweep in ops.items():
            md.append(f"#### {name} (TP{sweep['best_static_tp']})")
            md.append("")
            md.append(_table(OP_HEADER, op_rows(sweep)))
            md.append("")
    sp = out.get("sensitivity_split", {})
    if sp:
        md += ["## 3b. Sensitivity: generation / training split", ""]
        md.append(
            "The best static layout and the adaptive policy at each split of the scenario's "
            "GPUs (mean steady seconds). `bound by`: which side set the steady steps. "
            '`auto picks` marks the split `split.choose = "auto"` takes: the shortest best '
            "static step time (equal times: more generation GPUs). A generation speedup "
            "turns into an end-to-end one only where the adaptive run is still "
            "generation-bound."
        )
        md.append("")
        for name, sweep in sp.items():
            md.append(f"### {name}")
            md.append("")
            md.append(_table(SWEEP_HEADER, sweep_rows(sweep)))
            md.append("")
    sq = out.get("sensitivity_max_num_seqs", {})
    if any(sq.values()):
        md += ["## 3c. Sensitivity: sequences per instance (max_num_seqs)", ""]
        md.append(
            "The same scenario with its engines capped at each `max_num_seqs` (sequences an "
            "instance runs at once, at every TP; vLLM's default is 256), against the same "
            "ceilings. The cap decides how much of the load one instance takes in, and so "
            "which static TP is best and how much any scheduler can gain."
        )
        md.append("")
        for name, rows in sq.items():
            if not rows:
                continue
            md.append(f"### {name}")
            md.append("")
            md.append(ceiling_table(dict(_by_cap(rows)), first="max_num_seqs"))
            md.append("")
    md += ["## Plots", ""]
    for name, caption in plots:
        md.append(f"![{caption}]({name})")
        md.append("")
    md += ["## What the numbers say (computed from this run)", ""]
    md += [f"- {line}" for line in discussion(out)]
    md += ["", "## Assumptions and why results may differ from the paper", ""]
    md += [f"- {line}" for line in ASSUMPTIONS]
    path = outdir / "REPORT.md"
    path.write_text("\n".join(md) + "\n")
    return path


ASSUMPTIONS = (
    "Decode and prefill times come from `scheduler.perf_model` (H800 roofline plus cited "
    "efficiency terms); training at its MFU (0.52, Megatron-LM) with 6+2 FLOPs per "
    "parameter and token (update plus the old policy's log-probabilities).",
    "Small vs large TP: at equal batch per instance the performance model gives small TP "
    "more tokens/s per GPU, as Lambda's vLLM benchmark found (data parallelism beats tensor "
    "parallelism when the model fits), but by less than that benchmark's 6x per GPU "
    "(Mistral-7B on H100, TP1 vs TP8, vLLM v0.5.4): its time per output token (27.2 ms at "
    "TP1, 21.6 ms at TP8, about 90 requests in flight) exceeds the model's GPU time for "
    "that batch (11-16 ms and 3.3-3.9 ms at 1,000-2,000 tokens of context) by 11-18 ms of "
    "host time per step in both cases, which that engine did not overlap with the GPU and "
    "vLLM 0.6 removed. The model describes the newer engine (0.25 ms of exposed host time "
    "per step); no efficiency constant was changed for this reproduction.",
    "Workload: log-normal response lengths (median 1,500 tokens, prompt and sample sigmas "
    "0.6 / 0.8) capped at 20,480 tokens (DAPO's limit), 16 samples per prompt, +5% per step; "
    "the paper's traces are not public, and the gain of adaptive TP depends on how long "
    "the tail is relative to the bulk of the step.",
    "The compute planner runs with its defaults except `all_candidates_limit=0` (the scale "
    "mode of reactive balancing) so that re-planning 2,048 live requests stays fast; it "
    "re-plans every 5 s of simulated time.",
    "Generation has no inter-node traffic in this model (KV moves across nodes are charged "
    "by the planner's cost model, not as flows), so the network experiment simulates it "
    "once per size with the best static layout and every fabric sees the same generation.",
    "Network cost counts switch ports, transceivers, OCS ports and fibres with the price "
    "assumptions in `sim_backends/clustersim/cost.py`; the perf/cost ratios move with them.",
    "One-step-asynchronous pipeline: step time = max(generation, training of the previous "
    "batch) + weight sync; gradient all-reduces are not overlapped with compute.",
    "Where compute (the generation tail or the training FLOPs) dominates the step, the "
    "network's share is small and fabrics differ mostly by cost; the paper's simulator may "
    "weigh network phases more (its workload, batch sizes and overlap assumptions are not "
    "public).",
    "Training nodes come first and pods are 32 nodes (the fabric module's default, a DGX "
    "SuperPOD scalable unit), so the training pool's ring all-reduce stays within one pod "
    "at 1024 GPUs and crosses pods only at pod boundaries at 2048; smaller pods or a pool "
    "scattered over pods would put more of its traffic on the fabric above the ToRs.",
)


REGIME_HEADER = (
    "workload",
    "GPUs",
    "placement",
    "fabric",
    "algorithm",
    "step s",
    "compute s",
    "comm s",
    "generation s (network s)",
    "exposed comm + sync share",
    "cost MUSD (no host links)",
    "perf/cost vs fat-tree",
    "(no host links)",
)


def regime_rows(rows: Sequence[Mapping[str, Any]]) -> list[list[object]]:
    """Rows of :data:`REGIME_HEADER`, one per cell and fabric of the regime map."""
    return [
        [
            r["workload"],
            r["gpus"],
            r["placement"],
            r["fabric"],
            r["algorithm"],
            r["step_s"],
            r["compute_s"],
            r["comm_s"],
            _gen_cell(r),
            f"{r['exposed_share']:.0%}",
            f"{r['cost_usd'] / 1e6:.2f} ({r['cost_above_hosts_usd'] / 1e6:.2f})",
            f"{r['perf_per_cost_norm']:.2f}",
            _x(r["perf_per_cost_above_hosts_norm"], ""),
        ]
        for r in rows
    ]


def _gen_cell(r: Mapping[str, Any]) -> str:
    """A MoE row's generation time and its network all-to-all part; '-' where the map
    does not time generation (dense workloads)."""
    if r.get("gen_s") is None:
        return "-"
    bound = " (bound)" if r.get("bound") == "generation" else ""
    return f"{r['gen_s']:.1f} ({r['gen_net_s']:.1f}){bound}"


def _x(value: float | None, suffix: str = "x") -> str:
    return "n/a" if value is None else f"{value:.2f}{suffix}"


VERDICT_HEADER = (
    "workload",
    "GPUs",
    "placement",
    "best static (perf/cost)",
    "RFabric / best static",
    "best static, no host links",
    "RFabric / best static, no host links",
    "RFabric / fat-tree",
    "exposed share fat-tree / RFabric",
)


def verdict_rows(verdicts: Sequence[Mapping[str, Any]]) -> list[list[object]]:
    return [
        [
            v["workload"],
            v["gpus"],
            v["placement"],
            v["best_static"],
            f"{v['rfabric_vs_best']:.2f}x",
            v["best_static_above_hosts"] or "n/a",
            _x(v["rfabric_vs_best_above_hosts"]),
            f"{v['rfabric_vs_fat_tree']:.2f}x",
            f"{v['fat_tree_exposed_share']:.0%} / {v['rfabric_exposed_share']:.0%}",
        ]
        for v in verdicts
    ]


def regime_section(regime: Mapping[str, Any]) -> list[str]:
    """The regime map's part of the report: settings, the table, the verdicts, and what
    they say (computed from the rows)."""
    rows = regime.get("rows", [])
    if not rows:
        return []
    st = regime.get("settings", {})
    md = ["## 2b. Regime map: when does the fabric matter, and does RFabric pay off?", ""]
    gen_rows = [r for r in rows if r.get("gen_s") is not None]
    gen_ep = gen_rows[0].get("gen_ep_gpus", 0) if gen_rows else 0
    md.append(
        "Dense workloads: one RL step's training (4 mini-batches and the log-prob pass) "
        "plus the weight sync, timed on each fabric with the closed form (busiest link's "
        "bytes / capacity; tests hold it to the flow simulation), i.e. the step of a "
        "training-bound pipeline: the most a fabric can change (when generation is longer, "
        "only the sync depends on the fabric). MoE workload: the pipeline's step, "
        "max(generation, training) + sync, with generation timed too: instances of "
        f"{gen_ep} GPUs (experts over all of them, attention per node), the step's requests "
        "dealt round-robin and continuously batched, each decode iteration from the "
        "performance model's MoE decode (experts touched by the batch, KV reads, NVLink "
        "all-reduces, and the per-layer expert dispatch + combine over the network, not "
        "overlapped) at the bandwidth per GPU the fabric gives all instances' all-to-all "
        "together; that network time is the generation side's exposed communication. "
        "`contiguous`: an instance's nodes are consecutive (inside a pod); `scattered`: "
        "dealt over the pods, so its all-to-all crosses them. The generation all-to-all is "
        "timed alone (not contending with training's collectives) and is part of the "
        "optical fabrics' circuit demand (RFabric plans one set of circuits for training "
        "and generation, which run together). "
        f"Training pool {st.get('train_share', 0.5):.0%} of the GPUs; "
        f"communication hidden behind up to {st.get('overlap', 0):.0%} of the compute "
        "(exposed = max(0, comm - overlap x compute)); Megatron TP8 in a node + ZeRO-1 data "
        "parallelism; FSDP over every training GPU, 16,384 tokens per GPU per micro-batch; "
        f"MoE with expert parallelism over {st.get('ep_gpus', 64)} GPUs (8 nodes). "
        "`contiguous`: the training pool fills whole pods; `scattered`: its ranks dealt "
        "round-robin over the pods. Every fabric gets ring, tree and hierarchical "
        "collectives; `algorithm` is the one that gave the run its shortest step. Cost with "
        "host links, and in brackets without them (leaf host ports, their transceivers and "
        "fibres, alike for every fabric); prices in `sim_backends/clustersim/cost.py`."
    )
    md.append("")
    md.append(_table(REGIME_HEADER, regime_rows(rows)))
    md.append("")
    verdicts = regime.get("verdicts", [])
    if verdicts:
        md += ["### RFabric against the best static fabric (perf/cost)", ""]
        md.append(_table(VERDICT_HEADER, verdict_rows(verdicts)))
        md.append("")
        md += [f"- {line}" for line in regime_discussion(rows, verdicts)]
        md.append("")
    return md


def regime_discussion(
    rows: Sequence[Mapping[str, Any]], verdicts: Sequence[Mapping[str, Any]]
) -> list[str]:
    """Plain statements derived from the map's figures."""
    lines: list[str] = []
    wins = [v for v in verdicts if v["rfabric_vs_best"] > 1.0]
    priced = [v for v in verdicts if v["rfabric_vs_best_above_hosts"] is not None]
    wins_ah = [v for v in priced if v["rfabric_vs_best_above_hosts"] > 1.0]

    def cell(v: Mapping[str, Any]) -> str:
        return f"{v['workload']} at {v['gpus']} GPUs, {v['placement']}"

    if wins:
        lines.append(
            f"RFabric beats the best static fabric on perf/cost in {len(wins)} of "
            f"{len(verdicts)} cells: "
            + "; ".join(f"{cell(v)} by {v['rfabric_vs_best']:.2f}x" for v in wins)
            + "."
        )
    else:
        best = max(verdicts, key=lambda v: v["rfabric_vs_best"])
        lines.append(
            f"RFabric beats the best static fabric on perf/cost in none of the "
            f"{len(verdicts)} cells; its best is {best['rfabric_vs_best']:.2f}x of the best "
            f"static ({best['best_static']}) in {cell(best)}."
        )
    if priced:
        lines.append(
            f"Without host links RFabric is ahead of the best static fabric in {len(wins_ah)} "
            f"of {len(priced)} cells (range "
            f"{min(v['rfabric_vs_best_above_hosts'] for v in priced):.2f}-"
            f"{max(v['rfabric_vs_best_above_hosts'] for v in priced):.2f}x)."
        )
    vs_ft = [v["rfabric_vs_fat_tree"] for v in verdicts]
    lines.append(
        f"Against the non-blocking fat-tree RFabric's perf/cost is {min(vs_ft):.2f}-"
        f"{max(vs_ft):.2f}x (paper: 2.2-3.2x); with equal step times that is the cost ratio "
        "alone."
    )
    slow = [r for r in rows if r["fabric"] == "fat-tree-oversub" and r["step_norm"] > 1.0 + 1e-6]
    if slow:
        lines.append(
            "The 3:1 oversubscribed fat-tree is slower than the non-blocking one only in "
            + "; ".join(
                f"{r['workload']} at {r['gpus']} GPUs, {r['placement']} "
                f"({r['step_norm']:.2f}x the step)"
                for r in slow
            )
            + ": there the training collectives (MoE: the generation all-to-all, when "
            "generation bounds the step) cross pods; elsewhere they stay under the ToRs and "
            "every fabric gives the same step."
        )
    else:
        lines.append(
            "The 3:1 oversubscribed fat-tree gives the same step as the non-blocking one in "
            "every cell: the training collectives never load its core beyond its uplinks."
        )
    gen = [r for r in rows if r.get("gen_s") is not None]
    if gen:
        bound = [r for r in gen if r.get("bound") == "generation"]
        net = [r["gen_net_s"] / r["gen_s"] for r in gen if r["gen_s"] > 0]
        ref = {
            (r["workload"], r["gpus"], r["placement"]): r["gen_s"]
            for r in gen
            if r["fabric"] == "fat-tree"
        }
        spread = [
            r["gen_s"] / ref[(r["workload"], r["gpus"], r["placement"])]
            for r in gen
            if ref.get((r["workload"], r["gpus"], r["placement"]))
        ]
        lines.append(
            f"MoE generation bounds the step in {len(bound)} of {len(gen)} MoE rows; its "
            f"expert all-to-all over the network is {min(net):.0%}-{max(net):.0%} of the "
            f"generation time, and the fabric changes generation by "
            f"{min(spread):.2f}-{max(spread):.2f}x of the fat-tree's (the all-to-all crosses "
            "pods only when an instance's nodes are scattered over them)."
        )
    exposed = max(rows, key=lambda r: r["exposed_share"])
    lines.append(
        f"Largest exposed share of the step (communication not hidden + weight sync): "
        f"{exposed['exposed_share']:.0%}, {exposed['workload']} at {exposed['gpus']} GPUs "
        f"({exposed['placement']}, {exposed['fabric']})."
    )
    return lines


def discussion(out: Mapping[str, Any]) -> list[str]:
    """Observations derived from the figures of this run (no fixed conclusions)."""
    lines: list[str] = []
    for model, row in out.get("compute", {}).items():
        if "tail_floor_s" not in row or "adaptive" not in row:
            continue
        ad = row["adaptive"]
        lines.append(
            f"{model}: the best static layout (TP{row['static_tp']}) generates a step in "
            f"{row['static']['mean_gen_s']:.1f} s; the longest response alone on the widest "
            f"instance takes {row['tail_floor_s']:.1f} s, so no scheduler can speed "
            f"generation up by more than {row['static_gen_over_floor']:.2f}x here. The "
            f"adaptive scheduler reached {ad['speedup']:.2f}x end to end with "
            f"{ad['reshards']} reshards and {ad['migrations']} moves."
        )
        done = row.get("static_done_s", {})
        steps = row.get("static_step_gen_s", {})
        best = str(row["static_tp"])
        if done and best in done and best in steps:
            # the largest lead any layout has over the best static one through the bulk
            lead, at, fastest = max(
                ((done[best][f] - d[f], f, t) for t, d in done.items() for f in d),
                key=lambda x: (x[0], -int(x[2])),
            )
            fractions = " / ".join(f"{float(f):.0%}" for f in done[best])
            lines.append(
                f"{model}: {fractions} of the responses are done after "
                + "; ".join(
                    f"TP{t} " + " / ".join(f"{v:.1f}" for v in d.values()) + " s"
                    for t, d in done.items()
                )
                + f"; the whole step takes {steps[best]:.1f} s at TP{best}. "
                + (
                    f"The largest lead over TP{best} through the bulk is TP{fastest}'s, "
                    f"{lead:.1f} s at the {float(at):.0%} point; the longest responses, which "
                    f"decide the step, run slower per token on TP{fastest} (whole step "
                    f"{steps[fastest]:.1f} s there), so running the bulk on TP{fastest} and "
                    f"the tail on TP{best} would save about {lead:.1f} s "
                    f"({steps[best] / max(1e-9, steps[best] - lead):.2f}x) before the reshard "
                    "pauses: the performance model leaves adaptive TP little to gain at this "
                    "load."
                    if lead > 0
                    else f"No layout gets through the bulk sooner than TP{best}, so changing "
                    "the layout within a step has nothing to gain here."
                )
            )
        planned = [
            (p, row[p])
            for p in ("proactive", "adaptive")
            if "predicted_at_start_s" in row.get(p, {})
        ]
        if planned:
            steady = max(1, len(planned[0][1].get("steps", [])) - 1)
            names = " / ".join(p for p, _ in planned)
            lines.append(
                f"{model} ({names}): at each step start the planner predicted "
                + " / ".join(f"{r['predicted_at_start_s']:.1f}" for _, r in planned)
                + " s for the rest of the step; generation took "
                + " / ".join(f"{r['mean_gen_s']:.1f}" for _, r in planned)
                + " s ("
                + " / ".join(
                    f"{r['predicted_at_start_s'] / r['mean_gen_s']:.0%}" for _, r in planned
                )
                + "). A step ends with its longest response, so the planner takes as a "
                "request's critical path the N/(N+1) quantile of its remaining length (N "
                "requests left: where the longest of N is expected), under which every "
                "instance may hold a capped response. It changed the layout in "
                + " / ".join(str(r.get("layout_changes", 0)) for _, r in planned)
                + f" of {steady} steady step(s): it changes a layout only when the predicted "
                "step plus the reshard pause beats keeping it by more than "
                f"{SIM_PLANNER.switch_margin_rel:.0%} while requests run (by "
                f"{SIM_PLANNER.switch_margin_s:g} s when a step's batch has just arrived and "
                "no request holds KV yet: the layout then is the previous step's tail's)."
            )
        pro, rea = row.get("proactive"), row.get("reactive")
        if pro is not None and rea is not None and pro.get("layout_changes", 1) == 0:
            lines.append(
                f"{model}: `proactive` ({pro['speedup']:.2f}x) kept the layout, so it "
                "differs from the static baseline only in how it dispatched the step's "
                "requests at its start; they are indistinguishable then, so which instance "
                "queues the responses that turn out longest is luck of the draw. `reactive` "
                f"({rea['speedup']:.2f}x) moves requests off the instance predicted to finish "
                "last as their lengths show."
            )
    for size, table in out.get("network", {}).items():
        ft = table.get("fat-tree")
        if ft is None:
            continue
        net = ft["mean_train_comm_s"] + ft["mean_sync_s"]
        bound = "training" if ft["mean_train_s"] >= ft["mean_gen_s"] else "generation"
        best = max(table.items(), key=lambda kv: kv[1]["perf_per_cost_norm"])
        rf = table.get("rfabric", {})
        lines.append(
            f"{size} GPUs: on the Fat-Tree the network takes {net:.1f} s per step (gradient "
            f"all-reduces {ft['mean_train_comm_s']:.1f} s + weight sync {ft['mean_sync_s']:.2f} s) "
            f"of a {ft['mean_step_s']:.0f} s step that is {bound}-bound, so the fabrics' step "
            f"times differ by at most "
            f"{max(v['step_norm'] for v in table.values()) - 1:.1%} and perf/cost follows "
            f"cost: RFabric {rf.get('perf_per_cost_norm', 0):.2f}x the Fat-Tree, best "
            f"{best[0]} {best[1]['perf_per_cost_norm']:.2f}x."
        )
    lines += sweep_discussion(out.get("sensitivity_split", {}))
    lines += seqs_discussion(out.get("sensitivity_max_num_seqs", {}))
    sw = out.get("sensitivity_switching", {})
    if sw:
        rows = list(sw.items())
        first = rows[0][1]
        lines.append(
            "OCS switching time: "
            + ", ".join(f"{k} s: {v['mean_step_s']:.3f} s/step" for k, v in rows)
            + f". {first['syncs_without_window']} of {first['syncs']} weight syncs had no idle "
            "window before them (training ended after generation), so the slack gate kept "
            "the topology and, where the training circuits could not reach the generation "
            "pods, RFabric rewired on the critical path and was charged switching + settling "
            f"({rows[-1][1]['reconfig_charged_s']:.3f} s in all at the slowest switch); with a "
            "window the change is hidden."
        )
    return lines


def sweep_discussion(sweeps: Mapping[str, Any]) -> list[str]:
    """Per swept scenario: which side bounds the best static pipeline at each split, where
    it turns generation-bound, the split ``auto`` picks and the adaptive policy's
    generation and end-to-end speedups there."""
    lines: list[str] = []
    for name, sweep in sweeps.items():
        rows = sweep.get("splits", {})
        if not rows:
            continue
        by = ", ".join(f"{k} {r['bound']}" for k, r in rows.items())
        gen = [k for k, r in rows.items() if r["bound"] == "generation"]
        where = (
            f"generation-bound at {', '.join(gen)}"
            if gen
            else "training-bound or mixed at every split swept"
        )
        chosen = sweep.get("chosen")
        pick = ""
        if chosen in rows:
            c = rows[chosen]
            pick = (
                f"; auto picks {chosen} ({c['step_s']:.1f} s a step, {c['bound']}-bound), "
                f"where adaptive gains {c['adaptive_gen_speedup']:.3f}x in generation and "
                f"{c['adaptive_e2e_speedup']:.3f}x end to end ({c['adaptive_bound']}-bound)"
            )
        lines.append(
            f"Split sweep {name} (gen/train GPUs): best static pipeline {by}; {where}{pick}."
        )
    return lines


def _by_cap(rows: Mapping[str, Any]) -> list[tuple[str, Any]]:
    """A ``max_num_seqs`` sweep's rows (keyed by the cap as text), smallest cap first."""
    return sorted(rows.items(), key=lambda kv: int(kv[0]))


def seqs_discussion(sweeps: Mapping[str, Any]) -> list[str]:
    """Per scenario swept over ``max_num_seqs``: the best static layout and the adaptive
    and oracle speedups at each cap, and the range they span."""
    lines: list[str] = []
    for name, rows in sweeps.items():
        if not rows:
            continue
        ordered = _by_cap(rows)
        each = "; ".join(
            f"{cap}: best static TP{r['best_static_tp']} {r['best_static_s']:.1f} s, adaptive "
            f"{r['adaptive_speedup']:.3f}x, oracle {r['oracle_speedup']:.3f}x"
            for cap, r in ordered
        )
        adaptive = [r["adaptive_speedup"] for _, r in ordered]
        oracle = [r["oracle_speedup"] for _, r in ordered]
        lines.append(
            f"max_num_seqs sweep {name} (sequences per instance): {each}. Over the caps swept "
            f"the adaptive policy gains {min(adaptive):.3f}x-{max(adaptive):.3f}x and the "
            f"oracle {min(oracle):.3f}x-{max(oracle):.3f}x over the best static layout."
        )
    return lines
