"""The gateway over a real SGLang server: a request migrated mid-response between two
nodes must give the uninterrupted greedy output, token for token.

SGLang runs on an NVIDIA GPU, or on the CPU of an Intel AMX Xeon (its CPU build), so this
test is skipped elsewhere, saying why. Point ``$ORL_SGLANG_PYTHON`` at the Python of an
environment where ``import sglang`` works; ``$ORL_SGLANG_MODEL`` may name a model
directory (default: the tiny random Llama of the other engine tests) and
``$ORL_SGLANG_ARGS`` replace the extra server flags. The same checks run on every machine
over a stand-in of SGLang's API (test_sglang_standin.py).
"""

from __future__ import annotations

import asyncio
import os
import shlex
import shutil
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest

from node_agent.engine import Destination
from node_agent.engines import port_picker, server_factory
from node_agent.engines.base import CAP_PAUSE, CAP_UPDATE_WEIGHTS, Device, EngineServer, Placement
from node_agent.engines.http_engine import HttpEngine
from node_agent.engines.sglang import SglangServer, cpu_supported
from node_agent.gateway.engine import GatewayConfig, GatewayEngine
from tests.engines.conftest import GREEDY, Node, Nodes, check_logprobs, read_all, settings_for
from tests.engines.reference import Reference
from tests.helpers import eventually

pytestmark = [pytest.mark.engine, pytest.mark.gpu]

PROMPTS = [[5 + i, 17, 3 + 2 * i, 99, 42 + i, 7] for i in range(3)]
LONG = 2000
# two servers share GPU 0 (a and b are both one-GPU nodes); float32 and no CUDA graphs:
# the same greedy tokens however a sequence is batched or resumed, and a quick start
GPU_ARGS = ("--dtype", "float32", "--mem-fraction-static", "0.3", "--disable-cuda-graph")


def has_nvidia_gpu() -> bool:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return False
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.returncode == 0 and "GPU " in out.stdout


@pytest.fixture(scope="module")
def sglang_python() -> tuple[Path, Device]:
    """The Python with SGLang and the device it runs on, or a skip that says what is
    missing."""
    device: Device | None = "cuda" if has_nvidia_gpu() else "cpu" if cpu_supported() else None
    if device is None:
        pytest.skip("SGLang needs an NVIDIA GPU or an Intel AMX Xeon; this machine has neither")
    given = os.environ.get("ORL_SGLANG_PYTHON")
    if not given:
        pytest.skip(
            "SGLang is not installed here: set $ORL_SGLANG_PYTHON to the Python of an "
            "environment with SGLang (pip install sglang)"
        )
    probe = subprocess.run(
        [given, "-c", "import sglang; print(sglang.__version__)"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    if probe.returncode != 0:
        pytest.skip(f"$ORL_SGLANG_PYTHON={given} cannot import sglang: {probe.stderr[-500:]}")
    return Path(given), device


async def add(nodes: Nodes, name: str, device: Device) -> Node:
    """A one-instance node on ``device`` (Nodes.add places instances on the CPU)."""
    make = server_factory("sglang", nodes.settings(name))
    servers: list[EngineServer] = []

    def tracked(p: Placement) -> EngineServer:
        servers.append(make(p))
        return servers[-1]

    config = GatewayConfig(device=device, restart_backoff_s=(0.2, 0.5))
    engine = GatewayEngine(
        "sglang", 1, (1,), tracked, port_picker(0), peers=nodes.peers, node=name, config=config
    )
    node = Node(name, engine, servers)
    nodes.nodes.append(node)
    nodes.peers.gateways[name] = engine
    await engine.start()
    return node


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    given = os.environ.get("ORL_SGLANG_MODEL")
    if given:
        return Path(given)
    from sim_backends.tiny_models import TinyShape, write_hf_llama

    return write_hf_llama(tmp_path_factory.mktemp("hf") / "tiny", TinyShape(), seed=7)


@pytest.fixture
async def nodes(
    sglang_python: tuple[Path, Device], model: Path, tmp_path: Path
) -> AsyncIterator[tuple[Nodes, Node, Node]]:
    python, device = sglang_python
    extra = os.environ.get("ORL_SGLANG_ARGS")
    args = tuple(shlex.split(extra)) if extra is not None else GPU_ARGS if device == "cuda" else ()
    nodes = Nodes("sglang", settings_for(python, model, tmp_path, context=4096, args=args))
    try:
        a, b = await asyncio.gather(add(nodes, "a", device), add(nodes, "b", device))
        yield nodes, a, b
    finally:
        await nodes.close()


async def direct(server: HttpEngine, prompt: list[int], n: int) -> list[int]:
    """One uninterrupted greedy call straight to SGLang's ``/generate``."""
    body = {
        "input_ids": prompt,
        "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True},
    }
    async with (
        aiohttp.ClientSession() as http,
        http.post(server.base + "/generate", json=body) as r,
    ):
        assert r.status == 200, await r.text()
        doc = await r.json()
    return list(doc["output_ids"])


async def test_migration_mid_response_gives_the_uninterrupted_output(
    nodes: tuple[Nodes, Node, Node],
) -> None:
    _, a, b = nodes
    server, other = a.servers[0], b.servers[0]
    assert isinstance(server, SglangServer) and isinstance(other, SglangServer)
    assert CAP_PAUSE in server.capabilities, f"SGLang {server.version} cannot pause in place"
    reference = [await direct(other, p, LONG) for p in PROMPTS]
    reqs = [a.engine.submit(p, LONG, GREEDY) for p in PROMPTS]
    readers = [asyncio.create_task(read_all(r)) for r in reqs]
    await eventually(lambda: len(reqs[0].output) >= 100, within_s=300)
    await a.engine.pause()  # in place: a real engine would finish these in a blink
    try:
        load = await server.load()
        assert load.running == a.engine.stats().running_requests and load.kv_usage is not None
        moving = [r for r in reqs if not r.done]
        exported, missing = await a.engine.export_requests([r.id for r in moving])
    finally:
        await a.engine.unpause()
    assert reqs[0] in moving and not missing and exported[0].generated_tokens >= 100
    result = await b.engine.import_requests(exported, 0, recompute=True)
    assert set(result.admitted) == {r.id for r in moving}
    await a.engine.release_requests(exported, Destination("b", "in-process"))
    assert await asyncio.wait_for(asyncio.gather(*readers), 600) == reference
    assert all(r.hops == ["a", "b"] for r in moving)


async def test_logprobs_and_a_weight_update_from_disk(
    nodes: tuple[Nodes, Node, Node], model: Path, hf_model_next: Path
) -> None:
    """The tiny model's logprobs against the trainer's recomputation, then an update of
    ``a`` to the next checkpoint: its outputs are the new weights', ``b`` keeps the old."""
    if os.environ.get("ORL_SGLANG_MODEL"):
        pytest.skip("compares with the tiny test models: unset $ORL_SGLANG_MODEL")
    _, a, b = nodes
    server, other = a.servers[0], b.servers[0]
    assert isinstance(server, SglangServer) and CAP_UPDATE_WEIGHTS in server.capabilities
    await check_logprobs(server, Reference(model), PROMPTS, 32, "sg")
    path = await server.prepare_model(str(hf_model_next))
    await server.update_weights(path, version="step-2")
    assert server.model == path
    await check_logprobs(server, Reference(hf_model_next), PROMPTS, 32, "sg2")
    await check_logprobs(other, Reference(model), PROMPTS[:1], 32, "sg-old")
