#!/usr/bin/env python3
"""Weight sync as a phase that moves bytes, over the network-namespace testbed (root only).

Builds the testbed from a wiring (`orl-testbed up`), then for N rounds: sets generation,
publishes a new checkpoint of --checkpoint-bytes on the first training node (as a trainer
does, into its agent's checkpoint_dir), and runs `SetPhase(weight-sync, checkpoint)`: the
controller commits the circuits, every generation agent fetches the checkpoint from the
training agent's data address (over --streams connections) and loads it into its
(simulated) engine. Measured per round: the fetch rate of all generation nodes at once
(their bytes over the slowest node's fetch time) against the capacity the circuits and
NICs give it (tbf rates: the source's NIC, and per generation pod the circuits from the
source's pod), and against a baseline measured in the same round on the same circuits:
the same bytes from the same node to every generation node as plain TCP (the testbed's
built-in sender, the same number of connections). Also the bytes counted out of the OCS
ports toward the generation pods, and the whole call's time (phase change, fetch, load).

    sudo .venv/bin/python bench/weight_sync.py [--rounds 3] [--scale 8000] [--json out.json]
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
from typing import Any

from orchestrrl import checkpoint, errors
from orchestrrl import wiring as wiring_mod
from orchestrrl.client import AsyncClient
from orchestrrl.model import Phase
from sim_backends.testbed import lifecycle, weights

DEFAULT_SCALE = 8000.0  # 400 Gb/s circuits -> 50 Mb/s; all fetches at once share 400 Mb/s


async def run(args: argparse.Namespace) -> dict[str, Any]:
    load_before = os.getloadavg()
    t = time.monotonic()
    state = await lifecycle.up(
        args.wiring, testbed_id=args.id, scale=args.scale, progress=lambda m: print(f"  {m}")
    )
    up_s = time.monotonic() - t
    plan = state.plan
    source = next(n.name for n in plan.nodes if n.role == "train")
    rounds: list[dict[str, Any]] = []
    try:
        async with AsyncClient(plan.controller, timeout_s=60) as client:
            for i in range(args.rounds):
                await client.set_phase(Phase.GENERATION)
                version = f"r{i + 1}"
                path = await asyncio.to_thread(
                    weights.publish, plan, source, version, args.checkpoint_bytes, i + 1
                )
                size = checkpoint.verify(path).manifest.size
                t = time.monotonic()
                r = await weights.checkpoint_sync(
                    plan, version, source, streams=args.streams, timeout_s=300
                )
                call_s = time.monotonic() - t
                if not r.complete:
                    ws = r.change.weight_sync
                    raise errors.FailedPrecondition(
                        f"round {i + 1}: {ws.message if ws else 'no weight-sync report'}"
                    )
                raw_s, raw_mbps = await weights.raw_tcp_baseline(
                    plan, source, size, args.streams, timeout_s=300
                )
                row = {
                    "round": i + 1,
                    "checkpoint_bytes": size,
                    "generation_nodes": len(r.nodes),
                    "fetched_bytes": r.fetched_bytes,
                    "fetch_s": round(r.fetch_seconds, 3),
                    "mbps": round(r.mbps, 1),
                    "capacity_mbps": round(r.capacity_mbps, 1),
                    "share_of_capacity": round(r.efficiency, 3),
                    "raw_tcp_s": round(raw_s, 3),
                    "raw_tcp_mbps": round(raw_mbps, 1),
                    "ratio_to_raw_tcp": round(r.mbps / raw_mbps, 3) if raw_mbps else 0.0,
                    "circuit_bytes": r.circuit_bytes,
                    "call_s": round(call_s, 3),
                    "controller_sync_s": round(r.seconds, 3),
                    "nodes": [
                        {
                            "node": n.node,
                            "bytes": n.nbytes,
                            "fetch_s": round(n.seconds, 3),
                            "mbps": round(n.mbps, 1),
                            "capacity_mbps": round(n.capacity_mbps, 1),
                            "circuits": n.circuits,
                            "streams": n.streams,
                        }
                        for n in r.nodes
                    ],
                }
                rounds.append(row)
                print(
                    f"round {i + 1}: {len(r.nodes)} x {size / 1e6:.1f} MB in "
                    f"{r.fetch_seconds:.2f} s "
                    f"= {r.mbps:.1f} Mb/s of {r.capacity_mbps:g} Mb/s capacity "
                    f"({r.efficiency:.0%}); raw TCP {raw_mbps:.1f} Mb/s "
                    f"(weight sync {row['ratio_to_raw_tcp']:.2f}x of it); "
                    f"{r.circuit_bytes / 1e6:.1f} MB out of the circuits; call {call_s:.2f} s",
                    flush=True,
                )
    finally:
        await lifecycle.down(plan.id)

    def median(key: str) -> float:
        return round(statistics.median(float(r[key]) for r in rounds), 3)

    return {
        "wiring": str(args.wiring),
        "scale": plan.scale.describe(plan.uplink_gbps),
        "circuit_mbps": plan.scale.mbps(plan.uplink_gbps),
        "streams": args.streams,
        "up_s": round(up_s, 2),
        "rounds": rounds,
        "median_mbps": median("mbps"),
        "median_capacity_mbps": median("capacity_mbps"),
        "median_share_of_capacity": median("share_of_capacity"),
        "median_raw_tcp_mbps": median("raw_tcp_mbps"),
        "median_ratio_to_raw_tcp": median("ratio_to_raw_tcp"),
        "median_call_s": median("call_s"),
        "load_average_before": [round(x, 2) for x in load_before],
        "cpus": os.cpu_count(),
    }


def table(results: dict[str, Any]) -> str:
    head = (
        f"{'round':>5} {'nodes':>5} {'MB each':>8} {'fetch s':>8} {'Mb/s':>7} {'capacity':>8} "
        f"{'share':>6} {'raw TCP':>8} {'ratio':>6} {'circuit MB':>10} {'call s':>7}"
    )
    lines = [
        f"weight sync over the testbed ({results['scale']}, {results['streams']} connection(s) "
        "per node)",
        head,
    ]
    for r in results["rounds"]:
        lines.append(
            f"{r['round']:>5} {r['generation_nodes']:>5} {r['checkpoint_bytes'] / 1e6:>8.1f} "
            f"{r['fetch_s']:>8.2f} {r['mbps']:>7.1f} {r['capacity_mbps']:>8.1f} "
            f"{r['share_of_capacity']:>6.0%} {r['raw_tcp_mbps']:>8.1f} "
            f"{r['ratio_to_raw_tcp']:>6.2f} {r['circuit_bytes'] / 1e6:>10.1f} {r['call_s']:>7.2f}"
        )
    last = results["rounds"][-1]
    lines.append("last round per node:")
    for n in last["nodes"]:
        lines.append(
            f"  {n['node']:<10} {n['mbps']:>7.1f} Mb/s of {n['capacity_mbps']:g} alone "
            f"({n['circuits']} circuits, {n['streams']} connections)"
        )
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--wiring", type=Path, default=wiring_mod.default_wiring_path())
    p.add_argument("--id", default="benchws", help="testbed id (default %(default)s)")
    p.add_argument("--scale", type=float, default=DEFAULT_SCALE)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--streams", type=int, default=4, help="connections per node")
    p.add_argument(
        "--checkpoint-bytes",
        type=int,
        default=20_000_000,
        help="checkpoint size (default %(default)s)",
    )
    p.add_argument("--json", type=Path, help="also write the figures as JSON here")
    args = p.parse_args()
    if os.geteuid() != 0:
        print("bench/weight_sync.py needs root (network namespaces)", file=sys.stderr)
        return 2
    try:
        results = asyncio.run(run(args))
    except errors.OrlError as exc:
        print(f"bench/weight_sync.py: {exc}", file=sys.stderr)
        return 1
    print(table(results))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
