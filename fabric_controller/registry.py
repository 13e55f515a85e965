"""Node registry: which agents registered, when they were last heard, their telemetry.

Pure bookkeeping; the clock reading is passed in by the caller.
"""

from __future__ import annotations

import enum
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, replace

from fabric_controller.telemetry_bounds import Implausible, TelemetryBounds, check_sample
from orchestrrl import errors
from orchestrrl.model import Wiring
from orchestrrl.v1 import node_agent_pb2


class Health(enum.Enum):
    UP = "up"
    DOWN = "down"
    UNKNOWN = "unknown"


@dataclass(frozen=True)
class NodeRecord:
    name: str
    agent_address: str = ""
    session_id: str = ""
    gpu_backend: str = ""
    last_seen: float | None = None  # monotonic seconds
    telemetry: node_agent_pb2.TelemetrySample | None = None
    engine: str = ""  # the rollout engine's kind (vllm, llamacpp, sglang, sim)
    gateway: str = ""  # HOST:PORT of the node's generation gateway ("" without one)
    kv_import: bool = True  # its engine takes a moved KV cache (else it recomputes)
    max_num_seqs: int = 0  # sequences per instance of its engine (0: unknown)


def health(record: NodeRecord, now: float, deadline_s: float) -> Health:
    if record.last_seen is None:
        return Health.UNKNOWN
    return Health.UP if now - record.last_seen <= deadline_s else Health.DOWN


class Registry:
    def __init__(self, wiring: Wiring, deadline_s: float) -> None:
        self.wiring = wiring
        self.deadline_s = deadline_s
        self._nodes = {n.name: NodeRecord(n.name) for n in wiring.nodes}
        self._health = {n.name: Health.UNKNOWN for n in wiring.nodes}
        self._counts = dict.fromkeys(Health, 0)  # of _health, kept as it changes
        self._counts[Health.UNKNOWN] = len(self._health)

    def with_wiring(self, wiring: Wiring) -> Registry:
        """A registry for a reloaded wiring: nodes still wired keep their state."""
        fresh = Registry(wiring, self.deadline_s)
        for name in fresh._nodes:
            if name in self._nodes:
                fresh._nodes[name] = self._nodes[name]
                fresh._health[name] = self._health[name]
        fresh._counts = dict.fromkeys(Health, 0)
        for h in fresh._health.values():
            fresh._counts[h] += 1
        return fresh

    def register(
        self,
        node: str,
        address: str,
        gpu_backend: str,
        now: float,
        engine: str = "",
        gateway: str = "",
        kv_import: bool = True,
        max_num_seqs: int = 0,
    ) -> NodeRecord:
        self.wiring.node(node)  # NotFound with the known names
        record = NodeRecord(
            node,
            address,
            secrets.token_hex(8),
            gpu_backend,
            now,
            None,
            engine,
            gateway,
            kv_import,
            max_num_seqs,
        )
        self._nodes[node] = record
        return record

    def others_at(self, node: str, address: str, now: float) -> tuple[str, ...]:
        """The other nodes that registered ``address`` as their agent's and are up."""
        return tuple(
            r.name
            for r in self._nodes.values()
            if r.name != node
            and r.agent_address == address
            and health(r, now, self.deadline_s) is Health.UP
        )

    def release_address(self, node: str) -> None:
        """``node`` loses its agent address and its session (another node proved the
        address is its own): it must register again, at its own address."""
        self._nodes[node] = replace(self._nodes[node], agent_address="", session_id="")

    def _session(self, node: str, session_id: str) -> NodeRecord:
        self.wiring.node(node)  # NotFound with the known names
        record = self._nodes[node]
        if not session_id or record.session_id != session_id:
            raise errors.FailedPrecondition(
                f"node {node!r}: session {session_id!r} is not current "
                "(controller restarted or node re-registered); register again"
            )
        return record

    def seen(self, node: str, session_id: str, now: float) -> NodeRecord:
        record = replace(self._session(node, session_id), last_seen=now)
        self._nodes[node] = record
        return record

    def telemetry_batch(
        self,
        samples: Sequence[node_agent_pb2.TelemetrySample],
        now: float,
        wall: float | None = None,
    ) -> list[tuple[str, Implausible]]:
        """Samples of one upload, oldest first: each node keeps its newest. Every sample's
        node is checked before anything is stored, so a bad one changes nothing. A newest
        sample with implausible figures (:mod:`fabric_controller.telemetry_bounds`; ``wall``
        the controller's clock) is not stored: the node keeps its last plausible one, and
        the rejected nodes are returned with why."""
        newest: dict[str, node_agent_pb2.TelemetrySample] = {}
        for sample in samples:
            newest[sample.node] = sample
        records = [(self._registered(node), sample) for node, sample in newest.items()]
        rejected: list[tuple[str, Implausible]] = []
        for record, sample in records:
            bad = check_sample(sample, self.bounds(record), wall)
            if bad is not None:
                rejected.append((record.name, bad))
                continue
            self._store(record, sample, now)
        return rejected

    def bounds(self, record: NodeRecord) -> TelemetryBounds:
        """The plausibility bounds of a node's telemetry: its wired GPUs, its engine's seats."""
        return TelemetryBounds(self.wiring.node(record.name).gpus, record.max_num_seqs)

    def _registered(self, node: str) -> NodeRecord:
        record = self._nodes.get(node)
        if record is None:
            self.wiring.node(node)  # NotFound with the known names
            raise errors.NotFound(f"node {node!r} is not in the wiring")  # pragma: no cover
        if record.session_id == "":
            raise errors.FailedPrecondition(
                f"node {node!r}: telemetry before registration; register first"
            )
        return record

    def _store(
        self, record: NodeRecord, sample: node_agent_pb2.TelemetrySample, now: float
    ) -> None:
        # the constructor, not dataclasses.replace: this runs for every upload of every node
        self._nodes[record.name] = NodeRecord(
            name=record.name,
            agent_address=record.agent_address,
            session_id=record.session_id,
            gpu_backend=record.gpu_backend,
            last_seen=now,
            telemetry=sample,
            engine=record.engine,
            gateway=record.gateway,
            kv_import=record.kv_import,
            max_num_seqs=record.max_num_seqs,
        )

    def counts(self) -> dict[Health, int]:
        """Nodes by health as of the last look at each."""
        return dict(self._counts)

    def records(self) -> list[NodeRecord]:
        return [self._nodes[n.name] for n in self.wiring.nodes]

    def transitions(self, now: float, only: str | None = None) -> list[tuple[str, Health, Health]]:
        """Health changes since the last look, of every node or ``only`` one:
        (node, before, after)."""
        changed = []
        names = self._nodes if only is None else (only,)
        for name in names:
            h = health(self._nodes[name], now, self.deadline_s)
            before = self._health[name]
            if h is not before:
                changed.append((name, before, h))
                self._health[name] = h
                self._counts[before] -= 1
                self._counts[h] += 1
        return changed
