"""run_agent with a config file reloaded on (injected) SIGHUP, and its Prometheus metrics."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import TYPE_CHECKING, cast

import pytest
from structlog.testing import capture_logs

from node_agent.config import SIM_ENGINE, AgentConfig, ConfigSource, load
from node_agent.daemon import run_agent
from node_agent.metrics import AgentMetrics
from node_agent.uplink import UplinkSettings
from orchestrrl import grpcutil
from orchestrrl.v1 import node_agent_pb2, node_agent_pb2_grpc
from sim_backends.fake_controller import RunningFakeController, start_fake_controller

if TYPE_CHECKING:
    from orchestrrl.v1.node_agent_pb2_grpc import NodeAgentAsyncStub

pytestmark = pytest.mark.component

TIMEOUT = 30.0  # liveness on a busy machine (a subprocess starting, a reconnect)
FAST = UplinkSettings(rpc_timeout_s=2.0, backoff_initial_s=0.02, backoff_max_s=0.1)


async def eventually(predicate: Callable[[], bool], what: str) -> None:
    async with asyncio.timeout(TIMEOUT):
        while not predicate():  # noqa: ASYNC110 - polls state that other tasks change
            await asyncio.sleep(0.01)
    assert predicate(), what


@pytest.fixture
async def controller() -> AsyncIterator[RunningFakeController]:
    running = await start_fake_controller()
    yield running
    await running.server.stop(0)


def write_nic(root: Path, name: str) -> None:
    (root / name / "statistics").mkdir(parents=True)
    (root / name / "statistics" / "rx_bytes").write_text("0\n")
    (root / name / "statistics" / "tx_bytes").write_text("0\n")
    (root / name / "operstate").write_text("up\n")


BASE = """
node = "gen0-n0"
listen = "127.0.0.1:0"
plaintext = true
gpu_backend = "sim"
engine = "sim"
seed = 1
"""


async def test_sighup_applies_runtime_settings_and_reports_the_rest(
    controller: RunningFakeController, tmp_path: Path
) -> None:
    ready = tmp_path / "agent.ready"
    base = BASE + f'ready_file = "{ready}"\n'
    path = tmp_path / "agent.toml"
    path.write_text(base + f'controller = "{controller.address}"\ntelemetry_interval = 0.05\n')
    source = ConfigSource({}, path)
    config = load(source)
    hangups: asyncio.Queue[None] = asyncio.Queue()
    levels: list[str] = []
    stop = asyncio.Event()
    with capture_logs() as logs:
        task = asyncio.create_task(
            run_agent(
                config,
                stop.wait,
                uplink_settings=FAST,
                reload=lambda: load(source),
                hangup=hangups.get,
                set_log_level=levels.append,
            )
        )
        try:
            await eventually(lambda: len(controller.fake.samples) >= 1, "streams")

            def events(name: str) -> list[dict[str, object]]:
                return [e for e in logs if e["event"] == name]

            # a runtime change and a restart-only change
            path.write_text(
                base + f'controller = "{controller.address}"\ntelemetry_interval = 0.1\n'
                'log_level = "debug"\nnics = ["lo"]\ngpus = 4\n'
            )
            hangups.put_nowait(None)
            await eventually(lambda: len(events("config_reloaded")) == 1, "reloads")
            [reloaded] = events("config_reloaded")
            assert reloaded["applied"] == {
                "telemetry_interval_s": 0.1,
                "log_level": "debug",
                "nics": [["lo", None]],
            }
            assert reloaded["needs_restart"] == ["gpus"]
            [restart] = events("config_change_needs_restart")
            assert restart["fields"] == ["gpus"]
            assert levels == ["debug"]
            async with grpcutil.insecure_channel(ready.read_text().strip()) as channel:
                stub = cast("NodeAgentAsyncStub", node_agent_pb2_grpc.NodeAgentStub(channel))
                status = await stub.GetStatus(node_agent_pb2.GetStatusRequest(), timeout=TIMEOUT)
            assert [n.name for n in status.nics] == ["lo"]
            assert len(status.gpus) == 8  # gpus needs a restart
            await eventually(
                lambda: any(len(s.nics) == 1 for s in controller.fake.samples), "new NIC list"
            )

            # an invalid file is rejected and the running configuration stays
            path.write_text(base + "telemetry_interval = 0.001\ncolour = 1\n")
            hangups.put_nowait(None)
            await eventually(lambda: len(events("config_reload_rejected")) == 1, "rejects")
            [rejected] = events("config_reload_rejected")
            assert rejected["log_level"] == "error"
            problems = cast("list[str]", rejected["problems"])
            assert any("unknown key 'colour'" in p for p in problems)
            assert any("telemetry_interval=0.001" in p for p in problems)

            # the same good file again: gpus still needs a restart, nothing else changes
            path.write_text(
                base + f'controller = "{controller.address}"\ntelemetry_interval = 0.1\n'
                'log_level = "debug"\nnics = ["lo"]\ngpus = 4\n'
            )
            hangups.put_nowait(None)
            await eventually(lambda: len(events("config_reloaded")) == 2, "reloads again")
            assert events("config_reloaded")[1]["applied"] == {}
            assert levels == ["debug"]
        finally:
            stop.set()
            async with asyncio.timeout(TIMEOUT):
                assert await task == 0


async def test_metrics_of_a_running_agent(
    controller: RunningFakeController, tmp_path: Path
) -> None:
    rdma = tmp_path / "infiniband"
    port = rdma / "mlx5_0" / "ports" / "1"
    (port / "counters").mkdir(parents=True)
    (port / "hw_counters").mkdir()
    (port / "counters" / "port_xmit_data").write_text("1000\n")
    (port / "counters" / "port_rcv_data").write_text("500\n")
    (port / "hw_counters" / "np_cnp_sent").write_text("7\n")
    ready = tmp_path / "agent.ready"
    config = AgentConfig(
        engine=SIM_ENGINE,
        node="gen0-n0",
        listen="127.0.0.1:0",
        controller=controller.address,
        gpu_backend="sim",
        gpus=8,
        telemetry_interval_s=0.05,
        ready_file=ready,
        seed=1,
    )
    metrics = AgentMetrics()
    stop = asyncio.Event()
    task = asyncio.create_task(
        run_agent(config, stop.wait, uplink_settings=FAST, metrics=metrics, rdma_root=rdma)
    )

    def value(name: str, **labels: str) -> float | None:
        return metrics.registry.get_sample_value(name, labels)

    try:
        await eventually(lambda: len(controller.fake.samples) >= 2, "streams")
        await eventually(lambda: value("orl_agent_registered") == 1, "registered")
        assert (value("orl_agent_telemetry_samples_sent_total") or 0) >= 2
        assert value("orl_agent_telemetry_samples_dropped_total") == 0
        assert all(value("orl_agent_gpu_utilization", gpu=str(i)) is not None for i in range(8))
        # the simulated GPUs report the NVML extras too, but never had an XID: absent, not 0
        assert value("orl_agent_gpu_sm_clock_mhz", gpu="0") is not None
        assert value("orl_agent_gpu_last_xid", gpu="0") is None
        labels = {"device": "mlx5_0", "port": "1"}
        assert value("orl_agent_rdma_counter", counter="port_xmit_data", **labels) == 4000
        assert value("orl_agent_rdma_counter", counter="np_cnp_sent", **labels) == 7

        async with grpcutil.insecure_channel(ready.read_text().strip()) as channel:
            stub = cast("NodeAgentAsyncStub", node_agent_pb2_grpc.NodeAgentStub(channel))
            for _ in range(2):  # the second is a replay of the same command
                await stub.Drain(node_agent_pb2.DrainRequest(command_id="d1"), timeout=TIMEOUT)
            await stub.Reshard(
                node_agent_pb2.ReshardRequest(command_id="r1", tp_layout=[4, 4]), timeout=TIMEOUT
            )
            with pytest.raises(Exception, match="power of two"):
                await stub.Reshard(
                    node_agent_pb2.ReshardRequest(command_id="r2", tp_layout=[3, 5]),
                    timeout=TIMEOUT,
                )
        assert value("orl_agent_commands_total", kind="Drain", outcome="ok") == 1
        assert value("orl_agent_commands_total", kind="Drain", outcome="replayed") == 1
        assert value("orl_agent_commands_total", kind="Reshard", outcome="ok") == 1
        assert value("orl_agent_commands_total", kind="Reshard", outcome="invalid_argument") == 1
        assert value("orl_agent_reshard_seconds_count") == 1
    finally:
        stop.set()
        async with asyncio.timeout(TIMEOUT):
            assert await task == 0


async def test_metrics_listen_serves_and_stops(tmp_path: Path) -> None:
    config = AgentConfig(
        engine=SIM_ENGINE,
        node="gen0-n0",
        listen="127.0.0.1:0",
        controller="127.0.0.1:1",
        gpu_backend="sim",
        gpus=1,
        metrics_listen="127.0.0.1:0",
        ready_file=tmp_path / "ready",
    )
    stop = asyncio.Event()
    task = asyncio.create_task(run_agent(config, stop.wait, uplink_settings=FAST))
    await eventually((tmp_path / "ready").exists, "serving")
    stop.set()
    async with asyncio.timeout(TIMEOUT):
        assert await task == 0


async def test_metrics_listen_that_cannot_bind_exits_1(tmp_path: Path) -> None:
    config = AgentConfig(
        engine=SIM_ENGINE,
        node="gen0-n0",
        listen="127.0.0.1:0",
        gpu_backend="sim",
        gpus=1,
        metrics_listen="192.0.2.1:9101",  # TEST-NET-1: not an address of this host
        ready_file=tmp_path / "ready",
    )
    with capture_logs() as logs:
        assert await run_agent(config, asyncio.Event().wait) == 1
    [error] = [e for e in logs if e["log_level"] == "error"]
    assert error["event"] == "cannot_start"
    assert "cannot serve metrics on 192.0.2.1:9101" in error["error"]
    assert not (tmp_path / "ready").exists()
