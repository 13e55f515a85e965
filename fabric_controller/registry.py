"""Node registry: which agents registered, when they were last heard, their telemetry.

Pure bookkeeping; the clock reading is passed in by the caller.
"""

from __future__ import annotations

import enum
import secrets
from dataclasses import dataclass, replace

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

    def with_wiring(self, wiring: Wiring) -> Registry:
        """A registry for a reloaded wiring: nodes still wired keep their state."""
        fresh = Registry(wiring, self.deadline_s)
        for name in fresh._nodes:
            if name in self._nodes:
                fresh._nodes[name] = self._nodes[name]
                fresh._health[name] = self._health[name]
        return fresh

    def register(self, node: str, address: str, gpu_backend: str, now: float) -> NodeRecord:
        self.wiring.node(node)  # NotFound with the known names
        record = NodeRecord(node, address, secrets.token_hex(8), gpu_backend, now, None)
        self._nodes[node] = record
        return record

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

    def telemetry(self, node: str, sample: node_agent_pb2.TelemetrySample, now: float) -> None:
        self.wiring.node(node)
        record = self._nodes[node]
        if record.session_id == "":
            raise errors.FailedPrecondition(
                f"node {node!r}: telemetry before registration; register first"
            )
        self._nodes[node] = replace(record, last_seen=now, telemetry=sample)

    def counts(self) -> dict[Health, int]:
        """Nodes by health as of the last look at each."""
        out = dict.fromkeys(Health, 0)
        for h in self._health.values():
            out[h] += 1
        return out

    def records(self) -> list[NodeRecord]:
        return [self._nodes[n.name] for n in self.wiring.nodes]

    def transitions(self, now: float, only: str | None = None) -> list[tuple[str, Health, Health]]:
        """Health changes since the last look, of every node or ``only`` one:
        (node, before, after)."""
        changed = []
        names = self._nodes if only is None else (only,)
        for name in names:
            h = health(self._nodes[name], now, self.deadline_s)
            if h is not self._health[name]:
                changed.append((name, self._health[name], h))
                self._health[name] = h
        return changed
