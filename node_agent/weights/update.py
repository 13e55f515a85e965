"""The UpdateWeights command: fetch a checkpoint from another node, check it, load it.

:func:`order_from_pb` checks a request (every field named in its error);
:class:`WeightUpdater` carries it out, one at a time (another while one runs is refused:
Aborted, naming it):

1. nothing to do when the engines serve that version and checksum already;
2. fetch (:func:`node_agent.weights.fetch.fetch_checkpoint`) into the agent's
   checkpoint_dir, within the command's timeout, checked against the model the node
   serves (a checkpoint of another shape is refused before its bytes move);
3. load: the engines take the new weights all or nothing
   (``GatewayEngine.update_weights``, or the simulated engine's): first the engine's
   adapter prepares what its engine loads (checked against the model served; for
   llama.cpp converted to a GGUF) while the old weights serve; the load is never cut
   by the timeout (it is given what is left of it to drain the requests that finish on
   the old weights): a load cut in the middle could leave instances on different versions;
4. older checkpoints beyond ``keep`` are removed.

Any failure before the load leaves the engines untouched, and a failed load is rolled back
by the engines: the node keeps serving the version it had, and the error says so.
"""

from __future__ import annotations

import asyncio
import math
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from node_agent.gateway.engine import WeightUpdate
from node_agent.weights import plan
from node_agent.weights.fetch import (
    CheckpointSource,
    FetchResult,
    FetchStatus,
    fetch_checkpoint,
)
from node_agent.weights.store import CheckpointDir, check_checksum
from orchestrrl import checkpoint, errors
from orchestrrl.grpcutil import parse_address
from orchestrrl.logs import get_logger
from orchestrrl.v1 import common_pb2
from orchestrrl.v1 import node_agent_pb2 as pb

log = get_logger("node_agent.weights")

DEFAULT_TIMEOUT_S = 600.0
MAX_TIMEOUT_S = 86400.0
IN_FLIGHT = ("finish", "resume")
DEFAULT_KEEP = 2


@dataclass(frozen=True)
class UpdateOrder:
    command_id: str
    version: str
    checksum: str
    source_node: str
    source_address: str
    in_flight: str
    timeout_s: float
    streams: int


def check_in_flight(value: str, field: str = "in_flight") -> str:
    """ "" means "finish"."""
    if value == "":
        return "finish"
    if value not in IN_FLIGHT:
        raise errors.field_error(
            field,
            value,
            '"finish" (running requests end on the old weights) or "resume" (they stop and '
            'go on with the new ones); "" is "finish"',
        )
    return value


def check_timeout(value: float, field: str = "timeout_s") -> float:
    """0 means the default."""
    if value == 0:
        return DEFAULT_TIMEOUT_S
    if not math.isfinite(value) or not 0 < value <= MAX_TIMEOUT_S:
        raise errors.field_error(
            field, value, f"seconds in (0, {MAX_TIMEOUT_S:g}], or 0 ({DEFAULT_TIMEOUT_S:g})"
        )
    return value


def order_from_pb(r: pb.UpdateWeightsRequest) -> UpdateOrder:
    """The request checked field by field (InvalidArgument naming the first bad one)."""
    if not r.command_id:
        raise errors.field_error("command_id", "", "a non-empty id, unique per command")
    checkpoint.check_version(r.version)
    check_checksum(r.checksum)
    if not r.source_node:
        raise errors.field_error("source_node", "", "the node whose agent serves the checkpoint")
    parse_address(r.source_address, "source_address")
    return UpdateOrder(
        r.command_id,
        r.version,
        r.checksum,
        r.source_node,
        r.source_address,
        check_in_flight(r.in_flight),
        check_timeout(r.timeout_s),
        plan.check_streams(r.streams),
    )


@dataclass(frozen=True)
class UpdateReport:
    version: str  # served now
    previous: str
    checksum: str
    path: str
    bytes_fetched: int
    checkpoint_bytes: int
    fetch_seconds: float
    verify_seconds: float
    prepare_seconds: float
    load_seconds: float
    seconds: float
    resumes: int
    streams: int
    cached: bool
    how: str
    resumed_requests: int
    finished_on_old: int
    message: str

    def to_pb(self, command_id: str) -> pb.UpdateWeightsResponse:
        stages = [
            ("fetch", self.fetch_seconds),
            ("verify", self.verify_seconds),
            ("prepare", self.prepare_seconds),
            ("load", self.load_seconds),
        ]
        return pb.UpdateWeightsResponse(
            command_id=command_id,
            version=self.version,
            previous=self.previous,
            checksum=self.checksum,
            bytes_fetched=self.bytes_fetched,
            checkpoint_bytes=self.checkpoint_bytes,
            fetch_seconds=self.fetch_seconds,
            verify_seconds=self.verify_seconds,
            load_seconds=self.load_seconds,
            seconds=self.seconds,
            resumes=self.resumes,
            cached=self.cached,
            how=self.how,
            resumed_requests=self.resumed_requests,
            finished_on_old=self.finished_on_old,
            path=self.path,
            message=self.message,
            stages=[common_pb2.StageTiming(stage=s, seconds=t) for s, t in stages],
            streams=self.streams,
        )


@runtime_checkable
class WeightLoader(Protocol):
    """What loads weights into the node's engines: the gateway (real engines) or the
    simulated engine."""

    @property
    def weight_version(self) -> str: ...

    async def update_weights(
        self,
        path: str,
        version: str,
        in_flight: str = "finish",
        *,
        drain_timeout_s: float | None = None,
    ) -> WeightUpdate:
        """All or nothing: on an error the engines serve the old version."""


SourceFactory = Callable[[str, str], CheckpointSource]


class WeightUpdater:
    """Weight updates of one node: fetched into ``store``, loaded by ``loader``."""

    def __init__(
        self,
        node: str,
        store: CheckpointDir,
        loader: WeightLoader,
        kind: str,
        sources: SourceFactory,
        *,
        keep: int = DEFAULT_KEEP,
        part_bytes: int = plan.DEFAULT_PART_BYTES,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.node = node
        self.store = store
        self.loader = loader
        self.kind = kind
        self._sources = sources
        self.keep = keep
        self.part_bytes = plan.check_part_bytes(part_bytes)
        self._clock = clock
        self.served: checkpoint.Checkpoint | None = None  # loaded by an update
        self.running: UpdateOrder | None = None

    @property
    def weight_version(self) -> str:
        return self.loader.weight_version

    async def update(self, order: UpdateOrder) -> UpdateReport:
        running = self.running
        if running is not None:
            raise errors.Aborted(
                f"node {self.node!r} is updating its weights to version {running.version!r} "
                f"(command {running.command_id!r}); update to {order.version!r} refused, "
                "nothing changed: retry once it is done"
            )
        self.running = order
        previous = self.loader.weight_version
        try:
            return await self._update(order, previous)
        except checkpoint.CheckpointError as exc:
            raise errors.InvalidArgument(_kept(exc, self.node, previous)) from None
        except errors.OrlError as exc:
            raise _kind_of(exc)(_kept(exc, self.node, previous)) from None
        finally:
            self.running = None

    async def _update(self, order: UpdateOrder, previous: str) -> UpdateReport:
        t0 = self._clock()
        served = self.served
        if served is not None and (served.version, served.checksum) == (
            order.version,
            order.checksum,
        ):
            return UpdateReport(
                order.version, previous, order.checksum, str(served.path), 0,
                served.manifest.size, 0.0, 0.0, 0.0, 0.0, self._clock() - t0, 0, 0, True, "",
                0, 0, f"already serving version {order.version!r}: nothing to do",
            )  # fmt: skip
        expected = checkpoint.read_config(served) if served is not None else None
        deadline = t0 + order.timeout_s
        source = self._sources(order.source_node, order.source_address)
        status = FetchStatus()
        try:
            async with asyncio.timeout(order.timeout_s):
                fetched = await fetch_checkpoint(
                    source,
                    self.store.root,
                    order.version,
                    order.checksum,
                    streams=order.streams,
                    part_bytes=self.part_bytes,
                    expected_config=expected,
                    status=status,
                )
        except TimeoutError:
            raise errors.DeadlineExceeded(
                f"fetching checkpoint {order.version} from {order.source_node!r} at "
                f"{order.source_address} did not finish within {order.timeout_s:g} s, "
                f"{status.describe()} (a retry resumes it where it stopped)"
            ) from None
        finally:
            await source.close()
        l0 = self._clock()
        drain = max(1.0, deadline - l0)
        done = await self.loader.update_weights(
            str(fetched.checkpoint.path), order.version, order.in_flight, drain_timeout_s=drain
        )
        prepare_s = sum(s.seconds for s in done.stages if s.stage == "prepare")
        load_s = self._clock() - l0 - prepare_s
        self.served = fetched.checkpoint
        await asyncio.to_thread(self._prune, fetched.checkpoint.path.name)
        return self._report(order, previous, fetched, done, prepare_s, load_s, t0)

    def _report(
        self,
        order: UpdateOrder,
        previous: str,
        fetched: FetchResult,
        done: WeightUpdate,
        prepare_s: float,
        load_s: float,
        t0: float,
    ) -> UpdateReport:
        seconds = self._clock() - t0
        rate = plan.mbytes_per_s(fetched.bytes_fetched, fetched.fetch_seconds)
        got = (
            f"had it already ({fetched.checkpoint.path.name})"
            if fetched.cached
            else f"fetched {fetched.bytes_fetched} bytes from {order.source_node} in "
            f"{fetched.fetch_seconds:.2f} s ({rate:.1f} MB/s over {fetched.streams} "
            f"connection(s), {fetched.resumes} resumed)"
        )
        message = (
            f"version {order.version} serves on {self.node} ({done.how}; was {previous}): "
            f"{got}; loaded in {load_s:.2f} s"
        )
        log.info(
            "weights_synced",
            version=order.version,
            previous=previous,
            source=order.source_node,
            bytes=fetched.bytes_fetched,
            fetch_s=round(fetched.fetch_seconds, 3),
            load_s=round(load_s, 3),
            mbytes_per_s=round(rate, 2),
            cached=fetched.cached,
            how=done.how,
        )
        return UpdateReport(
            version=order.version,
            previous=previous,
            checksum=order.checksum,
            path=str(fetched.checkpoint.path),
            bytes_fetched=fetched.bytes_fetched,
            checkpoint_bytes=fetched.checkpoint.manifest.size,
            fetch_seconds=fetched.fetch_seconds,
            verify_seconds=fetched.verify_seconds,
            prepare_seconds=prepare_s,
            load_seconds=load_s,
            seconds=seconds,
            resumes=fetched.resumes,
            streams=fetched.streams,
            cached=fetched.cached,
            how=done.how,
            resumed_requests=done.resumed,
            finished_on_old=done.finished_on_old,
            message=message,
        )

    def _prune(self, serving: str) -> None:
        names = self.store.versions()
        for name in plan.to_prune(names, serving, self.keep):
            shutil.rmtree(self.store.root / name, ignore_errors=True)
        # unfinished fetches (of versions no longer wanted: one update runs at a time)
        for partial in self.store.root.glob(".partial-*"):
            if partial.is_dir():
                shutil.rmtree(partial, ignore_errors=True)
            else:
                partial.unlink(missing_ok=True)


def _kept(exc: BaseException, node: str, previous: str) -> str:
    return errors.bounded(
        f"weight update failed on node {node!r}: {exc}; it keeps serving version {previous!r}"
    )


def _kind_of(exc: errors.OrlError) -> type[errors.OrlError]:
    """The domain error class of ``exc`` (the status it maps to), whatever its subclass."""
    for kind in type(exc).__mro__:
        if kind.__module__ == errors.__name__ and issubclass(kind, errors.OrlError):
            return kind
    return errors.OrlError
