"""The reproduction's PNG plots (matplotlib, Agg backend): in the ``sim`` extra
(``pip install 'orchestrrl[sim]'``), so that daemons never pull in plotting."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.patches import Patch

from sim_backends.clustersim.generation import GenStepResult

TP_COLOURS = {1: "#9ecae1", 2: "#4292c6", 4: "#fd8d3c", 8: "#d94801", 16: "#7f2704"}


def plot_timeline(gen: GenStepResult, title: str, path: Path) -> None:
    """One row per GPU of the generation pool: which TP instance it served, over time."""
    nodes = sorted({s.node for s in gen.segments})
    row_of = {n: i for i, n in enumerate(nodes)}
    gpn = max((max(s.gpus) + 1 for s in gen.segments), default=8)
    fig, ax = plt.subplots(figsize=(10, max(3.0, 0.12 * gpn * len(nodes))))
    for s in gen.segments:
        for g in s.gpus:
            y = row_of[s.node] * gpn + g
            if s.kind == "pause":
                ax.broken_barh([(s.start, s.end - s.start)], (y, 0.9), color="#555555")
                continue
            busy = max(0.0, min(s.busy_end, s.end) - s.start)
            colour = TP_COLOURS.get(s.tp, "#444444")
            ax.broken_barh([(s.start, busy)], (y, 0.9), color=colour)
            if s.end > s.start + busy:
                ax.broken_barh(
                    [(s.start + busy, s.end - s.start - busy)], (y, 0.9), color=colour, alpha=0.2
                )
    ax.set_yticks([row_of[n] * gpn + gpn / 2 for n in nodes], nodes)
    ax.set_xlabel("time in step (s)")
    ax.set_title(title)
    handles = [Patch(color=c, label=f"TP{t}") for t, c in TP_COLOURS.items() if t <= gpn]
    handles.append(Patch(color="#555555", label="reshard pause"))
    ax.legend(handles=handles, loc="upper right", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_tail(curves: Mapping[str, Sequence[float]], title: str, path: Path) -> None:
    """Fraction of the step's responses done over time."""
    fig, ax = plt.subplots(figsize=(7, 4))
    for label, times in curves.items():
        n = len(times)
        if not n:
            continue
        ax.step(list(times), [(i + 1) / n for i in range(n)], where="post", label=label)
    ax.set_xlabel("time in step (s)")
    ax.set_ylabel("responses completed")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_link_utilisation(table: Mapping[str, Any], title: str, path: Path) -> None:
    """Mean utilisation per link class in each network phase, per fabric."""
    fabrics = list(table)
    bars: list[tuple[str, list[float]]] = []
    for phase in ("training", "weight-sync"):
        classes = sorted({c for f in fabrics for c in table[f]["link_utilisation"].get(phase, {})})
        for c in classes:
            bars.append(
                (
                    f"{phase}: {c}",
                    [table[f]["link_utilisation"].get(phase, {}).get(c, 0.0) for f in fabrics],
                )
            )
    fig, ax = plt.subplots(figsize=(10, 4))
    width = 0.8 / max(1, len(bars))
    for i, (label, values) in enumerate(bars):
        ax.bar([x + i * width for x in range(len(fabrics))], values, width, label=label)
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(fabrics))], fabrics)
    ax.set_ylabel("mean link utilisation")
    ax.set_title(title)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_perf_cost(network: Mapping[str, Mapping[str, Any]], path: Path) -> None:
    """Step time, cost and perf/cost of every fabric, normalised to the Fat-Tree."""
    sizes = list(network)
    fig, axes = plt.subplots(1, len(sizes), figsize=(6 * len(sizes), 4), squeeze=False)
    for ax, size in zip(axes[0], sizes, strict=True):
        table = network[size]
        fabrics = list(table)
        metrics = ("step_norm", "cost_norm", "perf_per_cost_norm")
        for i, m in enumerate(metrics):
            ax.bar(
                [x + i * 0.27 for x in range(len(fabrics))],
                [table[f][m] for f in fabrics],
                0.27,
                label=m.replace("_norm", "").replace("_", " "),
            )
        ax.axhline(1.0, color="black", lw=0.8)
        ax.set_xticks([x + 0.27 for x in range(len(fabrics))], fabrics, rotation=20, fontsize=8)
        ax.set_title(f"{size} GPUs (normalised to fat-tree)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_regimes(rows: Sequence[Mapping[str, Any]], path: Path) -> None:
    """Perf/cost (normalised to the fat-tree) per fabric for every cell of the regime
    map (workload, GPUs, placement), with and without host links."""
    cells = list(dict.fromkeys((r["workload"], r["gpus"], r["placement"]) for r in rows))
    fabrics = list(dict.fromkeys(r["fabric"] for r in rows))
    by = {(r["workload"], r["gpus"], r["placement"], r["fabric"]): r for r in rows}
    fig, axes = plt.subplots(2, 1, figsize=(max(8.0, 1.1 * len(cells)), 7), sharex=True)
    width = 0.8 / max(1, len(fabrics))
    for ax, key, title in (
        (axes[0], "perf_per_cost_norm", "perf/cost vs fat-tree"),
        (axes[1], "perf_per_cost_above_hosts_norm", "perf/cost vs fat-tree, no host links"),
    ):
        for i, f in enumerate(fabrics):
            ax.bar(
                [x + i * width for x in range(len(cells))],
                [(by[(*c, f)][key] if (*c, f) in by else None) or 0.0 for c in cells],
                width,
                label=f,
            )
        ax.axhline(1.0, color="black", lw=0.8)
        ax.set_ylabel(title)
        ax.legend(fontsize=7, ncol=len(fabrics))
    axes[1].set_xticks(
        [x + 0.4 - width / 2 for x in range(len(cells))],
        [f"{w}\n{g} {p}" for w, g, p in cells],
        rotation=30,
        fontsize=7,
        ha="right",
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_split_timeline(series: Mapping[str, Sequence[tuple[float, int]]], path: Path) -> None:
    """Trainer GPUs per weight version over time (asynchronous runs), one line per row."""
    fig, ax = plt.subplots(figsize=(8, 4))
    for label, points in series.items():
        if not points:
            continue
        ax.step([t for t, _ in points], [g for _, g in points], where="post", label=label)
    ax.set_xlabel("time (s)")
    ax.set_ylabel("trainer GPUs")
    ax.set_title("The split planner: trainer GPUs over time")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_version_lag(lags: Mapping[str, Mapping[str, Sequence[int]]], path: Path) -> None:
    """Share of trained trajectories per version lag, per row and mode."""
    rows = list(lags)
    fig, axes = plt.subplots(1, max(1, len(rows)), figsize=(3.2 * max(1, len(rows)), 3.4))
    if len(rows) <= 1:
        axes = [axes]
    for ax, row in zip(axes, rows, strict=False):
        modes = lags[row]
        width = 0.8 / max(1, len(modes))
        for i, (mode, values) in enumerate(modes.items()):
            if not values:
                continue
            top = max(values)
            xs = list(range(top + 1))
            share = [sum(1 for v in values if v == x) / len(values) for x in xs]
            ax.bar([x + i * width for x in xs], share, width=width, label=mode)
        ax.set_title(row, fontsize=8)
        ax.set_xlabel("version lag")
    axes[0].set_ylabel("share of trained trajectories")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
