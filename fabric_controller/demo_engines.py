"""`make demo-engines` / `orlctl demo-engines`: the compute half on real engines, on a CPU.

A local cluster (``examples/local-engines.toml``: two generation nodes of two "GPUs",
each a CPU core here) whose generation agents run a real engine (llama.cpp by default,
or vLLM) with a tiny random-weight model built on the spot. The demo sends a step's
requests to one node's gateway, as an RL rollout client would, and the controller's
compute-scheduling loop reshards and migrates. The demo prints each action with its
per-stage timings and, at the end, checks every response against the same request run
alone and uninterrupted on one engine server: under greedy decoding they must be equal
token for token.

What the demo shows does not depend on timing. It drives the conditions and chooses the
moment of the loop's decision (``PauseSchedule``, ``orlctl schedule pause`` /
``resume``): with the loop paused, the step's longest requests fill every seat of
gen0-n0 (nothing queues, gen0-n1 idles; they start one after another, ``STAGGER``), and
once the longest is ``RESUME_AT`` tokens in (the others started) and the controller
holds telemetry taken since, the loop is resumed and re-plans at once. On that state its
planner reshards both nodes (TP1+TP1 -> TP2) and moves a running request, its output so
far recomputed by gen0-n1 (for requests ``MIN_FIRST_WAVE_TOKENS`` long or more:
``check_config``). The rest of the step's requests follow, and the loop goes on as it
does in production. Should that decision move no running request (an engine that fails
to start makes a reshard fail, and the loop skips the migrations of a node whose reshard
failed), the demo pauses the loop and resumes it once more (``RESUMES``). The demo
counts a migration "of a running request" by the client's own stream: tokens of the
request had arrived before the move began. It exits non-zero unless it showed a reshard,
such a migration and equal outputs.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
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
LAYOUT = (1, 1)  # each generation node's instances: TP1 + TP1 (one CPU core each)
FIRST_WAVE = SEATS * len(LAYOUT)  # the longest requests: they fill gen0-n0's seats
# Tokens the longest first-wave request (demo-0) has when the loop resumes, the others
# started (RUNNING_AT tokens each). The planner (an H800 model of Qwen2.5-14B, as the
# controller's default) reshards TP1+TP1 -> TP2 and moves a running request when the
# running requests are predicted long enough and enough of them is left: with the
# shortest first-wave request MIN_FIRST_WAVE_TOKENS long it does so on every state the
# decision can see, the longest 700 to 1,500 tokens in, the others anywhere up to that
# (the telemetry the loop reads lags the client by a few seconds; waiting for the slowest
# instead let the longest run to its end on a loaded machine). tests/unit/
# test_demo_engines.py checks that on ``scheduling.decide``, tests/e2e/
# test_engines_demo.py on real engines.
RESUME_AT = 700
RUNNING_AT = 20
MIN_FIRST_WAVE_TOKENS = 1250
# The first wave starts one request after another, request k+1 once request k has
# STAGGER[k] tokens. Two requests on one instance decode in lockstep: started together
# they stay equal, and on two instances each holding such a pair the planner gains
# nothing by moving one of two equal requests (it reshards and moves none). Staggered,
# the two requests of an instance differ by a constant gap, and the two instances' gaps
# differ too.
STAGGER = (100, 100, 300)
# How often the demo resumes the loop on the first wave at most: once more when its
# decision moved no running request (an engine that failed to start made a reshard
# fail, and the loop skips the migrations of a node whose reshard failed).
RESUMES = 3
WAIT_S = 600.0  # the most any stage of the demo waits (a loaded machine is slow)


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


@dataclass(frozen=True)
class RunningMove:
    """A request moved while it ran: ``tokens`` of its output had reached the client
    before the migration began (so they were generated on the source)."""

    request_id: str
    route: str  # source -> target
    method: str  # recompute or kv
    tokens: int
    command_id: str


@dataclass
class DemoResult:
    engine: str
    requests: list[RequestResult] = field(default_factory=list)
    actions: list[dict[str, Any]] = field(default_factory=list)
    running_moves: list[RunningMove] = field(default_factory=list)
    resumed_at_tokens: list[int] = field(default_factory=list)  # first wave, at resume
    reference_s: float = 0.0
    cluster_up_s: float = 0.0
    run_s: float = 0.0

    @property
    def matched(self) -> int:
        return sum(r.matches for r in self.requests)

    def kinds(self, kind: str) -> list[dict[str, Any]]:
        return [a for a in self.actions if a["kind"] == kind and a["ok"]]

    @property
    def running_migrations(self) -> int:
        """Migrations that moved at least one running request with tokens generated."""
        return len({m.command_id for m in self.running_moves})

    @property
    def shown(self) -> bool:
        """Everything the demo claims: a reshard, a running request moved with its
        tokens, and every output equal to the uninterrupted run."""
        return (
            bool(self.kinds("reshard"))
            and self.running_migrations > 0
            and bool(self.requests)
            and self.matched == len(self.requests)
        )


def check_config(cfg: DemoConfig) -> None:
    """The step must hold what the demo shows: ``FIRST_WAVE`` requests to fill gen0-n0's
    seats, the shortest of them ``MIN_FIRST_WAVE_TOKENS`` long."""
    if cfg.requests < FIRST_WAVE:
        raise errors.field_error(
            "--requests", cfg.requests, f"at least {FIRST_WAVE}: they fill {GEN_NODE}'s seats"
        )
    caps = step_caps(cfg)
    if caps[FIRST_WAVE - 1] < MIN_FIRST_WAVE_TOKENS:
        need = next(
            m
            for m in range(MIN_FIRST_WAVE_TOKENS, 100_000)
            if lengths(cfg.requests, m)[FIRST_WAVE - 1] >= MIN_FIRST_WAVE_TOKENS
        )
        allowed = (
            f"at least {MIN_FIRST_WAVE_TOKENS}"
            if cfg.equal_lengths
            else f"at least {need} with {cfg.requests} requests"
        )
        raise errors.field_error(
            "--max-tokens",
            cfg.max_tokens,
            f"{allowed}: the {FIRST_WAVE} longest requests must be {MIN_FIRST_WAVE_TOKENS} "
            "tokens or longer for the loop's planner to find resharding worth it",
        )


def step_caps(cfg: DemoConfig) -> list[int]:
    """Each request's max_tokens, longest first."""
    if cfg.equal_lengths:
        return [cfg.max_tokens] * cfg.requests
    return lengths(cfg.requests, cfg.max_tokens)


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


class Progress:
    """What the client has received of each request: (wall time, tokens so far) at
    every chunk, for telling afterwards how far a request was when it moved."""

    def __init__(self) -> None:
        self.log: dict[str, list[tuple[float, int]]] = {}

    def add(self, rid: str, tokens: int) -> None:
        self.log.setdefault(rid, []).append((time.time(), tokens))

    def tokens(self, rid: str) -> int:
        got = self.log.get(rid)
        return got[-1][1] if got else 0

    def tokens_before(self, rid: str, when: float) -> int:
        """Tokens of ``rid`` that had arrived before wall time ``when``."""
        return max((n for t, n in self.log.get(rid, []) if t < when), default=0)


async def stream(
    url: str, rid: str, prompt: list[int], n: int, t0: float, progress: Progress
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
            if got:
                progress.add(rid, len(tokens))
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


async def _until(
    what: str, check: Callable[[], Awaitable[bool]], tasks: list[asyncio.Task[Output]]
) -> None:
    """Poll the coroutine function ``check`` until it is true; fail naming ``what`` after
    ``WAIT_S``, or at once when a request stream ended with an error."""
    async with asyncio.timeout(WAIT_S):
        while not await check():
            for task in tasks:
                if task.done() and task.exception() is not None:
                    raise errors.FailedPrecondition(f"while waiting for {what}: {task.exception()}")
            await asyncio.sleep(0.1)


async def _resume(
    client: AsyncClient,
    result: DemoResult,
    progress: Progress,
    t0: float,
    say: Callable[[str], None],
    tasks: list[asyncio.Task[Output]],
) -> int:
    """Resume the paused loop for its decision on the first wave; when that moved no
    running request, pause and resume it again, ``RESUMES`` times at most. How many
    times it was resumed."""
    for attempt in range(1, RESUMES + 1):
        if await _decide(client, result, progress, t0, say, tasks) or attempt == RESUMES:
            return attempt
        await client.pause_schedule(True)
        say(f"  [{time.perf_counter() - t0:5.1f} s] no running request moved (an action "
            "failed?): the loop is paused, and resumed once more")  # fmt: skip
    raise AssertionError("unreachable")


async def _decide(
    client: AsyncClient,
    result: DemoResult,
    progress: Progress,
    t0: float,
    say: Callable[[str], None],
    tasks: list[asyncio.Task[Output]],
) -> bool:
    """Resume the paused loop once the controller holds telemetry taken after now, and
    wait for its decision; whether a running request moved."""
    seen_at = time.time()

    async def reported() -> bool:  # the controller holds a sample taken since
        nodes = {n.node: n for n in await client.nodes()}
        return float(nodes[GEN_NODE].telemetry.get("timestamp", 0.0)) > seen_at

    await _until(f"telemetry of {GEN_NODE} newer than the client's view", reported, tasks)
    at = [progress.tokens(f"demo-{k}") for k in range(FIRST_WAVE)]
    result.resumed_at_tokens = result.resumed_at_tokens or at
    resumed = time.time()
    await client.pause_schedule(False)
    say(f"  [{time.perf_counter() - t0:5.1f} s] resumed (orlctl schedule resume) at "
        f"{min(at)}..{max(at)} tokens: the loop re-plans now")  # fmt: skip

    actions: list[dict[str, Any]] = []

    async def decided() -> bool:  # a plan made since, carried out (or empty)
        s = await client.schedule()
        actions[:] = s.actions  # (the watcher may not have printed them yet)
        return s.planned_at >= resumed and (s.acted or not (s.reshards or s.migrations))

    await _until("the loop's decision after resuming", decided, tasks)
    return bool(running_moves(actions, progress))


def running_moves(actions: list[dict[str, Any]], progress: Progress) -> list[RunningMove]:
    """The requests that ok migrations of running requests (their KV cache recomputed or
    moved, not a queued request dispatched) moved after tokens of theirs had arrived."""
    out = []
    for a in actions:
        if a["kind"] != "migrate" or not a["ok"] or a.get("method") not in ("recompute", "kv"):
            continue
        began = a["timestamp"] - a["seconds"]
        for rid in a["requests"]:
            tokens = progress.tokens_before(rid, began)
            if tokens > 0:
                out.append(RunningMove(rid, a["node"], a["method"], tokens, a["command_id"]))
    return out


async def _run(cfg: DemoConfig, run_dir: Path, quiet: bool) -> DemoResult:
    def say(message: str) -> None:
        if not quiet:
            print(message, flush=True)

    check_config(cfg)
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
    caps = step_caps(cfg)
    t = time.perf_counter()
    refs = await reference(settings, cfg.engine, ps, caps)
    result.reference_s = time.perf_counter() - t
    say(f"  reference: {len(ps)} requests of {caps[-1]}..{caps[0]} tokens, each alone on one "
        f"{cfg.engine} server ({result.reference_s:.1f} s)")  # fmt: skip
    t = time.perf_counter()
    # two sequences per instance: a CPU core decodes a batch barely faster than its
    # sequences one by one, and a full node's queue is what the loop can spread
    layout = ",".join(map(str, LAYOUT))
    engine = local.LocalEngine(cfg.engine, str(model), command, args, layout, SEATS, cfg.context)
    cluster = await asyncio.to_thread(
        local.up, WIRING, run_dir, ephemeral_ports=True, engine=engine,
        progress=lambda m: say(f"  {m}"),
    )  # fmt: skip
    result.cluster_up_s = time.perf_counter() - t
    try:
        async with AsyncClient(cluster.controller, timeout_s=10.0) as client:
            outs = await _step(cluster.controller, client, result, ps, caps, say, quiet)
    finally:
        await asyncio.to_thread(local.down, Path(cluster.run_dir))
    (run_dir / "outputs.json").write_text(
        json.dumps({"outputs": [o[0] for o in outs], "reference": refs})
    )
    for k, ((tokens, nodes, first_s), ref) in enumerate(zip(outs, refs, strict=True)):
        result.requests.append(
            RequestResult(f"demo-{k}", len(tokens), nodes, first_s, result.run_s, tokens == ref)
        )
    return result


Output = tuple[list[int], list[str], float]  # a request's tokens, nodes, first-token time


async def _step(
    controller: str,
    client: AsyncClient,
    result: DemoResult,
    ps: list[list[int]],
    caps: list[int],
    say: Callable[[str], None],
    quiet: bool,
) -> list[Output]:
    """The step: the first wave with the loop paused, the loop resumed at a known point,
    then the rest; each request's output."""
    gateways = {n.node: n.gateway for n in await client.nodes() if n.gateway}
    say("  gateways: " + ", ".join(f"{n} http://{g}" for n, g in sorted(gateways.items())))
    url = f"http://{gateways[GEN_NODE]}"
    await client.pause_schedule(True)
    first = list(range(FIRST_WAVE))
    say(f"  the compute-scheduling loop is paused (orlctl schedule pause); the {FIRST_WAVE} "
        f"longest requests fill {GEN_NODE}'s {FIRST_WAVE} seats (each starting when the one "
        f"before has {'/'.join(map(str, STAGGER))} tokens), and the loop resumes once all "
        f"run and the longest has {RESUME_AT} tokens:")  # fmt: skip
    progress = Progress()
    t0 = time.perf_counter()
    watcher = asyncio.create_task(_watch(controller, result.actions, t0, quiet))

    def start(k: int) -> asyncio.Task[Output]:
        return asyncio.create_task(stream(url, f"demo-{k}", ps[k], caps[k], t0, progress))

    tasks = [start(0)]
    try:
        for k in first[1:]:

            async def started(before: int = k - 1) -> bool:
                return progress.tokens(f"demo-{before}") >= STAGGER[before]

            await _until(f"{STAGGER[k - 1]} tokens of demo-{k - 1}", started, tasks)
            tasks.append(start(k))

        async def reached() -> bool:
            return progress.tokens("demo-0") >= RESUME_AT and all(
                progress.tokens(f"demo-{k}") >= RUNNING_AT for k in first
            )

        await _until(f"{RESUME_AT} tokens of demo-0, the others running", reached, tasks)
        await _resume(client, result, progress, t0, say, tasks)
        tasks += [start(k) for k in range(FIRST_WAVE, len(ps))]
        say(f"  [{time.perf_counter() - t0:5.1f} s] the other {len(ps) - FIRST_WAVE} "
            f"request(s) of the step stream into {GEN_NODE}; the loop goes on:")  # fmt: skip
        outs = await asyncio.gather(*tasks)
        await asyncio.sleep(0.5)  # the last actions' records
    finally:
        for task in tasks:
            task.cancel()
        watcher.cancel()
    result.run_s = time.perf_counter() - t0
    result.running_moves = running_moves(result.actions, progress)
    return list(outs)


def report(r: DemoResult) -> str:
    lines = [
        "  requests:",
        f"    {'id':<8} {'tokens':>6}  {'first token':>11}  {'nodes':<20} equal",
    ]
    for q in r.requests:
        lines.append(f"    {q.request_id:<8} {q.tokens:>6}  {q.first_token_s:>9.2f} s  "
                     f"{' -> '.join(q.nodes):<20} {'yes' if q.matches else 'NO'}")  # fmt: skip
    for m in r.running_moves:
        lines.append(f"  {m.request_id} moved while running, {m.route} by {m.method}, "
                     f"{m.tokens} tokens already generated")  # fmt: skip
    tokens = sum(m.tokens for m in r.running_moves)
    lines.append(
        f"  {len(r.kinds('reshard'))} reshard(s) and {len(r.kinds('migrate'))} migration(s) "
        f"carried out in {r.run_s:.1f} s, {r.running_migrations} of them of running "
        f"requests ({len(r.running_moves)} request(s), {tokens} tokens already generated); "
        f"{r.matched} of {len(r.requests)} outputs equal the uninterrupted run token for token"
    )
    if not r.shown:
        lines.append("  NOT SHOWN: the demo needs a reshard, a running request moved and "
                     "every output equal")  # fmt: skip
    return "\n".join(lines)


def run_demo_engines(cfg: DemoConfig, *, as_json: bool = False) -> int:
    """Run the demo; 0 when it showed a reshard and a running request moved, and every
    output matched; 1 otherwise."""
    setup_logging("warning", "console", sys.stderr)
    check_config(cfg)
    with tempfile.TemporaryDirectory(prefix="orl-demo-engines-") as tmp:
        run_dir = cfg.run_dir or Path(tmp)
        run_dir.mkdir(parents=True, exist_ok=True)
        r = asyncio.run(_run(cfg, run_dir, as_json))
    if as_json:
        doc = asdict(r)
        doc["matched"] = r.matched
        doc["reshards"] = len(r.kinds("reshard"))
        doc["migrations"] = len(r.kinds("migrate"))
        doc["running_migrations"] = r.running_migrations
        doc["shown"] = r.shown
        print(json.dumps(doc, indent=2))
    else:
        print(report(r))
    return 0 if r.shown else 1
