"""The fabric controller's imperative shell: it observes switches, asks the pure
planner what to change, programs the OCSes, verifies, and commits epochs.

Every decision lives in ``scheduler`` and ``fabric_controller.reconcile``; this
module only sequences I/O, measures stages, and reports what happened.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, replace

from fabric_controller.drivers.ocs import OcsDriver
from fabric_controller.events import Event, EventHub
from fabric_controller.reconcile import batches_by_ocs, check_applied, inverse
from fabric_controller.registry import Health, NodeRecord, Registry, health
from fabric_controller.store import EpochRecord, Store
from orchestrrl import errors
from orchestrrl.logs import get_logger
from orchestrrl.model import Circuit, Phase, Wiring
from orchestrrl.v1 import node_agent_pb2
from scheduler.circuits import CircuitPlan, plan_phase

log = get_logger("fabric_controller")


@dataclass(frozen=True)
class PhaseResult:
    record: EpochRecord
    changed: bool
    message: str


class _Stages:
    """Wall time per stage, in the order the stages ran."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self.times: dict[str, float] = {}

    @contextlib.contextmanager
    def stage(self, name: str) -> Iterator[None]:
        start = self._clock()
        try:
            yield
        finally:
            self.times[name] = self._clock() - start


class Controller:
    def __init__(
        self,
        wiring: Wiring,
        store: Store,
        ocs: Mapping[str, OcsDriver],
        *,
        heartbeat_interval_s: float = 1.0,
        heartbeat_deadline_s: float = 3.0,
        lock_timeout_s: float = 30.0,
        wall_clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        missing = sorted({o.name for o in wiring.ocses} - set(ocs))
        if missing:
            raise errors.FailedPrecondition(f"no driver for OCS {', '.join(missing)}")
        self.wiring = wiring
        self.store = store
        self.ocs = dict(ocs)
        self.heartbeat_interval_s = heartbeat_interval_s
        self.lock_timeout_s = lock_timeout_s
        self._wall = wall_clock
        self._mono = monotonic
        self.registry = Registry(wiring, heartbeat_deadline_s)
        self.events = EventHub(wall_clock)
        self._reconfig = asyncio.Lock()
        self._in_progress: str = ""
        self._current: EpochRecord | None = None

    async def start(self) -> EpochRecord:
        self._current = await self.store.current()
        log.info(
            "controller state loaded",
            epoch=self._current.epoch,
            phase=self._current.phase.value if self._current.phase else None,
            circuits=len(self._current.circuits),
            state=self.store.path,
        )
        return self._current

    @property
    def current(self) -> EpochRecord:
        if self._current is None:
            raise errors.FailedPrecondition("controller not started")
        return self._current

    # -- agents --

    def register(self, node: str, address: str, gpu_backend: str, gpus: int) -> NodeRecord:
        record = self.registry.register(node, address, gpu_backend, self._mono())
        wired = self.wiring.node(node).gpus
        note = "" if gpus == wired else f"; reports {gpus} GPUs but the wiring says {wired}"
        if note:
            log.warning("GPU count differs from the wiring", node=node, reported=gpus, wired=wired)
        log.info("node registered", node=node, agent=address, gpu_backend=gpu_backend)
        self.events.publish(
            Event("node_registered", node=node, message=f"agent at {address}{note}")
        )
        self._check_liveness()
        return record

    def heartbeat(self, node: str, session_id: str) -> None:
        self.registry.seen(node, session_id, self._mono())
        self._check_liveness()

    def telemetry(self, sample: node_agent_pb2.TelemetrySample) -> None:
        self.registry.telemetry(sample.node, sample, self._mono())

    def nodes(self) -> list[tuple[NodeRecord, Health, float | None]]:
        now = self._mono()
        out = []
        for r in self.registry.records():
            age = None if r.last_seen is None else now - r.last_seen
            out.append((r, self._health(r, now), age))
        return out

    def _health(self, record: NodeRecord, now: float) -> Health:
        return health(record, now, self.registry.deadline_s)

    def _check_liveness(self) -> None:
        for node, before, after in self.registry.transitions(self._mono()):
            if after is Health.DOWN:
                log.warning("node missed its heartbeat deadline", node=node)
                self.events.publish(
                    Event("node_down", node=node, message="heartbeat deadline missed")
                )
            elif after is Health.UP and before is Health.DOWN:
                log.info("node is back", node=node)
                self.events.publish(Event("node_up", node=node, message="heartbeats resumed"))

    async def run_liveness(self) -> None:
        """Mark nodes down when they miss their deadline (runs until cancelled)."""
        while True:
            await asyncio.sleep(self.heartbeat_interval_s / 2)
            self._check_liveness()

    # -- phases --

    async def _observe(self) -> tuple[frozenset[Circuit], frozenset[tuple[str, int]]]:
        async def one(name: str, drv: OcsDriver) -> tuple[set[Circuit], set[tuple[str, int]]]:
            pairs, down = await asyncio.gather(drv.cross_connects(), drv.down_ports())
            return {Circuit(name, a, b) for a, b in pairs}, {(name, p) for p in down}

        results = await asyncio.gather(*(one(n, d) for n, d in sorted(self.ocs.items())))
        circuits = frozenset(c for cs, _ in results for c in cs)
        down = frozenset(p for _, ds in results for p in ds)
        return circuits, down

    async def plan(self, phase: Phase) -> CircuitPlan:
        observed, down = await self._observe()
        return plan_phase(self.wiring, phase, observed, down)

    async def set_phase(self, phase: Phase, request_id: str = "") -> PhaseResult:
        if request_id:
            previous = await self.store.by_request(request_id)
            if previous is not None:
                return PhaseResult(previous, False, f"request {request_id!r} already applied")
        if self._reconfig.locked():
            log.info("waiting for the reconfiguration in progress", in_progress=self._in_progress)
        try:
            async with asyncio.timeout(self.lock_timeout_s):
                await self._reconfig.acquire()
        except TimeoutError:
            raise errors.Aborted(
                f"another reconfiguration ({self._in_progress}) is still in progress after "
                f"{self.lock_timeout_s:.0f} s; try again"
            ) from None
        try:
            self._in_progress = f"epoch {self.current.epoch + 1} ({phase.value})"
            if request_id:  # the first caller with this id may have finished while we waited
                previous = await self.store.by_request(request_id)
                if previous is not None:
                    return PhaseResult(previous, False, f"request {request_id!r} already applied")
            return await self._reconfigure(phase, request_id)
        finally:
            self._in_progress = ""
            self._reconfig.release()

    async def _reconfigure(self, phase: Phase, request_id: str) -> PhaseResult:
        current = self.current
        epoch = current.epoch + 1
        bound = log.bind(epoch=epoch, phase=phase.value)
        st = _Stages(self._mono)
        with st.stage("observe"):
            observed, down = await self._observe()
        with st.stage("plan"):
            plan = plan_phase(self.wiring, phase, observed, down)
        if plan.empty and phase is current.phase and plan.desired == current.circuits:
            bound.info("phase already in place", circuits=len(plan.desired))
            return PhaseResult(current, False, f"already in phase {phase.value}; nothing to change")
        bound.info("reconfiguring", add=len(plan.add), remove=len(plan.remove))
        with st.stage("program_ocs"):
            await self._program(plan, epoch, phase)
        with st.stage("verify"):
            await self._verify(plan, epoch, phase)
        record = EpochRecord(
            epoch=epoch,
            phase=phase,
            circuits=plan.desired,
            added=plan.add,
            removed=plan.remove,
            stages=dict(st.times),
            committed_at=self._wall(),
            request_id=request_id or None,
        )
        with st.stage("commit"):
            await self.store.commit(record)
        # the commit's own duration is known only after it; the caller sees it too
        record = replace(record, stages=dict(st.times))
        self._current = record
        bound.info(
            "epoch committed", added=len(plan.add), removed=len(plan.remove), stages=st.times
        )
        self.events.publish(
            Event(
                "epoch_committed",
                epoch=epoch,
                phase=phase,
                message=f"+{len(plan.add)} -{len(plan.remove)} circuits",
                stages=dict(st.times),
            )
        )
        return PhaseResult(record, True, f"epoch {epoch}: phase {phase.value}")

    async def _program(self, plan: CircuitPlan, epoch: int, phase: Phase) -> None:
        done: list[tuple[str, list[tuple[int, int]], list[tuple[int, int]]]] = []
        for name, (disconnect, connect) in batches_by_ocs(plan).items():
            try:
                await self.ocs[name].apply(disconnect, connect, request_id=f"epoch-{epoch}-{name}")
            except errors.OrlError as exc:
                await self._rollback(done, epoch)
                self._fail(epoch, phase, f"program_ocs: OCS {name!r} refused the batch: {exc}")
            done.append((name, disconnect, connect))

    async def _verify(self, plan: CircuitPlan, epoch: int, phase: Phase) -> None:
        observed, _ = await self._observe()
        problems = check_applied(plan, observed)
        if problems:
            await self._rollback([(n, d, c) for n, (d, c) in batches_by_ocs(plan).items()], epoch)
            self._fail(
                epoch, phase, "verify: switch state differs from the plan: " + "; ".join(problems)
            )

    async def _rollback(
        self, done: list[tuple[str, list[tuple[int, int]], list[tuple[int, int]]]], epoch: int
    ) -> None:
        for name, disconnect, connect in reversed(done):
            undo_disconnect, undo_connect = inverse(disconnect, connect)
            try:
                await self.ocs[name].apply(
                    undo_disconnect, undo_connect, request_id=f"epoch-{epoch}-{name}-rollback"
                )
                log.warning("rolled back OCS batch", ocs=name, epoch=epoch)
            except errors.OrlError as exc:
                log.error(
                    "rollback failed; the next phase change will repair it",
                    ocs=name,
                    error=str(exc),
                )

    def _fail(self, epoch: int, phase: Phase, message: str) -> None:
        full = (
            f"epoch {epoch} ({phase.value}) not committed: {message}; "
            f"the fabric stays at epoch {self.current.epoch}"
        )
        log.error("reconfiguration failed", epoch=epoch, phase=phase.value, error=message)
        self.events.publish(Event("phase_failed", epoch=epoch, phase=phase, message=full))
        raise errors.FailedPrecondition(full)
