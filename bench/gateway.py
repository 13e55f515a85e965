#!/usr/bin/env python3
"""The generation gateway's cost, and what a migration and a reshard cost a client.

On real engine servers (llama.cpp by default, or vLLM; ``make engines`` installs both) with
a tiny random-weight model built here, on this host's CPU cores:

* **overhead**: the same streamed requests (``--concurrency`` at a time, ``--tokens``
  each, greedy) sent to one engine server straight through its own streaming API (the
  adapter the gateway uses, without the gateway: the baseline) and through the gateway's
  OpenAI ``/v1/completions`` endpoint, in alternating rounds of the same run. Reported:
  tokens/s of each path and their ratio, time to first token of each and the difference,
  and the difference in wall time spread over the tokens streamed (the gateway's cost per
  token). Targets: tokens/s within 5 % of the engine's own, time to first token within
  5 ms. Measured twice: without logprobs, and with each sampled token's logprob on (as
  an RL rollout asks; the engine's own API with logprobs against the gateway's
  ``"logprobs": 0``), with the largest difference between the two paths' logprobs.
* **migration**: requests cut mid-response on node ``a`` and moved to node ``b`` (export,
  import with recomputation, release; the source follows the destination, as the agents
  do over gRPC): time of each stage, the time from import to the destination's first new
  token, and the longest gap the client saw between two tokens.
* **reshard**: a node of two instances resharded to one TP2 instance and back with
  requests in flight: the gateway's per-stage timings and the client's longest gap.

Every migrated and resharded output is checked against the same request run
uninterrupted; a mismatch is reported in the table and fails the run (exit code 1).

    python bench/gateway.py [--engine llamacpp|vllm] [--rounds 6] [--concurrency 2]
        [--tokens 256] [--trials 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp

from fabric_controller.demo_engines import build_model
from fabric_controller.local import installed_engine
from node_agent.engine import Destination
from node_agent.engines import port_picker, server_factory
from node_agent.engines.base import EngineServer, Placement, Sampling, Submission
from node_agent.engines.http_engine import EngineSettings
from node_agent.gateway.engine import GatewayConfig, GatewayEngine
from node_agent.gateway.http import GatewayServer, GatewaySettings
from node_agent.gateway.requests import Request
from orchestrrl.logs import setup_logging
from sim_backends.token_engine import LocalPeers

GREEDY = Sampling(temperature=0.0, ignore_eos=True)
VLLM_ARGS = ("--dtype=float32", "--enforce-eager", "--skip-tokenizer-init")


def prompt(i: int) -> list[int]:
    return [5 + i, 17, 3 + 2 * i, 99, 42 + i, 7]


@dataclasses.dataclass
class Timed:
    """One streamed request as its client saw it."""

    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    first_s: float = 0.0  # from sending to the first token
    total_s: float = 0.0
    max_gap_s: float = 0.0  # the longest wait between two tokens


async def timed(chunks: Any, t0: float) -> Timed:
    out = Timed()
    last = t0
    async for item in chunks:
        ids, logprobs = item  # each chunk's token ids and their logprobs (or none)
        now = time.perf_counter()
        out.logprobs.extend(logprobs)
        if ids:
            if not out.tokens:
                out.first_s = now - t0
            else:
                out.max_gap_s = max(out.max_gap_s, now - last)
            out.tokens.extend(ids)
            last = now
    out.total_s = time.perf_counter() - t0
    return out


async def direct(
    server: EngineServer, p: list[int], n: int, tag: str, logprobs: bool = False
) -> Timed:
    async def chunks() -> Any:
        async for c in server.generate(Submission(tag, tuple(p), n, GREEDY, logprobs=logprobs)):
            yield c.token_ids, list(c.logprobs)

    return await timed(chunks(), time.perf_counter())


async def via_gateway(
    http: aiohttp.ClientSession, url: str, p: list[int], n: int, logprobs: bool = False
) -> Timed:
    body = {"model": "tiny", "prompt": p, "max_tokens": n, "temperature": 0,
            "ignore_eos": True, "stream": True, "logprobs": 0 if logprobs else None}  # fmt: skip
    t0 = time.perf_counter()

    async def chunks() -> Any:
        async with http.post(url + "/v1/completions", json=body) as r:
            if r.status != 200:
                raise RuntimeError(f"gateway answered {r.status}: {await r.text()}")
            async for line in r.content:
                text = line.decode().strip()
                if text.startswith("data: {"):
                    event = json.loads(text[6:])
                    if "error" in event:
                        raise RuntimeError(f"gateway stream error: {event['error']}")
                    choice = event["choices"][0]
                    lp = choice.get("logprobs") or {}
                    yield choice["token_ids"], list(lp.get("token_logprobs") or [])

    return await timed(chunks(), t0)


async def from_request(req: Request) -> Timed:
    async def chunks() -> Any:
        async for ids in req.tokens():
            yield ids, []

    return await timed(chunks(), time.perf_counter())


class Bench:
    def __init__(self, kind: str, settings: EngineSettings) -> None:
        self.kind = kind
        self.settings = settings
        self.peers = LocalPeers()
        self.servers: dict[str, list[EngineServer]] = {}
        self.gateways: list[GatewayEngine] = []

    async def node(self, name: str, layout: tuple[int, ...], cpu_offset: int) -> GatewayEngine:
        make = server_factory(self.kind, dataclasses.replace(self.settings, cpu_offset=cpu_offset))
        servers = self.servers.setdefault(name, [])

        def tracked(p: Placement) -> EngineServer:
            servers.append(make(p))
            return servers[-1]

        engine = GatewayEngine(
            self.kind, sum(layout), layout, tracked, port_picker(0), peers=self.peers,
            node=name, config=GatewayConfig(device="cpu"),
        )  # fmt: skip
        await engine.start()
        self.peers.gateways[name] = engine
        self.gateways.append(engine)
        return engine

    async def close(self) -> None:
        for g in self.gateways:
            await g.close()


async def generated(req: Request, n: int) -> None:
    """Return once ``req`` has ``n`` output tokens (or is done)."""
    while len(req.output) < n and not req.done:  # noqa: ASYNC110 - the gateway's tasks
        await asyncio.sleep(0.0005)


async def overhead(
    bench: Bench, args: argparse.Namespace, *, logprobs: bool = False
) -> dict[str, Any]:
    name = "ol" if logprobs else "o"
    engine = await bench.node(name, (1,), 0)
    server = bench.servers[name][0]
    http_server = GatewayServer(engine, GatewaySettings("tiny", bench.settings.context))
    await http_server.start("127.0.0.1:0")
    url = f"http://{http_server.address}"
    paths: dict[str, list[Timed]] = {"engine": [], "gateway": []}
    walls: dict[str, list[float]] = {"engine": [], "gateway": []}
    try:
        async with aiohttp.ClientSession() as http:

            async def engine_round(k: int) -> list[Timed]:
                return list(await asyncio.gather(*(
                    direct(server, prompt(i), args.tokens, f"bench-{name}-{k}-{i}", logprobs)
                    for i in range(args.concurrency)
                )))  # fmt: skip

            async def gateway_round(k: int) -> list[Timed]:
                return list(await asyncio.gather(*(
                    via_gateway(http, url, prompt(i), args.tokens, logprobs)
                    for i in range(args.concurrency)
                )))  # fmt: skip

            rounds: dict[str, Callable[[int], Awaitable[list[Timed]]]] = {
                "engine": engine_round, "gateway": gateway_round,
            }  # fmt: skip
            await engine_round(-1)  # warm-up: first-call allocations in the engine
            await gateway_round(-1)
            for k in range(args.rounds):
                order = ("engine", "gateway") if k % 2 == 0 else ("gateway", "engine")
                for path in order:
                    t0 = time.perf_counter()
                    got = await rounds[path](k)
                    walls[path].append(time.perf_counter() - t0)
                    paths[path].extend(got)
        c = args.concurrency  # both lists hold rounds of the same prompts in the same order
        same = all(
            t.tokens == paths["engine"][j % c].tokens for j, t in enumerate(paths["gateway"])
        )
        # with logprobs on: one per token on both paths, and how far apart they are
        lp_diff = 0.0
        for j, t in enumerate(paths["gateway"]):
            e = paths["engine"][j % c]
            want = len(t.tokens) if logprobs else 0
            if len(t.logprobs) != want or len(e.logprobs) != len(e.tokens if logprobs else []):
                same = False
            elif t.tokens == e.tokens:
                pairs = zip(t.logprobs, e.logprobs, strict=True)
                lp_diff = max([lp_diff, *(abs(a - b) for a, b in pairs)])
    finally:
        await http_server.stop()
        await engine.close()
    tokens = args.concurrency * args.tokens
    rate = {p: tokens / statistics.median(w) for p, w in walls.items()}
    ttft = {p: statistics.median(t.first_s for t in ts) * 1e3 for p, ts in paths.items()}
    per_token_us = (
        (statistics.median(walls["gateway"]) - statistics.median(walls["engine"])) / (tokens) * 1e6
    )
    return {
        "rounds": args.rounds,
        "concurrency": args.concurrency,
        "tokens_per_request": args.tokens,
        "engine_tokens_per_s": rate["engine"],
        "gateway_tokens_per_s": rate["gateway"],
        "tokens_per_s_ratio": rate["gateway"] / rate["engine"],
        "engine_ttft_ms": ttft["engine"],
        "gateway_ttft_ms": ttft["gateway"],
        "ttft_added_ms": ttft["gateway"] - ttft["engine"],
        "wall_added_per_token_us": per_token_us,
        "outputs_equal": same,
        "logprobs": logprobs,
        "logprob_max_abs_diff": lp_diff,
    }


async def uninterrupted(bench: Bench, n: int, count: int) -> list[list[int]]:
    engine = await bench.node("ref", (1,), 0)
    try:
        reqs = [engine.submit(prompt(i), n, GREEDY) for i in range(count)]
        return [(await from_request(r)).tokens for r in reqs]
    finally:
        await engine.close()


async def migration(
    bench: Bench, args: argparse.Namespace, refs: list[list[int]]
) -> dict[str, Any]:
    a = await bench.node("a", (1,), 0)
    b = await bench.node("b", (1,), 1)
    stages: dict[str, list[float]] = {}
    equal = 0
    gaps: list[float] = []
    try:
        for trial in range(args.trials):
            cut = 20 + 40 * trial
            for _attempt in range(3):
                reqs = [a.submit(prompt(i), args.long, GREEDY) for i in range(2)]
                readers = [asyncio.create_task(from_request(r)) for r in reqs]
                await generated(reqs[0], cut)
                t = time.perf_counter()
                exported, _ = await a.export_requests([r.id for r in reqs if not r.done])
                t_export = time.perf_counter() - t
                if len(exported) == len(reqs):
                    break
                # a request finished before its export (a fast engine, a busy machine):
                # the others go on where they are, and the trial is made again
                await a.restore_requests(exported)
                await asyncio.gather(*readers)
            else:
                raise RuntimeError(f"trial {trial}: a request finished before every export")
            t = time.perf_counter()
            result = await b.import_requests(exported, 0, recompute=True)
            t_import = time.perf_counter() - t
            t = time.perf_counter()
            await a.release_requests(exported, Destination("b", "in-process"))
            t_release = time.perf_counter() - t
            moved = b.request(exported[0].request_id)
            assert moved is not None
            base = exported[0].generated_tokens
            t = time.perf_counter()
            await generated(moved, base + 1)
            first_new = time.perf_counter() - t + t_import
            outs = await asyncio.gather(*readers)
            equal += sum(o.tokens == refs[i] for i, o in enumerate(outs))
            gaps.append(max(o.max_gap_s for o in outs))
            for stage, s in (
                ("export", t_export),
                ("import", t_import),
                ("release", t_release),
                ("import_to_first_token", first_new),
            ):
                stages.setdefault(stage, []).append(s * 1e3)
            for st in result.stages:
                stages.setdefault(f"import.{st.stage}", []).append(st.seconds * 1e3)
    finally:
        await a.close()
        await b.close()
    return {
        "trials": args.trials,
        "requests_per_trial": 2,
        "stages_ms_p50": {k: statistics.median(v) for k, v in stages.items()},
        "stages_ms_max": {k: max(v) for k, v in stages.items()},
        "client_max_gap_ms_p50": statistics.median(gaps) * 1e3,
        "client_max_gap_ms_max": max(gaps) * 1e3,
        "outputs_equal": equal,
        "outputs": 2 * args.trials,
    }


async def reshard(bench: Bench, args: argparse.Namespace, refs: list[list[int]]) -> dict[str, Any]:
    node = await bench.node("r", (1, 1), 0)
    runs: list[dict[str, Any]] = []
    equal = 0
    try:
        for layout in ((2,), (1, 1)):
            reqs = [node.submit(prompt(i), args.long, GREEDY) for i in range(2)]
            readers = [asyncio.create_task(from_request(r)) for r in reqs]
            await asyncio.gather(*(generated(r, 50) for r in reqs))
            t = time.perf_counter()
            result = await node.reshard(layout)
            total = time.perf_counter() - t
            outs = await asyncio.gather(*readers)
            equal += sum(o.tokens == refs[i] for i, o in enumerate(outs))
            runs.append({
                "from": list(result.old_layout), "to": list(result.new_layout),
                "total_ms": total * 1e3,
                "stages_ms": {s.stage: s.seconds * 1e3 for s in result.stages},
                "client_max_gap_ms": max(o.max_gap_s for o in outs) * 1e3,
            })  # fmt: skip
    finally:
        await node.close()
    return {"runs": runs, "outputs_equal": equal, "outputs": 2 * len(runs)}


def table(r: dict[str, Any]) -> str:
    o, m, s = r["overhead"], r["migration"], r["reshard"]
    ol = r["overhead_logprobs"]
    lines = [
        f"gateway bench: {r['engine']} on the CPU, tiny random model "
        f"({o['concurrency']} streams x {o['tokens_per_request']} tokens, {o['rounds']} "
        "rounds per path, alternating)",
        "",
        f"{'overhead':<34} {'engine':>10} {'gateway':>10} {'gateway/engine':>15}",
        f"{'tokens/s (median round)':<34} {o['engine_tokens_per_s']:>10.0f} "
        f"{o['gateway_tokens_per_s']:>10.0f} {o['tokens_per_s_ratio']:>15.3f}",
        f"{'time to first token, ms (median)':<34} {o['engine_ttft_ms']:>10.2f} "
        f"{o['gateway_ttft_ms']:>10.2f} {o['ttft_added_ms']:>+13.2f}ms",
        f"{'wall time added per token':<34} {'':>10} {'':>10} "
        f"{o['wall_added_per_token_us']:>+13.1f}us",
        f"{'logprobs on: tokens/s':<34} {ol['engine_tokens_per_s']:>10.0f} "
        f"{ol['gateway_tokens_per_s']:>10.0f} {ol['tokens_per_s_ratio']:>15.3f}",
        f"{'logprobs on: first token, ms':<34} {ol['engine_ttft_ms']:>10.2f} "
        f"{ol['gateway_ttft_ms']:>10.2f} {ol['ttft_added_ms']:>+13.2f}ms",
        f"{'logprobs on: wall added per token':<34} {'':>10} {'':>10} "
        f"{ol['wall_added_per_token_us']:>+13.1f}us",
        f"{'logprobs on: max |engine - gateway|':<34} {'':>10} {'':>10} "
        f"{ol['logprob_max_abs_diff']:>15.1e}",
        f"  outputs equal on both paths: {o['outputs_equal'] and ol['outputs_equal']}",
        "",
        f"{'migration a -> b (' + str(m['trials']) + ' trials x 2)':<34} {'p50 ms':>10} "
        f"{'max ms':>10}",
    ]
    for k, v in m["stages_ms_p50"].items():
        lines.append(f"  {k:<32} {v:>10.1f} {m['stages_ms_max'][k]:>10.1f}")
    lines += [
        f"  {'longest gap a client saw':<32} {m['client_max_gap_ms_p50']:>10.1f} "
        f"{m['client_max_gap_ms_max']:>10.1f}",
        f"  outputs equal to uninterrupted: {m['outputs_equal']}/{m['outputs']}",
        "",
        f"{'reshard (2 requests in flight)':<34} {'total ms':>10} {'client gap':>10}  stages ms",
    ]
    for run in s["runs"]:
        name = f"{run['from']} -> {run['to']}"
        st = ", ".join(f"{k} {v:.0f}" for k, v in run["stages_ms"].items())
        lines.append(
            f"  {name:<32} {run['total_ms']:>10.0f} {run['client_max_gap_ms']:>10.0f}  {st}"
        )
    lines.append(f"  outputs equal to uninterrupted: {s['outputs_equal']}/{s['outputs']}")
    return "\n".join(lines)


async def run(args: argparse.Namespace) -> dict[str, Any]:
    command = args.engine_command or installed_engine(args.engine)
    if command is None:
        raise SystemExit(f"{args.engine} is not installed: run `make engines`")
    with tempfile.TemporaryDirectory(prefix="orl-bench-gateway-") as tmp:
        where = Path(tmp)
        model = await asyncio.to_thread(build_model, args.engine, where)
        settings = EngineSettings(
            str(model), command, "tiny", max_num_seqs=4, context=4096,
            args=VLLM_ARGS if args.engine == "vllm" else (), log_dir=where / "logs",
            start_timeout_s=600,
        )  # fmt: skip
        bench = Bench(args.engine, settings)
        try:
            result: dict[str, Any] = {"engine": args.engine}
            result["overhead"] = await overhead(bench, args)
            result["overhead_logprobs"] = await overhead(bench, args, logprobs=True)
            refs = await uninterrupted(bench, args.long, 2)
            result["migration"] = await migration(bench, args, refs)
            result["reshard"] = await reshard(bench, args, refs)
        finally:
            await bench.close()
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", choices=("llamacpp", "vllm"), default="llamacpp")
    p.add_argument("--engine-command", default="", help="default: what `make engines` installed")
    p.add_argument("--rounds", type=int, default=6, help="rounds per path (default 6)")
    p.add_argument("--concurrency", type=int, default=2, help="streams per round (default 2)")
    p.add_argument("--tokens", type=int, default=256, help="tokens per stream (default 256)")
    p.add_argument("--trials", type=int, default=5, help="migration trials (default 5)")
    p.add_argument("--long", type=int, default=600, help="tokens per moved request (default 600)")
    p.add_argument("--json", type=Path, help="also write the figures as JSON here")
    args = p.parse_args(argv)
    for name in ("rounds", "concurrency", "tokens", "trials"):
        if getattr(args, name) < 1:
            p.error(f"--{name}={getattr(args, name)}: must be at least 1")
    if args.long < 20 + 40 * args.trials + 50:
        p.error(f"--long={args.long}: must be at least {20 + 40 * args.trials + 50} "
                "(the last trial cuts at 20 + 40 x trials tokens)")  # fmt: skip
    setup_logging("warning")
    result = asyncio.run(run(args))
    print(table(result))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))
    ok = (result["migration"]["outputs_equal"] == result["migration"]["outputs"]
          and result["reshard"]["outputs_equal"] == result["reshard"]["outputs"])  # fmt: skip
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
