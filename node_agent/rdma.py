"""RDMA port counters from sysfs: data rates, congestion (CNP), out-of-sequence, PFC.

For every ``<root>/<device>/ports/<port>/`` the reader takes the standard ``counters/``
(``port_xmit_data`` and ``port_rcv_data`` count 4-byte words; they are reported here in
bytes) and the driver's ``hw_counters/`` (``np_cnp_sent``, ``rp_cnp_handled``,
``out_of_sequence``, and any counter whose name contains ``pause``: mlx5 reports PFC
pause frames only through ethtool, other drivers put them here). Files are read in a
worker thread (a driver may answer hw_counters from firmware, which can block). Which
files exist is looked up once and again every ``RESCAN_EVERY_SAMPLES`` samples or when
a file vanishes; each sample then only opens and reads the known files. Counters are
treated as 64-bit: a value below the previous one wraps when the previous one was in
the top half of the range, otherwise the counter was reset (driver reload) and that
interval has no rate.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from orchestrrl.logs import get_logger

log = get_logger("node_agent.rdma")

SYSFS_INFINIBAND = Path("/sys/class/infiniband")
WORD_BYTES = 4  # port_xmit_data / port_rcv_data count 4-byte words
COUNTER_MODULUS = 2**64
PORT_COUNTERS = ("port_xmit_data", "port_rcv_data", "port_xmit_discards", "port_rcv_errors")
HW_COUNTERS = ("np_cnp_sent", "rp_cnp_handled", "out_of_sequence", "np_ecn_marked_roce_packets")
RECHECK_EVERY_SAMPLES = 100
RESCAN_EVERY_SAMPLES = 100
WORD_COUNTERS = frozenset({"port_xmit_data", "port_rcv_data"})


@dataclass(frozen=True)
class RdmaSample:
    device: str
    port: int
    tx_bytes_per_s: float
    rx_bytes_per_s: float
    counters: dict[str, int] = field(default_factory=dict)  # as read (data counters in bytes)
    rates: dict[str, float] = field(default_factory=dict)  # per second, from the last reading


def counter_delta(previous: int, current: int) -> int | None:
    """``current - previous`` for a 64-bit counter; None when it was reset."""
    if current >= previous:
        return current - previous
    if previous >= COUNTER_MODULUS // 2:
        return (current - previous) % COUNTER_MODULUS
    return None


PortKey = tuple[str, int]
# per port: (counter name, file path, multiplier) of each file found at the last scan
PortFiles = tuple[PortKey, tuple[tuple[str, str, int], ...]]


class SysfsRdma:
    """Counters of every RDMA port under ``root``; nothing to read is not an error."""

    def __init__(
        self, *, root: Path = SYSFS_INFINIBAND, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._root = root
        self._clock = clock
        self._previous: dict[PortKey, tuple[float, dict[str, int]]] = {}
        self._lock = asyncio.Lock()
        self._present = True  # until a reading finds no devices
        self._skipped = 0
        self._files: list[PortFiles] | None = None  # None: scan before the next reading
        self._reads_since_scan = 0

    async def sample(self) -> list[RdmaSample]:
        # Without RDMA devices, skip the worker-thread hop; look again now and then, in
        # case the driver loads after the agent started.
        self._skipped += 1
        if not self._present and self._skipped % RECHECK_EVERY_SAMPLES != 1:
            return []
        async with self._lock:
            readings = await asyncio.to_thread(self._read_all)
            self._present = readings is not None
            if readings is None:
                return []
            now = self._clock()
            return [self._to_sample(key, counters, now) for key, counters in readings]

    def _read_all(self) -> list[tuple[PortKey, dict[str, int]]] | None:
        """Every port's counters; None when there is no RDMA device directory."""
        self._reads_since_scan += 1
        if self._files is None or self._reads_since_scan >= RESCAN_EVERY_SAMPLES:
            if not os.path.isdir(self._root):
                self._files = None
                return None
            self._files = self._scan()
            self._reads_since_scan = 0
        out: list[tuple[PortKey, dict[str, int]]] = []
        vanished = False
        for key, files in self._files:
            counters: dict[str, int] = {}
            for name, path, scale in files:
                value = _read_int(path)
                if value is None:
                    vanished = True
                else:
                    counters[name] = value * scale
            out.append((key, counters))
        if vanished:  # a device or counter went away: look again next time
            self._files = None
        return out

    def _scan(self) -> list[PortFiles]:
        out: list[PortFiles] = []
        try:
            devices = sorted(p for p in self._root.iterdir() if p.is_dir())
        except OSError:
            return out
        for device in devices:
            try:
                ports = sorted((device / "ports").iterdir(), key=lambda p: p.name)
            except OSError:
                continue
            for port in ports:
                if port.name.isdigit():
                    out.append(((device.name, int(port.name)), _port_files(port)))
        return out

    def _to_sample(self, key: tuple[str, int], counters: dict[str, int], now: float) -> RdmaSample:
        rates: dict[str, float] = {}
        previous = self._previous.get(key)
        if previous is not None and now > previous[0]:
            elapsed = now - previous[0]
            for name, value in counters.items():
                before = previous[1].get(name)
                if before is None:
                    continue
                # a data counter in bytes wraps at 4 * 2**64
                scale = WORD_BYTES if name in WORD_COUNTERS else 1
                delta = counter_delta(before // scale, value // scale)
                if delta is None:
                    log.info("rdma_counter_reset", device=key[0], port=key[1], counter=name)
                    continue
                rates[name] = delta * scale / elapsed
        self._previous[key] = (now, counters)
        return RdmaSample(
            device=key[0],
            port=key[1],
            tx_bytes_per_s=rates.get("port_xmit_data", 0.0),
            rx_bytes_per_s=rates.get("port_rcv_data", 0.0),
            counters=counters,
            rates=rates,
        )


def _port_files(port: Path) -> tuple[tuple[str, str, int], ...]:
    files = [
        (name, str(port / "counters" / name), WORD_BYTES if name in WORD_COUNTERS else 1)
        for name in PORT_COUNTERS
    ]
    hw = port / "hw_counters"
    names = list(HW_COUNTERS)
    with contextlib.suppress(OSError):
        names += sorted(p.name for p in hw.iterdir() if "pause" in p.name)
    files += [(name, str(hw / name), 1) for name in names]
    return tuple(f for f in files if os.path.isfile(f[1]))


def _read_int(path: str) -> int | None:
    """A counter file (os.open/os.read: a tenth of pathlib's cost per file)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        return int(os.read(fd, 64))
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)
