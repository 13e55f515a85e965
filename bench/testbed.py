#!/usr/bin/env python3
"""The network-namespace testbed: how long it takes to build and remove, how fast a
phase change reaches the data plane, and what the circuits deliver (root only).

Builds the testbed from a wiring (`orl-testbed up`), then for N rounds: sets
training and measures a train->gen stream (no circuit: it must fail), sets
weight-sync and measures the same stream against one circuit's capacity and the
planner's weight-sync schedule against its ideal (bytes / bottleneck capacity),
and finally removes the testbed (`orl-testbed down`). Every figure is measured in
this run; the machine's other load is printed with them.

    sudo .venv/bin/python bench/testbed.py [--rounds 3] [--scale 4000] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path

from orchestrrl import errors
from orchestrrl import wiring as wiring_mod
from orchestrrl.client import AsyncClient
from orchestrrl.model import Phase
from sim_backends.testbed import lifecycle, traffic
from sim_backends.testbed.plan import DEFAULT_SCALE, TestbedPlan

PROBE_BYTES = 25_000_000


async def probe(plan: TestbedPlan, source: str, target: str) -> traffic.Result:
    circuits = await traffic.committed_circuits(plan)
    report = await traffic.run_transfers(
        plan, [traffic.Transfer(source, target, PROBE_BYTES)], circuits=circuits, timeout_s=60
    )
    return report.results[0]


async def run(args: argparse.Namespace) -> dict[str, object]:
    load_before = os.getloadavg()
    t = time.monotonic()
    state = await lifecycle.up(
        args.wiring, testbed_id=args.id, scale=args.scale, progress=lambda m: print(f"  {m}")
    )
    up_s = time.monotonic() - t
    plan = state.plan
    circuit_mbps = plan.scale.mbps(plan.uplink_gbps)
    train = next(n for n in plan.nodes if n.role == "train")
    gen = next(n for n in plan.nodes if n.role == "gen")
    before: list[float] = []
    after: list[float] = []
    switch_s: list[float] = []
    ws_ratio: list[float] = []
    ws_s: list[float] = []
    ideal_s = 0.0
    try:
        async with AsyncClient(plan.controller, timeout_s=60) as client:
            for i in range(args.rounds):
                await client.set_phase(Phase.TRAINING)
                r = await probe(plan, train.name, gen.name)
                before.append(r.mbps)
                t = time.monotonic()
                await client.set_phase(Phase.WEIGHT_SYNC)
                switch_s.append(time.monotonic() - t)
                r = await probe(plan, train.name, gen.name)
                if not r.ok:
                    raise errors.FailedPrecondition(f"no path after weight-sync: {r.error}")
                after.append(r.mbps)
                ws = await traffic.weight_sync(plan, args.model_bytes, timeout_s=120)
                ws_s.append(ws.completion_s)
                ws_ratio.append(ws.efficiency)
                ideal_s = ws.ideal_s
                print(
                    f"round {i + 1}: training {before[-1]:.1f} Mb/s -> weight-sync "
                    f"{after[-1]:.1f} Mb/s of {circuit_mbps:g} ({after[-1] / circuit_mbps:.0%}); "
                    f"weight sync {ws.completion_s:.2f} s, ideal {ws.ideal_s:.2f} s "
                    f"({ws.efficiency:.0%}); phase change {switch_s[-1] * 1000:.0f} ms",
                    flush=True,
                )
    finally:
        t = time.monotonic()
        await lifecycle.down(plan.id)
        down_s = time.monotonic() - t
    return {
        "wiring": str(args.wiring),
        "scale": plan.scale.describe(plan.uplink_gbps),
        "up_s": round(up_s, 2),
        "down_s": round(down_s, 2),
        "circuit_mbps": circuit_mbps,
        "train_to_gen_mbps_training": [round(x, 1) for x in before],
        "train_to_gen_mbps_weight_sync": [round(x, 1) for x in after],
        "train_to_gen_share_of_circuit": round(statistics.median(after) / circuit_mbps, 3),
        "phase_change_to_weight_sync_ms_median": round(statistics.median(switch_s) * 1000, 1),
        "weight_sync_model_bytes": args.model_bytes,
        "weight_sync_s": [round(x, 2) for x in ws_s],
        "weight_sync_ideal_s": round(ideal_s, 3),
        "weight_sync_share_of_ideal_median": round(statistics.median(ws_ratio), 3),
        "load_average_before": [round(x, 2) for x in load_before],
        "cpus": os.cpu_count(),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--wiring", type=Path, default=wiring_mod.default_wiring_path())
    p.add_argument("--id", default="bench", help="testbed id (default %(default)s)")
    p.add_argument("--scale", type=float, default=DEFAULT_SCALE)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument(
        "--model-bytes",
        type=int,
        default=200_000_000,
        help="weight-sync size (default %(default)s: 4 s ideal on the example at 1:4000)",
    )
    p.add_argument("--json", type=Path, help="also write the figures as JSON here")
    args = p.parse_args()
    try:
        results = asyncio.run(run(args))
    except errors.OrlError as exc:
        print(f"bench/testbed.py: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(results, indent=2))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
