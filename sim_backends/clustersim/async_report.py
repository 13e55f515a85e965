"""The asynchronous mode's part of the reproduction report: verl's replayed runs, each
mechanism alone, the version lags, the split over time and the version-propagation figure
(REPORT section 1d; ``orl-sim async-replay`` prints the same tables)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from sim_backends.clustersim.replay import SOURCE, TARGET_ROWS, VARIANTS

REPLAY_HEADER = (
    "row (model, GPUs, trainer:rollout)",
    "verl published s/step",
    "model of verl s/step",
    "error",
    "published update_actor (+ref) s",
    "model training s",
    "published trainer wait s",
    "model trainer wait s",
    "OrchestrRL s/step",
    "OrchestrRL split (gen/train)",
    "throughput vs model of verl",
    "p99 lag verl / ours",
)

ABLATION_HEADER = ("row", *VARIANTS, "balance bound")

PROPAGATION_HEADER = (
    "core (4:1)",
    "push to",
    "circuit lease",
    "push s",
    "relay chain s",
    "engine load s (stall)",
    "switching charged s",
    "propagation s",
)

LABELS = {
    "verl": "verl's mode",
    "split": "split alone",
    "relay": "relay alone",
    "repack": "repack alone",
    "reshard": "repack + reshard",
    "circuits": "circuits alone",
    "orchestrrl": "OrchestrRL (all)",
}


def _label(key: str, row: Mapping[str, Any]) -> str:
    pub = row["published"]
    return f"{key} ({row['model']}, {pub['gpus']} {row['hardware']}, {pub['split']})"


def balance_bound(row: Mapping[str, Any]) -> float:
    """The speedup over the model of verl if its training and rollout GPU-seconds were
    spread over every GPU (linear scaling): the most a split can give in this model."""
    v = row["variants"]["verl"]
    t, g = int(row["train_gpus"]), int(row["gen_gpus"])
    step = float(v["mean_step_s"])
    work = t * float(v["mean_train_s"]) + g * step * (1.0 - float(v["rollout_idle"]))
    return step / (work / (t + g) + float(v["mean_sync_s"]))


def replay_rows(replay: Mapping[str, Any]) -> list[list[object]]:
    """Rows of :data:`REPLAY_HEADER`."""
    out: list[list[object]] = []
    for key, row in replay.get("rows", {}).items():
        pub = row["published"]
        verl = row["variants"]["verl"]
        ours = row["variants"]["orchestrrl"]
        out.append(
            [
                _label(key, row),
                pub["step_s"],
                row["model_step_s"],
                f"{row['error']:+.0%}",
                pub["update_s"] + pub.get("ref_s", 0.0),
                verl["mean_train_s"],
                pub["gen_s"],
                verl["mean_wait_s"],
                ours["mean_logged_step_s"],
                ours["splits"][-1],
                f"{ours['speedup']:.3f}x",
                f"{verl['lag_p99']:g} / {ours['lag_p99']:g}",
            ]
        )
    return out


def ablation_rows(
    replay: Mapping[str, Any], extra: Mapping[str, Any] | None = None
) -> list[list[object]]:
    """Rows of :data:`ABLATION_HEADER`: each mechanism's throughput over the model of
    verl (``extra``: rows that are not published runs, e.g. a rollout-bound split)."""
    rows: list[list[object]] = []
    for key, row in {**replay.get("rows", {}), **(extra or {})}.items():
        v = row["variants"]
        rows.append(
            [key, *(f"{v[k]['speedup']:.3f}x" for k in VARIANTS), f"{balance_bound(row):.3f}x"]
        )
    return rows


def propagation_rows(fig: Mapping[str, Any]) -> list[list[object]]:
    rows: list[list[object]] = []
    for r in fig.get("rows", []):
        core = {
            "fat-tree-oversub": "electrical Fat-Tree",
            "static-optical": "optical, standing circuits",
            "rfabric": "optical (RFabric)",
        }.get(r["fabric"], r["fabric"])
        push = "a relay per rollout pod" if r["schedule"] == "relay" else "every rollout node"
        lease = {
            "none": "none",
            "hidden": "yes, set up in the trainer's idle window",
            "charged": "yes, switching charged",
        }[r["lease"]]
        rows.append(
            [
                core,
                push,
                lease,
                r["push_s"],
                r["chain_s"],
                r["load_s"],
                r["reconfig_s"],
                r["propagation_s"],
            ]
        )
    return rows


def section(
    out: Mapping[str, Any],
    table: Callable[[Sequence[str], Sequence[Sequence[object]]], str],
    outdir: Path,
    plots: list[tuple[str, str]],
) -> list[str]:
    """REPORT section 1d (empty when the run has no asynchronous results); its plots
    are added to ``plots``."""
    a = out.get("async", {})
    replay = a.get("replay", {})
    if not replay and not a.get("propagation"):
        return []
    md = ["## 1d. Asynchronous RL: verl's fully-async runs replayed, and OrchestrRL's mode", ""]
    if replay:
        md.append(
            f"Published figures: {SOURCE} (H20, DAPO-Math-17k, 512 prompts x 16 responses per "
            "parameter version, staleness_threshold 0.5, partial rollout). verl's s/step is "
            "its `timing_s/step`: the trainer's wait for samples plus its update, summed "
            "over a version's local updates (the parameter sync is logged apart); the "
            "model's is the same sum. `model of verl`: the fixed split, a global sync that "
            "pauses every engine and aborts its requests (resumed after it, KV "
            "recomputed), admission by the same staleness bound, nothing dropped. "
            "`OrchestrRL`: the same GPUs and bound with the split planner, the relay tier "
            "(no global pause), repack and reshard of the tail and circuit leases. The "
            "workload's lengths are the simulator's DAPO-like assumption (median 1,500 "
            "response tokens), not fitted to verl, whose lengths are not published. Lag: "
            "versions between a trained trajectory's oldest token and the weights it trains."
        )
        md.append("")
        md.append(table(REPLAY_HEADER, replay_rows(replay)))
        md.append("")
        md.append(
            "Each mechanism alone, throughput (trained samples per second) over the model "
            "of verl on the same GPUs: `split` (the planner's split), `relay` (no global "
            "pause: engines drain and load from their node's relay copy), `repack` (relay "
            "and the tail repack), `reshard` (and its reshard), `circuits` (RFabric with a "
            "lease per weight wave), and everything. `balance bound`: the model of verl's "
            "training and rollout GPU-seconds spread over every GPU, the most a split can "
            "give under linear scaling."
        )
        md.append("")
        md.append(table(ABLATION_HEADER, ablation_rows(replay, a.get("stress"))))
        md.append("")
        md += [f"- {line}" for line in discussion(a)]
        md.append("")
        _plots(replay, outdir, plots)
    fig = a.get("propagation")
    if fig:
        md += ["### Version propagation on a 4:1 oversubscribed core", ""]
        md.append(
            f"{fig['model']} ({fig['weight_bytes'] / 1e9:.1f} GB) from {fig['train_gpus']} "
            f"trainer GPUs to {fig['rollout_gpus']} rollout GPUs, pods of "
            f"{fig['nodes_per_pod']} nodes (the trainer's two, the rollout's two), a core of a "
            f"quarter of the pods' NIC bandwidth; engines at TP{fig['engine_tp']}. "
            "Propagation = trainer step end to the last engine running the new version: "
            "push + relay chain + the engine's load from host memory (its only stall)."
        )
        md.append("")
        md.append(table(PROPAGATION_HEADER, propagation_rows(fig)))
        md.append("")
        md.append(
            f"With leases: {fig['leased_s']:.2f} s (target <= {fig['target_s']:.0f} s); the same "
            f"optical core left on its standing circuits: {fig['static_s']:.2f} s, "
            f"{fig['ratio']:.2f}x longer; the 4:1 electrical Fat-Tree: "
            f"{fig['electrical_s']:.2f} s ({fig['ratio_electrical']:.2f}x). Rollout stall "
            f"{fig['stall_s']:.3f} s per engine (target <= {fig['stall_target_s']} s): "
            + (
                "met."
                if fig["stall_s"] <= fig["stall_target_s"]
                else "missed: a TP"
                f"{fig['engine_tp']} shard copied from host memory at the measured "
                "35 GB/s host-to-device rate takes that long; only a double-buffered load "
                "(into spare GPU memory while decoding) would hide it."
            )
        )
        md.append("")
    return md


def discussion(a: Mapping[str, Any]) -> list[str]:
    """Lines computed from the asynchronous results."""
    rows = a.get("replay", {}).get("rows", {})
    if not rows:
        return []
    lines: list[str] = []
    errs = ", ".join(f"{k} {r['error']:+.0%}" for k, r in rows.items())
    within = [k for k, r in rows.items() if abs(r["error"]) <= 0.20]
    lines.append(
        f"The model of verl's mode against verl's s/step: {errs}; within 20 % on "
        f"{', '.join(within) or 'no row'}. Training decides it: the model's trainer takes "
        + ", ".join(f"{k} {r['update_error']:+.0%}" for k, r in rows.items())
        + " against verl's update_actor (plus ref where logged) at "
        + ", ".join(f"{r['trained_tokens_per_response']:.0f}" for r in rows.values())
        + " trained tokens per response (the DAPO-like lengths, prompt included), training at "
        "the 0.52 MFU the simulator uses everywhere. verl's update times imply "
        + ", ".join(
            f"{k} {r['implied_tokens_per_response']['at_mfu']:.0f}"
            for k, r in rows.items()
            if "implied_tokens_per_response" in r
        )
        + " trained tokens per response at that MFU (at most "
        + ", ".join(
            f"{r['implied_tokens_per_response']['at_peak']:.0f}"
            for r in rows.values()
            if "implied_tokens_per_response" in r
        )
        + " at the H20's whole 148 TFLOP/s): verl's responses were shorter than the lengths "
        "assumed here, which verl does not publish. Its own rows are not linear in the "
        "trainer's GPUs either: 16 x 313.81, 32 x 156.98 and 64 x 113.16 GPU-seconds per "
        "version (5.0k, 5.0k, 7.2k), so no one FLOP rate fits all three."
    )
    waits = ", ".join(
        f"{k} {r['published']['trainer_idle']:.0%} / {r['variants']['verl']['trainer_idle']:.0%}"
        for k, r in rows.items()
    )
    lines.append(
        f"Which side waits (verl's trainer idle ratio, published / model): {waits}. In the "
        "model the rollout idles "
        + ", ".join(f"{k} {r['variants']['verl']['rollout_idle']:.0%}" for k, r in rows.items())
        + " of the time at verl's split: the admitted groups (1.5 versions' worth) finish well "
        "inside a version, so at each sync almost nothing is running: verl's global pause "
        "costs the model a few tens of milliseconds, and the relay tier, the repack and the "
        "reshard have no tail to recover. verl's measured trainer waited for samples, so "
        "its rollout was slower relative to its trainer than the model's."
    )
    gains = ", ".join(f"{k} {r['variants']['orchestrrl']['speedup']:.2f}x" for k, r in rows.items())
    met = [
        k for k in TARGET_ROWS if k in rows and rows[k]["variants"]["orchestrrl"]["speedup"] >= 1.3
    ]
    missed = [k for k in TARGET_ROWS if k in rows and k not in met]
    bounds = ", ".join(f"{k} {balance_bound(r):.2f}x" for k, r in rows.items())
    lines.append(
        f"OrchestrRL's mode over the model of verl on the same GPUs: {gains} (target >= 1.3x "
        f"on {', '.join(TARGET_ROWS)}: met on {', '.join(met) or 'none'}"
        + (f", missed on {', '.join(missed)}" if missed else "")
        + "). All of it is the split: the planner moves nodes to the trainer, which bounds "
        f"every row in the model. The balance bound (both pools' GPU-seconds over every GPU, "
        f"any split) is {bounds}: no split reaches 1.3x where it is below; the planner moves "
        "whole nodes (8 GPUs), which leaves part of it where the best whole-node split "
        "overshoots, and beats it slightly where a smaller rollout pool runs fuller batches. "
        "The trajectories' p99 lag is "
        + ", ".join(
            f"{k} {r['variants']['verl']['lag_p99']:g} (verl) / "
            f"{r['variants']['orchestrrl']['lag_p99']:g} (ours)"
            for k, r in rows.items()
        )
        + " at the same staleness bound."
    )
    stress = a.get("stress", {})
    for key, row in stress.items():
        v = row["variants"]
        lines.append(
            f"Rollout-bound ({key}: {row['train_gpus']} trainer, {row['gen_gpus']} rollout "
            "GPUs, not a published run), where the rollout mechanisms have work: "
            + ", ".join(f"{LABELS[k]} {v[k]['speedup']:.3f}x" for k in VARIANTS[1:])
            + f"; verl's trainer waits {v['verl']['trainer_idle']:.0%} there. Draining engines "
            "(relay alone) lose the batch they stop admitting; the repack wins it back; a "
            "reshard pays only when a node's wide engine would free it sooner, pauses included "
            f"({v['reshard']['reshards']} reshards)."
        )
    return lines


def _plots(replay: Mapping[str, Any], outdir: Path, plots: list[tuple[str, str]]) -> None:
    from sim_backends.clustersim import plots as draw

    rows = replay.get("rows", {})
    series = {}
    for k, r in rows.items():
        ours = r["variants"]["orchestrrl"]
        series[k] = [
            (st["start_s"], int(split.split("/")[1]))
            for st, split in zip(ours["steps"], ours["splits"], strict=True)
        ]
    draw.plot_split_timeline(series, outdir / "async-split.png")
    plots.append(("async-split.png", "Trainer GPUs over time under OrchestrRL's split planner"))
    lags = {
        k: {
            label: [
                x for vs in r["variants"][key]["lags"][r["variants"][key]["warmup"] :] for x in vs
            ]
            for label, key in (("verl", "verl"), ("OrchestrRL", "orchestrrl"))
        }
        for k, r in rows.items()
    }
    draw.plot_version_lag(lags, outdir / "async-lag.png")
    plots.append(("async-lag.png", "Version lag of trained trajectories, verl vs OrchestrRL"))


__all__ = [
    "ABLATION_HEADER",
    "PROPAGATION_HEADER",
    "REPLAY_HEADER",
    "ablation_rows",
    "balance_bound",
    "discussion",
    "propagation_rows",
    "replay_rows",
    "section",
]
