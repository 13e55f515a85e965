"""Small helpers shared by the tests."""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from orchestrrl.devcerts import CertFiles
from orchestrrl.tls import TlsConfig

if TYPE_CHECKING:
    from fabric_controller.scheduler_loop import ComputeScheduler
    from fabric_controller.scheduling import SchedulingConfig
    from node_agent.servicer import NodeAgentService
    from orchestrrl import grpcutil
    from orchestrrl.model import Wiring
    from orchestrrl.v1.node_agent_pb2_grpc import NodeAgentAsyncStub
    from sim_backends.harness import Fabric


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


@dataclass
class Agent:
    """A node agent served in-process on an ephemeral port, its uplink to a controller
    running (:func:`start_agent`)."""

    node: str
    engine: Any  # the agent's RolloutEngine (a simulated engine or a real gateway)
    servicer: NodeAgentService
    server: grpcutil.RunningServer
    stub: NodeAgentAsyncStub
    uplink: asyncio.Task[None]

    async def stop(self) -> None:
        self.uplink.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.uplink
        await self.server.stop(0)
        await self.servicer.close()


async def start_agent(node: str, engine: Any, gpus: int, controller: str, tmp: Path) -> Agent:
    """An agent for ``engine`` (simulated GPUs, no NICs) that registers with and streams
    telemetry to ``controller`` every 0.05 s."""
    from node_agent.commands import CommandLog
    from node_agent.nics import SysfsNics
    from node_agent.servicer import SERVICE_NAME, NodeAgentService
    from node_agent.telemetry import Collector
    from node_agent.uplink import Uplink, UplinkSettings
    from orchestrrl import grpcutil
    from orchestrrl.v1 import node_agent_pb2_grpc as pb_grpc
    from sim_backends.gpus import SimulatedGpus

    fast = UplinkSettings(rpc_timeout_s=2.0, backoff_initial_s=0.02, backoff_max_s=0.1)
    collector = Collector(node, SimulatedGpus(gpus, seed=1), SysfsNics([], root=tmp), engine)
    await collector.open()
    servicer = NodeAgentService(collector, engine, CommandLog(), default_interval_s=0.05)
    server = await grpcutil.start_server(
        "127.0.0.1:0",
        lambda s: pb_grpc.add_NodeAgentServicer_to_server(servicer, s),
        [SERVICE_NAME],
    )
    uplink = Uplink(collector, server.address, lambda: controller, 0.05, settings=fast)
    channel = grpcutil.insecure_channel(server.address)
    stub = cast("NodeAgentAsyncStub", pb_grpc.NodeAgentStub(channel))
    return Agent(node, engine, servicer, server, stub, asyncio.create_task(uplink.run()))


def grpo_trainer(
    out: Path,
    *,
    model: Any,
    tokenizer: Any,
    prompts: list[Any],
    reward: Callable[..., list[float]],
    rollout_func: Callable[..., Any],
    callback: Any,
    generations: int,
    batch: int,
    steps: int,
    max_completion: int,
) -> Any:
    """TRL's own ``GRPOTrainer`` on the CPU as the TRL tests run it (``use_vllm=False``:
    ``rollout_func`` generates): ``batch`` completions a step, ``generations`` per prompt,
    lr 1e-2, fp32, seed 0, nothing saved or reported, one ``callback``."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    args = GRPOConfig(
        output_dir=str(out),
        per_device_train_batch_size=batch,
        num_generations=generations,
        max_steps=steps,
        max_completion_length=max_completion,
        learning_rate=1e-2,
        bf16=False,
        use_cpu=True,
        gradient_checkpointing=False,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        seed=0,
        disable_tqdm=True,
    )
    return GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=args,
        train_dataset=Dataset.from_dict({"prompt": prompts}),
        processing_class=tokenizer,
        rollout_func=rollout_func,
        callbacks=[callback],
    )


@dataclass
class ComputeLoop:
    """A controller on simulated OCSes, and its compute-scheduling loop served on an
    ephemeral port (:func:`compute_loop`): agents register at ``address``; the test runs
    the loop's rounds itself (``scheduler.round()``)."""

    fabric: Fabric
    scheduler: ComputeScheduler
    address: str


@contextlib.asynccontextmanager
async def compute_loop(
    wiring: Wiring,
    state: Path,
    config: SchedulingConfig,
    *,
    deadline_s: float,
    agent_timeout_s: float,
) -> AsyncIterator[ComputeLoop]:
    """A :class:`ComputeLoop` for ``wiring`` (its store at ``state``; a node is down
    ``deadline_s`` after its last heartbeat; agent calls time out after
    ``agent_timeout_s``), stopped on exit."""
    from fabric_controller.drivers.agents import AgentClients
    from fabric_controller.scheduler_loop import ComputeScheduler
    from fabric_controller.servicer import FabricControllerServicer
    from orchestrrl import grpcutil
    from orchestrrl.v1 import fabric_controller_pb2_grpc
    from sim_backends.harness import SERVICE, start_fabric

    fabric = await start_fabric(
        wiring, state, switching_time_s=0.001, heartbeat_interval_s=0.2, deadline_s=deadline_s
    )
    clients = AgentClients(None, timeout_s=agent_timeout_s)
    sched = ComputeScheduler(fabric.controller, clients.get, config=config)
    try:
        server = await grpcutil.start_server(
            "127.0.0.1:0",
            lambda s: fabric_controller_pb2_grpc.add_FabricControllerServicer_to_server(
                FabricControllerServicer(fabric.controller, scheduler=sched), s
            ),
            [SERVICE],
        )
        try:
            yield ComputeLoop(fabric, sched, server.address)
        finally:
            await server.stop(0)
    finally:
        await clients.close()
        await fabric.stop()
