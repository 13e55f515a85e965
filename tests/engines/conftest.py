"""Real inference engines on the CPU: where they are, tiny models for them, gateways over them.

``make test`` installs both engines before pytest runs (``scripts/install-engines.sh``);
the fixtures ``llama_binary`` and ``vllm_binary`` (tests/conftest.py) find them, or skip
the test saying which command installs them.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import signal
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import pytest

from node_agent.engines import port_picker, server_factory
from node_agent.engines.base import EngineServer, Placement, Sampling, Submission
from node_agent.engines.http_engine import EngineSettings, HttpEngine
from node_agent.gateway.engine import GatewayConfig, GatewayEngine
from node_agent.gateway.http import GatewayServer, GatewaySettings
from node_agent.gateway.requests import Request
from sim_backends.tiny_models import TinyShape, write_gguf_llama, write_hf_llama
from sim_backends.token_engine import LocalPeers
from tests.engines.reference import Reference, max_abs_diff
from tests.helpers import eventually

GREEDY = Sampling(temperature=0.0, ignore_eos=True)
# sampled as an RL rollout samples: the engines still report the raw model's logprobs
SAMPLED = Sampling(temperature=0.8, top_k=40, top_p=0.95, seed=11, ignore_eos=True)
LOGPROB_TOL = 1e-3  # float32 engine against float32 recomputation
TIE = 1e-4  # a greedy token may differ from the reference's argmax only within this gap


def cpu_placement(core: int = 0) -> Placement:
    """A TP1 instance on one core, on a free loopback port."""
    p = Placement(0, 1, (core,), "cpu", 0)
    return dataclasses.replace(p, port=port_picker(0)(p))


async def generate(
    server: EngineServer, prompt: list[int], n: int, sampling: Sampling, rid: str
) -> tuple[list[int], list[float]]:
    """One call straight to the adapter (no gateway), with logprobs."""
    tokens: list[int] = []
    logprobs: list[float] = []
    async for chunk in server.generate(Submission(rid, tuple(prompt), n, sampling, logprobs=True)):
        assert len(chunk.logprobs) == len(chunk.token_ids)
        tokens += chunk.token_ids
        logprobs += chunk.logprobs
    return tokens, logprobs


async def check_logprobs(
    server: EngineServer, ref: Reference, prompts: list[list[int]], n: int, tag: str
) -> tuple[float, list[list[int]]]:
    """Greedy and sampled calls: every logprob within LOGPROB_TOL of the trainer's
    recomputation, every greedy token the reference's argmax (or tied with it). Returns
    the largest difference and the greedy outputs."""
    worst = 0.0
    outs = []
    for i, prompt in enumerate(prompts):
        for kind, sampling in (("g", GREEDY), ("s", SAMPLED)):
            tokens, lps = await generate(server, prompt, n, sampling, f"{tag}-{kind}{i}")
            assert len(tokens) == len(lps) == n
            rec = ref.recompute(prompt, tokens)
            worst = max(worst, max_abs_diff(lps, rec.logprobs))
            if kind == "g":
                assert all(gap <= TIE for gap in rec.argmax_gap), rec.argmax_gap
                outs.append(tokens)
    assert worst < LOGPROB_TOL, worst
    return worst, outs


@pytest.fixture(scope="session")
def gguf_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # one layer: llama.cpp on a CPU is not batch-invariant, and a deeper random model
    # amplifies its rounding differences into other greedy tokens (measured: 0 of 384
    # continuations differed with one layer, 20 of 384 with two)
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    return write_gguf_llama(path, TinyShape(layers=1), seed=7)


@pytest.fixture(scope="session")
def hf_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_hf_llama(tmp_path_factory.mktemp("hf") / "tiny", TinyShape(), seed=7)


@pytest.fixture(scope="session")
def hf_model_next(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same model after a training step: other weights, the same tensors."""
    return write_hf_llama(tmp_path_factory.mktemp("hf") / "tiny-next", TinyShape(), seed=8)


@pytest.fixture(scope="session")
def hf_model_other(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A checkpoint of another shape: an update to it must be refused."""
    shape = TinyShape(layers=1, hidden=320, intermediate=640)
    return write_hf_llama(tmp_path_factory.mktemp("hf") / "tiny-other", shape, seed=9)


@dataclass
class Node:
    """A node's gateway over real engine instances (in this process)."""

    name: str
    engine: GatewayEngine
    servers: list[EngineServer] = field(default_factory=list)
    http: GatewayServer | None = None

    @property
    def url(self) -> str:
        assert self.http is not None
        return f"http://{self.http.address}"

    def live(self) -> list[EngineServer]:
        return [s for s in self.servers if s.alive]


class Nodes:
    """Gateways that follow each other's requests in-process (the agents use gRPC)."""

    def __init__(self, kind: str, settings: Callable[[str], EngineSettings]) -> None:
        self.kind = kind
        self.settings = settings
        self.peers = LocalPeers()
        self.nodes: list[Node] = []

    async def add(
        self,
        name: str,
        layout: tuple[int, ...],
        *,
        http: bool = False,
        gpus: int | None = None,
        cpu_offset: int = 0,
    ) -> Node:
        settings = dataclasses.replace(self.settings(name), cpu_offset=cpu_offset)
        make = server_factory(self.kind, settings)
        node = Node(name, None)  # type: ignore[arg-type]

        def tracked(p: Placement) -> EngineServer:
            server = make(p)
            node.servers.append(server)
            return server

        node.engine = GatewayEngine(
            self.kind,
            gpus or sum(layout),
            layout,
            tracked,
            port_picker(0),
            peers=self.peers,
            node=name,
            config=GatewayConfig(device="cpu", restart_backoff_s=(0.2, 0.5)),
        )
        await node.engine.start()
        self.nodes.append(node)
        self.peers.gateways[name] = node.engine
        if http:
            node.http = GatewayServer(
                node.engine, GatewaySettings(settings.served_model, settings.context)
            )
            await node.http.start("127.0.0.1:0")
        return node

    async def close(self) -> None:
        for node in self.nodes:
            if node.http is not None:
                await node.http.stop()
            await node.engine.close()


def settings_for(
    command: Path,
    model: Path,
    log_dir: Path,
    *,
    seqs: int = 4,
    context: int = 1024,
    args: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
) -> Callable[[str], EngineSettings]:
    def make(node: str) -> EngineSettings:
        return EngineSettings(
            model=str(model),
            command=str(command),
            served_model="tiny",
            max_num_seqs=seqs,
            context=context,
            args=args,
            env=env or {},
            log_dir=log_dir / node,
            start_timeout_s=600,
            stop_grace_s=15,
        )

    return make


async def read_all(req: Request) -> list[int]:
    out: list[int] = []
    async for chunk in req.tokens():
        out.extend(chunk)
    return out


async def freeze_mid_response(
    submit: Callable[[], list[Request]],
    signal_engine: Callable[[int], None],
    expected: list[list[int]],
    min_tokens: int = 1,
) -> tuple[list[Request], list[asyncio.Task[list[int]]]]:
    """Submit requests and freeze their engine (``signal_engine(SIGSTOP)``) while none of
    them is complete as the gateway sees them, however fast the engine runs: once each
    has streamed ``min_tokens`` it is frozen and the gateway drains what was already
    sent; if a request completed meanwhile the race was lost, and the engine is resumed,
    the outputs checked against ``expected`` and the attempt repeated. Returns the
    requests and their readers, the engine still frozen (for the caller to kill)."""
    for _attempt in range(5):
        reqs = submit()
        readers = [asyncio.create_task(read_all(r)) for r in reqs]
        await eventually(
            lambda: all(len(r.output) >= min_tokens or r.done for r in reqs),  # noqa: B023
            within_s=120,
        )
        signal_engine(signal.SIGSTOP)
        await asyncio.sleep(0.5)
        if not any(r.done for r in reqs):
            return reqs, readers
        signal_engine(signal.SIGCONT)
        assert await asyncio.gather(*readers) == expected
    pytest.fail("the engine finished a request before every attempt to freeze it")


def generating_tasks(server: EngineServer) -> list[int]:
    """The thread ids of an instance's processes other than the one that serves its HTTP
    API: those that generate (vLLM's engine core and its workers)."""
    assert isinstance(server, HttpEngine) and server.process.pid is not None
    group = server.process.pid  # the server leads its own process group
    tids: list[int] = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == group:
            continue
        try:
            if int((proc / "stat").read_text().rsplit(")", 1)[1].split()[2]) != group:
                continue
            tids += [int(t.name) for t in (proc / "task").iterdir()]
        except (OSError, ValueError, IndexError):
            continue  # it exited meanwhile
    return tids


@contextlib.contextmanager
def generating_below_the_test(servers: list[EngineServer]) -> Iterator[None]:
    """While inside, the instances' generating processes run at the lowest priority (nice
    19) while this test, the servers' HTTP processes and the gateway keep theirs: however
    busy the machine, an engine cannot run far ahead of a test that sets up a state to hold
    (requests started, then paused in place) while the test waits for the CPU. Afterwards
    their priority comes back where the system allows it (lowering a nice value needs
    CAP_SYS_NICE; without it they stay at 19: slower on a busy machine, the same tokens)."""
    before: dict[int, int] = {}
    for server in servers:
        for tid in generating_tasks(server):
            with contextlib.suppress(OSError):
                before[tid] = os.getpriority(os.PRIO_PROCESS, tid)
                os.setpriority(os.PRIO_PROCESS, tid, 19)
    try:
        yield
    finally:
        for tid, nice in before.items():
            with contextlib.suppress(OSError):
                os.setpriority(os.PRIO_PROCESS, tid, nice)


async def stream_http(url: str, body: dict[str, object]) -> list[int]:
    """The token ids a client of the gateway at ``url`` reads, streaming."""
    tokens: list[int] = []
    async with (
        aiohttp.ClientSession() as http,
        http.post(url + "/v1/completions", json={**body, "stream": True}) as r,
    ):
        assert r.status == 200, await r.text()
        async for line in r.content:
            text = line.decode().strip()
            if text.startswith("data: {"):
                event = json.loads(text[6:])
                assert "error" not in event, event
                tokens.extend(event["choices"][0]["token_ids"])
    return tokens
