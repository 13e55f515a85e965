#!/usr/bin/env python3
"""What a weight update costs an engine instance, against starting the engine cold.

For each engine (``make engines`` installs vLLM's CPU build and llama.cpp's server), on
this host's CPU, with two checkpoints of one tiny random-weight Llama built here (the
trainer's step 1 and step 2, Hugging Face safetensors):

* **update**: a running instance takes the other checkpoint, alternately, ``--rounds``
  times, through its adapter as the gateway would: vLLM in place
  (``prepare_model``: the checkpoint's layout checked, then ``update_weights``: pause,
  ``reload_weights`` from disk, KV cache dropped, version label, resume); llama.cpp by
  restart (``prepare_model``: the checkpoint converted to a float32 GGUF, its cached GGUF
  deleted first so that every round converts, then stop, ``use_model``, start).
* **cold start**: a new instance started on the same checkpoint from disk (vLLM: the
  directory; llama.cpp: the GGUF), until its health check answers, ``--cold-rounds``
  times (default: vLLM 1, about a minute each here; llama.cpp 5), in the same run.

Reported: the median of each and their ratio (cold / update), and checks that the
update really took: the updated instance's greedy tokens and logprobs on a probe prompt
against the cold instance's (tokens equal, largest logprob difference), and the
updated instance's logprobs (a greedy and a sampled call) against the trainer's
recomputation under the checkpoint's weights (transformers, float32, teacher-forced:
what an RL trainer computes; skipped when transformers is not installed). A mismatch
(other tokens, or a logprob off by 1e-3 or more) fails the run (exit code 1).

    python bench/weight_update.py [--engine all|vllm|llamacpp] [--rounds 5]
        [--cold-rounds N] [--layers 4] [--hidden 512] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from fabric_controller.local import installed_engine
from node_agent.engines import adapter
from node_agent.engines.base import Placement, Sampling, Submission
from node_agent.engines.http_engine import EngineSettings, HttpEngine
from node_agent.engines.llamacpp import gguf_path
from orchestrrl.logs import setup_logging
from sim_backends.tiny_models import TinyShape, write_hf_llama

GREEDY = Sampling(temperature=0.0, ignore_eos=True)
SAMPLED = Sampling(temperature=0.8, top_k=40, top_p=0.95, seed=11, ignore_eos=True)
VLLM_ARGS = ("--dtype=float32", "--enforce-eager", "--skip-tokenizer-init")
PROBE = [5, 17, 3, 99, 42, 7]
PROBE_TOKENS = 32
ENGINES = ("vllm", "llamacpp")
COLD_ROUNDS = {"vllm": 1, "llamacpp": 5}  # cold starts by default (vLLM's take a minute)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def new_server(kind: str, settings: EngineSettings) -> HttpEngine:
    return adapter(kind)(Placement(0, 1, (0,), "cpu", free_port()), settings)


def recompute(checkpoint: Path, prompt: list[int], tokens: list[int]) -> list[float] | None:
    """The trainer's logprobs of ``tokens`` after ``prompt`` (None without transformers)."""
    try:
        import torch
        from transformers import LlamaForCausalLM
        from transformers.utils import logging as transformers_logging
    except ImportError:
        return None
    transformers_logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    model = LlamaForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
        lp = torch.log_softmax(logits.float(), dim=-1)
        out: list[float] = lp.gather(1, torch.tensor(tokens)[:, None])[:, 0].tolist()
    return out


async def probe(server: HttpEngine, sampling: Sampling = GREEDY) -> tuple[list[int], list[float]]:
    tokens: list[int] = []
    lps: list[float] = []
    sub = Submission(f"probe-{time.monotonic_ns()}", tuple(PROBE), PROBE_TOKENS, sampling, True)
    async for chunk in server.generate(sub):
        tokens += chunk.token_ids
        lps += chunk.logprobs
    return tokens, lps


async def update(server: HttpEngine, kind: str, checkpoint: Path) -> dict[str, float]:
    """One weight update of a running instance, as the gateway does it; its stages in ms."""
    t0 = time.perf_counter()
    if kind == "llamacpp":  # every step's checkpoint is new: convert it again
        await asyncio.to_thread(gguf_path(checkpoint, "f32").unlink, missing_ok=True)
    path = await server.prepare_model(str(checkpoint))
    t1 = time.perf_counter()
    if kind == "vllm":
        await server.update_weights(path, version=checkpoint.name)
    else:
        await server.stop()
        server.use_model(path)
        await server.start()
    t2 = time.perf_counter()
    return {"prepare_ms": (t1 - t0) * 1e3, "load_ms": (t2 - t1) * 1e3, "total_ms": (t2 - t0) * 1e3}


async def bench_engine(
    kind: str, command: str, steps: tuple[Path, Path], args: argparse.Namespace, logs: Path
) -> dict[str, Any]:
    settings = EngineSettings(
        "", command, "tiny", max_num_seqs=2, context=2048,
        args=VLLM_ARGS if kind == "vllm" else (), log_dir=logs / kind, start_timeout_s=900,
    )  # fmt: skip
    server = new_server(kind, settings)
    server.use_model(await server.prepare_model(str(steps[0])))
    await server.start()
    updates = []
    try:
        for i in range(args.rounds):
            updates.append(await update(server, kind, steps[(i + 1) % 2]))
        last = steps[args.rounds % 2]
        updated = await probe(server)
        sampled = await probe(server, SAMPLED)
        model = server.model
    finally:
        await server.stop()
    colds = []
    cold_probe: tuple[list[int], list[float]] = ([], [])
    cold_rounds = args.cold_rounds or COLD_ROUNDS[kind]
    for _ in range(cold_rounds):
        cold = new_server(kind, settings)
        cold.use_model(model)  # the same checkpoint (llama.cpp: its GGUF), from disk
        t0 = time.perf_counter()
        await cold.start()
        colds.append((time.perf_counter() - t0) * 1e3)
        try:
            cold_probe = await probe(cold)
        finally:
            await cold.stop()
    update_ms = statistics.median(u["total_ms"] for u in updates)
    cold_ms = statistics.median(colds)
    trainer: float | None = None
    for tokens, lps in (updated, sampled):
        ref = await asyncio.to_thread(recompute, last, PROBE, tokens)
        if ref is not None:
            diff = max(abs(a - b) for a, b in zip(lps, ref, strict=True))
            trainer = max(trainer or 0.0, diff)
    return {
        "checkpoint": last.name,
        "rounds": args.rounds,
        "cold_rounds": cold_rounds,
        "update_ms": [u["total_ms"] for u in updates],
        "update_ms_p50": update_ms,
        "prepare_ms_p50": statistics.median(u["prepare_ms"] for u in updates),
        "load_ms_p50": statistics.median(u["load_ms"] for u in updates),
        "cold_start_ms": colds,
        "cold_start_ms_p50": cold_ms,
        "cold_over_update": cold_ms / update_ms,
        "probe_tokens_equal": updated[0] == cold_probe[0],
        "probe_logprob_max_abs_diff": max(
            (abs(a - b) for a, b in zip(updated[1], cold_probe[1], strict=True)), default=0.0
        ),
        "trainer_logprob_max_abs_diff": trainer,
    }


def trainer_cell(e: dict[str, Any]) -> str:
    d = e["trainer_logprob_max_abs_diff"]
    return "-" if d is None else f"{d:.1e}"


def table(r: dict[str, Any]) -> str:
    m = r["model"]
    lines = [
        f"weight update vs cold start, on the CPU: tiny random Llama, {m['layers']} layers, "
        f"hidden {m['hidden']}, vocab {m['vocab']}, {m['parameters'] / 1e6:.1f} M parameters "
        f"({m['safetensors_mb']:.0f} MB float32)",
        "",
        f"{'engine':<9} {'how':<16} {'update ms':>10} {'(prepare':>9} {'load)':>8} "
        f"{'cold ms':>9} {'cold/update':>12} {'probe = cold':>12} {'|dlp| cold':>10} "
        f"{'|dlp| trainer':>13}",
    ]
    how = {"vllm": "in place (disk)", "llamacpp": "convert+restart"}
    for kind, e in r["engines"].items():
        lines.append(
            f"{kind:<9} {how[kind]:<16} {e['update_ms_p50']:>10.0f} {e['prepare_ms_p50']:>9.0f} "
            f"{e['load_ms_p50']:>8.0f} {e['cold_start_ms_p50']:>9.0f} "
            f"{e['cold_over_update']:>11.1f}x {e['probe_tokens_equal']!s:>12} "
            f"{e['probe_logprob_max_abs_diff']:>10.1e} {trainer_cell(e):>13}"
        )
    counts = [
        f"{k}: {e['rounds']} updates, {e['cold_rounds']} cold starts"
        for k, e in r["engines"].items()
    ]
    lines.append(f"(medians of {'; '.join(counts)})")
    return "\n".join(lines)


async def run(args: argparse.Namespace) -> dict[str, Any]:
    kinds = ENGINES if args.engine == "all" else (args.engine,)
    commands = {k: installed_engine(k) for k in kinds}
    missing = [k for k, c in commands.items() if c is None]
    if missing:
        raise SystemExit(f"{', '.join(missing)} not installed: run `make engines`")
    shape = TinyShape(
        layers=args.layers, hidden=args.hidden, intermediate=args.hidden * 11 // 4, vocab=8192
    )
    with tempfile.TemporaryDirectory(prefix="orl-bench-weights-") as tmp:
        where = Path(tmp)
        steps = (
            await asyncio.to_thread(write_hf_llama, where / "step-1", shape, seed=1),
            await asyncio.to_thread(write_hf_llama, where / "step-2", shape, seed=2),
        )
        size = (steps[0] / "model.safetensors").stat().st_size
        result: dict[str, Any] = {
            "model": {
                **dataclasses.asdict(shape),
                "parameters": size // 4,
                "safetensors_mb": size / 1e6,
            },
            "engines": {},
        }
        for kind in kinds:
            command = commands[kind]
            assert command is not None
            result["engines"][kind] = await bench_engine(kind, command, steps, args, where / "logs")
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", choices=("all", *ENGINES), default="all")
    p.add_argument("--rounds", type=int, default=5, help="weight updates (default 5)")
    p.add_argument(
        "--cold-rounds", type=int, default=0, help="cold starts (default: vLLM 1, llama.cpp 5)"
    )
    p.add_argument("--layers", type=int, default=4, choices=range(1, 33), metavar="N")
    p.add_argument("--hidden", type=int, default=512, choices=[64 * k for k in range(1, 33)])
    p.add_argument("--json", type=Path, help="also write the figures as JSON here")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error(f"--rounds={args.rounds}: must be at least 1")
    if args.cold_rounds < 0:
        p.error(f"--cold-rounds={args.cold_rounds}: must be at least 1 (0: the default)")
    setup_logging("warning")
    result = asyncio.run(run(args))
    print(table(result))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))
    ok = all(
        e["probe_tokens_equal"]
        and e["probe_logprob_max_abs_diff"] < 1e-3
        and (e["trainer_logprob_max_abs_diff"] or 0.0) < 1e-3
        for e in result["engines"].values()
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
