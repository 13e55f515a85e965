#!/usr/bin/env python3
"""Simulation time of one network phase of ``orl-sim`` at 1024 and 2048 H800 GPUs.

For every fabric: build it (RFabric/static optics plan circuits), then simulate one
training phase (ring all-reduce of the Qwen2.5-72B gradients, bf16, over the training
half) and one weight-sync phase (the model from every training node to every generation
node, the schedule of ``scheduler.weight_sync``). Prints the simulated phase times next
to the floor (model bytes over one node's NICs) and the wall/CPU time the simulation
took. Baseline measured in the same run: the same fat-tree weight sync through the
keyed, pure-Python front end of the flow model (``flows.simulate`` with per-transfer
paths), i.e. what the vectorised fabric path saves.

    python bench/sim_network.py [--gpus 1024,2048] [--rounds 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

from sim_backends.clustersim.collectives import ring_allreduce, weight_sync_transfers
from sim_backends.clustersim.fabrics import (
    ClusterSpec,
    FabricKind,
    FabricOptions,
    Transfer,
    build_fabric,
)
from sim_backends.clustersim.flows import FlowTransfer, simulate

T = TypeVar("T")
MODEL_BYTES = 72.7e9 * 2  # Qwen2.5-72B, bf16


def timed(fn: Callable[[], T], rounds: int) -> tuple[float, float, T]:
    """Median wall and process-CPU seconds per call, and the first call's result (a
    rewiring RFabric rewires on the first call only)."""
    wall: list[float] = []
    cpu: list[float] = []
    out: T | None = None
    for _ in range(rounds):
        w0, c0 = time.perf_counter(), time.process_time()
        result = fn()
        if out is None:
            out = result
        wall.append(time.perf_counter() - w0)
        cpu.append(time.process_time() - c0)
    assert out is not None
    return statistics.median(wall), statistics.median(cpu), out


def keyed_fat_tree(cluster: ClusterSpec, transfers: list[Transfer]) -> float:
    """The fat-tree weight sync through the keyed API (the baseline)."""
    bps = cluster.node_bytes_per_s
    cap: dict[Any, float] = {}
    for x in range(cluster.nodes):
        cap[("up", x)] = bps
        cap[("down", x)] = bps
    for p in range(cluster.pods):
        size = min(cluster.nodes_per_pod, cluster.nodes - p * cluster.nodes_per_pod)
        cap[("tor-up", p)] = size * bps
        cap[("tor-down", p)] = size * bps
    flows = []
    for i, t in enumerate(transfers):
        a, b = cluster.pod_of(t.src), cluster.pod_of(t.dst)
        path: tuple[Any, ...] = (("up", t.src), ("down", t.dst))
        if a != b:
            path = (("up", t.src), ("tor-up", a), ("tor-down", b), ("down", t.dst))
        flows.append(FlowTransfer(i, t.nbytes, (path,)))
    return simulate(cap, flows).makespan


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--gpus", default="1024,2048")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    rows: list[dict[str, Any]] = []
    header = (
        f"{'GPUs':>5} {'fabric':<17} {'build ms':>9} {'train sim':>10} {'train ms':>9} "
        f"{'ws sim':>8} {'ws ms':>8} {'ws cpu ms':>9} {'flows':>6}  note"
    )
    print(header)
    print("-" * len(header))
    for gpus in (int(x) for x in args.gpus.split(",")):
        cluster = ClusterSpec(nodes=gpus // 8)
        half = cluster.nodes // 2
        train, gen = list(range(half)), list(range(half, cluster.nodes))
        ring = ring_allreduce(train, MODEL_BYTES)
        ws = weight_sync_transfers(train, gen, MODEL_BYTES, cluster)
        floor = MODEL_BYTES / cluster.node_bytes_per_s
        for kind in FabricKind:
            opts = FabricOptions()

            build = partial(build_fabric, kind, cluster, opts, train, gen, ring + ws)
            b_wall, _, fabric = timed(build, args.rounds)
            # the training phase first (RFabric then rewires for the weight sync)
            t_wall, _, tr = timed(partial(fabric.run_phase, "training", ring, 1.0), 1)
            ws_for = weight_sync_transfers(train, gen, MODEL_BYTES, cluster, fabric)
            sync = partial(fabric.run_phase, "weight-sync", ws_for, 1.0)
            w_wall, w_cpu, wr = timed(sync, args.rounds)
            note = wr.reason[:60]
            print(
                f"{gpus:>5} {kind.value:<17} {b_wall * 1e3:>9.1f} {tr.seconds:>9.3f}s "
                f"{t_wall * 1e3:>9.1f} {wr.seconds:>7.3f}s {w_wall * 1e3:>8.1f} "
                f"{w_cpu * 1e3:>9.1f} {len(ws_for):>6}  {note}"
            )
            rows.append(
                {
                    "gpus": gpus,
                    "fabric": kind.value,
                    "build_wall_s": b_wall,
                    "training_sim_s": tr.seconds,
                    "training_wall_s": t_wall,
                    "weight_sync_sim_s": wr.seconds,
                    "weight_sync_wall_s": w_wall,
                    "weight_sync_cpu_s": w_cpu,
                    "weight_sync_transfers": len(ws_for),
                    "weight_sync_floor_s": floor,
                    "reason": wr.reason,
                }
            )
        k_wall, k_cpu, k_sim = timed(partial(keyed_fat_tree, cluster, ws), args.rounds)
        print(
            f"{gpus:>5} {'baseline: keyed':<17} {'':>9} {'':>10} {'':>9} {k_sim:>7.3f}s "
            f"{k_wall * 1e3:>8.1f} {k_cpu * 1e3:>9.1f} {len(ws):>6}  "
            f"fat-tree via flows.simulate; floor {floor:.3f}s"
        )
        rows.append(
            {
                "gpus": gpus,
                "fabric": "baseline-keyed-fat-tree",
                "weight_sync_sim_s": k_sim,
                "weight_sync_wall_s": k_wall,
                "weight_sync_cpu_s": k_cpu,
                "weight_sync_transfers": len(ws),
                "weight_sync_floor_s": floor,
            }
        )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
