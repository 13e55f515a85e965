"""GPU backends: simulated GPUs, NvmlGpus against a monkeypatched pynvml, selection."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pynvml
import pytest
from structlog.testing import capture_logs

from node_agent.gpus import GIB, NvmlGpus, NvmlUnavailable, select_backend
from sim_backends.gpus import SimulatedGpus
from tests.helpers import FakeClock

pytestmark = pytest.mark.unit


# -- simulated GPUs ----------------------------------------------------------------------


async def test_simulated_inventory_is_h800_like_and_seeded() -> None:
    gpus = SimulatedGpus(8, seed=1)
    inventory = await gpus.inventory()
    assert [g.index for g in inventory] == list(range(8))
    assert all(g.memory_total_bytes == 80 * GIB for g in inventory)
    assert all("H800" in g.name and "simulated" in g.name for g in inventory)
    assert len({g.uuid for g in inventory}) == 8
    assert all(g.uuid.startswith("GPU-") for g in inventory)
    assert await SimulatedGpus(8, seed=1).inventory() == inventory
    assert await SimulatedGpus(8, seed=2).inventory() != inventory
    assert gpus.name == "sim"


async def test_simulated_idle_gpus() -> None:
    gpus = SimulatedGpus(4, seed=1)
    for sample in await gpus.sample():
        assert sample.utilization == 0.0
        assert 80.0 <= sample.power_watts <= 120.0
        assert sample.memory_used_bytes < 0.05 * sample.memory_total_bytes


async def test_simulated_gpus_follow_the_load() -> None:
    clock = FakeClock()
    load = 0.0
    gpus = SimulatedGpus(4, seed=1, load=lambda: load, clock=clock)
    idle = await gpus.sample()
    load = 1.0
    clock.now = 120.0  # long enough for the temperature to settle
    busy = await gpus.sample()
    for before, after in zip(idle, busy, strict=True):
        assert after.utilization > 0.8
        assert after.power_watts > before.power_watts + 300
        assert after.power_watts <= 700.0
        assert after.temperature_c > before.temperature_c + 20
        assert after.memory_used_bytes > 0.8 * after.memory_total_bytes


async def test_follow_replaces_the_load_source() -> None:
    gpus = SimulatedGpus(2, seed=1)
    gpus.follow(lambda: 0.7)
    assert all(s.utilization > 0.5 for s in await gpus.sample())


# -- NVML (pynvml monkeypatched: the real call path without a GPU) -----------------------


class FakeNvml:
    """Records calls; patched over the real pynvml module's functions."""

    def __init__(self, count: int = 2) -> None:
        self.count = count
        self.calls: list[str] = []
        self.power_error: int | None = None
        self.unsupported: set[str] = set()  # names of NVML functions that fail
        self.nvlink_kib = [0, 0]  # cumulative TX, RX KiB on each of links 0 and 1
        self.xid_events: list[tuple[str, int]] = []  # (handle, xid) pending
        self.registered: list[str] = []

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        for name in (
            "nvmlInit",
            "nvmlShutdown",
            "nvmlDeviceGetCount",
            "nvmlDeviceGetHandleByIndex",
            "nvmlDeviceGetName",
            "nvmlDeviceGetUUID",
            "nvmlDeviceGetMemoryInfo",
            "nvmlDeviceGetUtilizationRates",
            "nvmlDeviceGetPowerUsage",
            "nvmlDeviceGetTemperature",
            "nvmlDeviceGetClockInfo",
            "nvmlDeviceGetPcieThroughput",
            "nvmlDeviceGetTotalEccErrors",
            "nvmlDeviceGetFieldValues",
            "nvmlEventSetCreate",
            "nvmlEventSetFree",
            "nvmlDeviceRegisterEvents",
            "nvmlEventSetWait",
        ):
            monkeypatch.setattr(pynvml, name, self._maybe_unsupported(name, getattr(self, name)))

    def _maybe_unsupported(self, name: str, fn: Any) -> Any:
        def call(*args: Any) -> Any:
            if name in self.unsupported:
                raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
            return fn(*args)

        return call

    def nvmlDeviceGetClockInfo(self, handle: str, clock: int) -> int:
        assert clock == pynvml.NVML_CLOCK_SM
        return 1980

    def nvmlDeviceGetPcieThroughput(self, handle: str, counter: int) -> int:
        self.calls.append("pcie")
        return {pynvml.NVML_PCIE_UTIL_TX_BYTES: 1000, pynvml.NVML_PCIE_UTIL_RX_BYTES: 2000}[
            counter
        ]  # KB/s

    def nvmlDeviceGetTotalEccErrors(self, handle: str, kind: int, counter: int) -> int:
        assert counter == pynvml.NVML_VOLATILE_ECC
        return {pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED: 5}.get(kind, 0)

    def nvmlDeviceGetFieldValues(self, handle: str, fields: list[tuple[int, int]]) -> Any:
        out = []
        for field_id, link in fields:
            tx = field_id == pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX
            if link < 2:  # two links report; the others are not present
                value = self.nvlink_kib[0 if tx else 1]
                out.append(
                    SimpleNamespace(
                        fieldId=field_id,
                        nvmlReturn=pynvml.NVML_SUCCESS,
                        value=SimpleNamespace(ullVal=value),
                    )
                )
            else:
                out.append(
                    SimpleNamespace(fieldId=field_id, nvmlReturn=pynvml.NVML_ERROR_NOT_SUPPORTED)
                )
        return out

    def nvmlEventSetCreate(self) -> str:
        return "events"

    def nvmlEventSetFree(self, events: str) -> None:
        self.calls.append("free")

    def nvmlDeviceRegisterEvents(self, handle: str, types: int, events: str) -> None:
        assert types == pynvml.nvmlEventTypeXidCriticalError
        self.registered.append(handle)

    def nvmlEventSetWait(self, events: str, timeout_ms: int) -> Any:
        assert timeout_ms == 0  # never blocks the sampling thread
        if not self.xid_events:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_TIMEOUT)
        handle, xid = self.xid_events.pop(0)
        return SimpleNamespace(
            device=handle, eventType=pynvml.nvmlEventTypeXidCriticalError, eventData=xid
        )

    def nvmlInit(self) -> None:
        self.calls.append("init")

    def nvmlShutdown(self) -> None:
        self.calls.append("shutdown")

    def nvmlDeviceGetCount(self) -> int:
        return self.count

    def nvmlDeviceGetHandleByIndex(self, index: int) -> str:
        return f"handle{index}"

    def nvmlDeviceGetName(self, handle: str) -> str:
        return "NVIDIA H800"

    def nvmlDeviceGetUUID(self, handle: str) -> str:
        return f"GPU-{handle}"

    def nvmlDeviceGetMemoryInfo(self, handle: str) -> Any:
        return SimpleNamespace(total=80 * GIB, used=60 * GIB, free=20 * GIB)

    def nvmlDeviceGetUtilizationRates(self, handle: str) -> Any:
        return SimpleNamespace(gpu=75, memory=40)

    def nvmlDeviceGetPowerUsage(self, handle: str) -> int:
        if self.power_error is not None:
            raise pynvml.NVMLError(self.power_error)
        return 350_000  # milliwatts

    def nvmlDeviceGetTemperature(self, handle: str, sensor: int) -> int:
        assert sensor == pynvml.NVML_TEMPERATURE_GPU
        return 61


async def test_nvml_inventory_and_sample(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeNvml(count=2)
    fake.install(monkeypatch)
    gpus = await NvmlGpus.open()
    assert gpus.name == "nvml"
    inventory = await gpus.inventory()
    assert [(g.index, g.name, g.uuid, g.memory_total_bytes) for g in inventory] == [
        (0, "NVIDIA H800", "GPU-handle0", 80 * GIB),
        (1, "NVIDIA H800", "GPU-handle1", 80 * GIB),
    ]
    samples = await gpus.sample()
    assert len(samples) == 2
    sample = samples[1]
    assert sample.index == 1
    assert sample.utilization == pytest.approx(0.75)
    assert sample.memory_used_bytes == 60 * GIB
    assert sample.memory_total_bytes == 80 * GIB
    assert sample.power_watts == pytest.approx(350.0)
    assert sample.temperature_c == 61.0
    await gpus.close()
    assert fake.calls == ["init", "pcie", "pcie", "pcie", "pcie", "free", "shutdown"]


async def test_nvml_extras_clock_pcie_nvlink_ecc_xid(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeNvml(count=2)
    fake.install(monkeypatch)
    clock = FakeClock(10.0)
    gpus = await NvmlGpus.open()
    gpus._clock = clock  # the reading times of the NVLink counters
    assert fake.registered == ["handle0", "handle1"]
    fake.nvlink_kib = [100, 50]
    first = await gpus.sample()
    sample = first[0]
    assert sample.sm_clock_mhz == 1980.0
    assert sample.pcie_tx_bytes_per_s == 1000 * 1024
    assert sample.pcie_rx_bytes_per_s == 2000 * 1024
    assert sample.ecc_corrected == 5
    assert sample.ecc_uncorrected == 0
    assert sample.nvlink_tx_bytes_per_s is None  # a rate needs two readings
    assert (sample.xid_errors, sample.last_xid) == (0, None)

    fake.nvlink_kib = [100 + 2048, 50 + 1024]  # per link, two links
    fake.xid_events = [("handle1", 79), ("handle1", 48)]
    clock.now = 12.0
    with capture_logs() as logs:
        second = await gpus.sample()
    assert fake.calls.count("pcie") == 4  # slow (20 ms a call): not again within 5 s
    assert second[0].pcie_tx_bytes_per_s == 1000 * 1024  # the last reading
    clock.now = 15.0
    await gpus.sample()
    assert fake.calls.count("pcie") == 8
    assert second[0].nvlink_tx_bytes_per_s == 2 * 2048 * 1024 / 2.0
    assert second[0].nvlink_rx_bytes_per_s == 2 * 1024 * 1024 / 2.0
    assert (second[0].xid_errors, second[0].last_xid) == (0, None)
    assert (second[1].xid_errors, second[1].last_xid) == (2, 48)
    assert [e["xid"] for e in logs if e["event"] == "gpu_xid_error"] == [79, 48]
    await gpus.close()


async def test_nvml_extras_not_supported_are_absent_with_one_warning_each(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake = FakeNvml(count=2)
    fake.unsupported = {
        "nvmlDeviceGetClockInfo",
        "nvmlDeviceGetPcieThroughput",
        "nvmlDeviceGetTotalEccErrors",
        "nvmlDeviceGetFieldValues",
        "nvmlDeviceRegisterEvents",
    }
    fake.install(monkeypatch)
    with capture_logs() as logs:
        gpus = await NvmlGpus.open()
        for _ in range(2):
            samples = await gpus.sample()
    for s in samples:
        assert s.sm_clock_mhz is None
        assert s.pcie_tx_bytes_per_s is None
        assert s.pcie_rx_bytes_per_s is None
        assert s.nvlink_tx_bytes_per_s is None
        assert s.ecc_corrected is None
        assert s.ecc_uncorrected is None
        assert s.xid_errors is None
        assert s.utilization == pytest.approx(0.75)  # the rest still reads
    warned = sorted(e["metric"] for e in logs if e["event"] == "nvml_metric_unavailable")
    assert warned == [
        "ecc_corrected",
        "ecc_uncorrected",
        "nvlink",
        "pcie_rx",
        "pcie_tx",
        "sm_clock",
        "xid",
    ]
    await gpus.close()


async def test_nvml_metric_not_supported_reads_zero_and_warns_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake = FakeNvml(count=1)
    fake.power_error = pynvml.NVML_ERROR_NOT_SUPPORTED
    fake.install(monkeypatch)
    gpus = await NvmlGpus.open()
    with capture_logs() as logs:
        first = await gpus.sample()
        await gpus.sample()
    assert first[0].power_watts == 0.0
    assert first[0].temperature_c == 61.0
    warnings = [e for e in logs if e["event"] == "nvml_metric_unavailable"]
    assert len(warnings) == 1
    assert warnings[0]["metric"] == "power"
    assert warnings[0]["reason"] == "Not Supported"


def library_not_found() -> None:
    raise pynvml.NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)


async def test_nvml_open_fails_clearly_without_the_library(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(pynvml, "nvmlInit", library_not_found)
    with pytest.raises(NvmlUnavailable, match="nvmlInit failed: NVML Shared Library Not Found"):
        await NvmlGpus.open()


async def test_nvml_without_gpus_is_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeNvml(count=0)
    fake.install(monkeypatch)
    with pytest.raises(NvmlUnavailable, match="no GPUs"):
        await NvmlGpus.open()
    assert fake.calls == ["init", "shutdown"]


# -- selection ---------------------------------------------------------------------------


async def test_auto_falls_back_to_simulated_gpus_with_one_clear_log_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(pynvml, "nvmlInit", library_not_found)
    with capture_logs() as logs:
        backend = await select_backend("auto", 4, seed=1)
    assert isinstance(backend, SimulatedGpus)
    assert len(await backend.inventory()) == 4
    assert len(logs) == 1
    assert logs[0]["event"] == "nvml_unavailable_using_simulated_gpus"
    assert logs[0]["log_level"] == "warning"
    assert "NVML Shared Library Not Found" in logs[0]["reason"]
    assert logs[0]["simulated_gpus"] == 4


async def test_auto_uses_nvml_when_it_works(monkeypatch: pytest.MonkeyPatch) -> None:
    FakeNvml(count=2).install(monkeypatch)
    backend = await select_backend("auto", 8)
    assert isinstance(backend, NvmlGpus)
    assert len(await backend.inventory()) == 2
    await backend.close()


async def test_nvml_backend_fails_hard(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pynvml, "nvmlInit", library_not_found)
    with pytest.raises(NvmlUnavailable) as info:
        await select_backend("nvml", 8)
    message = str(info.value)
    assert "--gpu-backend nvml" in message
    assert "NVML Shared Library Not Found" in message
    assert "--gpu-backend auto or sim" in message


async def test_sim_backend_never_touches_nvml() -> None:
    async def explode() -> NvmlGpus:
        raise AssertionError("NVML must not be opened for --gpu-backend sim")

    backend = await select_backend("sim", 2, open_nvml=explode)
    assert isinstance(backend, SimulatedGpus)
