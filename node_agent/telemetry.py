"""The node's status and telemetry, gathered from the GPU backend, the NICs and the engine."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from node_agent.engine import EngineState, EngineStats, RolloutEngine
from node_agent.gpus import GpuBackend, GpuInfo, GpuSample
from node_agent.nics import NicSample, NicSpec, SysfsNics
from node_agent.rdma import RdmaSample, SysfsRdma
from orchestrrl import __version__, errors

MIN_INTERVAL_S = 0.05
MAX_INTERVAL_S = 3600.0


def check_interval(value: float, field: str) -> float:
    """A telemetry interval in seconds, within the range the agent supports."""
    if not MIN_INTERVAL_S <= value <= MAX_INTERVAL_S:
        raise errors.field_error(
            field, value, f"must be between {MIN_INTERVAL_S} and {MAX_INTERVAL_S:g} seconds"
        )
    return value


@dataclass(frozen=True)
class NodeStatus:
    node: str
    gpu_backend: str
    gpus: tuple[GpuInfo, ...]
    nics: tuple[NicSpec, ...]
    engine_state: EngineState
    tp_layout: tuple[int, ...]
    version: str


@dataclass(frozen=True)
class Telemetry:
    node: str
    timestamp: float  # seconds since the Unix epoch
    gpus: tuple[GpuSample, ...]
    nics: tuple[NicSample, ...]
    engine: EngineStats
    engine_state: EngineState
    tp_layout: tuple[int, ...]
    rdma: tuple[RdmaSample, ...] = ()  # not in the protobuf sample; served on /metrics


class Collector:
    """Reads every telemetry source of the node; :meth:`open` once before use."""

    def __init__(
        self,
        node: str,
        gpus: GpuBackend,
        nics: SysfsNics,
        engine: RolloutEngine,
        *,
        rdma: SysfsRdma | None = None,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.node = node
        self._gpus = gpus
        self._nics = nics
        self._engine = engine
        self._rdma = rdma
        self._wall_clock = wall_clock
        self._gpu_inventory: tuple[GpuInfo, ...] = ()
        self._nic_inventory: tuple[NicSpec, ...] = ()

    async def open(self) -> None:
        self._gpu_inventory = tuple(await self._gpus.inventory())
        self._nic_inventory = tuple(await self._nics.open())

    async def replace_nics(self, nics: SysfsNics) -> None:
        """Report ``nics`` from now on (config reload); rates restart from their next reading."""
        inventory = tuple(await nics.open())
        self._nics, self._nic_inventory = nics, inventory

    def status(self) -> NodeStatus:
        return NodeStatus(
            node=self.node,
            gpu_backend=self._gpus.name,
            gpus=self._gpu_inventory,
            nics=self._nic_inventory,
            engine_state=self._engine.state,
            tp_layout=self._engine.tp_layout,
            version=__version__,
        )

    async def sample(self) -> Telemetry:
        async with asyncio.TaskGroup() as tg:
            gpus = tg.create_task(self._gpus.sample())
            nics = tg.create_task(self._nics.sample())
            rdma = tg.create_task(self._rdma.sample()) if self._rdma is not None else None
        engine = self._engine.stats()
        return Telemetry(
            node=self.node,
            timestamp=self._wall_clock(),
            gpus=tuple(gpus.result()),
            nics=tuple(nics.result()),
            engine=engine,
            engine_state=self._engine.state,
            tp_layout=self._engine.tp_layout,
            rdma=tuple(rdma.result()) if rdma is not None else (),
        )

    async def every(self, interval_s: float | Callable[[], float]) -> AsyncIterator[Telemetry]:
        """A sample now and then every ``interval_s`` (fixed rate: slow reads do not drift)."""
        async for _ in ticks(interval_s):
            yield await self.sample()


async def ticks(interval_s: float | Callable[[], float]) -> AsyncIterator[None]:
    """Yield now and then every ``interval_s`` at a fixed rate; a callable interval is read
    at every tick, so a new interval (config reload) applies from the next tick."""
    interval = interval_s if callable(interval_s) else (lambda: interval_s)
    loop = asyncio.get_running_loop()
    deadline = loop.time()
    while True:
        yield
        deadline += interval()
        now = loop.time()
        if deadline < now:  # fell behind (slow read, suspended host): restart from now
            deadline = now
        await asyncio.sleep(deadline - now)
