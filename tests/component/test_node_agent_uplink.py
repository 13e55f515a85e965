"""The uplink's bounded telemetry buffer against a fake controller that goes away."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest
from structlog.testing import capture_logs

from node_agent.engine import EngineState, EngineStats
from node_agent.fake_controller import start_fake_controller
from node_agent.metrics import AgentMetrics
from node_agent.telemetry import NodeStatus, Telemetry
from node_agent.uplink import TelemetryBuffer, Uplink, UplinkSettings
from orchestrrl import errors

pytestmark = pytest.mark.component

TIMEOUT = 10.0
FAST = UplinkSettings(rpc_timeout_s=2.0, backoff_initial_s=0.02, backoff_max_s=0.1)
IDLE = EngineStats(0, 0, 0.0, 0.0)


class SteppedCollector:
    """Takes a sample only when the test releases one; sample n has timestamp n."""

    node = "gen0-n0"

    def __init__(self) -> None:
        self.release: asyncio.Queue[None] = asyncio.Queue()
        self.taken = 0

    def status(self) -> NodeStatus:
        return NodeStatus(self.node, "sim", (), (), EngineState.RUNNING, (1,), "test")

    async def sample(self) -> Telemetry:
        await self.release.get()
        self.taken += 1
        return Telemetry(self.node, float(self.taken), (), (), IDLE, EngineState.RUNNING, (1,))

    def take(self, n: int) -> None:
        for _ in range(n):
            self.release.put_nowait(None)


async def eventually(predicate: Callable[[], bool], what: str) -> None:
    async with asyncio.timeout(TIMEOUT):
        while not predicate():  # noqa: ASYNC110 - polls state that other tasks change
            await asyncio.sleep(0.01)
    assert predicate(), what


def value(metrics: AgentMetrics, name: str) -> float:
    got = metrics.registry.get_sample_value(name)
    assert got is not None, name
    return got


async def test_samples_taken_while_away_arrive_after_reconnect_oldest_dropped() -> None:
    running = await start_fake_controller()
    address = running.address
    collector = SteppedCollector()
    metrics = AgentMetrics()
    uplink = Uplink(
        collector,  # type: ignore[arg-type]
        "127.0.0.1:1",
        lambda: address,
        0.05,
        settings=FAST,
        buffer_samples=4,
        metrics=metrics,
    )
    with capture_logs() as logs:
        task = asyncio.create_task(uplink.run())
        try:
            await eventually(lambda: value(metrics, "orl_agent_registered") == 1, "registers")
            collector.take(3)
            await eventually(lambda: len(running.fake.samples) == 3, "streams")
            assert [s.timestamp for s in running.fake.samples] == [1.0, 2.0, 3.0]
            assert value(metrics, "orl_agent_telemetry_samples_sent_total") == 3

            await running.server.stop(0)  # the controller goes away
            await eventually(lambda: value(metrics, "orl_agent_registered") == 0, "notices")
            collector.take(10)  # samples 4..13 while away: room for 4
            await eventually(lambda: collector.taken == 13, "keeps sampling")
            await eventually(lambda: uplink.buffer.dropped == 6, "drops the oldest")
            assert len(uplink.buffer) == 4
            assert value(metrics, "orl_agent_telemetry_samples_dropped_total") == 6
            assert value(metrics, "orl_agent_telemetry_samples_buffered") == 4

            back = await start_fake_controller(address)  # it comes back, same address
            try:
                await eventually(lambda: len(back.fake.samples) == 4, "sends the backlog")
                assert [s.timestamp for s in back.fake.samples] == [10.0, 11.0, 12.0, 13.0]
                collector.take(1)
                await eventually(lambda: len(back.fake.samples) == 5, "then live samples")
                assert back.fake.samples[-1].timestamp == 14.0
                assert value(metrics, "orl_agent_telemetry_samples_sent_total") == 8
                assert value(metrics, "orl_agent_telemetry_samples_dropped_total") == 6
                assert value(metrics, "orl_agent_uplink_reconnects_total") >= 1
                assert value(metrics, "orl_agent_registered") == 1
            finally:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                await back.server.stop(0)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    full = [e for e in logs if e["event"] == "telemetry_buffer_full"]
    assert len(full) == 1
    assert full[0]["capacity"] == 4
    [backlog] = [e for e in logs if e["event"] == "telemetry_backlog_sending"]
    assert backlog["buffered"] == 4
    assert backlog["dropped_while_away"] == 6
    assert backlog["dropped_total"] == 6


def telemetry(n: int) -> Telemetry:
    return Telemetry("n", float(n), (), (), IDLE, EngineState.RUNNING, (1,))


async def test_buffer_keeps_the_newest_and_sent_skips_a_head_dropped_meanwhile() -> None:
    buffer = TelemetryBuffer(2)
    first = telemetry(1)
    buffer.put(first)
    head = await buffer.head()
    assert head is first
    buffer.put(telemetry(2))
    buffer.put(telemetry(3))  # drops 1 while it was being sent
    buffer.sent(head)  # must not drop 2
    assert buffer.dropped == 1
    assert (await buffer.head()).timestamp == 2.0
    assert len(buffer) == 2
    assert buffer.take_drop_report() == 1
    assert buffer.take_drop_report() == 0


def test_buffer_needs_room_for_one_sample() -> None:
    with pytest.raises(errors.InvalidArgument, match="at least 1"):
        TelemetryBuffer(0)
