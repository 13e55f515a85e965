"""Small helpers shared by the tests."""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from orchestrrl.devcerts import CertFiles
from orchestrrl.tls import TlsConfig


class FakeClock:
    """A clock that moves only when a test sets ``now``."""

    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


async def eventually(
    cond: Callable[[], bool], within_s: float = 30.0, poll_s: float = 0.002
) -> None:
    """Return once ``cond()`` holds; TimeoutError after ``within_s`` (generous: a wait for
    liveness on a busy machine, never a check that something is fast)."""
    async with asyncio.timeout(within_s):
        while not cond():  # noqa: ASYNC110 - polls state that other tasks change
            await asyncio.sleep(poll_s)


async def until(
    check: Callable[[], Awaitable[bool]], within_s: float = 60.0, poll_s: float = 0.05
) -> None:
    """Return once ``await check()`` holds (a check that asks a server); TimeoutError
    after ``within_s``. Wait only for a state that stays once reached (a held one)."""
    async with asyncio.timeout(within_s):
        while not await check():  # noqa: ASYNC110 - polls a server, which has no event
            await asyncio.sleep(poll_s)


def tls(files: CertFiles) -> TlsConfig:
    """The mutual-TLS settings of a certificate from ``make_dev_pki``."""
    return TlsConfig(files.cert, files.key, files.ca)


def orlctl(*args: str, timeout_s: float = 300.0) -> str:
    """``orlctl --json ARGS`` in a subprocess; its stdout (AssertionError with its stderr
    when it exits non-zero)."""
    r = subprocess.run(
        [sys.executable, "-m", "fabric_controller.cli", "--json", *args],
        capture_output=True, text=True, timeout=timeout_s,
    )  # fmt: skip
    assert r.returncode == 0, f"orlctl {' '.join(args)} exited {r.returncode}:\n{r.stderr}"
    return r.stdout


@dataclass(frozen=True)
class LocalCluster:
    controller: str  # HOST:PORT of the fabric controller
    gateways: list[str]  # http://HOST:PORT of each generation node's gateway, sorted


@contextlib.contextmanager
def local_llamacpp_cluster(
    run_dir: Path, model: Path, llama_binary: Path, *, seats: int = 8, context: int = 256
) -> Iterator[LocalCluster]:
    """`orlctl local up` of examples/local-engines.toml (simulated OCS, controller, a
    training node and two generation nodes, each running two llama-servers on ``model``,
    a GGUF) on ephemeral ports in ``run_dir``; `orlctl local down` on exit. A trainer
    publishes checkpoints for the weight-sync phase in
    ``fabric_controller.local.checkpoint_dir(run_dir, demo_rl.TRAIN_NODE)``."""
    from fabric_controller import demo_rl
    from orchestrrl.client import Client

    up = orlctl("local", "up", "--wiring", str(demo_rl.WIRING), "--run-dir", str(run_dir),
                "--ephemeral-ports", "--engine", "llamacpp", "--engine-model", str(model),
                "--engine-command", str(llama_binary), "--tp-layout", "1,1",
                "--engine-max-num-seqs", str(seats), "--engine-context", str(context))  # fmt: skip
    controller = json.loads(up)["controller"]
    try:
        with Client(controller) as client:
            gateways = sorted(f"http://{n.gateway}" for n in client.nodes() if n.gateway)
        yield LocalCluster(controller, gateways)
    finally:
        orlctl("local", "down", "--run-dir", str(run_dir))
