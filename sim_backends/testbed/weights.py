"""Weight sync through the node agents over the testbed's circuits, measured.

:func:`checkpoint_sync` publishes nothing itself (:func:`publish` writes a checkpoint into
a training node's agent directory, as a trainer does); it reads the OCS ports' byte
counters, sets ``weight-sync`` with the checkpoint through the controller (the generation
agents fetch it from the training agent's data address: only the circuits the phase set
up lead there), reads the counters again, and compares each node's transfer rate with the
capacity the circuits and NICs give it (the tbf rates of the testbed's links):

- a node fetching over ``streams`` connections from a source in another pod can use at
  most ``min(streams, circuits between the pods)`` circuits (ECMP puts each connection on
  one), and neither NIC's rate;
- all generation nodes at once share the source's NIC and, per generation pod, the
  circuits between the source's pod and that pod.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from orchestrrl import errors
from orchestrrl.client import AsyncClient, CircuitView, PhaseChange, WeightSyncIncomplete
from orchestrrl.model import Phase, Role
from sim_backends import netns
from sim_backends.testbed.plan import TestbedPlan, checkpoint_dir
from sim_backends.tiny_models import shape_of_size, write_checkpoint


@dataclass(frozen=True)
class NodeRate:
    node: str
    ok: bool
    nbytes: int
    seconds: float
    circuits: int
    streams: int
    capacity_mbps: float  # what its path allows (NICs, circuits, streams)
    error: str = ""

    @property
    def mbps(self) -> float:
        return self.nbytes * 8 / self.seconds / 1e6 if self.seconds > 0 else 0.0


@dataclass(frozen=True)
class CheckpointSyncReport:
    change: PhaseChange
    source: str
    checkpoint_bytes: int
    nodes: tuple[NodeRate, ...]
    seconds: float  # the controller's: from the commands' start to the last answer
    circuit_bytes: int  # out of the OCS ports toward generation pods, from the source's pod
    ocs_bytes: int  # out of every OCS port
    capacity_mbps: float  # of all the fetches at once

    @property
    def complete(self) -> bool:
        ws = self.change.weight_sync
        return ws is not None and ws.complete

    @property
    def fetched_bytes(self) -> int:
        return sum(n.nbytes for n in self.nodes)

    @property
    def fetch_seconds(self) -> float:
        """The slowest node's fetch: all of them run at once."""
        return max((n.seconds for n in self.nodes), default=0.0)

    @property
    def mbps(self) -> float:
        s = self.fetch_seconds
        return self.fetched_bytes * 8 / s / 1e6 if s > 0 else 0.0

    @property
    def efficiency(self) -> float:
        return self.mbps / self.capacity_mbps if self.capacity_mbps > 0 else 0.0


def publish(plan: TestbedPlan, node: str, version: str, nbytes: int, seed: int = 0) -> Path:
    """A checkpoint of about ``nbytes`` in ``node``'s agent directory, as a trainer writes
    one (orchestrrl.checkpoint.write); its path."""
    return write_checkpoint(checkpoint_dir(plan, node), version, shape_of_size(nbytes), seed=seed)


async def port_tx_bytes(plan: TestbedPlan) -> dict[int, int]:
    """Bytes sent out of each port of the (first) OCS, by port number."""
    o = plan.ocses[0]
    out = await netns.run(["ip", "-n", o.netns, "-j", "-s", "link", "show"])
    ports: dict[int, int] = {}
    for link in json.loads(out.stdout or "[]"):
        name = str(link.get("ifname", "")).split("@")[0]
        if name.startswith("p") and name[1:].isdigit():
            ports[int(name[1:])] = int(link["stats64"]["tx"]["bytes"])
    return ports


def _toward(circuits: list[CircuitView], source_pod: str, gen_pods: set[str]) -> list[int]:
    """The OCS port of each circuit from ``source_pod`` that leads into a generation pod."""
    ports = []
    for c in circuits:
        if c.pod_a == source_pod and c.pod_b in gen_pods:
            ports.append(c.b)
        elif c.pod_b == source_pod and c.pod_a in gen_pods:
            ports.append(c.a)
    return ports


def capacities(
    plan: TestbedPlan, circuits: list[CircuitView], source: str, streams: int
) -> tuple[dict[str, float], float]:
    """Each generation node's capacity alone, and all of theirs at once, in Mb/s."""
    src = plan.node(source)
    circuit = plan.scale.mbps(plan.uplink_gbps)
    gens = [n for n in plan.nodes if n.role == Role.GEN.value]

    def between(pod: str) -> int:
        return sum(1 for c in circuits if {c.pod_a, c.pod_b} == {src.pod, pod})

    alone = {
        n.name: min(src.nic_mbps, n.nic_mbps, min(streams, between(n.pod)) * circuit)
        if n.pod != src.pod
        else min(src.nic_mbps, n.nic_mbps)
        for n in gens
    }
    pods = {n.pod for n in gens}
    shared = sum(
        min(
            between(pod) * circuit,
            sum(min(alone[n.name], n.nic_mbps) for n in gens if n.pod == pod),
        )
        for pod in pods
    )
    return alone, min(src.nic_mbps, shared)


async def checkpoint_sync(
    plan: TestbedPlan,
    version: str,
    source: str,
    *,
    streams: int = 4,
    idle_window_ms: float = 0.0,
    timeout_s: float = 120.0,
    request_id: str = "",
) -> CheckpointSyncReport:
    """Set weight-sync with checkpoint ``version`` from ``source`` and measure it (see the
    module docstring). An incomplete sync is reported, not raised."""
    before = await port_tx_bytes(plan)
    async with AsyncClient(plan.controller, timeout_s=30.0) as client:
        try:
            change = await client.set_phase(
                Phase.WEIGHT_SYNC,
                request_id,
                idle_window_ms / 1000.0,
                checkpoint=version,
                source=source,
                streams=streams,
                sync_timeout_s=timeout_s,
            )
        except WeightSyncIncomplete as exc:
            change = exc.change
    after = await port_tx_bytes(plan)
    ws = change.weight_sync
    if ws is None:
        raise errors.FailedPrecondition("the controller answered without a weight-sync report")
    gen_pods = {n.pod for n in plan.nodes if n.role == Role.GEN.value}
    toward = _toward(change.circuits, plan.node(source).pod, gen_pods)
    alone, shared = capacities(plan, change.circuits, source, streams)
    nodes = tuple(
        NodeRate(
            n.node,
            n.ok,
            n.bytes_fetched,
            n.fetch_seconds,
            n.circuits,
            n.streams or streams,
            alone.get(n.node, 0.0),
            n.error,
        )
        for n in ws.nodes
    )
    return CheckpointSyncReport(
        change,
        source,
        ws.checkpoint_bytes,
        nodes,
        ws.seconds,
        sum(after.get(p, 0) - before.get(p, 0) for p in toward),
        sum(after[p] - before.get(p, 0) for p in after),
        shared,
    )


async def raw_tcp_baseline(
    plan: TestbedPlan, source: str, nbytes: int, streams: int, timeout_s: float = 120.0
) -> tuple[float, float]:
    """The same bytes from ``source`` to every generation node at once as plain TCP
    (the testbed's built-in sender, ``streams`` connections each): (seconds, Mb/s)."""
    from sim_backends.testbed import traffic

    gens = [n.name for n in plan.nodes if n.role == Role.GEN.value]
    circuits = await traffic.committed_circuits(plan)
    report = await traffic.run_transfers(
        plan,
        [traffic.Transfer(source, g, nbytes) for g in gens],
        tool="builtin",
        streams=streams,
        timeout_s=timeout_s,
        circuits=circuits,
    )
    if not report.ok:
        failed = [f"{r.target}: {r.error}" for r in report.results if not r.ok]
        raise errors.Unavailable("raw TCP baseline failed: " + "; ".join(failed))
    return report.wall_s, report.mbps
