"""The agent facade of the controller: node registrations, heartbeats, telemetry
ingestion and the node listing, over the in-memory node registry
(:mod:`fabric_controller.registry`).

Clocks are injected (``monotonic`` for liveness, ``wall_clock`` for telemetry lag and
plausibility); ``on_contact`` is told the node that just registered or sent a heartbeat
(the controller passes :meth:`fabric_controller.liveness.Liveness.check`, so a node's
health change is seen at once, without scanning the cluster).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from fabric_controller.events import Event, EventHub
from fabric_controller.metrics import ControllerMetrics
from fabric_controller.registry import Health, NodeRecord, Registry, health
from fabric_controller.telemetry_bounds import Implausible
from orchestrrl import errors
from orchestrrl.logs import get_logger
from orchestrrl.model import Wiring
from orchestrrl.v1 import node_agent_pb2

log = get_logger("fabric_controller")

# A node sending implausible telemetry is warned about at most this often (each sample
# is counted: orl_telemetry_rejected_total{reason="implausible"}).
IMPLAUSIBLE_WARN_INTERVAL_S = 60.0


class Agents:
    def __init__(
        self,
        wiring: Wiring,
        events: EventHub,
        metrics: ControllerMetrics,
        *,
        heartbeat_deadline_s: float,
        wall_clock: Callable[[], float],
        monotonic: Callable[[], float],
        on_contact: Callable[[str], None] = lambda _node: None,
    ) -> None:
        self.registry = Registry(wiring, heartbeat_deadline_s)
        self._events = events
        self._metrics = metrics
        self._wall = wall_clock
        self._mono = monotonic
        self._on_contact = on_contact
        # node -> (when its last implausible-telemetry warning was logged, left out since)
        self._implausible_warned: dict[str, tuple[float, int]] = {}

    @property
    def wiring(self) -> Wiring:
        return self.registry.wiring

    def reload(self, wiring: Wiring) -> None:
        """Adopt a reloaded wiring: nodes still wired keep their state."""
        self.registry = self.registry.with_wiring(wiring)

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
        *,
        proven: str | None = None,
    ) -> NodeRecord:
        """Register ``node``'s agent at ``address``. An address that another node (up)
        registered is refused (FailedPrecondition naming it), unless ``proven``: the
        agent at the address showed it is ``node`` (how, in those words); then the
        others lose the address and their session (issue 28: a node may not take over
        another node's agent address, and the first to claim one cannot lock out its
        owner)."""
        self.wiring.node(node)  # NotFound with the known names, before anything else
        shared = self.registry.others_at(node, address, self._mono())
        if shared and proven is None:
            raise errors.FailedPrecondition(
                f"agent_address {errors.shown(address, 128)} is registered by node(s) "
                f"{', '.join(shared)} (up); node {node!r} may take it only when the agent there "
                f"is node {node!r}: register this node's own agent address"
            )
        record = self.registry.register(
            node, address, gpu_backend, self._mono(), engine, gateway, kv_import, max_num_seqs
        )
        wired = self.wiring.node(node).gpus
        note = "" if gpus == wired else f"; reports {gpus} GPUs but the wiring says {wired}"
        if note:
            log.warning("gpu_count_differs_from_wiring", node=node, reported=gpus, wired=wired)
        for other in shared:
            self.registry.release_address(other)
        if shared:
            note += (
                f"; node(s) {', '.join(shared)} had registered the same agent address and "
                f"lost it ({proven})"
            )
            log.warning("agent_address_taken_back", node=node, others=shared, proof=proven)
        log.info("node_registered", node=node, agent=address, gpu_backend=gpu_backend)
        self._events.publish(
            Event("node_registered", node=node, message=f"agent at {address}{note}")
        )
        self._on_contact(node)
        return record

    def claimants(self, node: str, address: str) -> tuple[str, ...]:
        """The other nodes (up) that registered ``address`` as their agent's."""
        return self.registry.others_at(node, address, self._mono())

    def heartbeat(self, node: str, session_id: str) -> None:
        self.registry.seen(node, session_id, self._mono())
        self._on_contact(node)

    def telemetry(self, sample: node_agent_pb2.TelemetrySample) -> None:
        self.telemetry_batch([sample], 1)

    def telemetry_batch(
        self, newest: Sequence[node_agent_pb2.TelemetrySample], samples: int
    ) -> None:
        """One upload of ``samples`` samples; ``newest`` holds the newest sample of each node
        in it (an agent's upload: one). Each node keeps its newest sample; every sample is
        counted; the lag observed is the upload's: the age of its newest sample (older
        samples of a batch waited in the agent by design). An unknown or unregistered
        node rejects the whole upload, storing nothing. A node's newest sample with
        implausible figures is not stored (counted, and a warning at most every
        ``IMPLAUSIBLE_WARN_INTERVAL_S`` per node)."""
        rejected = self.registry.telemetry_batch(newest, self._mono(), self._wall())
        if rejected:
            self._implausible_telemetry(rejected)
        self._metrics.telemetry_samples.inc(samples)
        taken = max((s.timestamp for s in newest), default=0.0)
        if taken > 0:
            self._metrics.telemetry_lag.observe(max(0.0, self._wall() - taken))

    def _implausible_telemetry(self, rejected: Sequence[tuple[str, Implausible]]) -> None:
        now = self._mono()
        for node, why in rejected:
            self._metrics.telemetry_rejected.labels(reason="implausible").inc()
            last, suppressed = self._implausible_warned.get(node, (None, 0))
            if last is not None and now - last < IMPLAUSIBLE_WARN_INTERVAL_S:
                self._implausible_warned[node] = (last, suppressed + 1)
                continue
            self._implausible_warned[node] = (now, 0)
            log.warning(
                "telemetry_sample_implausible",
                node=node,
                problem=str(why),
                suppressed=suppressed,  # warnings left out since the last one of the node
            )

    def nodes(self) -> list[tuple[NodeRecord, Health, float | None]]:
        """Every wired node: its record, health and seconds since it was last heard."""
        now = self._mono()
        out = []
        for r in self.registry.records():
            age = None if r.last_seen is None else now - r.last_seen
            out.append((r, health(r, now, self.registry.deadline_s), age))
        return out
