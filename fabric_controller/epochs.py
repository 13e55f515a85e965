"""The epoch manager: phase changes as journaled, verified, committed epochs.

It asks the pure planners what to change (``scheduler``, ``fabric_controller.reconcile``),
has the switches programmed and verified (:mod:`fabric_controller.switches`), journals
each stage in the store before moving on (so a restart after ``kill -9`` knows where it
stopped), measures stages, and reports. The store is any ``EpochStore``
(:mod:`fabric_controller.store`); the pods down come from the liveness tracker
(:mod:`fabric_controller.liveness`) through ``down_pods``.

Latency (a phase change on a 2048-node fabric is budgeted at 100 ms, see
bench/phase_switch.py): one observation of the switches, batches of one step to all
OCSes at once, verification from the tables the switches returned (see
:mod:`fabric_controller.switches`), and phase plans memoized on their inputs.

Recovery rule after a crash: a reconfiguration whose OCS batches were all
acknowledged (stage ``ocs_programmed`` or later) is rolled forward and committed; so
is one journaled earlier whose circuits the switches already hold exactly (the crash
fell between the last batch and the journal) when verification passes; anything
else is rolled back to the last committed epoch. Either way the switches are re-read
and repaired to exactly the chosen epoch.

Request ids: every successful answer to a phase request with a ``request_id`` is
recorded in the store (a committed epoch in the same transaction as the epoch; "nothing
to change", a gated change and a drift repair on their own), and a retry with the same
id and phase gets it again, never a new change; the same id with another phase is
refused. A failed attempt changes nothing and records nothing: its retry is fresh.

Outcome unknown: a store that answers Unavailable (a replicated store without a quorum)
may still apply the write later. The change stops there, and the next one first reads
the head epoch and the journal again and runs the recovery above.

High availability (:mod:`fabric_controller.leadership`): every change checks that this
controller leads (``role``); the switch I/O stamps the leader's fencing token on every
batch and refuses to send one once the leadership is lost. A change that loses the
leadership midway stops without another switch or store write and leaves its journal to
the next leader's recovery; its caller gets ``NotLeader`` (the standby answer).

Degraded phases: when OCS ports are down, a phase may get fewer circuits than it would
with every port up; its epoch records the pod pairs short of circuits (``missing``),
its answer and event say so, and the drift check re-plans it when ports come back.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, replace

import structlog

from fabric_controller.events import Event, EventHub
from fabric_controller.leadership import NotLeader, Role
from fabric_controller.metrics import ControllerMetrics
from fabric_controller.modes import effective_phase, mode_target
from fabric_controller.reconcile import converge, describe_shortfall, ours, shortfall, steps
from fabric_controller.store import EpochRecord, EpochStore, Missing, PendingRecord, RequestOutcome
from fabric_controller.switches import StageError, Switches
from fabric_controller.weight_sync import SyncReport
from orchestrrl import errors
from orchestrrl.logs import get_logger
from orchestrrl.model import Circuit, Mode, Phase, Wiring
from scheduler.circuits import CircuitPlan
from scheduler.gate import DEFAULT_SETTLING_MARGIN_S, slack_gate
from scheduler.network import PhaseCircuits, PhaseDemand, plan_phase_circuits

log = get_logger("fabric_controller")

# Journal stages from which a crashed reconfiguration is rolled forward.
ROLL_FORWARD_STAGES = ("ocs_programmed",)


@dataclass(frozen=True)
class PhaseResult:
    record: EpochRecord
    changed: bool
    message: str
    gated: bool = False
    explanation: str = ""  # how the circuits were chosen (planner or template, and why)
    weight_sync: SyncReport | None = None  # what a weight sync after the commit did

    @property
    def missing(self) -> Missing:
        """Circuits the epoch lacks because OCS ports are down (empty: none)."""
        return self.record.missing

    @property
    def degraded(self) -> bool:
        return self.record.degraded


class _Stages:
    """Wall time per stage, in the order the stages first ran (a stage entered twice,
    like the journal, adds up)."""

    def __init__(self, clock: Callable[[], float], metrics: ControllerMetrics) -> None:
        self._clock = clock
        self._metrics = metrics
        self.times: dict[str, float] = {}

    @contextlib.contextmanager
    def stage(self, name: str) -> Iterator[None]:
        start = self._clock()
        try:
            yield
        finally:
            took = self._clock() - start
            self.times[name] = self.times.get(name, 0.0) + took
            self._metrics.stage_seconds.labels(name).observe(took)


def _pairs(circuits: frozenset[Circuit]) -> str:
    return ", ".join(str(c) for c in sorted(circuits)) or "none"


def _ports(ports: frozenset[tuple[str, int]]) -> str:
    """``ocs0:3, ocs0:7`` (at most 8 named, then a count)."""
    named = sorted(ports)
    text = ", ".join(f"{o}:{p}" for o, p in named[:8]) or "none"
    return text + (f" and {len(named) - 8} more" if len(named) > 8 else "")


class EpochManager:
    """One reconfiguration at a time (``lock_timeout_s`` for the next to wait), from the
    committed epoch in ``store`` over ``switches``. ``fault_hook`` is called with the
    stage just journaled (``planned``, ``ocs_programmed``, ``verified``, ``committed``)
    so that crash tests can stop the process there."""

    def __init__(
        self,
        wiring: Wiring,
        store: EpochStore,
        switches: Switches,
        events: EventHub,
        metrics: ControllerMetrics,
        *,
        down_pods: Callable[[], frozenset[str]] = frozenset,
        wall_clock: Callable[[], float],
        monotonic: Callable[[], float],
        lock_timeout_s: float = 30.0,
        settling_margin_s: float = DEFAULT_SETTLING_MARGIN_S,
        fault_hook: Callable[[str], None] = lambda _stage: None,
        demand: PhaseDemand | None = None,
        plan_cache_size: int = 16,
        role: Role | None = None,
    ) -> None:
        if plan_cache_size < 0:
            raise errors.field_error("plan_cache_size", plan_cache_size, "an integer >= 0")
        self.wiring = wiring
        self.store = store
        self.switches = switches
        self.events = events
        self.metrics = metrics
        self.demand = demand or PhaseDemand()
        self.plan_cache_size = plan_cache_size
        self.lock_timeout_s = lock_timeout_s
        self.settling_margin_s = settling_margin_s
        self._down_pods = down_pods
        self._wall = wall_clock
        self._mono = monotonic
        self._fault = fault_hook
        # phase plans by their inputs (pure, so equal inputs give the equal plan): an RL
        # loop walks the same phases over the same circuits step after step
        self._plans: OrderedDict[tuple[object, ...], PhaseCircuits] = OrderedDict()
        self._reconfig = asyncio.Lock()
        self._in_progress = ""
        self._current: EpochRecord | None = None
        self._needs_recovery = True
        self._stale = False  # the head epoch must be read again (outcome of a write unknown)
        self.role = role or Role()

    # -- life cycle --

    async def start(self) -> EpochRecord:
        """Load the committed epoch and converge the switches to it (or to the
        interrupted epoch, see the module docstring). A switch that cannot be reached
        leaves the controller serving; recovery is retried before the next change."""
        self._current = await self.store.current()
        self._stale = False
        self.metrics.epoch.set(self._current.epoch)
        log.info(
            "state_loaded",
            epoch=self._current.epoch,
            phase=self._current.phase.value if self._current.phase else None,
            circuits=len(self._current.circuits),
            state=self.store.location,
        )
        try:
            async with self._locked("recovery"), self._watched():
                await self._recover()
        except NotLeader:
            raise
        except errors.OrlError as exc:
            log.error(
                "recovery_incomplete", error=str(exc), note="retried before the next phase change"
            )
            self.events.publish(Event("recovery_failed", message=str(exc)))
        return self.current

    @property
    def current(self) -> EpochRecord:
        if self._current is None:
            raise errors.FailedPrecondition("controller not started")
        return self._current

    @property
    def in_progress(self) -> str:
        """What holds the lock ("" when nothing does)."""
        return self._in_progress if self._reconfig.locked() else ""

    @property
    def busy(self) -> bool:
        """A reconfiguration (or recovery, or drift check) holds the lock."""
        return self._reconfig.locked()

    def invalidate(self) -> None:
        """Forget what this controller believes is committed: the next change (or drift
        check) reads the head epoch and the journal again and runs the recovery first.
        Called when leadership ends, and when a store write's outcome is unknown."""
        self._stale = True
        self._needs_recovery = True

    async def quiesce(self) -> None:
        """Wait until no change, recovery or drift check holds the lock (after a step
        down: the change in flight ends at its next switch or store write)."""
        async with self._reconfig:
            pass

    @contextlib.asynccontextmanager
    async def _watched(self) -> AsyncIterator[None]:
        """Around a change: Unavailable (the store's outcome unknown, or a deposed
        leader's refusal) makes the next change re-read and recover first; NotLeader
        also ends this controller's term (step down)."""
        try:
            yield
        except errors.Unavailable as exc:
            self.invalidate()
            if isinstance(exc, NotLeader):
                self.role.lose(str(exc))
            raise

    def reload(self, wiring: Wiring) -> None:
        """Adopt a new (already validated) wiring: plans of the old one are dropped."""
        self.wiring = wiring
        self._plans.clear()

    @contextlib.asynccontextmanager
    async def _locked(self, what: str) -> AsyncIterator[None]:
        if self._reconfig.locked():
            log.info("waiting_for_reconfiguration", in_progress=self._in_progress)
        try:
            async with asyncio.timeout(self.lock_timeout_s):
                await self._reconfig.acquire()
        except TimeoutError:
            raise errors.Aborted(
                f"another reconfiguration ({self._in_progress}) is still in progress after "
                f"{self.lock_timeout_s:g} s; try again"
            ) from None
        self._in_progress = what
        try:
            yield
        finally:
            self._in_progress = ""
            self._reconfig.release()

    # -- planning --

    def _plan_phase(
        self, phase: Phase, committed: frozenset[Circuit], failed: frozenset[tuple[str, int]]
    ) -> PhaseCircuits:
        """The phase's circuits relative to ``committed`` (memoized: the planner is pure)."""
        down_pods = self._down_pods()
        unavailable = failed
        if down_pods:
            unavailable |= {
                (o, port) for pod, o, port in self.wiring.uplink_ports() if pod in down_pods
            }
        key = (phase, committed, unavailable, down_pods, self.demand)
        cached = self._plans.get(key)
        if cached is not None:
            self._plans.move_to_end(key)
            return cached
        planned = plan_phase_circuits(
            self.wiring,
            phase,
            committed,
            unavailable,
            without_pods=down_pods,
            demand=self.demand,
        )
        if self.plan_cache_size:
            self._plans[key] = planned
            while len(self._plans) > self.plan_cache_size:
                self._plans.popitem(last=False)
        return planned

    def _shortfall(
        self,
        phase: Phase,
        committed: frozenset[Circuit],
        failed: frozenset[tuple[str, int]],
        planned: PhaseCircuits,
    ) -> Missing:
        """What ``planned`` (around the ``failed`` ports) lacks against the same phase
        planned with every port up: the circuits the port failures cost it."""
        if not any(self.wiring.port_owner(o, p) is not None for o, p in failed):
            return ()
        full = self._plan_phase(phase, committed, frozenset())
        return shortfall(self.wiring, full.circuits.desired, planned.circuits.desired)

    async def plan(self, phase: Phase) -> PhaseCircuits:
        """What a phase change would do to the switches now (nothing is changed): the
        switch program from what they hold, and how the circuits were chosen."""
        observed, down = await self.switches.observe()
        planned = self._plan_phase(phase, self.current.circuits, down)
        return replace(planned, circuits=converge(self.wiring, observed, planned.circuits.desired))

    # -- recovery and drift --

    async def _recover(self, observed: frozenset[Circuit] | None = None) -> str:
        """Converge to the committed epoch, or roll an interrupted one forward or back
        (``observed``: the switches' circuits if just read). An interrupted epoch whose
        journal stops before ``ocs_programmed`` is rolled forward too when the switches
        hold exactly its circuits and verification passes (the optics need not move
        twice); if that verification fails, it is rolled back."""
        if self._stale:  # what is committed is read again: a write's outcome was unknown
            self._current = await self.store.current()
            self._stale = False
            self.metrics.epoch.set(self._current.epoch)
            log.info("state_reloaded", epoch=self._current.epoch, state=self.store.location)
        pending = await self.store.pending()
        current = self.current
        forward = pending is not None and pending.stage in ROLL_FORWARD_STAGES
        held = False  # the switches already hold the interrupted epoch's circuits
        if pending is not None and not forward:
            if observed is None:
                observed, _ = await self.switches.observe()
            held = forward = converge(self.wiring, observed, pending.circuits).empty
        target = pending.circuits if forward and pending else current.circuits
        tag = f"recover-{current.epoch}-{secrets.token_hex(4)}"
        try:
            plan = await self.switches.converge(target, tag, observed)
        except StageError as exc:
            if not held:
                raise
            log.warning("interrupted_epoch_failed_verification", error=str(exc))
            forward = held = False
            plan = await self.switches.converge(current.circuits, tag)
        self._needs_recovery = False
        if pending is None:
            if not plan.empty:
                self.metrics.drift_repairs.inc()
                msg = (
                    f"switches repaired to epoch {current.epoch}: +{len(plan.add)} "
                    f"-{len(plan.remove)} circuits ({_pairs(plan.add | plan.remove)})"
                )
                log.warning("drift_repaired", epoch=current.epoch, message=msg)
                self.events.publish(Event("drift_repaired", epoch=current.epoch, message=msg))
                return msg
            return f"switches match epoch {current.epoch}"
        if forward:
            record = EpochRecord(
                epoch=pending.epoch,
                phase=pending.phase,
                circuits=pending.circuits,
                added=pending.added,
                removed=pending.removed,
                stages={"recovered": 0.0},
                committed_at=self._wall(),
                request_id=pending.request_id,
                missing=pending.missing,
            )
            why = " (the switches already held its circuits)" if held else ""
            msg = (
                f"interrupted epoch {pending.epoch} ({pending.phase.value}) rolled forward from "
                f"stage {pending.stage}{why} and committed; fabric at epoch {record.epoch}"
            )
            outcome = None
            if pending.request_id:
                outcome = RequestOutcome(
                    pending.request_id, pending.phase, record.epoch, True, False, msg, "",
                    record.committed_at,
                )  # fmt: skip
            await self.store.commit(record, outcome)
            self._current = record
            self.metrics.epochs.inc()
            self.metrics.epoch.set(record.epoch)
            self.events.publish(
                Event("recovered", epoch=record.epoch, phase=record.phase, message=msg)
            )
        else:
            await self.store.abandon()
            self.metrics.rollbacks.labels(f"restart:{pending.stage}").inc()
            msg = (
                f"interrupted epoch {pending.epoch} ({pending.phase.value}) rolled back from "
                f"stage {pending.stage}; fabric at epoch {current.epoch}"
            )
            self.events.publish(
                Event("rolled_back", epoch=current.epoch, phase=current.phase, message=msg)
            )
        log.warning("recovered", message=msg)
        return msg

    async def reconcile_once(self) -> str | None:
        """Repair drift between the switches and the committed epoch, re-plan the phase
        around ports that went down under its circuits, and re-plan a degraded phase when
        ports came back up so that it gets its full circuits again (skips when busy)."""
        if self._reconfig.locked():
            return None
        async with self._locked("drift check"), self._watched():
            self.role.check("drift check")
            current = self.current
            observed, down = await self.switches.observe()
            if current.phase is None or self._needs_recovery:
                return await self._recover(observed)
            hit = sorted(
                c for c in current.circuits if (c.ocs, c.a) in down or (c.ocs, c.b) in down
            )
            if hit:
                log.warning("ports_down_under_circuits", circuits=[str(c) for c in hit])
                result = await self._reconfigure(current.phase, "", None)
                msg = (
                    f"port(s) down under {_pairs(frozenset(hit))}: phase "
                    f"{current.phase.value} re-planned around them as epoch "
                    f"{result.record.epoch}"
                ) + (f"; degraded: {describe_shortfall(result.missing)}" if result.degraded else "")
                self.events.publish(
                    Event("rerouted", epoch=result.record.epoch, phase=current.phase, message=msg)
                )
                return msg
            if current.degraded and self._restorable(current, down):
                result = await self._reconfigure(current.phase, "", None)
                if result.changed:
                    new = result.record
                    msg = (
                        f"OCS port(s) back up: degraded epoch {current.epoch} "
                        f"({describe_shortfall(current.missing)}) re-planned as epoch "
                        f"{new.epoch}: +{len(new.added)} -{len(new.removed)} circuits; "
                    ) + (
                        f"still degraded: {describe_shortfall(new.missing)}"
                        if new.degraded
                        else f"phase {current.phase.value} has its full circuits again"
                    )
                    log.warning("degraded_phase_restored", message=msg)
                    self.events.publish(
                        Event("restored", epoch=new.epoch, phase=current.phase, message=msg)
                    )
                    return msg
            return await self._recover(observed)

    def _restorable(self, current: EpochRecord, down: frozenset[tuple[str, int]]) -> bool:
        """A degraded epoch's phase, planned around the ports down now, would lack fewer
        circuits than the epoch does (ports came back up)."""
        assert current.phase is not None
        planned = self._plan_phase(current.phase, current.circuits, down)
        now = self._shortfall(current.phase, current.circuits, down, planned)
        return sum(n for *_, n in now) < sum(n for *_, n in current.missing)

    async def run_reconcile(self, interval_s: float) -> None:
        """Check for drift every ``interval_s`` (runs until cancelled)."""
        while True:
            await asyncio.sleep(interval_s)
            try:
                await self.reconcile_once()
            except errors.OrlError as exc:
                self._needs_recovery = True
                log.warning("drift_check_failed", error=str(exc))

    # -- phases --

    async def set_phase(
        self,
        phase: Phase,
        request_id: str = "",
        idle_window_s: float | None = None,
        then: Callable[[PhaseResult], Awaitable[PhaseResult]] | None = None,
        then_what: str = "",
        mode_change: bool = False,
    ) -> PhaseResult:
        """Change to ``phase`` (a new epoch), or say why nothing changed.

        In async mode (:mod:`fabric_controller.modes`) training and generation are
        refused and weight-sync keeps the standing circuits; ``mode_change`` (only
        :meth:`set_mode`) commits ``phase`` as it is.

        ``then``: work that needs the phase's circuits (a weight sync), run on the result
        while the lock is still held, so that no other phase change moves the circuits
        under it (they wait for it, or give up after ``lock_timeout_s`` naming
        ``then_what``); it runs on a replayed answer too. Its errors are its own: the epoch
        stays committed.

        With a ``request_id`` the request is idempotent: its first successful outcome
        (a new epoch, "nothing to change", a gated change, a drift repair) is recorded
        durably, and a retry with the same id and phase returns that outcome (the epoch
        it named, ``changed`` false) without changing anything, even after other
        changes or a restart; the same id with another phase is refused
        (FailedPrecondition naming the first request's phase and epoch). A failed
        attempt (an error, or a change rolled back) changes nothing and is not
        recorded: a retry with its id is a fresh attempt."""
        if request_id and then is None:
            replay = await self._replay(phase, request_id)
            if replay is not None:
                return replay
        async with self._locked(f"epoch {self.current.epoch + 1} ({phase.value})"):
            async with self._watched():
                result = await self._set_phase_locked(phase, request_id, idle_window_s, mode_change)
            if then is None:
                return result
            self._in_progress = then_what or f"work after epoch {result.record.epoch}"
            return await then(result)

    async def set_mode(
        self, mode: Mode, request_id: str = "", leave_to: Phase | None = None
    ) -> PhaseResult:
        """Put the cluster in ``mode``: async commits the standing topology (an epoch of
        phase async), phased commits ``leave_to`` (generation by default) when the
        cluster is in async mode; nothing changes when it is in ``mode`` already
        (:func:`fabric_controller.modes.mode_target`)."""
        mode_target(self.current.phase, mode, leave_to)  # bad input: refused at once
        async with self._locked(f"mode {mode.value}"):
            target = mode_target(self.current.phase, mode, leave_to)
            if target is None:
                cur = self.current
                phase = cur.phase.value if cur.phase is not None else "none"
                return PhaseResult(
                    cur, False, f"the cluster is in {mode.value} mode already (epoch "
                    f"{cur.epoch}, phase {phase}): nothing to change",
                )  # fmt: skip
            async with self._watched():
                return await self._set_phase_locked(target, request_id, None, True)

    async def _set_phase_locked(
        self,
        phase: Phase,
        request_id: str,
        idle_window_s: float | None,
        mode_change: bool = False,
    ) -> PhaseResult:
        self.role.check(f"phase change to {phase.value}")
        if not mode_change:
            phase = effective_phase(self.current.phase, phase)
        if request_id:  # a caller with this id may have finished while this one waited
            replay = await self._replay(phase, request_id)
            if replay is not None:
                return replay
        if self._needs_recovery:
            try:
                await self._recover()
            except NotLeader:
                raise
            except errors.OrlError as exc:
                raise errors.FailedPrecondition(
                    f"cannot change phase: the switches are not at a known epoch yet "
                    f"(recovery failed: {exc})"
                ) from None
            if request_id:  # recovery may have committed this id's interrupted epoch
                replay = await self._replay(phase, request_id)
                if replay is not None:
                    return replay
        result = await self._reconfigure(phase, request_id, idle_window_s)
        if request_id and not result.changed:  # a new epoch recorded its outcome itself
            await self.store.record_outcome(
                RequestOutcome(
                    request_id, phase, result.record.epoch, False, result.gated,
                    result.message, result.explanation, self._wall(),
                )
            )  # fmt: skip
        return result

    async def _replay(self, phase: Phase, request_id: str) -> PhaseResult | None:
        """The recorded outcome of ``request_id`` (None if it has none yet); refused when
        it was for another phase."""
        done = await self.store.outcome(request_id)
        if done is None:
            return None
        async_sync = done.phase is Phase.ASYNC and phase is Phase.WEIGHT_SYNC
        if done.phase is not phase and not async_sync:
            raise errors.FailedPrecondition(
                f"request_id={errors.shown(request_id)} was already used for phase "
                f"{done.phase.value} (answered at epoch {done.epoch}); not applied to phase "
                f"{phase.value}: a retry must ask for the same phase, a new request needs a "
                "new request_id"
            )
        record = await self.store.epoch(done.epoch)
        return PhaseResult(
            record,
            False,
            f"request {errors.shown(request_id)} already applied: {done.message}",
            gated=done.gated,
            explanation=done.explanation,
        )

    async def _reconfigure(
        self, phase: Phase, request_id: str, idle_window_s: float | None
    ) -> PhaseResult:
        current = self.current
        epoch = current.epoch + 1
        bound = log.bind(epoch=epoch, phase=phase.value)
        st = _Stages(self._mono, self.metrics)
        t0 = self._mono()
        with st.stage("observe"):
            observed, down = await self.switches.observe()
        with st.stage("plan"):
            # the new epoch relative to the committed one; the switch program from what
            # the switches really hold (so drift is repaired on the way)
            planned = self._plan_phase(phase, current.circuits, down)
            epoch_plan = planned.circuits
            plan = converge(self.wiring, observed, epoch_plan.desired)
            plan_steps = steps(plan)
            missing = self._shortfall(phase, current.circuits, down, planned)
        explanation = planned.explanation
        if phase is current.phase and epoch_plan.desired == current.circuits:
            if plan.empty:
                bound.info("phase_already_in_place", circuits=len(plan.desired))
                return PhaseResult(
                    current,
                    False,
                    f"already in phase {phase.value}; nothing to change",
                    explanation=explanation,
                )
            return await self._repair(current, plan, bound)
        gate = slack_gate(
            idle_window_s, self.switches.switching_time(plan_steps), self.settling_margin_s
        )
        if not gate.reconfigure:
            self.metrics.gated.inc()
            bound.info("phase_gated", reason=gate.reason)
            self.events.publish(
                Event("phase_gated", epoch=current.epoch, phase=phase, message=gate.reason)
            )
            return PhaseResult(current, False, gate.reason, gated=True, explanation=explanation)
        bound.info(
            "reconfiguring", add=len(plan.add), remove=len(plan.remove), planner=planned.planner
        )
        with st.stage("journal"):
            await self.store.begin(
                PendingRecord(
                    epoch, phase, plan.desired, epoch_plan.add, epoch_plan.remove, "planned",
                    request_id or None, self._wall(), missing,
                )
            )  # fmt: skip
        self._fault("planned")
        reached = "planned"  # the journal's stage, for a step-down's account
        try:
            if self.switches.electrical:  # traffic leaves the circuits about to move first
                with st.stage("drain_routes"):
                    await self.switches.program_routes(
                        ours(self.wiring, observed) & plan.desired, "drain_routes"
                    )
            with st.stage("program_ocs"):
                tables = await self.switches.program(
                    plan_steps, f"epoch-{epoch}-{secrets.token_hex(4)}"
                )
            with st.stage("journal"):
                self.role.check(f"journal epoch {epoch}")
                await self.store.advance("ocs_programmed")
            reached = "ocs_programmed"
            self._fault("ocs_programmed")
            if self.switches.electrical:
                with st.stage("program_routes"):
                    await self.switches.program_routes(plan.desired, "program_routes")
            with st.stage("verify"):
                self.switches.verify(plan, observed, tables)
                if self.switches.electrical:
                    await self.switches.verify_routes(plan.desired)
            self._fault("verified")
            reached = "verified"
        except StageError as exc:
            try:  # a deposed leader does not roll back: the next leader's recovery does
                self.role.check(f"epoch {epoch}: {exc}")
            except NotLeader as deposed:
                self._interrupted(epoch, phase, reached, deposed)
                raise deposed from None
            await self._roll_back(epoch, phase, exc)
        except NotLeader as exc:
            self._interrupted(epoch, phase, reached, exc)
            raise
        record = EpochRecord(
            epoch=epoch,
            phase=phase,
            circuits=plan.desired,
            added=epoch_plan.add,
            removed=epoch_plan.remove,
            stages=dict(st.times),
            committed_at=self._wall(),
            request_id=request_id or None,
            missing=missing,
        )
        message = f"epoch {epoch}: phase {phase.value}"
        degraded = ""
        if missing:
            lost = frozenset(p for p in down if self.wiring.port_owner(*p) is not None)
            degraded = f"degraded: {describe_shortfall(missing)} because OCS port(s) " + (
                f"{_ports(lost)} are down"
            )
            message += f"; {degraded}"
            bound.warning("phase_degraded", missing=missing, down=_ports(lost))
        outcome = None
        if request_id:
            outcome = RequestOutcome(
                request_id, phase, epoch, True, False, message, explanation, record.committed_at
            )
        with st.stage("commit"):
            try:
                self.role.check(f"commit epoch {epoch}")  # (etcd refuses it too)
                await self.store.commit(record, outcome)
            except NotLeader as exc:
                self._interrupted(epoch, phase, reached, exc)
                raise
        self._fault("committed")
        # the commit's own duration is known only after it; the caller sees it too
        record = replace(record, stages=dict(st.times))
        self._current = record
        self.metrics.epochs.inc()
        self.metrics.epoch.set(epoch)
        self.metrics.reconfiguration_seconds.observe(self._mono() - t0)
        self.metrics.circuit_changes.labels("add").inc(len(plan.add))
        self.metrics.circuit_changes.labels("remove").inc(len(plan.remove))
        bound.info(
            "epoch_committed", added=len(plan.add), removed=len(plan.remove), stages=st.times
        )
        self.events.publish(
            Event(
                "epoch_committed",
                epoch=epoch,
                phase=phase,
                message=f"+{len(plan.add)} -{len(plan.remove)} circuits "
                f"({planned.planner} planner); {gate.reason}"
                + (f"; {degraded}" if degraded else ""),
                stages=dict(st.times),
            )
        )
        return PhaseResult(record, True, message, explanation=explanation)

    def _interrupted(self, epoch: int, phase: Phase, stage: str, exc: NotLeader) -> None:
        """Account for a change cut short by a step-down: nothing more was written."""
        msg = (
            f"epoch {epoch} ({phase.value}) interrupted after stage {stage}: this controller "
            f"is no longer the leader ({exc}); it sent no further switch command and wrote "
            "nothing more; the journal is left to the new leader, whose recovery rolls it "
            "forward or back"
        )
        log.warning("phase_interrupted", epoch=epoch, phase=phase.value, stage=stage, error=msg)
        self.events.publish(Event("phase_interrupted", epoch=epoch, phase=phase, message=msg))

    async def _repair(
        self, current: EpochRecord, plan: CircuitPlan, bound: structlog.typing.FilteringBoundLogger
    ) -> PhaseResult:
        """The phase is in place but the switches drifted: restore the epoch, no new one."""
        try:
            await self.switches.converge(
                plan.desired, f"repair-{current.epoch}-{secrets.token_hex(4)}"
            )
        except StageError as exc:
            self._needs_recovery = True
            raise errors.FailedPrecondition(
                f"epoch {current.epoch}: repairing drift failed at stage {exc.stage}: {exc.detail}"
            ) from None
        self.metrics.drift_repairs.inc()
        msg = (
            f"already in phase {current.phase.value if current.phase else '-'}; repaired drift "
            f"of epoch {current.epoch}: +{len(plan.add)} -{len(plan.remove)} circuits"
        )
        bound.warning("drift_repaired", added=len(plan.add), removed=len(plan.remove))
        self.events.publish(Event("drift_repaired", epoch=current.epoch, message=msg))
        return PhaseResult(current, False, msg)

    async def _roll_back(self, epoch: int, phase: Phase, exc: StageError) -> None:
        """Return the switches to the committed epoch and raise a precise account."""
        current = self.current
        self.metrics.rollbacks.labels(exc.stage).inc()
        try:
            undo = await self.switches.converge(
                current.circuits, f"rollback-{epoch}-{secrets.token_hex(4)}"
            )
            await self.store.abandon()
            outcome = (
                f"rolled back ({len(undo.add)} circuit(s) restored, {len(undo.remove)} removed); "
                f"the fabric is at epoch {current.epoch}"
            )
        except NotLeader:
            raise
        except errors.OrlError as undo_exc:
            self._needs_recovery = True
            outcome = (
                f"rollback failed too ({undo_exc}); the controller retries the repair to "
                f"epoch {current.epoch} before the next change"
            )
        message = (
            f"epoch {epoch} ({phase.value}) not committed: stage {exc.stage}: {exc.detail}; "
            f"{outcome}"
        )
        log.error("reconfiguration_failed", epoch=epoch, phase=phase.value, error=message)
        self.events.publish(Event("phase_failed", epoch=epoch, phase=phase, message=message))
        raise errors.FailedPrecondition(message) from None
