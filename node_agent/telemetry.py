"""The node's status and telemetry, gathered from the GPU backend, the NICs and the engine."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import NamedTuple

from node_agent.engine import EngineProgress, EngineState, EngineStats, RolloutEngine
from node_agent.gpus import GpuBackend, GpuInfo, GpuSample
from node_agent.nics import NicRates, NicReader, NicReading, NicSample, NicSpec
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
    engine: str = "sim"  # the rollout engine's kind
    gateway: str = ""  # HOST:PORT of the generation gateway ("" without one)
    instance_health: tuple[str, ...] = ()
    kv_import: bool = True
    max_num_seqs: int = 0
    weight_version: str = ""  # the weights the engines serve
    checkpoint_address: str = ""  # where other nodes fetch its checkpoints ("": `listen`)
    checkpoints: bool = False  # the agent has a checkpoint_dir


@dataclass(frozen=True)
class Telemetry:
    node: str
    timestamp: float  # seconds since the Unix epoch
    gpus: tuple[GpuSample, ...]
    nics: tuple[NicSample, ...]
    engine: EngineStats
    engine_state: EngineState
    tp_layout: tuple[int, ...]
    rdma: tuple[RdmaSample, ...] = ()
    # Per-request progress of the step; None when this sample was taken without it (the
    # uplink reads it once per upload, see Uplink).
    progress: EngineProgress | None = None
    weight_version: str = ""  # the weights the engines serve at this sample


class Reading(NamedTuple):
    """Every source read at one instant, the NICs' answer not decoded yet: a
    :class:`Telemetry` once :meth:`Collector.telemetry` has turned it into one."""

    timestamp: float  # seconds since the Unix epoch
    gpus: list[GpuSample]
    nics: NicReading
    rdma: list[RdmaSample]
    engine: EngineStats
    engine_state: EngineState
    tp_layout: tuple[int, ...]
    progress: EngineProgress | None
    weight_version: str = ""


class Collector:
    """Reads every telemetry source of the node; :meth:`open` once before use.

    A sample is taken in two parts: :meth:`read` reads every source now, and
    :meth:`telemetry` decodes the reading and computes the NICs' rates against the
    previous reading of the same consumer. The uplink reads at every sampling interval and
    decodes a whole upload's readings together, in one pass: code that runs once per
    interval runs cache-cold, at several times its cost in a loop. :meth:`sample` does
    both at once."""

    def __init__(
        self,
        node: str,
        gpus: GpuBackend,
        nics: NicReader,
        engine: RolloutEngine,
        *,
        rdma: SysfsRdma | None = None,
        wall_clock: Callable[[], float] = time.time,
        engine_kind: str = "sim",
        gateway: str = "",
        instance_health: Callable[[], tuple[str, ...]] | None = None,
        weight_version: Callable[[], str] | None = None,
        checkpoint_address: str = "",
        checkpoints: bool = False,
    ) -> None:
        self.node = node
        self._weight_version = weight_version
        self._checkpoint_address = checkpoint_address
        self._checkpoints = checkpoints
        self._engine_kind = engine_kind
        self._gateway = gateway
        self._instance_health = instance_health
        self._gpus = gpus
        self._nics = nics
        self._engine = engine
        self._rdma = rdma
        self._wall_clock = wall_clock
        self._gpu_inventory: tuple[GpuInfo, ...] = ()
        self._nic_inventory: tuple[NicSpec, ...] = ()
        # The engine's figures of the sample being taken (read before the GPUs, so that
        # simulated GPUs can follow them without asking the engine a second time)
        self.engine_stats = EngineStats(0, 0, 0.0, 0.0)
        self._rates = NicRates()  # sample()'s

    async def open(self) -> None:
        self._gpu_inventory = tuple(await self._gpus.inventory())
        self._nic_inventory = tuple(await self._nics.open())

    async def replace_nics(self, nics: NicReader) -> None:
        """Report ``nics`` from now on (config reload); rates restart from their next reading."""
        inventory = tuple(await nics.open())
        old, self._nics, self._nic_inventory = self._nics, nics, inventory
        old.close()

    def close(self) -> None:
        self._nics.close()

    def status(self) -> NodeStatus:
        return NodeStatus(
            node=self.node,
            gpu_backend=self._gpus.name,
            gpus=self._gpu_inventory,
            nics=self._nic_inventory,
            engine_state=self._engine.state,
            tp_layout=self._engine.tp_layout,
            version=__version__,
            engine=self._engine_kind,
            gateway=self._gateway,
            instance_health=self._instance_health() if self._instance_health else (),
            kv_import=self._engine.kv_import,
            max_num_seqs=self._engine.max_num_seqs,
            weight_version=self._weight_version() if self._weight_version else "",
            checkpoint_address=self._checkpoint_address,
            checkpoints=self._checkpoints,
        )

    async def read(self, progress: bool = True) -> Reading:
        """Every source once; ``progress``: with the engine's per-request progress (its
        cost grows with the requests in flight, so the uplink reads it once per upload)."""
        # One after the other: tasks to overlap the worker-thread reads (NVML, RDMA sysfs)
        # would cost more CPU than they save in latency at these sizes.
        engine = self._engine
        stats = self.engine_stats = engine.stats()
        gpus = await self._gpus.sample()
        nics = await self._nics.read()
        rdma = await self._rdma.sample() if self._rdma is not None else []
        return Reading(
            self._wall_clock(),
            gpus,
            nics,
            rdma,
            stats,
            engine.state,
            engine.tp_layout,
            engine.progress() if progress else None,
            self._weight_version() if self._weight_version else "",
        )

    def telemetry(self, reading: Reading, rates: NicRates) -> Telemetry:
        """``reading`` decoded, with NIC rates from ``rates`` (the consumer's own: readings
        go through it in the order they were taken)."""
        return Telemetry(
            self.node,
            reading.timestamp,
            tuple(reading.gpus),
            tuple(rates.samples(reading.nics)),
            reading.engine,
            reading.engine_state,
            reading.tp_layout,
            tuple(reading.rdma),
            reading.progress,
            reading.weight_version,
        )

    async def sample(self, progress: bool = True) -> Telemetry:
        """:meth:`read` and :meth:`telemetry` at once."""
        return self.telemetry(await self.read(progress), self._rates)

    async def every(self, interval_s: float | Callable[[], float]) -> AsyncIterator[Telemetry]:
        """A sample now and then every ``interval_s`` (fixed rate: slow reads do not drift),
        with rates of its own."""
        rates = NicRates()
        async for _ in ticks(interval_s):
            yield self.telemetry(await self.read(), rates)


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
        # asyncio.sleep on the loop at hand: sleep looks the running loop up at every
        # call, which costs a getpid() system call per tick
        wake: asyncio.Future[None] = loop.create_future()
        timer = loop.call_at(deadline, set_done, wake)
        try:
            await wake
        finally:
            timer.cancel()


def set_done(future: asyncio.Future[None]) -> None:
    """Complete ``future`` unless it is done already (cancelled, say): a timer callback."""
    if not future.done():
        future.set_result(None)
