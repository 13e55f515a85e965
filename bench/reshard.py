#!/usr/bin/env python3
"""Reshard throughput of the node agent's worker pool against a plain in-memory copy.

Starts a WorkerPool (one process per GPU rank, torch.distributed: gloo on CPU, NCCL with
CUDA) holding a synthetic Llama-shaped model, walks the layouts TP 8 -> 4 -> 2 -> 1 and
back once to warm up (a long-running agent's steady state: the workers reuse freed shard
memory, as the CUDA caching allocator does on GPUs; the warm-up walk is printed too), then
walks ``--rounds`` more times. For every
step that moves bytes it compares

- reshard: bytes moved over torch.distributed / the move-weights time (staging: local
  copies, every send and receive, until the last worker is done; the checksum
  verification and the commit are reported apart);
- clone: the same number of bytes copied in this process by torch ``clone`` of a byte
  tensor (allocation, page faults and copy), measured right after, in the same run, so the
  machine's noise hits both: the acceptance baseline;
- memcpy: the same bytes copied into a buffer allocated and touched beforehand (no page
  faults): the stricter reference, shown for honesty.

Each baseline is the fastest of 3 tries.

    python bench/reshard.py [--gpus 8] [--layers 8] [--hidden 1024] [--rounds 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from node_agent.reshard.plan import synthetic_model
from node_agent.reshard.workers import WorkerPool
from orchestrrl.logs import setup_logging

TARGET_RATIO = 0.5  # the acceptance: at least half the copy rate
REPEATS = 3


def walk(gpus: int) -> list[tuple[int, ...]]:
    """TP gpus -> gpus/2 -> ... -> 1 and back up, as equal instances, from TP gpus."""
    degrees = []
    tp = gpus
    while tp >= 1:
        degrees.append(tp)
        tp //= 2
    down = [(t,) * (gpus // t) for t in degrees]
    return down[1:] + down[-2::-1]


def clone_seconds(src: torch.Tensor) -> float:
    best = float("inf")
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        dst = src.clone()
        best = min(best, time.perf_counter() - t0)
        del dst
    return best


def memcpy_seconds(src: torch.Tensor) -> float:
    dst = torch.zeros_like(src)  # allocated and touched before the clock starts
    best = float("inf")
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return best


def run(args: argparse.Namespace) -> dict[str, Any]:
    model = synthetic_model(
        layers=args.layers, hidden=args.hidden, ffn=args.ffn, vocab=args.vocab, dtype=args.dtype
    )
    steps: list[dict[str, Any]] = []
    with WorkerPool(args.gpus, (args.gpus,), model=model, seed=1, timeout_s=600) as pool:
        for walk_index in range(args.rounds + 1):  # walk 0 warms up: reported, not in totals
            for layout in walk(args.gpus):
                report = pool.reshard(layout)
                if report.bytes_moved == 0:
                    continue  # fewer replicas -> more TP: every rank already holds its shard
                src = torch.ones(report.bytes_moved, dtype=torch.uint8)
                steps.append(
                    {
                        "warm_up": walk_index == 0,
                        "old_layout": list(report.old_layout),
                        "new_layout": list(report.new_layout),
                        "bytes": report.bytes_moved,
                        "senders": report.senders,
                        "move_s": report.move_s,
                        "verify_s": report.verify_s,
                        "commit_s": report.commit_s,
                        "clone_s": clone_seconds(src),
                        "memcpy_s": memcpy_seconds(src),
                        "kept_bytes_copied": sum(w.copied_bytes for w in report.workers),
                        "worker_max_s": {
                            "local": max(w.local_s for w in report.workers),
                            "transfer": max(w.transfer_s for w in report.workers),
                            "unpack": max(w.unpack_s for w in report.workers),
                            "total": max(w.seconds for w in report.workers),
                        },
                    }
                )
                del src
        backend = pool.backend
    measured = [s for s in steps if not s["warm_up"]]
    warm_up = [s for s in steps if s["warm_up"]]
    moved = sum(s["bytes"] for s in measured)
    rate = {k: moved / sum(s[f"{k}_s"] for s in measured) for k in ("move", "clone", "memcpy")}
    cold = sum(s["bytes"] for s in warm_up) / sum(s["move_s"] for s in warm_up)
    cold_clone = sum(s["bytes"] for s in warm_up) / sum(s["clone_s"] for s in warm_up)
    return {
        "backend": backend,
        "gpus": args.gpus,
        "model_bytes": model.nbytes,
        "model": {
            "layers": args.layers,
            "hidden": args.hidden,
            "ffn": args.ffn or 4 * args.hidden,
            "vocab": args.vocab,
            "dtype": args.dtype,
        },
        "cpu_threads": torch.get_num_threads(),
        "rounds": args.rounds,
        "steps": steps,
        "bytes_moved": moved,
        "reshard_GBps": rate["move"] / 1e9,
        "clone_GBps": rate["clone"] / 1e9,
        "memcpy_GBps": rate["memcpy"] / 1e9,
        "ratio_to_clone": rate["move"] / rate["clone"],
        "ratio_to_memcpy": rate["move"] / rate["memcpy"],
        "ratio_to_clone_per_step_median": statistics.median(
            s["clone_s"] / s["move_s"] for s in measured
        ),
        "warm_up_reshard_GBps": cold / 1e9,
        "warm_up_ratio_to_clone": cold / cold_clone,
        "target_ratio": TARGET_RATIO,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--gpus", type=int, default=8, help="worker processes (GPU ranks)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--ffn", type=int, default=None, help="default 4 x hidden")
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--rounds", type=int, default=2, help="measured walks down and back up")
    p.add_argument("--json", type=Path, help="also write the figures as JSON here")
    args = p.parse_args()
    if args.gpus < 2 or args.gpus & (args.gpus - 1):
        p.error(f"--gpus={args.gpus}: expected a power of two >= 2")
    if args.rounds < 1:
        p.error(f"--rounds={args.rounds}: must be at least 1")
    setup_logging("warning")
    res = run(args)
    print(
        f"reshard throughput: {res['gpus']} worker processes over {res['backend']}, model "
        f"{res['model_bytes'] / 2**20:.0f} MiB ({args.dtype}), {res['rounds']} measured walks "
        f"after one warm-up; baselines copy the same bytes in this process "
        f"({res['cpu_threads']} threads, best of {REPEATS})"
    )
    print(
        f"{'old -> new layout':<36} {'MiB':>7} {'senders':>7} {'move s':>7} {'reshard':>8} "
        f"{'clone':>7} {'ratio':>6} {'memcpy':>7} {'ratio':>6} {'verify s':>8}   (rates in GB/s)"
    )
    for s in res["steps"]:
        nbytes = s["bytes"]
        name = ("(warm-up) " if s["warm_up"] else "") + f"{s['old_layout']}->{s['new_layout']}"
        name = name.replace(" ", "")
        print(
            f"{name:<36} {nbytes / 2**20:>7.0f} {s['senders']:>7} {s['move_s']:>7.3f} "
            f"{nbytes / s['move_s'] / 1e9:>8.2f} {nbytes / s['clone_s'] / 1e9:>7.2f} "
            f"{s['clone_s'] / s['move_s']:>6.2f} {nbytes / s['memcpy_s'] / 1e9:>7.2f} "
            f"{s['memcpy_s'] / s['move_s']:>6.2f} {s['verify_s']:>8.3f}"
        )
    print(
        f"{'total (measured walks)':<36} {res['bytes_moved'] / 2**20:>7.0f} {'':>7} {'':>7} "
        f"{res['reshard_GBps']:>8.2f} {res['clone_GBps']:>7.2f} {res['ratio_to_clone']:>6.2f} "
        f"{res['memcpy_GBps']:>7.2f} {res['ratio_to_memcpy']:>6.2f}"
    )
    ratio = res["ratio_to_clone"]
    verdict = "meets" if ratio >= TARGET_RATIO else "misses"
    print(
        f"warm-up walk (cold shard memory, not in the totals): reshard "
        f"{res['warm_up_reshard_GBps']:.2f} GB/s, {res['warm_up_ratio_to_clone']:.2f} x clone"
    )
    print(
        f"reshard / clone = {ratio:.2f} (per-step median "
        f"{res['ratio_to_clone_per_step_median']:.2f}): {verdict} the target of "
        f"{TARGET_RATIO:.2f}; reshard / memcpy = {res['ratio_to_memcpy']:.2f}"
    )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(res, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
