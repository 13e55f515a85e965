"""GPU telemetry backends: NVML on real nodes, a simulation everywhere else.

Both satisfy :class:`GpuBackend`. NVML calls block, so :class:`NvmlGpus` runs them in a
worker thread (``asyncio.to_thread``); the coroutine API keeps the event loop free.

Beyond utilisation, memory, power and temperature, NVML gives (each absent, never 0,
where the GPU or driver does not report it, with one warning per metric):

* SM clock: ``nvmlDeviceGetClockInfo(NVML_CLOCK_SM)`` in MHz.
* PCIe throughput: ``nvmlDeviceGetPcieThroughput(NVML_PCIE_UTIL_{TX,RX}_BYTES)``, KB/s
  averaged by the driver over 20 ms. Each call waits that long (2 x 8 GPUs = 320 ms), so
  it is read at most every ``PCIE_EVERY_S`` seconds and the last reading is reported in
  between; at 10 Hz it would otherwise not keep up.
* NVLink data throughput: ``nvmlDeviceGetFieldValues`` with
  ``NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_{TX,RX}`` per link (scope = link index), which are
  cumulative KiB counters: summed over the links that answer, rates from deltas.
* ECC: ``nvmlDeviceGetTotalEccErrors`` volatile corrected / uncorrected counts.
* XID: an NVML event set registered for ``nvmlEventTypeXidCriticalError`` at open; each
  sample drains it without waiting (``nvmlEventSetWait`` with a 0 ms timeout) and counts
  the events per GPU since the agent started, keeping the last XID code.
"""

from __future__ import annotations

import asyncio
import ctypes
import importlib
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Literal, NamedTuple, Protocol

from orchestrrl import errors
from orchestrrl.logs import get_logger

log = get_logger("node_agent.gpus")

GIB = 2**30
KIB = 1024
PCIE_EVERY_S = 5.0
BackendKind = Literal["auto", "nvml", "sim"]
BACKEND_KINDS: tuple[BackendKind, ...] = ("auto", "nvml", "sim")


@dataclass(frozen=True)
class GpuInfo:
    index: int
    name: str
    uuid: str
    memory_total_bytes: int


class GpuSample(NamedTuple):
    """One GPU's reading (a named tuple: built for every GPU at every sample, 10 Hz by
    default; a frozen dataclass costs five times as much to build)."""

    index: int  # type: ignore[assignment]  # the field shadows tuple.index, on purpose
    utilization: float  # 0..1
    memory_used_bytes: int
    memory_total_bytes: int
    power_watts: float
    temperature_c: float
    # NVML extras (GpuSample fields 7..15 and /metrics);
    # None: this GPU or driver does not report it (never 0 for 'unknown').
    sm_clock_mhz: float | None = None
    pcie_tx_bytes_per_s: float | None = None
    pcie_rx_bytes_per_s: float | None = None
    nvlink_tx_bytes_per_s: float | None = None
    nvlink_rx_bytes_per_s: float | None = None
    ecc_corrected: int | None = None  # volatile: since the driver loaded
    ecc_uncorrected: int | None = None
    xid_errors: int | None = None  # critical XID events seen since the agent started
    last_xid: int | None = None


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

    def __init__(
        self,
        nvml: ModuleType,
        handles: list[Any],
        inventory: list[GpuInfo],
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._nvml = nvml
        self._handles = handles
        self._inventory = inventory
        self._clock = clock
        self._warned: set[str] = set()
        self._nvlink_previous: dict[int, tuple[float, int, int]] = {}
        self._pcie: dict[int, tuple[Any, Any]] = {}
        self._pcie_read_at: float | None = None
        self._xid_counts: dict[int, int] = {}  # GPUs registered for XID events only
        self._last_xid: dict[int, int] = {}
        self._events: Any = None
        self._open_events()

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
        await asyncio.to_thread(self._close_blocking)

    def _close_blocking(self) -> None:
        if self._events is not None:
            self._read(0, "xid", self._nvml.nvmlEventSetFree, self._events)
            self._events = None
        self._nvml.nvmlShutdown()

    def _open_events(self) -> None:
        nvml = self._nvml
        self._events = self._read(0, "xid", nvml.nvmlEventSetCreate)
        if self._events is None:
            return
        for info, handle in zip(self._inventory, self._handles, strict=True):
            registered = self._read(
                info.index,
                "xid",
                nvml.nvmlDeviceRegisterEvents,
                handle,
                nvml.nvmlEventTypeXidCriticalError,
                self._events,
            )
            if registered is not _FAILED:
                self._xid_counts[info.index] = 0

    def _sample_blocking(self) -> list[GpuSample]:
        nvml = self._nvml
        self._drain_xid_events()
        now = self._clock()
        read_pcie = self._pcie_read_at is None or now - self._pcie_read_at >= PCIE_EVERY_S
        if read_pcie:
            self._pcie_read_at = now
        samples = []
        for info, handle in zip(self._inventory, self._handles, strict=True):
            i = info.index
            memory = self._read(i, "memory", nvml.nvmlDeviceGetMemoryInfo, handle)
            util = self._read(i, "utilization", nvml.nvmlDeviceGetUtilizationRates, handle)
            power_mw = self._read(i, "power", nvml.nvmlDeviceGetPowerUsage, handle)
            temperature = self._read(
                i, "temperature", nvml.nvmlDeviceGetTemperature, handle, nvml.NVML_TEMPERATURE_GPU
            )
            sm_clock = self._read(
                i, "sm_clock", nvml.nvmlDeviceGetClockInfo, handle, nvml.NVML_CLOCK_SM
            )
            if read_pcie:
                self._pcie[i] = (
                    self._read(
                        i, "pcie_tx", nvml.nvmlDeviceGetPcieThroughput, handle,
                        nvml.NVML_PCIE_UTIL_TX_BYTES,
                    ),
                    self._read(
                        i, "pcie_rx", nvml.nvmlDeviceGetPcieThroughput, handle,
                        nvml.NVML_PCIE_UTIL_RX_BYTES,
                    ),
                )  # fmt: skip
            pcie_tx, pcie_rx = self._pcie.get(i, (_FAILED, _FAILED))
            corrected = self._read(
                i,
                "ecc_corrected",
                nvml.nvmlDeviceGetTotalEccErrors,
                handle,
                nvml.NVML_MEMORY_ERROR_TYPE_CORRECTED,
                nvml.NVML_VOLATILE_ECC,
            )
            uncorrected = self._read(
                i,
                "ecc_uncorrected",
                nvml.nvmlDeviceGetTotalEccErrors,
                handle,
                nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                nvml.NVML_VOLATILE_ECC,
            )
            nvlink_tx, nvlink_rx = self._nvlink_rates(i, handle, now)
            samples.append(
                GpuSample(
                    index=i,
                    utilization=float(util.gpu) / 100.0 if _ok(util) else 0.0,
                    memory_used_bytes=int(memory.used) if _ok(memory) else 0,
                    memory_total_bytes=info.memory_total_bytes,
                    power_watts=float(power_mw) / 1000.0 if _ok(power_mw) else 0.0,
                    temperature_c=float(temperature) if _ok(temperature) else 0.0,
                    sm_clock_mhz=float(sm_clock) if _ok(sm_clock) else None,
                    pcie_tx_bytes_per_s=float(pcie_tx) * KIB if _ok(pcie_tx) else None,
                    pcie_rx_bytes_per_s=float(pcie_rx) * KIB if _ok(pcie_rx) else None,
                    nvlink_tx_bytes_per_s=nvlink_tx,
                    nvlink_rx_bytes_per_s=nvlink_rx,
                    ecc_corrected=int(corrected) if _ok(corrected) else None,
                    ecc_uncorrected=int(uncorrected) if _ok(uncorrected) else None,
                    xid_errors=self._xid_counts.get(i),
                    last_xid=self._last_xid.get(i),
                )
            )
        return samples

    def _nvlink_rates(
        self, index: int, handle: Any, now: float
    ) -> tuple[float | None, float | None]:
        """NVLink TX/RX bytes per second over all links; None until two readings (or never,
        when no link reports the counters)."""
        nvml = self._nvml
        links = range(nvml.NVML_NVLINK_MAX_LINKS)
        fields = [(nvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, link) for link in links] + [
            (nvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX, link) for link in links
        ]
        values = self._read(index, "nvlink", nvml.nvmlDeviceGetFieldValues, handle, fields)
        if not _ok(values):
            return None, None
        tx = rx = 0
        answered = False
        for value in values:
            if value.nvmlReturn != nvml.NVML_SUCCESS:
                continue
            answered = True
            if value.fieldId == nvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX:
                tx += int(value.value.ullVal)
            else:
                rx += int(value.value.ullVal)
        if not answered:
            self._warn(index, "nvlink", "no NVLink reports throughput counters")
            return None, None
        previous = self._nvlink_previous.get(index)
        self._nvlink_previous[index] = (now, tx, rx)
        if previous is None or now <= previous[0] or tx < previous[1] or rx < previous[2]:
            return None, None  # first reading, or the counters were reset
        elapsed = now - previous[0]
        return (tx - previous[1]) * KIB / elapsed, (rx - previous[2]) * KIB / elapsed

    def _drain_xid_events(self) -> None:
        if self._events is None or not self._xid_counts:
            return
        nvml = self._nvml
        keys = {
            _handle_key(h): info.index
            for info, h in zip(self._inventory, self._handles, strict=True)
        }
        while True:
            try:
                event = nvml.nvmlEventSetWait(self._events, 0)
            except nvml.NVMLError as exc:
                if getattr(exc, "value", None) != nvml.NVML_ERROR_TIMEOUT:
                    self._warn(0, "xid", str(exc))
                return
            index = keys.get(_handle_key(event.device))
            if index is None or index not in self._xid_counts:
                continue
            self._xid_counts[index] += 1
            self._last_xid[index] = int(event.eventData)
            log.error("gpu_xid_error", gpu=index, xid=int(event.eventData))

    def _read(self, index: int, metric: str, fn: Callable[..., Any], *args: Any) -> Any:
        """One NVML query; a metric the GPU cannot report reads as ``_FAILED`` (one warning
        per metric)."""
        try:
            return fn(*args)
        except self._nvml.NVMLError as exc:
            self._warn(index, metric, str(exc))
            return _FAILED

    def _warn(self, index: int, metric: str, reason: str) -> None:
        if metric not in self._warned:
            self._warned.add(metric)
            log.warning("nvml_metric_unavailable", gpu=index, metric=metric, reason=reason)


_FAILED: Any = object()  # a reading NVML refused; distinct from a legitimate None result


def _ok(value: Any) -> bool:
    return value is not _FAILED


def _handle_key(handle: Any) -> Any:
    """A hashable identity of an NVML device handle (a ctypes pointer compares by object)."""
    if isinstance(handle, ctypes._Pointer):
        return ctypes.cast(handle, ctypes.c_void_p).value
    return handle


async def select_backend(
    kind: BackendKind,
    sim_count: int,
    seed: int = 0,
    *,
    open_nvml: Callable[[], Awaitable[NvmlGpus]] = NvmlGpus.open,
) -> GpuBackend:
    """``nvml`` or fail; ``sim``; or ``auto``: NVML when it works, else simulated GPUs."""
    if kind == "sim":
        log.info("gpu_backend_simulated", gpus=sim_count, reason="--gpu-backend sim")
        return _simulated(sim_count, seed)
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
        return _simulated(sim_count, seed)


def _simulated(count: int, seed: int) -> GpuBackend:
    """Simulated GPUs (``sim_backends.gpus``: test doubles live outside production code,
    loaded only when the configuration or the ``auto`` fallback selects them)."""
    sim = importlib.import_module("sim_backends.gpus")
    backend: GpuBackend = sim.SimulatedGpus(count, seed)
    return backend
