"""`make demo-engines` / `orlctl demo-engines`: the compute half on real engines, on a CPU.

A local cluster (``examples/local-engines.toml``: two generation nodes of two "GPUs",
each a CPU core here) whose generation agents run a real engine (llama.cpp by default,
or vLLM) with a tiny random-weight model built on the spot. The demo sends a step's
requests to one node's gateway, as an RL rollout client would; the controller's
compute-scheduling loop sees the imbalance in the agents' telemetry and reshards and
migrates. The demo prints each action with its per-stage timings and, at the end,
checks every response against the same request run alone and uninterrupted on one
engine server: under greedy decoding they must be equal token for token.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from fabric_controller import local
from node_agent.engines import adapter, port_picker
from node_agent.engines.base import Chunk, Placement, Sampling, Submission
from node_agent.engines.http_engine import EngineSettings
from orchestrrl import errors
from orchestrrl.client import AsyncClient
from orchestrrl.logs import setup_logging

WIRING = Path(__file__).resolve().parents[1] / "examples" / "local-engines.toml"
GEN_NODE = "gen0-n0"  # the node the client sends to; gen0-n1 starts idle
SEATS = 2  # sequences per engine instance


@dataclass(frozen=True)
class DemoConfig:
    engine: str = "llamacpp"
    command: str = ""  # default: what `make engines` installed
    requests: int = 8
    max_tokens: int = 2000  # the longest request's; the others are shorter (a long tail)
    equal_lengths: bool = False  # every request max_tokens long instead
    context: int = 4096
    run_dir: Path | None = None


@dataclass
class RequestResult:
    request_id: str
    tokens: int
    nodes: list[str]
    first_token_s: float
    total_s: float
    matches: bool


@dataclass
class DemoResult:
    engine: str
    requests: list[RequestResult] = field(default_factory=list)
    actions: list[dict[str, Any]] = field(default_factory=list)
    reference_s: float = 0.0
    cluster_up_s: float = 0.0
    run_s: float = 0.0

    @property
    def matched(self) -> int:
        return sum(r.matches for r in self.requests)

    def kinds(self, kind: str) -> list[dict[str, Any]]:
        return [a for a in self.actions if a["kind"] == kind and a["ok"]]


def prompts(n: int) -> list[list[int]]:
    return [[5 + i, 17, 3 + 2 * i, 99, 42 + i, 7] for i in range(n)]


def lengths(n: int, longest: int) -> list[int]:
    """A step's long tail: output caps from ``longest`` down to ``longest / n``."""
    return [max(16, longest * (n - k) // n) for k in range(n)]


def build_model(kind: str, where: Path) -> Path:
    """A tiny random model for ``kind`` (the simulator's builder, run as a program)."""
    path = where / ("tiny.gguf" if kind == "llamacpp" else "tiny-llama")
    fmt = "gguf" if kind == "llamacpp" else "hf"
    argv = [sys.executable, "-m", "sim_backends.tiny_models", fmt, str(path)]
    if kind == "llamacpp":
        # one layer: llama.cpp on a CPU is not batch-invariant, and a deeper random
        # model turns its rounding differences into other greedy tokens; wide enough to
        # take ~5 ms a token, so that the step outlasts the scheduling loop's reaction
        argv += ["--layers", "1", "--hidden", "1024", "--vocab", "8192"]
    subprocess.run(argv, check=True, capture_output=True, timeout=300)
    return path


async def reference(
    settings: EngineSettings, kind: str, ps: list[list[int]], caps: list[int]
) -> list[list[int]]:
    """Each prompt alone and uninterrupted on one engine server (no gateway, no agent)."""
    cls = adapter(kind)
    # llama.cpp: one instance on two cores (its thread count does not change its results:
    # 0 differences in 32 x 200 greedy tokens); vLLM's TP2 on a CPU is slower than TP1
    devices = (0, 1) if kind == "llamacpp" else (0,)
    place = Placement(0, len(devices), devices, "cpu", 0)
    server = cls(Placement(0, len(devices), devices, "cpu", port_picker(0)(place)), settings)
    await server.start()
    try:
        outs = []
        for k, (p, n) in enumerate(zip(ps, caps, strict=True)):
            sub = Submission(f"reference-{k}", tuple(p), n, Sampling(0.0, ignore_eos=True))
            tokens: list[int] = []
            async for chunk in server.generate(sub):
                assert isinstance(chunk, Chunk)
                tokens.extend(chunk.token_ids)
            outs.append(tokens)
        return outs
    finally:
        await server.stop()


async def stream(
    url: str, rid: str, prompt: list[int], n: int, t0: float
) -> tuple[list[int], list[str], float]:
    body = {"prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True,
            "stream": True, "request_id": rid}  # fmt: skip
    tokens: list[int] = []
    nodes: list[str] = []
    first = 0.0
    async with aiohttp.ClientSession() as http, http.post(url + "/v1/completions", json=body) as r:
        if r.status != 200:
            raise errors.FailedPrecondition(f"request {rid}: HTTP {r.status}: {await r.text()}")
        async for line in r.content:
            text = line.decode().strip()
            if not text.startswith("data: {"):
                continue
            event = json.loads(text[6:])
            if "error" in event:
                raise errors.FailedPrecondition(f"request {rid}: {event['error']['message']}")
            got = event["choices"][0]["token_ids"]
            if got and not first:
                first = time.perf_counter() - t0
            tokens.extend(got)
            nodes = event.get("orl", {}).get("nodes", nodes)
    return tokens, nodes, first


async def _watch(controller: str, seen: list[dict[str, Any]], t0: float, quiet: bool) -> None:
    """Print the compute-scheduling loop's actions as they happen."""
    async with AsyncClient(controller, timeout_s=10.0) as client:
        while True:
            s = await client.schedule()
            for a in s.actions:
                key = (a["command_id"], a["kind"], a["node"])
                if any((x["command_id"], x["kind"], x["node"]) == key for x in seen):
                    continue
                seen.append(a)
                if not quiet:
                    ok = "ok" if a["ok"] else "FAILED"
                    print(f"  [{time.perf_counter() - t0:5.1f} s] {a['kind']:<8} {ok:<6} "
                          f"{a['node']}: {a['message']}", flush=True)  # fmt: skip
            await asyncio.sleep(0.25)


async def _run(cfg: DemoConfig, run_dir: Path, quiet: bool) -> DemoResult:
    def say(message: str) -> None:
        if not quiet:
            print(message, flush=True)

    result = DemoResult(cfg.engine)
    command = cfg.command or local.installed_engine(cfg.engine)
    if command is None:
        raise errors.FailedPrecondition(
            f"{cfg.engine} is not installed in .engines/: run `make engines` "
            "(or pass --engine-command)"
        )
    say(f"demo-engines: {cfg.engine} on the CPU, a tiny random-weight model built here")
    model = await asyncio.to_thread(build_model, cfg.engine, run_dir)
    args = (
        ("--dtype=float32", "--enforce-eager", "--skip-tokenizer-init")
        if cfg.engine == "vllm"
        else ()
    )
    settings = EngineSettings(
        str(model), command, "tiny", max_num_seqs=8, context=cfg.context, args=args,
        log_dir=run_dir / "logs" / "reference", start_timeout_s=600,
    )  # fmt: skip
    ps = prompts(cfg.requests)
    caps = (
        [cfg.max_tokens] * cfg.requests
        if cfg.equal_lengths
        else lengths(cfg.requests, cfg.max_tokens)
    )
    t = time.perf_counter()
    refs = await reference(settings, cfg.engine, ps, caps)
    result.reference_s = time.perf_counter() - t
    say(f"  reference: {len(ps)} requests of {caps[-1]}..{caps[0]} tokens, each alone on one "
        f"{cfg.engine} server ({result.reference_s:.1f} s)")  # fmt: skip
    t = time.perf_counter()
    # two sequences per instance: a CPU core decodes a batch barely faster than its
    # sequences one by one, and a full node's queue is what the loop can spread
    engine = local.LocalEngine(cfg.engine, str(model), command, args, "1,1", SEATS, cfg.context)
    cluster = await asyncio.to_thread(
        local.up, WIRING, run_dir, ephemeral_ports=True, engine=engine,
        progress=lambda m: say(f"  {m}"),
    )  # fmt: skip
    result.cluster_up_s = time.perf_counter() - t
    try:
        async with AsyncClient(cluster.controller, timeout_s=10.0) as client:
            gateways = {n.node: n.gateway for n in await client.nodes() if n.gateway}
        say("  gateways: " + ", ".join(f"{n} http://{g}" for n, g in sorted(gateways.items())))
        url = f"http://{gateways[GEN_NODE]}"
        say(f"  {len(ps)} requests stream from {GEN_NODE}'s gateway; the controller's "
            "compute-scheduling loop acts on the agents' telemetry:")  # fmt: skip
        t0 = time.perf_counter()
        watcher = asyncio.create_task(_watch(cluster.controller, result.actions, t0, quiet))
        try:
            outs = await asyncio.gather(
                *(
                    stream(url, f"demo-{k}", p, n, t0)
                    for k, (p, n) in enumerate(zip(ps, caps, strict=True))
                )
            )
            await asyncio.sleep(0.5)  # the last actions' records
        finally:
            watcher.cancel()
        result.run_s = time.perf_counter() - t0
        (run_dir / "outputs.json").write_text(
            json.dumps({"outputs": [o[0] for o in outs], "reference": refs})
        )
        for k, ((tokens, nodes, first), ref) in enumerate(zip(outs, refs, strict=True)):
            result.requests.append(
                RequestResult(f"demo-{k}", len(tokens), nodes, first, result.run_s, tokens == ref)
            )
    finally:
        await asyncio.to_thread(local.down, Path(cluster.run_dir))
    return result


def report(r: DemoResult) -> str:
    lines = [
        "  requests:",
        f"    {'id':<8} {'tokens':>6}  {'first token':>11}  {'nodes':<20} equal",
    ]
    for q in r.requests:
        lines.append(f"    {q.request_id:<8} {q.tokens:>6}  {q.first_token_s:>9.2f} s  "
                     f"{' -> '.join(q.nodes):<20} {'yes' if q.matches else 'NO'}")  # fmt: skip
    lines.append(
        f"  {len(r.kinds('reshard'))} reshard(s) and {len(r.kinds('migrate'))} migration(s) "
        f"carried out in {r.run_s:.1f} s; {r.matched} of {len(r.requests)} outputs equal "
        "the uninterrupted run token for token"
    )
    return "\n".join(lines)


def run_demo_engines(cfg: DemoConfig, *, as_json: bool = False) -> int:
    """Run the demo; 0 when every output matched, 1 otherwise."""
    setup_logging("warning", "console", sys.stderr)
    with tempfile.TemporaryDirectory(prefix="orl-demo-engines-") as tmp:
        run_dir = cfg.run_dir or Path(tmp)
        run_dir.mkdir(parents=True, exist_ok=True)
        r = asyncio.run(_run(cfg, run_dir, as_json))
    if as_json:
        doc = asdict(r)
        doc["matched"] = r.matched
        print(json.dumps(doc, indent=2))
    else:
        print(report(r))
    return 0 if r.requests and r.matched == len(r.requests) else 1
