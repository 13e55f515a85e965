"""The uplink's bounded telemetry buffer against a fake controller that goes away."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest
from structlog.testing import capture_logs

from node_agent.engine import EngineState, EngineStats
from node_agent.metrics import AgentMetrics
from node_agent.nics import NicRates
from node_agent.telemetry import NodeStatus, Telemetry
from node_agent.uplink import (
    Session,
    TelemetryBuffer,
    Uplink,
    UplinkSettings,
    check_flush_interval,
    samples_per_flush,
)
from orchestrrl import errors
from sim_backends.fake_controller import start_fake_controller

pytestmark = pytest.mark.component

TIMEOUT = 30.0  # liveness on a busy machine (a subprocess starting, a reconnect)
FAST = UplinkSettings(rpc_timeout_s=2.0, backoff_initial_s=0.02, backoff_max_s=0.1)
IDLE = EngineStats(0, 0, 0.0, 0.0)


class SteppedCollector:
    """Takes a sample only when the test releases one; sample n has timestamp n."""

    node = "gen0-n0"

    def __init__(self) -> None:
        self.release: asyncio.Queue[None] = asyncio.Queue()
        self.taken = 0
        self.with_progress: list[int] = []  # the samples taken with engine progress
        self.decoded: list[float] = []  # the timestamps of the readings decoded, in order

    def status(self) -> NodeStatus:
        return NodeStatus(self.node, "sim", (), (), EngineState.RUNNING, (1,), "test")

    async def read(self, progress: bool = True) -> Telemetry:
        """The reading is the sample itself (see :meth:`telemetry`)."""
        await self.release.get()
        self.taken += 1
        if progress:
            self.with_progress.append(self.taken)
        return Telemetry(self.node, float(self.taken), (), (), IDLE, EngineState.RUNNING, (1,))

    def telemetry(self, reading: Telemetry, rates: object) -> Telemetry:
        self.decoded.append(reading.timestamp)
        return reading

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
        flush_interval_s=0.0,  # every sample as it is taken
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


async def test_samples_go_up_in_batches_each_closed_by_a_sample_with_progress() -> None:
    running = await start_fake_controller()
    collector = SteppedCollector()
    metrics = AgentMetrics()
    uplink = Uplink(
        collector,  # type: ignore[arg-type]
        "127.0.0.1:1",
        running.address,
        0.05,
        settings=FAST,
        metrics=metrics,
        flush_interval_s=0.2,  # 4 samples per upload
    )
    task = asyncio.create_task(uplink.run())
    try:
        await eventually(lambda: value(metrics, "orl_agent_registered") == 1, "registers")
        collector.take(9)
        await eventually(lambda: len(running.fake.samples) == 9, "uploads")
        # the first sample goes up at once, then every 4th closes an upload
        assert [len(b.samples) for b in running.fake.batches] == [1, 4, 4]
        assert collector.with_progress == [1, 5, 9]
        assert [s.timestamp for s in running.fake.samples] == [float(n) for n in range(1, 10)]
        assert value(metrics, "orl_agent_telemetry_samples_sent_total") == 9
        # not yet a full upload: read, and decoded only when the upload's last is read
        collector.take(3)
        await eventually(lambda: collector.taken == 12, "samples")
        await asyncio.sleep(0.1)
        assert len(running.fake.samples) == 9 and len(uplink.buffer) == 0
        assert collector.decoded == [float(n) for n in range(1, 10)]
        collector.take(1)
        await eventually(lambda: len(running.fake.samples) == 13, "uploads")
        assert collector.decoded == [float(n) for n in range(1, 14)]  # in reading order
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await running.server.stop(0)


def test_samples_per_flush_and_flush_interval_bounds() -> None:
    assert samples_per_flush(0.1, 1.0) == 10
    assert samples_per_flush(0.1, 0.0) == 1  # 0: every sample
    assert samples_per_flush(1.0, 0.2) == 1  # never fewer than one sample per upload
    assert samples_per_flush(0.3, 1.0) == 3
    assert check_flush_interval(0.0, "f") == 0.0
    with pytest.raises(errors.InvalidArgument, match="telemetry_flush_interval=-1"):
        check_flush_interval(-1, "telemetry_flush_interval")


async def test_buffer_batches_end_on_a_flush_mark() -> None:
    buffer = TelemetryBuffer(10)
    for n, flush in ((1, False), (2, False), (3, True), (4, False)):
        buffer.put(telemetry(n), flush=flush)
    assert [s.timestamp for s in await buffer.batch(10)] == [1.0, 2.0, 3.0]  # not the 4th
    for n, flush in ((5, True), (6, False), (7, True)):
        buffer.put(telemetry(n), flush=flush)
    # a backlog larger than one message is cut after the last mark that fits
    first = await buffer.batch(6)
    assert [s.timestamp for s in first] == [1.0, 2.0, 3.0, 4.0, 5.0]
    buffer.sent(first)
    assert [s.timestamp for s in await buffer.batch(6)] == [6.0, 7.0]
    waiter = asyncio.ensure_future(TelemetryBuffer(2).batch(5))
    await asyncio.sleep(0.01)
    assert not waiter.done()  # nothing flushable yet
    waiter.cancel()


class CountingStub:
    def __init__(self) -> None:
        self.heartbeats = 0

    def Heartbeat(self, request: object, timeout: float) -> asyncio.Future[None]:
        self.heartbeats += 1
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        done.set_result(None)
        return done


async def test_uploads_push_the_heartbeat_back_and_without_them_it_goes_out() -> None:
    uplink = Uplink(SteppedCollector(), "127.0.0.1:1", "127.0.0.1:1", 1.0)  # type: ignore[arg-type]
    stub = CountingStub()
    loop = asyncio.get_running_loop()
    task = asyncio.create_task(
        uplink._heartbeats(stub, Session("c", "s", 0.05))  # type: ignore[arg-type]
    )
    try:
        await asyncio.sleep(0)  # the session's heartbeat timer is armed
        armed = uplink._heartbeat_timer
        assert armed is not None
        after = 0.05 + 0.05 / 2  # the interval, and half of it (< the sampling interval)
        before = loop.time()
        uplink._uploaded()  # an upload reached the controller
        moved = uplink._heartbeat_timer
        assert moved is not None and moved is not armed and armed.cancelled()
        assert before + after <= moved.when() <= loop.time() + after
        assert stub.heartbeats == 0
        await eventually(lambda: stub.heartbeats >= 2, "no uploads: heartbeats go out")
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    assert uplink._heartbeat_timer is None  # the session's timer goes with it


class SlowHeartbeatStub:
    """Heartbeats that complete only when the test says so."""

    def __init__(self) -> None:
        self.calls: list[asyncio.Future[None]] = []

    def Heartbeat(self, request: object, timeout: float) -> asyncio.Future[None]:
        self.calls.append(asyncio.get_running_loop().create_future())
        return self.calls[-1]


async def test_an_upload_during_a_heartbeat_call_re_arms_the_timer_harmlessly() -> None:
    uplink = Uplink(SteppedCollector(), "127.0.0.1:1", "127.0.0.1:1", 0.05)  # type: ignore[arg-type]
    stub = SlowHeartbeatStub()
    task = asyncio.create_task(
        uplink._heartbeats(stub, Session("c", "s", 0.05))  # type: ignore[arg-type]
    )
    try:
        await eventually(lambda: len(stub.calls) == 1, "a heartbeat is due")
        for _ in range(3):  # uploads while it is in flight; their timers may fire meanwhile
            uplink._uploaded()
            await asyncio.sleep(0.05)
        assert len(stub.calls) == 1 and not task.done()  # one call at a time, no error
        stub.calls[0].set_result(None)
        await eventually(lambda: len(stub.calls) == 2, "the next one after it")
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


class BrokenDecodeCollector(SteppedCollector):
    """Readings with these timestamps fail to decode."""

    def __init__(self, broken: set[float]) -> None:
        super().__init__()
        self.broken = broken

    def telemetry(self, reading: Telemetry, rates: object) -> Telemetry:
        if reading.timestamp in self.broken:
            raise ValueError(f"cannot decode reading {reading.timestamp:g}")
        return super().telemetry(reading, rates)


@pytest.mark.parametrize(
    ("broken", "buffered"), [({2.0}, [1.0, 3.0]), ({3.0}, [1.0, 2.0]), ({1.0, 2.0, 3.0}, [])]
)
async def test_a_reading_that_fails_to_decode_is_skipped_and_the_upload_still_closes(
    broken: set[float], buffered: list[float]
) -> None:
    collector = BrokenDecodeCollector(broken)
    uplink = Uplink(collector, "127.0.0.1:1", "127.0.0.1:1", 0.05)  # type: ignore[arg-type]
    readings = [telemetry(n) for n in (1, 2, 3)]
    with capture_logs() as logs:
        uplink._buffer(readings, NicRates())  # type: ignore[arg-type]
    assert [e["event"] for e in logs] == ["telemetry_sample_failed"] * len(broken)
    assert len(uplink.buffer) == len(buffered)
    if buffered:  # the last one decoded closes the upload
        assert [s.timestamp for s in await uplink.buffer.batch(10)] == buffered
