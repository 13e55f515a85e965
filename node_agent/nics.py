"""NIC telemetry from sysfs: byte counters, rates from deltas, and link state.

Reads ``<root>/<nic>/statistics/{rx,tx}_bytes`` and ``<root>/<nic>/operstate`` in a
worker thread. A missing interface reads as down with zero counters (one warning), so
a renamed or unplugged NIC never stops the agent.
"""

from __future__ import annotations

import asyncio
import os
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from orchestrrl import errors
from orchestrrl.logs import get_logger

log = get_logger("node_agent.nics")

SYSFS_NET = Path("/sys/class/net")
# Linux interface names: 1..15 bytes, no '/', ':' or whitespace.
IFNAME_RE = re.compile(r"^[^/:\s]{1,15}$")


@dataclass(frozen=True)
class NicSpec:
    name: str
    speed_gbps: float  # 0 when unknown


@dataclass(frozen=True)
class NicSample:
    name: str
    rx_bytes: int
    tx_bytes: int
    rx_gbps: float
    tx_gbps: float
    oper_up: bool


@dataclass(frozen=True)
class _Counters:
    rx_bytes: int
    tx_bytes: int
    oper_up: bool


def parse_nic(text: str, field: str = "--nic") -> tuple[str, float | None]:
    """Parse ``NAME`` or ``NAME=GBPS``; GBPS None means 'read the link speed'."""
    name, sep, gbps_text = text.partition("=")
    if not IFNAME_RE.match(name):
        raise errors.field_error(
            field, text, "expected NAME[=GBPS] with a Linux interface name (1-15 chars, no / or :)"
        )
    if not sep:
        return name, None
    try:
        gbps = float(gbps_text)
    except ValueError:
        gbps = -1.0
    if not 0 < gbps <= 100_000:
        raise errors.field_error(field, text, "GBPS must be a number of Gb/s above 0, e.g. 400")
    return name, gbps


class SysfsNics:
    """Telemetry of the NICs named on the command line."""

    def __init__(
        self,
        nics: Sequence[tuple[str, float | None]],
        *,
        root: Path = SYSFS_NET,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._nics = list(nics)
        self._root = root
        self._clock = clock
        self._specs: list[NicSpec] = []
        self._previous: dict[str, tuple[float, _Counters]] = {}
        self._rates: dict[str, tuple[float, float]] = {}
        self._missing: set[str] = set()
        self._lock = asyncio.Lock()  # one reading at a time keeps the deltas ordered

    async def open(self) -> list[NicSpec]:
        """Resolve link speeds not given on the command line; return the inventory."""
        self._specs = await asyncio.to_thread(self._resolve_specs)
        return list(self._specs)

    def inventory(self) -> list[NicSpec]:
        return list(self._specs) if self._specs else [NicSpec(n, g or 0.0) for n, g in self._nics]

    async def sample(self) -> list[NicSample]:
        if not self._nics:  # nothing to read: no worker-thread hop
            return []
        async with self._lock:
            readings = await asyncio.to_thread(self._read_all)
            now = self._clock()
            return [self._to_sample(name, counters, now) for name, counters in readings]

    # -- blocking helpers (run in a worker thread) --------------------------------------

    def _resolve_specs(self) -> list[NicSpec]:
        return [
            NicSpec(name, gbps if gbps is not None else self._link_speed_gbps(name))
            for name, gbps in self._nics
        ]

    def _link_speed_gbps(self, name: str) -> float:
        """``speed`` is in Mb/s; virtual or down links report -1 or refuse the read."""
        try:
            mbps = int((self._root / name / "speed").read_text().strip())
        except (OSError, ValueError):
            return 0.0
        return mbps / 1000.0 if mbps > 0 else 0.0

    def _read_all(self) -> list[tuple[str, _Counters | None]]:
        return [(name, self._read(name)) for name, _ in self._nics]

    def _read(self, name: str) -> _Counters | None:
        # os.open/os.read on prebuilt paths: a tenth of pathlib's cost, which matters at 10 Hz
        base = f"{self._root}/{name}"
        try:
            rx = int(_read_small(f"{base}/statistics/rx_bytes"))
            tx = int(_read_small(f"{base}/statistics/tx_bytes"))
            state = _read_small(f"{base}/operstate").strip()
        except (OSError, ValueError):
            return None
        return _Counters(rx, tx, state == b"up")

    # -- rates --------------------------------------------------------------------------

    def _to_sample(self, name: str, counters: _Counters | None, now: float) -> NicSample:
        if counters is None:
            if name not in self._missing:
                self._missing.add(name)
                log.warning(
                    "nic_missing",
                    nic=name,
                    path=str(self._root / name),
                    effect="reported as down with zero counters until it appears",
                )
            self._previous.pop(name, None)
            self._rates.pop(name, None)
            return NicSample(name, 0, 0, 0.0, 0.0, False)
        if name in self._missing:
            self._missing.discard(name)
            log.info("nic_present", nic=name)
        rx_gbps, tx_gbps = self._rates.get(name, (0.0, 0.0))
        previous = self._previous.get(name)
        if previous is not None and now > previous[0]:
            elapsed = now - previous[0]
            rx_gbps = _gbps(counters.rx_bytes - previous[1].rx_bytes, elapsed)
            tx_gbps = _gbps(counters.tx_bytes - previous[1].tx_bytes, elapsed)
        self._previous[name] = (now, counters)
        self._rates[name] = (rx_gbps, tx_gbps)
        return NicSample(
            name, counters.rx_bytes, counters.tx_bytes, rx_gbps, tx_gbps, counters.oper_up
        )


def _read_small(path: str) -> bytes:
    """The content of a small sysfs file (a counter or a word)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        return os.read(fd, 256)
    finally:
        os.close(fd)


def _gbps(delta_bytes: int, elapsed_s: float) -> float:
    """A negative delta means the counters were reset (driver reload): no rate this time."""
    return max(0, delta_bytes) * 8 / elapsed_s / 1e9
