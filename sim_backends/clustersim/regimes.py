"""The regime map: when does a fabric change the step, and does RFabric pay off?

For every workload of :data:`WORKLOADS` (dense Qwen2.5-72B under Megatron and under FSDP,
Qwen3-235B-A22B with expert parallelism), cluster size (1024 and 2048 H800), placement
of the pools over the pods (contiguous, scattered) and fabric, one RL step's training
(:mod:`.parallel`) and weight sync, timed on the fabric with the closed form
``Fabric.transfer_seconds(method="bottleneck")`` (max over links of bytes / capacity;
tests hold it to the flow simulation on the collectives used here). Every fabric gets
the same collective algorithms (ring, tree, hierarchical); each run keeps the one with
the shortest step and reports it. The optical fabrics are built per algorithm: the
TopoOpt-like one fixes its circuits for that algorithm's whole-job demand (one step's
training collectives weighted by how often they run, plus the weight sync), RFabric
starts from the same circuits and re-plans per phase behind the slack gate.

Step = training of one RL step's batch + weight sync: the pipeline when training bounds
it (generation no longer than training, so generation hides entirely and the sync gets
no idle window: RFabric rewires for it only on the critical path, charged). When
generation is longer, the step is ``generation + sync`` and only the sync depends on the
fabric, so this map is the most a fabric can change. The training pool is half of the
GPUs (:data:`TRAIN_SHARE`); batch: the network experiment's (weak scaling from 64 GPUs,
step 1 of the seeded workload). Overlap of communication with compute:
:data:`OVERLAP` of the compute time, for every fabric.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from scheduler.perf_model import PerfModel, default_model
from sim_backends.clustersim.collectives import ALGORITHMS, weight_sync_transfers
from sim_backends.clustersim.fabrics import (
    ClusterSpec,
    FabricKind,
    FabricOptions,
    build_fabric,
)
from sim_backends.clustersim.models import shape
from sim_backends.clustersim.parallel import Parallelism, time_training, training_traffic
from sim_backends.clustersim.pipeline import scattered_pools
from sim_backends.clustersim.scenario import FABRIC_KINDS, WorkloadConfig
from sim_backends.clustersim.workload import step_workload

TRAIN_SHARE = 0.5
OVERLAP = 0.5
EP_GPUS = 64  # 8 nodes: 2 of Qwen3-235B-A22B's 128 experts per GPU
PLACEMENTS = ("contiguous", "scattered")


@dataclass(frozen=True)
class Workload:
    label: str
    model: str
    layout: Parallelism


WORKLOADS = (
    Workload("dense 72B Megatron", "Qwen2.5-72B", Parallelism("megatron", tp=8, overlap=OVERLAP)),
    Workload("dense 72B FSDP", "Qwen2.5-72B", Parallelism("fsdp", overlap=OVERLAP)),
    Workload("MoE 235B EP", "Qwen3-235B-A22B", Parallelism("ep", ep=EP_GPUS, overlap=OVERLAP)),
)


def batch_tokens(gpus: int, workload: WorkloadConfig, seed: int) -> int:
    """Tokens of step 1 of the network experiment's weak-scaled batch at ``gpus``."""
    wl = replace(workload, prompts_per_step=max(1, round(workload.prompts_per_step * gpus / 64)))
    return step_workload(wl, seed, 1).total_tokens


def run_one(
    w: Workload,
    nodes: int,
    placement: str,
    kind: str,
    tokens: int,
    perf: PerfModel,
) -> dict[str, Any]:
    """One cell of the map (means nothing is averaged: one representative step)."""
    cluster = ClusterSpec(nodes)
    train_n = max(1, round(nodes * TRAIN_SHARE))
    if placement == "contiguous":
        train, gen = tuple(range(train_n)), tuple(range(train_n, nodes))
    else:
        train, gen = scattered_pools(train_n, nodes - train_n, cluster.nodes_per_pod)
    sh = shape(w.model)
    traffic = training_traffic(
        sh,
        w.layout,
        train,
        cluster.gpus_per_node,
        cluster.pod_of,
        tokens=tokens,
        mini_batches=4,
        flops_per_gpu=perf.hardware.peak_flops * perf.efficiency.training_mfu,
    )
    best: dict[str, Any] | None = None
    for algo in ALGORITHMS:
        sync = weight_sync_transfers(train, gen, sh.weight_bytes, cluster)
        fabric = build_fabric(
            FabricKind(kind), cluster, FabricOptions(), train, gen, [*traffic.demand(algo), *sync]
        )
        if kind == "fat-tree-oversub":
            sync = weight_sync_transfers(train, gen, sh.weight_bytes, cluster, fabric)
        rc_train, _, _ = fabric.prepare_phase(
            "training", traffic.demand(algo), traffic.update_compute_s
        )
        timing = time_training(
            traffic,
            lambda ts, f=fabric: f.transfer_seconds(ts, "bottleneck"),  # type: ignore[misc]
            algorithm=algo,
            overlap=w.layout.overlap,
            latency_s=perf.efficiency.network_latency_s,
        )
        rc_sync, rewired, _ = fabric.prepare_phase("weight-sync", sync, 0.0)
        sync_s = fabric.transfer_seconds(sync, "bottleneck") + rc_sync
        step = timing.train_s + rc_train + sync_s
        if best is None or step < best["step_s"] - 1e-12:
            cost = fabric.cost()
            best = {
                "workload": w.label,
                "gpus": nodes * 8,
                "placement": placement,
                "fabric": kind,
                "algorithm": algo,
                "algorithms": dict(timing.choices),
                "step_s": step,
                "compute_s": timing.compute_s,
                "comm_s": timing.comm_s,
                "exposed_s": timing.exposed_s + rc_train,
                "sync_s": sync_s,
                "exposed_share": (timing.exposed_s + rc_train + sync_s) / step,
                "pattern_s": dict(timing.pattern_s),
                "cost_usd": cost.total,
                "cost_above_hosts_usd": cost.above_hosts().total,
                "perf_per_cost": 1.0 / step / (cost.total / 1e6),
                # None: nothing above the hosts to pay for (one tier, or one pod)
                "perf_per_cost_above_hosts": _ratio(1.0 / step, cost.above_hosts().total / 1e6),
                "sync_rewired": rewired,
            }
    assert best is not None
    return best


def cells(
    sizes: Sequence[int], workload: WorkloadConfig, seed: int
) -> list[tuple[str, Callable[[], list[dict[str, Any]]]]]:
    """The map as labelled tasks, one per (workload, size, placement), each returning
    its rows (one per fabric) with perf/cost normalised to the non-blocking fat-tree."""
    perf = default_model("Qwen2.5-72B", "H800-SXM")
    out: list[tuple[str, Callable[[], list[dict[str, Any]]]]] = []
    for nodes in sizes:
        tokens = batch_tokens(nodes * 8, workload, seed)
        for w in WORKLOADS:
            for placement in PLACEMENTS:

                def one(
                    w: Workload = w,
                    nodes: int = nodes,
                    placement: str = placement,
                    tokens: int = tokens,
                ) -> list[dict[str, Any]]:
                    rows = [run_one(w, nodes, placement, k, tokens, perf) for k in FABRIC_KINDS]
                    ref = rows[0]
                    for r in rows:
                        r["tokens"] = tokens
                        r["step_norm"] = r["step_s"] / ref["step_s"]
                        r["perf_per_cost_norm"] = r["perf_per_cost"] / ref["perf_per_cost"]
                        r["perf_per_cost_above_hosts_norm"] = _ratio(
                            r["perf_per_cost_above_hosts"], ref["perf_per_cost_above_hosts"]
                        )
                    return rows

                out.append((f"regime map: {w.label}, {nodes * 8} GPUs, {placement}", one))
    return out


def verdicts(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (workload, size, placement): RFabric's perf/cost against the best static
    fabric's (with and without host links) and against the fat-tree."""
    groups: dict[tuple[str, int, str], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["workload"], r["gpus"], r["placement"]), []).append(r)
    out = []
    for (wl, gpus, placement), rs in groups.items():
        rf = next((r for r in rs if r["fabric"] == "rfabric"), None)
        static = [r for r in rs if r["fabric"] != "rfabric"]
        if rf is None or not static:
            continue
        best = max(static, key=lambda r: r["perf_per_cost"])
        priced = [r for r in static if r["perf_per_cost_above_hosts"] is not None]
        best_ah = max(priced, key=lambda r: r["perf_per_cost_above_hosts"]) if priced else None
        out.append(
            {
                "workload": wl,
                "gpus": gpus,
                "placement": placement,
                "best_static": best["fabric"],
                "rfabric_vs_best": rf["perf_per_cost"] / best["perf_per_cost"],
                "best_static_above_hosts": best_ah["fabric"] if best_ah else None,
                "rfabric_vs_best_above_hosts": _ratio(
                    rf["perf_per_cost_above_hosts"],
                    best_ah["perf_per_cost_above_hosts"] if best_ah else None,
                ),
                "rfabric_vs_fat_tree": rf["perf_per_cost_norm"],
                "rfabric_exposed_share": rf["exposed_share"],
                "fat_tree_exposed_share": next(
                    r["exposed_share"] for r in rs if r["fabric"] == "fat-tree"
                ),
            }
        )
    return out


def _ratio(a: float | None, b: float | None) -> float | None:
    """``a / b``, or None when either is missing or ``b`` is 0."""
    return None if a is None or b is None or b == 0 else a / b
