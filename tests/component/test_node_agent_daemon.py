"""The whole agent (run_agent, and the real process) against a fake FabricController."""

from __future__ import annotations

import asyncio
import json
import signal
import sys
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import pytest
from structlog.testing import capture_logs

from node_agent.config import SIM_ENGINE, AgentConfig
from node_agent.daemon import run_agent
from node_agent.uplink import UplinkSettings
from orchestrrl import grpcutil
from orchestrrl.v1 import node_agent_pb2, node_agent_pb2_grpc
from sim_backends.fake_controller import RunningFakeController, start_fake_controller

if TYPE_CHECKING:
    from orchestrrl.v1.node_agent_pb2_grpc import NodeAgentAsyncStub

pytestmark = pytest.mark.component

REPO = Path(__file__).resolve().parents[2]
TIMEOUT = 30.0  # liveness on a busy machine (a subprocess starting, a reconnect)
FAST = UplinkSettings(rpc_timeout_s=2.0, backoff_initial_s=0.02, backoff_max_s=0.1)
Context = Any


Controller = RunningFakeController
start_controller = start_fake_controller


@pytest.fixture
async def controller() -> AsyncIterator[Controller]:
    running = await start_controller()
    yield running
    await running.server.stop(0)


async def eventually(predicate: Callable[[], bool], what: str) -> None:
    async with asyncio.timeout(TIMEOUT):
        while not predicate():  # noqa: ASYNC110 - polls state that other tasks change
            await asyncio.sleep(0.01)
    assert predicate(), what


@dataclass
class RunningAgent:
    task: asyncio.Task[int]
    stop: asyncio.Event
    ready_file: Path

    async def finish(self) -> int:
        self.stop.set()
        async with asyncio.timeout(TIMEOUT):
            return await self.task


@pytest.fixture
async def start_agent(tmp_path: Path) -> AsyncIterator[Callable[..., RunningAgent]]:
    agents: list[RunningAgent] = []

    def start(controller: Callable[[], str]) -> RunningAgent:
        ready = tmp_path / f"agent{len(agents)}.ready"
        config = AgentConfig(
            engine=SIM_ENGINE,
            node="gen0-n0",
            listen="127.0.0.1:0",
            gpu_backend="sim",
            gpus=8,
            telemetry_interval_s=0.05,
            ready_file=ready,
            seed=1,
        )
        stop = asyncio.Event()
        task = asyncio.create_task(
            run_agent(config, stop.wait, controller=controller, uplink_settings=FAST)
        )
        agents.append(RunningAgent(task, stop, ready))
        return agents[-1]

    yield start
    for agent in agents:
        if not agent.task.done():
            await agent.finish()


async def test_registers_heartbeats_streams_and_reregisters_after_a_restart(
    controller: Controller, start_agent: Callable[..., RunningAgent]
) -> None:
    address = controller.address
    agent = start_agent(lambda: address)
    fake = controller.fake
    await eventually(lambda: len(fake.registrations) >= 1, "the agent registers")
    registration = fake.registrations[0]
    assert registration.node == "gen0-n0"
    bound = agent.ready_file.read_text().strip()
    assert registration.agent_address == bound  # the real bound address, not port 0
    assert not bound.endswith(":0")
    assert registration.status.node == "gen0-n0"
    assert registration.status.gpu_backend == "sim"
    assert list(registration.status.tp_layout) == [2, 2, 2, 2]
    assert len(registration.status.gpus) == 8

    # The advertised address serves NodeAgent.
    async with grpcutil.insecure_channel(registration.agent_address) as channel:
        stub = cast("NodeAgentAsyncStub", node_agent_pb2_grpc.NodeAgentStub(channel))
        status = await stub.GetStatus(node_agent_pb2.GetStatusRequest(), timeout=TIMEOUT)
        assert status.node == "gen0-n0"

    await eventually(lambda: len(fake.heartbeats) >= 2, "the agent heartbeats")
    assert {h.session_id for h in fake.heartbeats} == {"session-1"}
    assert {h.node for h in fake.heartbeats} == {"gen0-n0"}
    await eventually(lambda: len(fake.samples) >= 3, "the agent streams telemetry")
    assert {s.node for s in fake.samples} == {"gen0-n0"}
    assert all(len(s.gpus) == 8 for s in fake.samples)

    # The controller goes away and comes back on the same address with no memory.
    await controller.server.stop(0)
    restarted = await start_controller(address)
    try:
        fresh = restarted.fake
        await eventually(lambda: len(fresh.registrations) >= 1, "the agent registers again")
        assert fresh.registrations[0].agent_address == bound
        await eventually(lambda: len(fresh.heartbeats) >= 1, "heartbeats resume")
        await eventually(lambda: len(fresh.samples) >= 1, "telemetry resumes")
        assert await agent.finish() == 0
    finally:
        await restarted.server.stop(0)


async def test_reregisters_when_the_controller_forgets_the_session(
    controller: Controller, start_agent: Callable[..., RunningAgent]
) -> None:
    fake = controller.fake
    with capture_logs() as logs:
        agent = start_agent(lambda: controller.address)
        await eventually(lambda: len(fake.heartbeats) >= 1, "the agent heartbeats")
        fake.sessions.clear()  # as after a controller restart that lost its state
        await eventually(lambda: len(fake.registrations) >= 2, "the agent registers again")
        await eventually(
            lambda: any(h.session_id == "session-2" for h in fake.heartbeats),
            "heartbeats use the new session",
        )
        assert await agent.finish() == 0
    lost = [e for e in logs if e["event"] == "controller_session_lost"]
    assert lost
    assert "session 'session-1' is not current" in lost[0]["reason"]


async def test_keeps_retrying_when_the_controller_rejects_the_node(
    start_agent: Callable[..., RunningAgent],
) -> None:
    running = await start_controller(reject="node 'gen0-n0' is not in the wiring")
    fake = running.fake
    try:
        with capture_logs() as logs:
            agent = start_agent(lambda: running.address)
            await eventually(lambda: len(fake.registrations) >= 2, "the agent keeps trying")
            assert not agent.task.done()
            fake.reject = None  # the operator fixes the wiring
            await eventually(lambda: len(fake.heartbeats) >= 1, "the agent registers")
            assert await agent.finish() == 0
        rejected = [e for e in logs if e["event"] == "controller_rejected_registration"]
        assert rejected
        assert rejected[0]["log_level"] == "error"
        assert "node 'gen0-n0' is not in the wiring" in rejected[0]["reason"]
    finally:
        await running.server.stop(0)


async def test_serves_while_the_controller_is_unreachable(
    start_agent: Callable[..., RunningAgent],
) -> None:
    with capture_logs() as logs:
        agent = start_agent(lambda: "127.0.0.1:1")  # nothing listens there
        await eventually(agent.ready_file.exists, "the agent is ready")
        await eventually(
            lambda: sum(e["event"] == "controller_unreachable" for e in logs) >= 2,
            "the agent retries",
        )
        async with grpcutil.insecure_channel(agent.ready_file.read_text().strip()) as channel:
            stub = cast("NodeAgentAsyncStub", node_agent_pb2_grpc.NodeAgentStub(channel))
            reply = await stub.Drain(node_agent_pb2.DrainRequest(command_id="d1"), timeout=TIMEOUT)
            assert reply.engine_state == node_agent_pb2.ENGINE_STATE_DRAINED
        assert await agent.finish() == 0


async def test_the_daemon_process_registers_and_stops_on_sigterm(
    controller: Controller, tmp_path: Path
) -> None:
    ready = tmp_path / "agent.ready"
    log_path = tmp_path / "agent.log"
    with log_path.open("w") as log_file:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "node_agent.main",
            "--plaintext",
            "--engine=sim",
            "--node=gen0-n1",
            "--listen=127.0.0.1:0",
            f"--controller={controller.address}",
            "--gpu-backend=sim",
            "--gpus=4",
            "--telemetry-interval=0.05",
            f"--ready-file={ready}",
            "--log-format=json",
            cwd=REPO,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=log_file,
            stderr=log_file,
        )
    try:
        fake = controller.fake
        await eventually(lambda: len(fake.registrations) >= 1, "the daemon registers")
        assert fake.registrations[0].agent_address == ready.read_text().strip()
        assert len(fake.registrations[0].status.gpus) == 4
        await eventually(lambda: len(fake.samples) >= 1, "the daemon streams telemetry")
        proc.send_signal(signal.SIGTERM)
        async with asyncio.timeout(TIMEOUT):
            code = await proc.wait()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    output = log_path.read_text()
    assert code == 0, output
    events = [json.loads(line) for line in output.splitlines() if line.startswith("{")]
    names = [e["event"] for e in events]
    assert "serving" in names
    assert "registered" in names
    assert names[-1] == "stopped"
    assert all(e.get("node") == "gen0-n1" for e in events)


async def test_nvml_backend_without_nvml_exits_1(monkeypatch: pytest.MonkeyPatch) -> None:
    import pynvml

    def library_not_found() -> None:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)

    monkeypatch.setattr(pynvml, "nvmlInit", library_not_found)
    config = AgentConfig(
        node="gen0-n0", engine=SIM_ENGINE, listen="127.0.0.1:0", gpu_backend="nvml"
    )
    with capture_logs() as logs:
        assert await run_agent(config, asyncio.Event().wait) == 1
    [error] = [e for e in logs if e["log_level"] == "error"]
    assert error["event"] == "gpu_backend_unavailable"
    assert "NVML Shared Library Not Found" in error["error"]


async def test_layout_that_does_not_fit_the_gpus_exits_2(tmp_path: Path) -> None:
    ready = tmp_path / "agent.ready"
    config = AgentConfig(
        engine=SIM_ENGINE,
        node="gen0-n0",
        listen="127.0.0.1:0",
        gpu_backend="sim",
        gpus=4,
        tp_layout=(4, 4),
        ready_file=ready,
    )
    with capture_logs() as logs:
        assert await run_agent(config, asyncio.Event().wait) == 2
    [error] = [e for e in logs if e["log_level"] == "error"]
    assert error["event"] == "invalid_configuration"
    assert "--tp-layout=[4, 4]" in error["error"]
    assert not ready.exists()  # never announced ready


async def test_the_daemon_process_reloads_its_config_file_on_sighup(
    controller: Controller, tmp_path: Path
) -> None:
    ready = tmp_path / "agent.ready"
    config = tmp_path / "agent.toml"
    common = (
        f'node = "gen0-n1"\nlisten = "127.0.0.1:0"\ncontroller = "{controller.address}"\n'
        f'gpu_backend = "sim"\ngpus = 2\nplaintext = true\nready_file = "{ready}"\n'
        'log_format = "json"\nengine = "sim"\n'
    )
    config.write_text(common + "telemetry_interval = 0.05\n")
    log_path = tmp_path / "agent.log"
    with log_path.open("w") as log_file:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "node_agent.main",
            f"--config={config}",
            cwd=REPO,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=log_file,
            stderr=log_file,
        )
    try:
        await eventually(lambda: len(controller.fake.samples) >= 1, "the daemon streams")
        config.write_text(common + 'telemetry_interval = 0.1\nlog_level = "debug"\n')
        proc.send_signal(signal.SIGHUP)
        await eventually(lambda: "config_reloaded" in log_path.read_text(), "it reloads")
        proc.send_signal(signal.SIGTERM)
        async with asyncio.timeout(TIMEOUT):
            code = await proc.wait()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    output = log_path.read_text()
    assert code == 0, output
    events = [json.loads(line) for line in output.splitlines() if line.startswith("{")]
    [reloaded] = [e for e in events if e["event"] == "config_reloaded"]
    assert reloaded["applied"] == {"telemetry_interval_s": 0.1, "log_level": "debug"}
    assert reloaded["needs_restart"] == []
