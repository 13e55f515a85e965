"""The regime map: when does a fabric change the step, and does RFabric pay off?

For every workload of :data:`WORKLOADS` (dense Qwen2.5-72B under Megatron and under FSDP,
Qwen3-235B-A22B with expert parallelism), cluster size (1024 and 2048 H800), placement
of the pools over the pods (contiguous, scattered) and fabric, one RL step's training
(:mod:`.parallel`), weight sync and, for the MoE workload, generation, timed on the
fabric with the closed form ``Fabric.transfer_seconds(method="bottleneck")`` (max over
links of bytes / capacity; tests hold it to the flow simulation on the collectives used
here). Every fabric gets
the same collective algorithms (ring, tree, hierarchical); each run keeps the one with
the shortest step and reports it. The optical fabrics are built per algorithm: the
TopoOpt-like one fixes its circuits for that algorithm's whole-job demand (one step's
training collectives weighted by how often they run, plus the weight sync and, MoE, the
generation all-to-all), RFabric starts from the same circuits and re-plans per phase
behind the slack gate.

Dense workloads: step = training of one RL step's batch + weight sync: the pipeline when
training bounds it (generation no longer than training, so generation hides entirely and
the sync gets no idle window: RFabric rewires for it only on the critical path, charged).
When generation is longer, the step is ``generation + sync`` and only the sync depends on
the fabric, so for them this map is the most a fabric can change.

MoE workload (``Workload.gen_gpus`` > 0): generation is timed too, because its expert
parallelism puts traffic on the fabric, and the step is the pipeline's
``max(generation, training) + sync``. The generation pool (the other half of the GPUs)
runs instances of :data:`GEN_EP_GPUS` GPUs (:func:`gen_instances`: consecutive nodes for
``contiguous``, nodes dealt over the pods for ``scattered``); the step's requests
(:func:`gen_schedule`, the network experiment's weak-scaled step 1) are dealt
round-robin and continuously batched; each decode iteration is
``PerfModel.moe_decode_breakdown`` (experts touched by the batch, KV reads, NVLink
all-reduces, and per layer the dispatch + combine over the network, not overlapped), at
the bandwidth per GPU the fabric gives all instances' all-to-all at once
(:func:`_gen_bandwidth`, the closed form as for training); that network time is the
generation side's exposed communication. The generation all-to-all is timed alone (not
contending with training's collectives, which run at the same time: optimistic for a
shared core) and joins the optical fabrics' demand: the TopoOpt-like circuits are
allocated for it too, and RFabric plans one set of circuits for training and generation
together (they run together). The sync gets no idle window (the all-to-all runs until
generation ends). The training pool is half of the
GPUs (:data:`TRAIN_SHARE`); batch: the network experiment's (weak scaling from 64 GPUs,
step 1 of the seeded workload). Overlap of communication with compute:
:data:`OVERLAP` of the compute time, for every fabric.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from orchestrrl import errors
from scheduler.perf_model import PerfModel, default_model
from sim_backends.clustersim.collectives import ALGORITHMS, all_to_all, weight_sync_transfers
from sim_backends.clustersim.fabrics import (
    ClusterSpec,
    Fabric,
    FabricKind,
    FabricOptions,
    Transfer,
    build_fabric,
)
from sim_backends.clustersim.models import a2a_bytes_per_token_layer, shape
from sim_backends.clustersim.parallel import Parallelism, time_training, training_traffic
from sim_backends.clustersim.pipeline import scattered_pools
from sim_backends.clustersim.scenario import FABRIC_KINDS, WorkloadConfig
from sim_backends.clustersim.workload import RolloutRequest, step_workload

TRAIN_SHARE = 0.5
OVERLAP = 0.5
EP_GPUS = 64  # 8 nodes: 2 of Qwen3-235B-A22B's 128 experts per GPU
# a MoE generation instance: 4 nodes, experts over its 32 GPUs (4 per GPU), attention
# tensor-parallel per node and data-parallel across its nodes (an assumption: SGLang's
# DP-attention + EP deployments of large MoE models span several nodes; 470 GB of BF16
# weights fill most of one 8 x 80 GB node, leaving little KV cache)
GEN_EP_GPUS = 32
PREFILL_CHUNK = 8192  # as the generation simulator (vLLM's max_num_batched_tokens)
PLACEMENTS = ("contiguous", "scattered")


@dataclass(frozen=True)
class Workload:
    """A row group of the map; ``gen_gpus`` > 0: generation is timed too, on instances
    of that many GPUs (MoE expert parallelism), and the step is the pipeline's
    ``max(generation, training) + sync``; 0: training + sync (see the module doc)."""

    label: str
    model: str
    layout: Parallelism
    gen_gpus: int = 0


WORKLOADS = (
    Workload("dense 72B Megatron", "Qwen2.5-72B", Parallelism("megatron", tp=8, overlap=OVERLAP)),
    Workload("dense 72B FSDP", "Qwen2.5-72B", Parallelism("fsdp", overlap=OVERLAP)),
    Workload(
        "MoE 235B EP",
        "Qwen3-235B-A22B",
        Parallelism("ep", ep=EP_GPUS, overlap=OVERLAP),
        gen_gpus=GEN_EP_GPUS,
    ),
)

# one instance's continuous batching: (batch, iterations, mean context at the first) per
# segment between completions, and the prompt tokens it prefills
Segments = tuple[tuple[int, int, float], ...]


@dataclass(frozen=True)
class GenSchedule:
    """The generation of one step on instances of ``gpus`` GPUs: each instance's
    requests (dealt round-robin, as verl splits a batch), admitted first come first
    served up to ``cap`` running sequences; a finished one's slot goes to the next. The
    schedule depends on the lengths only, so it is computed once and timed per fabric."""

    gpus: int
    cap: int
    segments: tuple[Segments, ...]  # per instance
    prompt_tokens: tuple[int, ...]  # per instance
    tokens: int  # prompt + response tokens of the step

    @property
    def instances(self) -> int:
        return len(self.segments)


def gen_schedule(
    requests: Sequence[RolloutRequest], instances: int, gpus: int, cap: int
) -> GenSchedule:
    """:class:`GenSchedule` of ``requests`` over ``instances`` instances."""
    if instances < 1 or cap < 1:
        raise errors.field_error("instances/cap", (instances, cap), "integers >= 1")
    segs: list[Segments] = []
    prompts: list[int] = []
    for i in range(instances):
        mine = list(requests[i::instances])
        prompts.append(sum(r.prompt_tokens for r in mine))
        out: list[tuple[int, int, float]] = []
        queue = iter(mine)
        # running: (remaining tokens, context now)
        running: list[list[int]] = []
        for r in queue:
            running.append([r.response_tokens, r.prompt_tokens])
            if len(running) >= cap:
                break
        while running:
            step = min(x[0] for x in running)
            out.append((len(running), step, sum(x[1] for x in running) / len(running)))
            for x in running:
                x[0] -= step
                x[1] += step
            running = [x for x in running if x[0] > 0]
            for r in queue:
                running.append([r.response_tokens, r.prompt_tokens])
                if len(running) >= cap:
                    break
        segs.append(tuple(out))
    tokens = sum(r.prompt_tokens + r.response_tokens for r in requests)
    return GenSchedule(gpus, cap, tuple(segs), tuple(prompts), tokens)


@dataclass(frozen=True)
class GenTime:
    seconds: float  # the slowest instance: the step's generation
    network_s: float  # of which expert dispatch/combine over the network (not overlapped)


def time_generation(
    perf: PerfModel, sched: GenSchedule, network_bandwidth: float | None = None
) -> GenTime:
    """Prefill (chunks of :data:`PREFILL_CHUNK`) then decode of every instance with
    :meth:`PerfModel.moe_decode_breakdown`, each segment by the trapezoid rule over its
    iterations (the compute and memory terms are affine in the context, as in the
    generation simulator); ``network_bandwidth``: what the fabric gives each GPU."""
    n = sched.gpus
    lines: dict[int, tuple[float, float, float, float, float, float, float]] = {}

    def line(b: int) -> tuple[float, float, float, float, float, float, float]:
        if b not in lines:
            b0 = perf.moe_decode_breakdown(n, b, 0.0, network_bandwidth)
            b1 = perf.moe_decode_breakdown(n, b, 1.0, network_bandwidth)
            fixed = b0.kernels_s + b0.allreduce_s + b0.network_a2a_s
            lines[b] = (
                b0.compute_s,
                b1.compute_s - b0.compute_s,
                b0.memory_s,
                b1.memory_s - b0.memory_s,
                fixed,
                b0.host_s,
                b0.overhead_s,
            )
        return lines[b]

    def at(b: int, ctx: float) -> float:
        c0, dc, m0, dm, fixed, host, over = line(b)
        return max(max(c0 + dc * ctx, m0 + dm * ctx) + fixed, host) + over

    def prefill(tokens: int) -> float:
        full, rest = divmod(tokens, PREFILL_CHUNK)
        t = full * perf.moe_prefill_time(n, PREFILL_CHUNK, 0, network_bandwidth)
        return t + perf.moe_prefill_time(n, rest, 0, network_bandwidth)

    layers = perf.model.layers
    worst = GenTime(0.0, 0.0)
    for segs, prompt in zip(sched.segments, sched.prompt_tokens, strict=True):
        t = prefill(prompt)
        net = (
            layers
            * perf.moe_a2a_time(n, PREFILL_CHUNK, network_bandwidth)
            * (prompt / PREFILL_CHUNK)
        )
        for b, its, ctx in segs:
            t += its * (at(b, ctx) + at(b, ctx + its - 1)) / 2.0
            net += its * layers * perf.moe_a2a_time(n, b, network_bandwidth)
        if t > worst.seconds:
            worst = GenTime(t, net)
    return worst


def gen_instances(
    gen: Sequence[int], nodes_per_instance: int, placement: str = "contiguous"
) -> list[list[int]]:
    """The generation instances' nodes: ``contiguous``, consecutive groups of the pool's
    nodes in rank order (an instance stays inside a pod whenever the pod can hold it);
    ``scattered``, instance ``i`` of ``I`` takes ranks ``i, i + I, i + 2I, ...`` (a shared
    cluster's scheduler gives an engine whatever nodes are free, so its nodes land in
    different pods). A remainder too small for an instance stays idle."""
    if placement not in PLACEMENTS:
        raise errors.field_error("placement", placement, "one of " + ", ".join(PLACEMENTS))
    k = nodes_per_instance
    count = len(gen) // k
    if placement == "scattered":
        return [list(gen[i : count * k : count]) for i in range(count)]
    return [list(gen[i * k : (i + 1) * k]) for i in range(count)]


@functools.lru_cache(maxsize=8)
def _gen_schedule(
    nodes: int, gen_gpus: int, workload: WorkloadConfig, seed: int, model: str
) -> GenSchedule:
    """The MoE generation schedule of the map's step 1 at ``nodes`` nodes (cached: the
    same for every placement and fabric)."""
    perf = default_model(model, "H800-SXM")
    g = perf.hardware.gpus_per_node
    gen_nodes = nodes - max(1, round(nodes * TRAIN_SHARE))
    per = max(1, gen_gpus // g)
    instances = max(1, gen_nodes // per)
    wl = replace(workload, prompts_per_step=max(1, round(workload.prompts_per_step * nodes / 8)))
    reqs = step_workload(wl, seed, 1).requests
    mean_ctx = sum(r.prompt_tokens + r.response_tokens for r in reqs) / len(reqs)
    engine_cap = perf.max_num_seqs(gen_gpus) * per  # one engine cap per attention DP node
    cap = max(1, min(engine_cap, int(perf.kv_capacity_tokens(gen_gpus) / mean_ctx)))
    return gen_schedule(reqs, instances, gen_gpus, cap)


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
    workload: WorkloadConfig | None = None,
    seed: int = 1,
) -> dict[str, Any]:
    """One cell of the map (means nothing is averaged: one representative step);
    ``workload`` and ``seed`` give a MoE workload's generation requests."""
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
    sched: GenSchedule | None = None
    gen_demand: list[Transfer] = []
    groups: list[list[int]] = []
    gen_perf = perf
    if w.gen_gpus:
        gen_perf = default_model(w.model, perf.hardware.name)
        wl = workload if workload is not None else WorkloadConfig()
        sched = _gen_schedule(nodes, w.gen_gpus, wl, seed, w.model)
        per = max(1, w.gen_gpus // cluster.gpus_per_node)
        groups = gen_instances(gen, per, placement)[: sched.instances]
        # the step's dispatch + combine bytes per node (every layer, every token)
        per_node = (
            sched.tokens / max(1, len(groups) * per) * sh.layers * a2a_bytes_per_token_layer(sh)
        )
        gen_demand = list(all_to_all(groups, per_node, "ep generation all-to-all").transfers)
    best: dict[str, Any] | None = None
    for algo in ALGORITHMS:
        sync = weight_sync_transfers(train, gen, sh.weight_bytes, cluster)
        fabric = build_fabric(
            FabricKind(kind),
            cluster,
            FabricOptions(),
            train,
            gen,
            [*traffic.demand(algo), *gen_demand, *sync],
        )
        if kind == "fat-tree-oversub":
            sync = weight_sync_transfers(train, gen, sh.weight_bytes, cluster, fabric)
        # generation runs while training does: RFabric plans one set of circuits for both
        rc_train, _, _ = fabric.prepare_phase(
            "training", [*traffic.demand(algo), *gen_demand], traffic.update_compute_s
        )
        timing = time_training(
            traffic,
            lambda ts, f=fabric: f.transfer_seconds(ts, "bottleneck"),  # type: ignore[misc]
            algorithm=algo,
            overlap=w.layout.overlap,
            latency_s=perf.efficiency.network_latency_s,
        )
        gen_s = gen_net_s = 0.0
        gen_bw = None
        if sched is not None:
            gen_bw = _gen_bandwidth(fabric, groups, gen_perf, cluster.node_bytes_per_s)
            gt = time_generation(gen_perf, sched, gen_bw)
            gen_s, gen_net_s = gt.seconds, gt.network_s
        rc_sync, rewired, _ = fabric.prepare_phase("weight-sync", sync, 0.0)
        sync_s = fabric.transfer_seconds(sync, "bottleneck") + rc_sync
        train_side = timing.train_s + rc_train
        gen_bound = sched is not None and gen_s > train_side
        step = max(gen_s, train_side) + sync_s
        exposed = gen_net_s if gen_bound else timing.exposed_s + rc_train
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
                "exposed_s": exposed,
                "sync_s": sync_s,
                "exposed_share": (exposed + sync_s) / step,
                "train_s": train_side,
                # generation (MoE workloads only): the slowest instance, its expert
                # dispatch/combine over the network, the bandwidth per GPU the fabric gave
                # that all-to-all, and whether generation bounds the step
                "gen_s": gen_s if sched is not None else None,
                "gen_net_s": gen_net_s if sched is not None else None,
                "gen_gbps_per_gpu": gen_bw * 8 / 1e9 if gen_bw is not None else None,
                "gen_instances": sched.instances if sched is not None else 0,
                "gen_ep_gpus": w.gen_gpus,
                "bound": "generation" if gen_bound else "training",
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


def _gen_bandwidth(
    fabric: Fabric, groups: Sequence[Sequence[int]], perf: PerfModel, node_bps: float
) -> float | None:
    """Bandwidth per GPU the fabric gives the generation instances' all-to-all, all
    instances at once: the NIC rate divided by the fabric's slowdown of the pattern
    against the NICs alone (its bottleneck time over ``(k-1)/k x bytes / node rate``;
    bottleneck times scale with the bytes, so one unit measures it). None when no
    instance spans nodes."""
    unit = 1e9
    ts = all_to_all(groups, unit).transfers
    if not ts:
        return None
    k = max(len(x) for x in groups)
    ideal = (k - 1) / k * unit / node_bps
    slowdown = max(1.0, fabric.transfer_seconds(ts, "bottleneck") / ideal)
    return perf.hardware.nic_bandwidth / slowdown


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
                    rows = [
                        run_one(w, nodes, placement, k, tokens, perf, workload, seed)
                        for k in FABRIC_KINDS
                    ]
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
