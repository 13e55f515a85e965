"""RDMA port counters read from a fake /sys/class/infiniband tree, and their metrics."""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client import generate_latest

from node_agent.gpus import GpuSample
from node_agent.metrics import AgentMetrics
from node_agent.rdma import COUNTER_MODULUS, SysfsRdma, counter_delta
from tests.helpers import FakeClock

pytestmark = pytest.mark.unit


def write_port(root: Path, device: str, port: int, **counters: int) -> None:
    base = root / device / "ports" / str(port)
    (base / "counters").mkdir(parents=True, exist_ok=True)
    (base / "hw_counters").mkdir(exist_ok=True)
    for name, value in counters.items():
        folder = "counters" if name.startswith("port_") else "hw_counters"
        (base / folder / name).write_text(f"{value}\n")


def test_counter_delta_handles_64_bit_wrap_and_reset() -> None:
    assert counter_delta(10, 15) == 5
    assert counter_delta(COUNTER_MODULUS - 3, 2) == 5  # wrapped
    assert counter_delta(1_000, 10) is None  # reset (driver reload): no rate


async def test_rates_from_deltas_in_bytes(tmp_path: Path) -> None:
    clock = FakeClock(100.0)
    write_port(
        tmp_path,
        "mlx5_0",
        1,
        port_xmit_data=1000,
        port_rcv_data=500,
        np_cnp_sent=3,
        rp_cnp_handled=4,
        out_of_sequence=0,
        rx_prio3_pause=1,
    )
    write_port(tmp_path, "mlx5_1", 1, port_xmit_data=0)
    rdma = SysfsRdma(root=tmp_path, clock=clock)
    first = await rdma.sample()
    assert [(s.device, s.port) for s in first] == [("mlx5_0", 1), ("mlx5_1", 1)]
    assert first[0].counters["port_xmit_data"] == 4000  # 4-byte words
    assert first[0].counters["rx_prio3_pause"] == 1  # a driver's PFC pause counter
    assert first[0].rates == {}
    assert first[0].tx_bytes_per_s == 0.0

    write_port(
        tmp_path,
        "mlx5_0",
        1,
        port_xmit_data=1000 + 250_000,
        port_rcv_data=500 + 500_000,
        np_cnp_sent=13,
        rp_cnp_handled=4,
        out_of_sequence=2,
        rx_prio3_pause=1,
    )
    clock.now = 102.0
    [second, _] = await rdma.sample()
    assert second.tx_bytes_per_s == 250_000 * 4 / 2
    assert second.rx_bytes_per_s == 500_000 * 4 / 2
    assert second.rates["np_cnp_sent"] == 5.0
    assert second.rates["out_of_sequence"] == 1.0


async def test_wrapped_data_counter(tmp_path: Path) -> None:
    clock = FakeClock(0.0)
    write_port(tmp_path, "mlx5_0", 1, port_xmit_data=COUNTER_MODULUS - 10)
    rdma = SysfsRdma(root=tmp_path, clock=clock)
    await rdma.sample()
    write_port(tmp_path, "mlx5_0", 1, port_xmit_data=10)
    clock.now = 1.0
    [sample] = await rdma.sample()
    assert sample.tx_bytes_per_s == 20 * 4


async def test_no_rdma_devices_is_not_an_error(tmp_path: Path) -> None:
    assert await SysfsRdma(root=tmp_path / "missing").sample() == []


async def test_metrics_expose_rdma_and_gpu_extras_and_omit_absent_ones(tmp_path: Path) -> None:
    clock = FakeClock(0.0)
    write_port(tmp_path, "mlx5_0", 1, port_xmit_data=0, np_cnp_sent=0)
    rdma = SysfsRdma(root=tmp_path, clock=clock)
    await rdma.sample()
    write_port(tmp_path, "mlx5_0", 1, port_xmit_data=100, np_cnp_sent=8)
    clock.now = 2.0
    metrics = AgentMetrics()
    metrics.observe_rdma(await rdma.sample())
    metrics.observe_gpus(
        [
            GpuSample(0, 0.5, 1, 2, 300.0, 60.0, sm_clock_mhz=1980.0, ecc_corrected=3),
            GpuSample(1, 0.25, 1, 2, 300.0, 60.0),  # no extras: none exposed
        ]
    )
    text = generate_latest(metrics.registry).decode()
    dev = 'device="mlx5_0",port="1"'
    tx = 'orl_agent_rdma_bytes_per_second{device="mlx5_0",direction="tx",port="1"} 200.0'
    assert tx in text
    assert f'orl_agent_rdma_counter_per_second{{counter="np_cnp_sent",{dev}}} 4.0' in text
    assert 'orl_agent_gpu_utilization{gpu="0"} 0.5' in text
    assert 'orl_agent_gpu_utilization{gpu="1"} 0.25' in text
    assert 'orl_agent_gpu_sm_clock_mhz{gpu="0"} 1980.0' in text
    assert 'orl_agent_gpu_ecc_errors{gpu="0",type="corrected"} 3.0' in text
    assert 'gpu_sm_clock_mhz{gpu="1"}' not in text
    assert 'orl_agent_gpu_ecc_errors{gpu="0",type="uncorrected"}' not in text


def test_the_gateways_stale_stopped_counter_is_exposed_once_watched() -> None:
    metrics = AgentMetrics()
    assert "orl_agent_gateway_stale_stopped" not in generate_latest(metrics.registry).decode()
    stopped = [3]
    metrics.watch_gateway(lambda: stopped[0])
    assert "orl_agent_gateway_stale_stopped_total 3.0" in generate_latest(metrics.registry).decode()
    stopped[0] = 5  # read at each scrape
    assert "orl_agent_gateway_stale_stopped_total 5.0" in generate_latest(metrics.registry).decode()
