"""The fabric controller: one object composed of four parts, each readable and
testable alone.

- :mod:`fabric_controller.agents`: the agent facade (registrations, heartbeats,
  telemetry ingestion, the node listing) over the in-memory node registry;
- :mod:`fabric_controller.liveness`: node health changes (events, metrics, the
  liveness loop) and the pods whose every node is down;
- :mod:`fabric_controller.switches`: switch I/O (observe, program and verify the OCSes,
  program and verify the ToRs' routes);
- :mod:`fabric_controller.epochs`: the epoch manager (phase changes journaled in the
  store, committed or rolled back, recovery after a crash, request-id replay, drift
  checks), over any ``fabric_controller.store.EpochStore``.

``Controller`` builds them from one wiring, a store and the switch drivers, shares one
event hub and one set of metrics among them, hands a wiring reload (SIGHUP) to each,
and exposes the calls the servicer, the daemon and the compute scheduler make.

``role`` (:mod:`fabric_controller.leadership`): a single controller leads for life
(token 0). In an HA group the daemon starts it as a standby and calls :meth:`lead` with
the fenced store and the token of each term it wins; a lost term is logged
(``stepped_down``, WARNING) and published as an event of that name.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Mapping, Sequence

from fabric_controller.agents import IMPLAUSIBLE_WARN_INTERVAL_S, Agents
from fabric_controller.drivers.electrical import ElectricalDriver
from fabric_controller.drivers.ocs import OcsDriver
from fabric_controller.epochs import ROLL_FORWARD_STAGES, EpochManager, PhaseResult
from fabric_controller.events import Event, EventHub
from fabric_controller.leadership import Role
from fabric_controller.liveness import Liveness
from fabric_controller.metrics import ControllerMetrics
from fabric_controller.registry import Health, NodeRecord, Registry
from fabric_controller.store import EpochRecord, EpochStore
from fabric_controller.switches import Switches
from orchestrrl import errors
from orchestrrl.logs import get_logger
from orchestrrl.model import Mode, Phase, Wiring
from orchestrrl.v1 import node_agent_pb2
from orchestrrl.wiring import diff as wiring_diff
from scheduler.gate import DEFAULT_SETTLING_MARGIN_S
from scheduler.network import PhaseCircuits, PhaseDemand

__all__ = [
    "IMPLAUSIBLE_WARN_INTERVAL_S",
    "ROLL_FORWARD_STAGES",
    "Controller",
    "PhaseResult",
]

log = get_logger("fabric_controller")


class Controller:
    def __init__(
        self,
        wiring: Wiring,
        store: EpochStore,
        ocs: Mapping[str, OcsDriver],
        *,
        heartbeat_interval_s: float = 1.0,
        heartbeat_deadline_s: float = 3.0,
        lock_timeout_s: float = 30.0,
        settling_margin_s: float = DEFAULT_SETTLING_MARGIN_S,
        wall_clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
        fault_hook: Callable[[str], None] = lambda _stage: None,
        metrics: ControllerMetrics | None = None,
        electrical: Mapping[str, ElectricalDriver] | None = None,
        demand: PhaseDemand | None = None,
        plan_cache_size: int = 16,
        role: Role | None = None,
    ) -> None:
        self.store = store
        # ``identify(node, address)``: ask the agent at ``address`` to show it is ``node``
        # (raises OrlError if not); None: an address another node holds is refused
        self.identify: Callable[[str, str], Awaitable[None]] | None = None
        self.role = role or Role()
        self.role.on_lost.append(self._stepped_down)
        self.heartbeat_interval_s = heartbeat_interval_s
        self.metrics = metrics or ControllerMetrics()
        self.events = EventHub(wall_clock)
        self._wiring = wiring
        self.switches = Switches(
            wiring, ocs, electrical, fault_hook=fault_hook, fencing=self.role.fencing_token
        )
        self.agents = Agents(
            wiring,
            self.events,
            self.metrics,
            heartbeat_deadline_s=heartbeat_deadline_s,
            wall_clock=wall_clock,
            monotonic=monotonic,
            on_contact=lambda node: self.liveness.check(node),
        )
        self.liveness = Liveness(
            lambda: self.agents.registry,
            self.events,
            self.metrics,
            monotonic=monotonic,
            interval_s=heartbeat_interval_s / 2,
        )
        self.epochs = EpochManager(
            wiring,
            store,
            self.switches,
            self.events,
            self.metrics,
            down_pods=self.liveness.down_pods,
            wall_clock=wall_clock,
            monotonic=monotonic,
            lock_timeout_s=lock_timeout_s,
            settling_margin_s=settling_margin_s,
            fault_hook=fault_hook,
            demand=demand,
            plan_cache_size=plan_cache_size,
            role=self.role,
        )

    # -- life cycle --

    async def start(self) -> EpochRecord:
        """Load the committed epoch and converge the switches to it (or roll an
        interrupted epoch forward or back: :mod:`fabric_controller.epochs`)."""
        return await self.epochs.start()

    async def lead(
        self, store: EpochStore, token: int, alive: Callable[[], bool], address: str
    ) -> EpochRecord:
        """Begin a term as the elected leader: write through ``store`` (fenced with this
        term's lease and token), stamp ``token`` on switch commands while ``alive()``, and
        run the same start-up as a restart (read the journal and the head, observe the
        switches, roll forward or back, repair drift, report)."""
        self.store = store
        self.epochs.store = store
        self.epochs.invalidate()
        # registrations are per term: agents register with each new leader (one left
        # over from an earlier term would count its node down, and its pod out)
        self.agents.registry = Registry(self.wiring, self.agents.registry.deadline_s)
        self.role.lead(token, alive, address)
        log.info("leading", token=token, address=address, state=store.location)
        self.events.publish(
            Event("leader_elected", message=f"{address} leads with fencing token {token}")
        )
        record = await self.epochs.start()
        self.role.serve()
        return record

    def _stepped_down(self, reason: str) -> None:
        """The term ended: serve nothing mutating, forget the committed view, say so."""
        self.epochs.invalidate()
        in_flight = self.epochs.in_progress
        msg = f"stepped down: {reason}" + (
            f"; {in_flight} in flight ends without another switch or store write"
            if in_flight
            else ""
        )
        log.warning("stepped_down", reason=reason, in_flight=in_flight or None, message=msg)
        self.events.publish(Event("stepped_down", message=msg))

    @property
    def wiring(self) -> Wiring:
        return self._wiring

    def reload(self, wiring: Wiring) -> list[str]:
        """Adopt a new (already validated) wiring; known nodes keep their state. Returns
        what changed (``orchestrrl.wiring.diff``), also logged and published. A wiring
        naming a switch without a driver is refused (FailedPrecondition), nothing changed."""
        self.switches.reload(wiring)  # checks the drivers first
        changes = wiring_diff(self._wiring, wiring)
        self._wiring = wiring
        self.epochs.reload(wiring)
        self.agents.reload(wiring)
        summary = errors.listed(changes) if changes else "no change"
        log.info("wiring_changes", changes=len(changes), summary=summary)
        self.events.publish(
            Event("wiring_reloaded", message=f"{len(wiring.nodes)} nodes; {summary}")
        )
        return changes

    # -- agents --

    @property
    def registry(self) -> Registry:
        return self.agents.registry

    def register(
        self,
        node: str,
        address: str,
        gpu_backend: str,
        gpus: int,
        engine: str = "",
        gateway: str = "",
        kv_import: bool = True,
        max_num_seqs: int = 0,
    ) -> NodeRecord:
        return self.agents.register(
            node, address, gpu_backend, gpus, engine, gateway, kv_import, max_num_seqs
        )

    async def register_agent(
        self,
        node: str,
        address: str,
        gpu_backend: str,
        gpus: int,
        engine: str = "",
        gateway: str = "",
        kv_import: bool = True,
        max_num_seqs: int = 0,
    ) -> NodeRecord:
        """An agent's registration (the Register RPC): as :meth:`register`, but an address
        that another node (up) holds is taken only when the agent there shows it is
        ``node`` (``identify``); otherwise refused, naming the holder (issue 28)."""
        proven = None
        if self.identify is not None and self.agents.claimants(node, address):
            try:
                await self.identify(node, address)
                proven = f"the agent at {address} showed it is {node}"
            except errors.OrlError as exc:
                log.warning("agent_address_claim_refused", node=node, address=address,
                            error=str(exc))  # fmt: skip
        return self.agents.register(
            node, address, gpu_backend, gpus, engine, gateway, kv_import, max_num_seqs,
            proven=proven,
        )  # fmt: skip

    def heartbeat(self, node: str, session_id: str) -> None:
        self.agents.heartbeat(node, session_id)

    def telemetry(self, sample: node_agent_pb2.TelemetrySample) -> None:
        self.agents.telemetry(sample)

    def telemetry_batch(
        self, newest: Sequence[node_agent_pb2.TelemetrySample], samples: int
    ) -> None:
        """See :meth:`fabric_controller.agents.Agents.telemetry_batch`."""
        self.agents.telemetry_batch(newest, samples)

    def nodes(self) -> list[tuple[NodeRecord, Health, float | None]]:
        return self.agents.nodes()

    async def run_liveness(self) -> None:
        """Mark nodes down when they miss their deadline (runs until cancelled)."""
        await self.liveness.run()

    # -- switches --

    @property
    def ocs(self) -> dict[str, OcsDriver]:
        """The OCS drivers by switch name (the switch I/O's own dict)."""
        return self.switches.ocs

    @property
    def electrical(self) -> dict[str, ElectricalDriver]:
        return self.switches.electrical

    # -- epochs --

    @property
    def current(self) -> EpochRecord:
        return self.epochs.current

    @property
    def demand(self) -> PhaseDemand:
        return self.epochs.demand

    async def plan(self, phase: Phase) -> PhaseCircuits:
        """What a phase change would do to the switches now (nothing is changed)."""
        return await self.epochs.plan(phase)

    async def set_phase(
        self,
        phase: Phase,
        request_id: str = "",
        idle_window_s: float | None = None,
        then: Callable[[PhaseResult], Awaitable[PhaseResult]] | None = None,
        then_what: str = "",
    ) -> PhaseResult:
        """Change to ``phase`` (a new epoch), or say why nothing changed; ``then``: work on
        the committed phase under its lock (a weight sync); see
        :meth:`fabric_controller.epochs.EpochManager.set_phase`."""
        return await self.epochs.set_phase(phase, request_id, idle_window_s, then, then_what)

    @property
    def mode(self) -> Mode:
        """The cluster's mode: the committed epoch's (:mod:`fabric_controller.modes`)."""
        return Mode.of(self.current.phase)

    async def set_mode(
        self, mode: Mode, request_id: str = "", leave_to: Phase | None = None
    ) -> PhaseResult:
        """Put the cluster in ``mode`` (:meth:`fabric_controller.epochs.EpochManager.set_mode`)."""
        return await self.epochs.set_mode(mode, request_id, leave_to)

    async def reconcile_once(self) -> str | None:
        """One drift check; see :meth:`fabric_controller.epochs.EpochManager.reconcile_once`."""
        return await self.epochs.reconcile_once()

    async def run_reconcile(self, interval_s: float) -> None:
        """Check for drift every ``interval_s`` (runs until cancelled)."""
        await self.epochs.run_reconcile(interval_s)
