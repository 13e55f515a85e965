#!/usr/bin/env python3
"""GRPO on the toy task without any engine: a tiny random Llama learns, lengths drift.

Each step samples ``--prompts`` prompts x ``--n`` samples from the policy with plain torch
(``orchestrrl.rl.policy.sample``), scores them with ``orchestrrl.rl.tasks.TargetStop``,
takes one GRPO step (``PolicyTrainer.step``: logprob check, clipped loss, AdamW) and
writes the new weights as a versioned checkpoint, as the RL demo does between its
training and weight-sync phases. The baseline is the untrained policy measured in the
same run: the summary gives the reward of the last steps over that of the first.

    python bench/grpo_toy.py [--steps 30] [--prompts 8] [--n 8] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from orchestrrl.rl import policy
from orchestrrl.rl.tasks import TargetStop
from orchestrrl.rl.trainer import PolicyTrainer, TrainConfig


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--prompts", type=int, default=8, help="groups per step")
    p.add_argument("--n", type=int, default=8, help="samples per prompt")
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--vocab", type=int, default=64)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--lr", type=float, default=5e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch threads (1: tiny model)")
    p.add_argument("--window", type=int, default=5, help="steps averaged at each end")
    p.add_argument("--json", type=Path, help="write the figures here")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)

    config = policy.llama_config(
        vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers
    )
    task = TargetStop(args.vocab)
    trainer = PolicyTrainer(
        policy.new_policy(config, args.seed), config, TrainConfig(learning_rate=args.lr)
    )
    rows: list[dict[str, Any]] = []
    print(
        f"{'step':>4} {'ver':>4} {'reward':>7} {'len':>5} {'p50':>4} {'p99':>4} {'stop':>5} "
        f"{'|dlogp|max':>10} {'sample_s':>8} {'train_s':>7} {'save_s':>6}"
    )
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as root:
        trainer.save(Path(root))
        for step in range(args.steps):
            t0 = time.perf_counter()
            groups = policy.sample(
                trainer.model,
                task.prompts(args.prompts, seed=args.seed * 100_003 + step),
                n=args.n,
                max_tokens=args.max_tokens,
                seed=args.seed * 100_003 + step,
                version=str(trainer.version),
            )
            t1 = time.perf_counter()
            rewards = [[task.reward(s.prompt_ids, s.completion_ids) for s in g] for g in groups]
            report = trainer.step(groups, rewards)
            t2 = time.perf_counter()
            ckpt = trainer.save(Path(root))
            t3 = time.perf_counter()
            row = {
                **report.row(),
                "step": step,
                "checkpoint": ckpt.path.name,
                "sample_s": t1 - t0,
                "train_s": t2 - t1,
                "save_s": t3 - t2,
            }
            rows.append(row)
            print(
                f"{step:>4} {report.version:>4} {report.reward_mean:>7.3f} "
                f"{report.length_mean:>5.1f} {report.length_p50:>4.0f} {report.length_p99:>4.0f} "
                f"{report.stop_fraction:>5.2f} {report.logprob_diff_max:>10.1e} "
                f"{t1 - t0:>8.2f} {t2 - t1:>7.2f} {t3 - t2:>6.2f}"
            )
    total = time.perf_counter() - started
    w = max(1, min(args.window, len(rows) // 2))

    def mean(key: str, part: list[dict[str, Any]]) -> float:
        return sum(float(r[key]) for r in part) / len(part)

    first, last = rows[:w], rows[-w:]
    summary = {
        "steps": len(rows),
        "window": w,
        "reward_first": mean("reward_mean", first),
        "reward_last": mean("reward_mean", last),
        "reward_ratio": mean("reward_mean", last) / max(mean("reward_mean", first), 1e-9),
        "length_first": mean("length_mean", first),
        "length_last": mean("length_mean", last),
        "logprob_diff_max": max(float(r["logprob_diff_max"]) for r in rows),
        "sample_s": sum(float(r["sample_s"]) for r in rows),
        "train_s": sum(float(r["train_s"]) for r in rows),
        "save_s": sum(float(r["save_s"]) for r in rows),
        "total_s": total,
    }
    print(
        f"reward {summary['reward_first']:.3f} (first {w} steps) -> "
        f"{summary['reward_last']:.3f} (last {w}): {summary['reward_ratio']:.2f}x; "
        f"mean length {summary['length_first']:.1f} -> {summary['length_last']:.1f} tokens; "
        f"max |engine-free logprob diff| {summary['logprob_diff_max']:.1e}"
    )
    print(
        f"time: sampling {summary['sample_s']:.1f} s, training {summary['train_s']:.1f} s, "
        f"checkpoints {summary['save_s']:.1f} s, total {total:.1f} s"
    )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        doc = {"config": vars(args) | {"json": str(args.json)}, "summary": summary, "rows": rows}
        args.json.write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
