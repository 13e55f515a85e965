"""Simulated GPUs for the node agent: H800-class readings that follow the engine's load.

The agent loads this module only when ``--gpu-backend sim`` is configured or ``auto``
finds no NVML (``node_agent.gpus.select_backend``, with a log line); tests and the
local cluster use it directly.
"""

from __future__ import annotations

import math
import random
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from node_agent.gpus import GIB, GpuInfo, GpuSample
from orchestrrl import errors


@dataclass(frozen=True)
class SimGpuModel:
    """An H800 SXM: 80 GiB HBM3, 700 W board power, SM boost clock 1980 MHz (as H100 SXM5),
    NVLink 400 GB/s. Decode traffic: PCIe carries prompts in and tokens out (small);
    NVLink carries the tensor-parallel all-reduces, about 2 per layer per iteration of
    batch x hidden x 2 bytes (for a 14B model at batch 256 some 12 GB/s per GPU)."""

    name: str = "NVIDIA H800 (simulated)"
    memory_total_bytes: int = 80 * GIB
    idle_watts: float = 90.0
    max_watts: float = 700.0
    idle_c: float = 32.0
    hot_c: float = 72.0
    thermal_time_constant_s: float = 20.0
    reserved_memory_fraction: float = 0.9  # a serving engine reserves its KV pool up front
    idle_sm_mhz: float = 345.0
    max_sm_mhz: float = 1980.0
    power_throttle: float = 0.08  # clock lost at full load to the power limit
    pcie_rx_bytes_per_s: float = 0.5e9  # at full load (host to device)
    pcie_tx_bytes_per_s: float = 0.2e9
    nvlink_bytes_per_s: float = 12e9  # each direction, at full load


class SimulatedGpus:
    """Simulated GPUs whose utilisation, power and temperature follow ``load`` (0..1)."""

    name = "sim"

    def __init__(
        self,
        count: int,
        seed: int = 0,
        *,
        load: Callable[[], float] = lambda: 0.0,
        clock: Callable[[], float] = time.monotonic,
        model: SimGpuModel | None = None,
    ) -> None:
        if count < 1:
            raise errors.field_error("gpus", count, "a node has at least one GPU")
        self._model = model or SimGpuModel()
        self._load = load
        self._clock = clock
        self._rng = random.Random(seed)
        self._inventory = [
            GpuInfo(
                index=i,
                name=self._model.name,
                uuid=f"GPU-{uuid.UUID(int=self._rng.getrandbits(128), version=4)}",
                memory_total_bytes=self._model.memory_total_bytes,
            )
            for i in range(count)
        ]
        # Each GPU is a little different (binning, airflow): a fixed per-GPU factor.
        self._bias = [self._rng.uniform(0.97, 1.03) for _ in range(count)]
        self._temperature = [self._model.idle_c] * count
        self._last = clock()
        # CPU seconds (this thread's) spent simulating readings, without reading the load
        # (the engine accounts for its own); bench/agent_overhead.py reports it
        self.simulation_cpu_s = 0.0

    async def inventory(self) -> list[GpuInfo]:
        return list(self._inventory)

    async def sample(self) -> list[GpuSample]:
        m = self._model
        load = min(1.0, max(0.0, self._load()))
        started = time.thread_time()
        now = self._clock()
        # First-order thermal lag towards the temperature the current load sustains.
        settle = 1.0 - math.exp(-max(0.0, now - self._last) / m.thermal_time_constant_s)
        self._last = now
        # Locals and positional GpuSample fields: this runs for every GPU at 10 Hz.
        # noise: uniform with the standard deviation named (random() is a C call;
        # random.gauss is Python code, and this runs for every GPU at every sample)
        uniform = self._rng.random
        temperatures = self._temperature
        reserved = m.reserved_memory_fraction if load > 0.0 else 0.01
        heat = m.hot_c - m.idle_c
        power_span = 0.8 * m.max_watts - m.idle_watts
        power_floor = m.idle_watts * 0.9
        samples = []
        for info, bias in zip(self._inventory, self._bias, strict=True):
            util = (
                0.0
                if load == 0.0
                else min(1.0, max(0.0, bias * (0.35 + 0.6 * load) + (uniform() - 0.5) * _SD2))
            )
            busy = util * bias
            i = info.index
            temp = temperatures[i]
            temp += (m.idle_c + heat * busy - temp) * settle
            temperatures[i] = temp
            power = max(power_floor, m.idle_watts + power_span * busy + (uniform() - 0.5) * _SD5)
            # NVML reports clocks in steps of 15 MHz; the power limit costs some at full load
            clock = (
                m.idle_sm_mhz
                if util == 0.0
                else round(m.max_sm_mhz * (1.0 - m.power_throttle * busy) / 15) * 15
            )
            nvlink = m.nvlink_bytes_per_s * busy
            samples.append(
                GpuSample(
                    i,
                    util,
                    int(info.memory_total_bytes * reserved),
                    info.memory_total_bytes,
                    power,
                    temp,
                    clock,  # sm_clock_mhz
                    m.pcie_tx_bytes_per_s * busy,
                    m.pcie_rx_bytes_per_s * busy,
                    nvlink,  # tx
                    nvlink,  # rx
                    0,  # ecc_corrected: a healthy simulated GPU reports, and has none
                    0,  # ecc_uncorrected
                    0,  # xid_errors
                )
            )
        self.simulation_cpu_s += time.thread_time() - started
        return samples

    async def close(self) -> None:
        return None

    def follow(self, load: Callable[[], float]) -> None:
        """Make the simulated load follow ``load`` (for example the engine's busy fraction)."""
        self._load = load


_SD2 = 0.02 * math.sqrt(12)  # uniform(-1/2, 1/2) x this has a standard deviation of 0.02
_SD5 = 5.0 * math.sqrt(12)  # ... of 5 W
