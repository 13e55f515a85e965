"""CPU accounting of the simulated parts of the agent (what bench/agent_overhead.py reports
apart from the agent's own work), and the per-sample savings: one engine reading per
sample, GPU gauges set only when /metrics is collected."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest
from structlog.testing import capture_logs

from node_agent.daemon import _report_cpu_on_sigusr1, cpu_accounting
from node_agent.engine import busy_fraction
from node_agent.gpus import GpuSample
from node_agent.metrics import AgentMetrics
from node_agent.nics import SysfsNics
from node_agent.telemetry import Collector
from sim_backends.engine import SimEngineConfig, SimulatedEngine
from sim_backends.gpus import SimulatedGpus
from tests.helpers import FakeClock

pytestmark = pytest.mark.unit


def sim_engine(clock: FakeClock) -> SimulatedEngine:
    return SimulatedEngine(8, (2, 2, 2, 2), seed=1, clock=clock, config=SimEngineConfig())


def test_engine_accounts_cpu_only_for_simulation_steps() -> None:
    clock = FakeClock()
    engine = sim_engine(clock)
    engine.stats()
    assert engine.simulation_cpu_s == 0.0  # no time passed: nothing simulated
    clock.now = 30.0  # 600 steps of 50 ms with requests arriving and decoding
    engine.stats()
    stepped = engine.simulation_cpu_s
    assert stepped > 0.0
    engine.stats()
    engine.progress()
    assert engine.simulation_cpu_s == stepped  # reading the figures is not simulation


async def test_gpus_account_their_simulation_and_not_the_load_they_follow() -> None:
    clock = FakeClock()
    engine = sim_engine(clock)
    gpus = SimulatedGpus(8, clock=clock)
    gpus.follow(lambda: busy_fraction(engine.stats()))
    clock.now = 30.0
    await gpus.sample()  # the load reading steps the engine 30 s: the engine's account
    assert engine.simulation_cpu_s > 0.0
    assert 0.0 < gpus.simulation_cpu_s < engine.simulation_cpu_s
    accounting = cpu_accounting(engine, gpus)
    assert accounting["engine_simulation_cpu_s"] == engine.simulation_cpu_s
    assert accounting["gpu_simulation_cpu_s"] == gpus.simulation_cpu_s
    assert accounting["process_cpu_s"] >= engine.simulation_cpu_s + gpus.simulation_cpu_s


async def test_collector_reads_the_engine_once_and_before_the_gpus() -> None:
    clock = FakeClock()
    engine = sim_engine(clock)
    gpus = SimulatedGpus(8, clock=clock)
    calls = 0
    real_stats = engine.stats

    def stats():  # type: ignore[no-untyped-def]
        nonlocal calls
        calls += 1
        return real_stats()

    engine.stats = stats  # type: ignore[method-assign]
    collector = Collector("n0", gpus, SysfsNics([]), engine, wall_clock=lambda: 1.0)
    gpus.follow(lambda: busy_fraction(collector.engine_stats))
    await collector.open()
    clock.now = 30.0
    sample = await collector.sample(progress=False)
    assert calls == 1
    assert sample.engine is collector.engine_stats
    assert sample.engine.running_requests > 0
    assert all(g.utilization > 0.0 for g in sample.gpus)  # they followed this sample's load


async def test_sigusr1_logs_the_accounting() -> None:
    clock = FakeClock()
    engine, gpus = sim_engine(clock), SimulatedGpus(8, clock=clock)
    loop = asyncio.get_running_loop()
    _report_cpu_on_sigusr1(engine, gpus)
    try:
        with capture_logs() as logs:
            os.kill(os.getpid(), signal.SIGUSR1)
            for _ in range(100):
                if logs:
                    break
                await asyncio.sleep(0.01)
    finally:
        loop.remove_signal_handler(signal.SIGUSR1)
    [entry] = [e for e in logs if e["event"] == "cpu_accounting"]
    assert set(entry) >= {"process_cpu_s", "engine_simulation_cpu_s", "gpu_simulation_cpu_s"}


def test_gpu_gauges_show_the_latest_readings_handed_over_when_collected() -> None:
    metrics = AgentMetrics()

    def utilization() -> float | None:
        return metrics.registry.get_sample_value("orl_agent_gpu_utilization", {"gpu": "0"})

    assert utilization() is None  # nothing handed over yet
    metrics.observe_gpus([GpuSample(0, 0.25, 1, 2, 300.0, 60.0)])
    metrics.observe_gpus([GpuSample(0, 0.75, 1, 2, 300.0, 60.0, sm_clock_mhz=1980.0)])
    assert utilization() == 0.75  # the newest of the two, applied at collection
    assert utilization() == 0.75  # and kept until the next hand-over
    metrics.observe_gpus([GpuSample(0, 0.5, 1, 2, 300.0, 60.0)])  # no SM clock this time
    assert utilization() == 0.5
    sm = metrics.registry.get_sample_value("orl_agent_gpu_sm_clock_mhz", {"gpu": "0"})
    assert sm == 1980.0  # an unreported reading leaves the gauge as it was, as before
