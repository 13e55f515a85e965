"""GPU telemetry backends: NVML on real nodes, a simulation everywhere else.

Both satisfy :class:`GpuBackend`. NVML calls block, so :class:`NvmlGpus` runs them in a
worker thread (``asyncio.to_thread``); the coroutine API keeps the event loop free.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Literal, Protocol

from orchestrrl import errors
from orchestrrl.logs import get_logger

log = get_logger("node_agent.gpus")

GIB = 2**30
BackendKind = Literal["auto", "nvml", "sim"]
BACKEND_KINDS: tuple[BackendKind, ...] = ("auto", "nvml", "sim")


@dataclass(frozen=True)
class GpuInfo:
    index: int
    name: str
    uuid: str
    memory_total_bytes: int


@dataclass(frozen=True)
class GpuSample:
    index: int
    utilization: float  # 0..1
    memory_used_bytes: int
    memory_total_bytes: int
    power_watts: float
    temperature_c: float


class GpuBackend(Protocol):
    @property
    def name(self) -> str:
        """``nvml`` or ``sim``; reported as NodeStatus.gpu_backend."""

    async def inventory(self) -> list[GpuInfo]: ...

    async def sample(self) -> list[GpuSample]: ...

    async def close(self) -> None: ...


class NvmlUnavailable(errors.Unavailable):
    """NVML could not be initialised (no library, no driver, no permission)."""


class NvmlGpus:
    """GPUs read through nvidia-ml-py. Create with :meth:`open`."""

    name = "nvml"

    def __init__(self, nvml: ModuleType, handles: list[Any], inventory: list[GpuInfo]) -> None:
        self._nvml = nvml
        self._handles = handles
        self._inventory = inventory
        self._warned: set[tuple[int, str]] = set()

    @classmethod
    async def open(cls) -> NvmlGpus:
        """Initialise NVML and read the inventory; :class:`NvmlUnavailable` if it fails."""
        return await asyncio.to_thread(cls._open_blocking)

    @classmethod
    def _open_blocking(cls) -> NvmlGpus:
        try:
            import pynvml
        except ImportError as exc:  # pragma: no cover - nvidia-ml-py is a dependency
            raise NvmlUnavailable(f"nvidia-ml-py is not installed: {exc}") from None
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as exc:
            raise NvmlUnavailable(f"nvmlInit failed: {exc}") from None
        try:
            count = pynvml.nvmlDeviceGetCount()
            handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
            inventory = [
                GpuInfo(
                    index=i,
                    name=str(pynvml.nvmlDeviceGetName(h)),
                    uuid=str(pynvml.nvmlDeviceGetUUID(h)),
                    memory_total_bytes=int(pynvml.nvmlDeviceGetMemoryInfo(h).total),
                )
                for i, h in enumerate(handles)
            ]
        except pynvml.NVMLError as exc:
            pynvml.nvmlShutdown()
            raise NvmlUnavailable(f"reading the GPU inventory failed: {exc}") from None
        if not inventory:
            pynvml.nvmlShutdown()
            raise NvmlUnavailable("NVML reports no GPUs on this node")
        return cls(pynvml, handles, inventory)

    async def inventory(self) -> list[GpuInfo]:
        return list(self._inventory)

    async def sample(self) -> list[GpuSample]:
        return await asyncio.to_thread(self._sample_blocking)

    async def close(self) -> None:
        await asyncio.to_thread(self._nvml.nvmlShutdown)

    def _sample_blocking(self) -> list[GpuSample]:
        samples = []
        for info, handle in zip(self._inventory, self._handles, strict=True):
            memory = self._read(info.index, "memory", self._nvml.nvmlDeviceGetMemoryInfo, handle)
            util = self._read(
                info.index, "utilization", self._nvml.nvmlDeviceGetUtilizationRates, handle
            )
            power_mw = self._read(info.index, "power", self._nvml.nvmlDeviceGetPowerUsage, handle)
            temperature = self._read(
                info.index,
                "temperature",
                self._nvml.nvmlDeviceGetTemperature,
                handle,
                self._nvml.NVML_TEMPERATURE_GPU,
            )
            samples.append(
                GpuSample(
                    index=info.index,
                    utilization=float(util.gpu) / 100.0 if util is not None else 0.0,
                    memory_used_bytes=int(memory.used) if memory is not None else 0,
                    memory_total_bytes=info.memory_total_bytes,
                    power_watts=float(power_mw) / 1000.0 if power_mw is not None else 0.0,
                    temperature_c=float(temperature) if temperature is not None else 0.0,
                )
            )
        return samples

    def _read(self, index: int, metric: str, fn: Callable[..., Any], *args: Any) -> Any:
        """One NVML query; a metric the GPU cannot report reads as 0 with one warning."""
        try:
            return fn(*args)
        except self._nvml.NVMLError as exc:
            if (index, metric) not in self._warned:
                self._warned.add((index, metric))
                log.warning("nvml_metric_unavailable", gpu=index, metric=metric, reason=str(exc))
            return None


@dataclass(frozen=True)
class SimGpuModel:
    """An H800 SXM: 80 GiB HBM3, 700 W board power."""

    name: str = "NVIDIA H800 (simulated)"
    memory_total_bytes: int = 80 * GIB
    idle_watts: float = 90.0
    max_watts: float = 700.0
    idle_c: float = 32.0
    hot_c: float = 72.0
    thermal_time_constant_s: float = 20.0
    reserved_memory_fraction: float = 0.9  # a serving engine reserves its KV pool up front


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

    async def inventory(self) -> list[GpuInfo]:
        return list(self._inventory)

    async def sample(self) -> list[GpuSample]:
        m = self._model
        load = min(1.0, max(0.0, self._load()))
        now = self._clock()
        # First-order thermal lag towards the temperature the current load sustains.
        settle = 1.0 - math.exp(-max(0.0, now - self._last) / m.thermal_time_constant_s)
        self._last = now
        samples = []
        for info, bias in zip(self._inventory, self._bias, strict=True):
            util = 0.0 if load == 0.0 else _clip(bias * (0.35 + 0.6 * load) + self._noise(0.02))
            target_c = m.idle_c + (m.hot_c - m.idle_c) * util * bias
            temp = self._temperature[info.index]
            self._temperature[info.index] = temp + (target_c - temp) * settle
            reserved = m.reserved_memory_fraction if load > 0.0 else 0.01
            power = m.idle_watts + (0.8 * m.max_watts - m.idle_watts) * util * bias
            samples.append(
                GpuSample(
                    index=info.index,
                    utilization=util,
                    memory_used_bytes=int(info.memory_total_bytes * reserved),
                    memory_total_bytes=info.memory_total_bytes,
                    power_watts=max(m.idle_watts * 0.9, power + self._noise(5.0)),
                    temperature_c=self._temperature[info.index],
                )
            )
        return samples

    async def close(self) -> None:
        return None

    def follow(self, load: Callable[[], float]) -> None:
        """Make the simulated load follow ``load`` (for example the engine's busy fraction)."""
        self._load = load

    def _noise(self, scale: float) -> float:
        return self._rng.gauss(0.0, scale)


def _clip(value: float) -> float:
    return min(1.0, max(0.0, value))


async def select_backend(
    kind: BackendKind,
    sim_count: int,
    seed: int = 0,
    *,
    open_nvml: Callable[[], Awaitable[NvmlGpus]] = NvmlGpus.open,
) -> GpuBackend:
    """``nvml`` or fail; ``sim``; or ``auto``: NVML when it works, else simulated GPUs."""
    if kind == "sim":
        return SimulatedGpus(sim_count, seed)
    try:
        return await open_nvml()
    except NvmlUnavailable as exc:
        if kind == "nvml":
            raise NvmlUnavailable(
                f"--gpu-backend nvml: NVML is unavailable ({exc}); install or load the NVIDIA "
                "driver, or use --gpu-backend auto or sim"
            ) from None
        log.warning(
            "nvml_unavailable_using_simulated_gpus",
            reason=str(exc),
            simulated_gpus=sim_count,
            hint="use --gpu-backend nvml to make this an error",
        )
        return SimulatedGpus(sim_count, seed)
