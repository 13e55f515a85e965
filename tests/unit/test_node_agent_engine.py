"""The engine adapter's layout rule and the simulated rollout engine (fake clock)."""

from __future__ import annotations

import asyncio

import pytest

from node_agent.engine import (
    EngineState,
    EngineStats,
    busy_fraction,
    default_layout,
    parse_layout,
    validate_layout,
)
from orchestrrl import errors
from sim_backends.engine import SimEngineConfig, SimulatedEngine
from tests.helpers import FakeClock

pytestmark = pytest.mark.unit


def engine(
    layout: tuple[int, ...] = (2, 2, 2, 2), seed: int = 7, relayout_delay_s: float = 0.0
) -> tuple[SimulatedEngine, FakeClock]:
    clock = FakeClock()
    sim = SimulatedEngine(8, layout, seed, clock=clock, relayout_delay_s=relayout_delay_s)
    return sim, clock


@pytest.mark.parametrize(
    "layout", [(8,), (4, 4), (2, 2, 2, 2), (1,) * 8, (4, 2, 1, 1), (1, 1, 2, 4)]
)
def test_valid_layouts(layout: tuple[int, ...]) -> None:
    assert validate_layout(layout, 8) == layout


@pytest.mark.parametrize(
    ("layout", "rule"),
    [
        ((3, 3, 2), "power of two"),
        ((16,), "power of two in 1..8"),
        ((0, 8), "power of two"),
        ((2, 2), "sum to the node's GPU count 8"),
        ((4, 4, 4), "sum to the node's GPU count 8"),
        ((), "at least one instance"),
    ],
)
def test_invalid_layouts_name_field_value_and_rule(layout: tuple[int, ...], rule: str) -> None:
    with pytest.raises(errors.InvalidArgument) as info:
        validate_layout(layout, 8)
    message = str(info.value)
    assert message.startswith(f"tp_layout={list(layout)!r}")
    assert rule in message


def test_parse_layout() -> None:
    assert parse_layout("2, 2,4", 8) == (2, 2, 4)
    assert parse_layout("4,4", None) == (4, 4)
    with pytest.raises(errors.InvalidArgument, match=r"--tp-layout='2,x'.*comma-separated"):
        parse_layout("2,x", 8)
    with pytest.raises(errors.InvalidArgument, match="power of two"):
        parse_layout("3,1", None)


def test_default_layout() -> None:
    assert default_layout(8) == (2, 2, 2, 2)
    assert default_layout(1) == (1,)
    assert default_layout(3) == (2, 1)
    for gpus in range(1, 17):
        validate_layout(default_layout(gpus), gpus)


def test_busy_fraction() -> None:
    assert busy_fraction(EngineStats(5, 0, 0.0, 0.0)) == 0.0
    assert busy_fraction(EngineStats(0, 3, 100.0, 0.0)) == 0.5
    assert busy_fraction(EngineStats(0, 3, 100.0, 1.0)) == 1.0


def test_requests_arrive_run_and_finish() -> None:
    sim, clock = engine()
    assert sim.stats() == EngineStats(0, 0, 0.0, 0.0)
    clock.now = 30.0
    stats = sim.stats()
    assert stats.running_requests > 0
    assert stats.tokens_per_s > 0
    assert 0 < stats.kv_cache_usage < 1
    assert sim.state is EngineState.RUNNING


def test_same_seed_same_trajectory() -> None:
    a, clock_a = engine(seed=3)
    b, clock_b = engine(seed=3)
    for t in (5.0, 12.5, 40.0):
        clock_a.now = clock_b.now = t
        assert a.stats() == b.stats()


async def test_drained_admits_nothing_and_running_requests_finish() -> None:
    sim, clock = engine()
    clock.now = 30.0
    running = sim.stats().running_requests
    await sim.drain()
    assert sim.state is EngineState.DRAINED
    previous = running
    for step in range(1, 21):  # 600 s: the longest response (16k tokens) completes
        clock.now = 30.0 + 30.0 * step
        stats = sim.stats()
        assert stats.running_requests <= previous  # nothing is admitted
        previous = stats.running_requests
    assert stats.running_requests == 0  # every admitted request completed
    assert stats.queued_requests > 0  # arrivals wait for resume
    await sim.resume()
    clock.now += 1.0
    assert sim.state is EngineState.RUNNING
    assert sim.stats().running_requests > 0


async def test_drain_and_resume_are_idempotent() -> None:
    sim, _ = engine()
    await sim.drain()
    await sim.drain()
    assert sim.state is EngineState.DRAINED
    await sim.resume()
    await sim.resume()
    assert sim.state is EngineState.RUNNING


async def test_reshard_while_running_keeps_requests_and_state() -> None:
    sim, clock = engine()
    clock.now = 30.0
    before = sim.stats()
    result = await sim.reshard([8])
    assert result.old_layout == (2, 2, 2, 2)
    assert result.new_layout == (8,)
    assert sim.tp_layout == (8,)
    assert sim.state is EngineState.RUNNING
    assert [s.stage for s in result.stages] == ["pause", "relayout", "resume"]
    assert all(s.seconds >= 0 for s in result.stages)
    assert result.bytes_moved == 0
    assert result.message == "simulated engine: layout changed, no weights moved"
    after = sim.stats()  # no time passed: every in-flight request is still there
    assert after.running_requests + after.queued_requests == (
        before.running_requests + before.queued_requests
    )


async def test_reshard_while_drained_stays_drained() -> None:
    sim, clock = engine()
    clock.now = 10.0
    await sim.drain()
    result = await sim.reshard([1] * 8)
    assert result.new_layout == (1,) * 8
    assert sim.state is EngineState.DRAINED


async def test_reshard_to_the_same_layout_is_a_no_op() -> None:
    sim, _ = engine()
    result = await sim.reshard([2, 2, 2, 2])
    assert result.stages == ()
    assert result.bytes_moved == 0
    assert "nothing to do" in result.message


async def test_invalid_reshard_leaves_the_layout_alone() -> None:
    sim, _ = engine()
    with pytest.raises(errors.InvalidArgument, match=r"tp_layout=\[4, 2\].*sum"):
        await sim.reshard([4, 2])
    assert sim.tp_layout == (2, 2, 2, 2)
    assert sim.state is EngineState.RUNNING


async def test_commands_during_a_reshard_are_refused() -> None:
    sim, _ = engine(relayout_delay_s=0.05)
    reshard = asyncio.create_task(sim.reshard([4, 4]))
    await asyncio.sleep(0)
    assert sim.state is EngineState.RESHARDING
    assert sim.stats().tokens_per_s == 0.0  # paused
    for command in (sim.drain(), sim.resume(), sim.reshard([8])):
        with pytest.raises(errors.Aborted, match="in progress"):
            await command
    result = await reshard
    assert result.new_layout == (4, 4)
    assert sim.state is EngineState.RUNNING


async def test_cancelled_reshard_restores_the_prior_state() -> None:
    sim, _ = engine(relayout_delay_s=10.0)
    await sim.drain()
    reshard = asyncio.create_task(sim.reshard([8]))
    await asyncio.sleep(0)
    reshard.cancel()
    with pytest.raises(asyncio.CancelledError):
        await reshard
    assert sim.state is EngineState.DRAINED
    assert sim.tp_layout == (2, 2, 2, 2)


def test_a_full_kv_cache_queues_the_rest() -> None:
    # A tiny KV pool: TP=1 instances cannot hold the load; the excess waits in the queue.
    config = SimEngineConfig(memory_fraction=0.37, arrival_rate_per_gpu=4.0)
    clock = FakeClock()
    sim = SimulatedEngine(8, [1] * 8, 1, config=config, clock=clock)
    clock.now = 60.0
    stats = sim.stats()
    assert stats.kv_cache_usage <= 1.0
    assert stats.queued_requests > 0


def test_long_gaps_are_skipped_not_replayed() -> None:
    sim, clock = engine()
    clock.now = 10.0
    sim.stats()
    clock.now = 10.0 + 24 * 3600.0  # a day without queries still answers promptly
    assert sim.stats().running_requests >= 0


def test_rejects_a_node_without_gpus() -> None:
    with pytest.raises(errors.InvalidArgument, match="gpus=0"):
        SimulatedEngine(0, [1])
