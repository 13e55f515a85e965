"""Fabrics of the cluster simulator: topologies as link graphs, and RFabric.

The interface the rest of the simulator uses:

- :class:`ClusterSpec` - servers, GPUs, NICs and the pod (ToR group) size.
- :class:`FabricKind`, :class:`FabricOptions`.
- :func:`build_fabric` ``(kind, cluster, options, train_nodes, gen_nodes, job_transfers=())``
  -> :class:`Fabric`. ``train_nodes``/``gen_nodes`` are node indexes (0..nodes-1).
  ``job_transfers`` is one representative step of the job's inter-node traffic (for
  example the training all-reduce plus the weight sync of a step); the static optical
  fabric (TopoOpt-like) fixes its circuits for the whole job from it, and RFabric starts
  from those same circuits. Empty: the phase templates (a mesh among the training pods
  plus every training pod to every generation pod, equal weights).
- :meth:`Fabric.run_phase` ``(phase, transfers, idle_window_s=0.0)`` -> :class:`PhaseResult`.
  All transfers start together at the phase start and share links max-min fairly
  (:mod:`.flows`); ``seconds`` is when the last one ends, plus any reconfiguration time
  that could not be hidden. ``idle_window_s`` is how long the inter-pod traffic has been
  idle before the phase starts (for example the compute before a gradient all-reduce,
  or the time between the end of training and the weight sync): RFabric rewires only
  when the slack gate says the switching fits in it (``scheduler.gate``), so rewiring
  is then free; otherwise it keeps the current circuits (multi-hop over them when a pod
  pair has no direct circuit) and says why in ``reason``. Only when the current
  circuits cannot connect the phase's pods at all does it rewire anyway and charge the
  switching + settling time the window does not cover (``reconfig_s``). With
  ``FabricOptions(slack_gate=False)`` it rewires for every phase whose plan changes and
  charges the uncovered time (the ablation of the gate). A fabric is stateful across
  phases only for RFabric (its current circuits); every other fabric is fixed.
- :meth:`Fabric.cost` -> :class:`sim_backends.clustersim.cost.CostBreakdown`.

Topology model (all links full duplex, modelled as one directed link per direction):

- every node has ``nics_per_node`` NICs of ``nic_gbps`` to the electrical ToR layer of
  its pod; a pod is ``nodes_per_pod`` nodes under one ToR group (rail-optimised leaves:
  one 64-port leaf per NIC rail, half its ports down, so 32 nodes; see
  :data:`DEFAULT_NODES_PER_POD`). Cross-rail traffic inside a node goes over NVLink
  (NCCL's PXN), so a node's NICs act as one link of ``nics_per_node * nic_gbps``;
- ``fat-tree``: non-blocking Clos above the ToRs (pod uplinks = pod downlinks);
  ``fat-tree-oversub``: ToR uplinks divided by ``options.oversubscription``;
- ``rail-optimised``: one leaf per rail per pod and one non-blocking spine plane per
  rail (NVIDIA SuperPOD style). With PXN every node-to-node transfer splits evenly
  over the rails, and equal splits over identical planes give exactly the max-min
  rates of the aggregated graph, so its performance is that of ``fat-tree``; only its
  port count differs (each rail plane is a Clos over ``nodes`` endpoints);
- ``static-optical`` (TopoOpt-like) and ``rfabric``: every ToR uplink goes to an OCS
  port (``options.ocs_ports`` per OCS, 3D MEMS); circuits join pod pairs, traffic
  between pods uses the direct circuits (ECMP over them) or, when a pair has none, the
  shortest paths over circuits through other pods' ToRs (split evenly).
  ``static-optical`` allocates its circuits once from the job's demand
  (``scheduler.circuits.allocate``, MixNet's bottleneck-first greedy); ``rfabric``
  re-plans them per phase from the phase's pod-to-pod bytes with
  ``scheduler.network.plan_network`` and applies the slack gate.

Link classes in :attr:`PhaseResult.link_utilisation`: ``"nic"`` (node <-> ToR),
``"tor-up"`` (ToR <-> electrical spine, electrical fabrics), ``"ocs"`` (pod-pair
circuits, optical fabrics). Utilisation = bytes carried / (capacity x phase seconds),
averaged over every link of the class (idle links count as 0).
"""

from __future__ import annotations

import enum
import math
from collections import defaultdict, deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import combinations, pairwise

import numpy as np
import numpy.typing as npt

from orchestrrl import errors
from orchestrrl.model import Circuit, Ocs, Pod, Role, Tor, Uplink, Wiring
from scheduler.circuits import PodPair, allocate, pair
from scheduler.gate import DEFAULT_SETTLING_MARGIN_S, GateDecision, slack_gate
from scheduler.network import NetworkConfig, Workload, plan_network
from sim_backends.clustersim.cost import (
    DEFAULT_PRICES,
    CostBreakdown,
    Prices,
    fat_tree_cost,
    optical_cost,
    rail_cost,
)
from sim_backends.clustersim.flows import FloatArray, IntArray, simulate_indexed

# capacity, class per link, sub-flow owner, sub-flow bytes, entry sub-flow, entry link
_FlowArrays = tuple[FloatArray, list[str], IntArray, FloatArray, IntArray, IntArray]

# A pod is the servers under one group of rail leaves: NVIDIA's DGX H100 SuperPOD
# reference architecture builds a scalable unit of 32 nodes whose 8 NIC rails each go to
# one 64-port 400G leaf (QM9700), 32 ports down and 32 up (non-blocking).
DEFAULT_NODES_PER_POD = 32
# Switch radix for counting electrical tiers: 64 x 400G (QM9700, Tomahawk-4 class).
DEFAULT_SWITCH_RADIX = 64

PHASES = ("training", "generation", "weight-sync")


@dataclass(frozen=True)
class ClusterSpec:
    """GPU servers and their NICs. Node indexes are 0..nodes-1, pods are consecutive
    blocks of ``nodes_per_pod`` nodes (the last pod may be smaller)."""

    nodes: int  # GPU servers
    gpus_per_node: int = 8
    nics_per_node: int = 8
    nic_gbps: float = 400.0  # per NIC, per direction
    nodes_per_pod: int = DEFAULT_NODES_PER_POD

    def __post_init__(self) -> None:
        for name in ("nodes", "gpus_per_node", "nics_per_node", "nodes_per_pod"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise errors.field_error(f"cluster.{name}", value, "an integer >= 1")
        if not self.nic_gbps > 0:
            raise errors.field_error("cluster.nic_gbps", self.nic_gbps, "a number > 0")

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def pods(self) -> int:
        return -(-self.nodes // self.nodes_per_pod)

    def pod_of(self, node: int) -> int:
        return node // self.nodes_per_pod

    @property
    def node_bytes_per_s(self) -> float:
        """One node's NIC bandwidth per direction, in bytes/s."""
        return self.nics_per_node * self.nic_gbps * 1e9 / 8.0


class FabricKind(enum.Enum):
    FAT_TREE = "fat-tree"
    OVERSUBSCRIBED = "fat-tree-oversub"
    RAIL = "rail-optimised"
    STATIC_OPTICAL = "static-optical"
    RFABRIC = "rfabric"

    @classmethod
    def parse(cls, value: str, field: str = "fabric.kind") -> FabricKind:
        for kind in cls:
            if value == kind.value or value.replace("_", "-").lower() == kind.value:
                return kind
        raise errors.field_error(field, value, "one of " + ", ".join(k.value for k in cls))


@dataclass(frozen=True)
class FabricOptions:
    oversubscription: float = 3.0  # ToR down:up for fat-tree-oversub (3:1 is common)
    ocs_switching_s: float = 0.010  # 3D MEMS (Calient), the paper's simulator assumption
    ocs_ports: int = 320  # 3D MEMS (Calient S320)
    reconfigure: bool = True  # RFabric: False keeps the initial (static) circuits
    settle_margin_s: float = DEFAULT_SETTLING_MARGIN_S  # ToR-side optics lock after a switch
    slack_gate: bool = True  # False: rewire every phase and charge what the window hides not
    switch_radix: int = DEFAULT_SWITCH_RADIX
    # optical fabrics: a pod's NICs per ToR uplink into the OCS layer (1: one uplink per
    # NIC, non-blocking; 4: a 4:1 oversubscribed core whose circuits are re-pointable)
    optical_oversubscription: float = 1.0

    def __post_init__(self) -> None:
        if not self.optical_oversubscription >= 1:
            raise errors.field_error(
                "fabric.optical_oversubscription", self.optical_oversubscription, "a number >= 1"
            )
        if not self.oversubscription >= 1:
            raise errors.field_error(
                "fabric.oversubscription", self.oversubscription, "a number >= 1"
            )
        if not self.ocs_switching_s >= 0:
            raise errors.field_error("fabric.ocs_switching_s", self.ocs_switching_s, ">= 0")
        if not self.settle_margin_s >= 0:
            raise errors.field_error("fabric.settle_margin_s", self.settle_margin_s, ">= 0")
        if self.ocs_ports < 2:
            raise errors.field_error("fabric.ocs_ports", self.ocs_ports, "an integer >= 2")
        if self.switch_radix < 4 or self.switch_radix % 2:
            raise errors.field_error(
                "fabric.switch_radix", self.switch_radix, "an even integer >= 4"
            )


@dataclass(frozen=True)
class Transfer:
    """``nbytes`` from node ``src`` to node ``dst`` (indexes 0..nodes-1)."""

    src: int
    dst: int
    nbytes: float
    tag: str = ""


@dataclass(frozen=True)
class PhaseResult:
    seconds: float  # completion of all transfers, plus reconfiguration charged to the phase
    reconfig_s: float  # OCS switching time charged (0 when not rewired or hidden in the window)
    reconfigured: bool
    reason: str  # slack-gate explanation for RFabric; "" otherwise
    link_utilisation: Mapping[str, float]  # mean utilisation per link class
    transfer_s: float = 0.0  # the transfers alone (seconds - reconfig_s)
    circuits: int = 0  # optical fabrics: circuits in use during the phase


class Fabric:
    """A fabric under the cluster; build with :func:`build_fabric`.

    Electrical fabrics are fixed link graphs. Optical ones hold circuits between pods;
    RFabric's change per phase. ``run_phase`` is the only method with an effect (the
    RFabric circuits), and it is deterministic.
    """

    def __init__(
        self,
        kind: FabricKind,
        cluster: ClusterSpec,
        options: FabricOptions,
        train_nodes: Sequence[int],
        gen_nodes: Sequence[int],
        job_transfers: Sequence[Transfer] = (),
    ) -> None:
        self.kind = kind
        self.cluster = cluster
        self.options = options
        self.train_nodes = tuple(sorted(set(train_nodes)))
        self.gen_nodes = tuple(sorted(set(gen_nodes)))
        for name, group in (("train_nodes", self.train_nodes), ("gen_nodes", self.gen_nodes)):
            bad = [n for n in group if not 0 <= n < cluster.nodes]
            if bad:
                raise errors.field_error(name, bad[0], f"node indexes 0..{cluster.nodes - 1}")
        both = set(self.train_nodes) & set(self.gen_nodes)
        if both:
            raise errors.field_error(
                "gen_nodes", min(both), "a node that is not also a training node"
            )
        n, p = cluster.nodes, cluster.pods
        node_bps = cluster.node_bytes_per_s
        self._pod = np.arange(n, dtype=np.int64) // cluster.nodes_per_pod
        self._pod_nodes = np.bincount(self._pod, minlength=p)
        # links 0..n-1 node up, n..2n-1 node down; electrical: 2n+pod ToR up, 2n+p+pod down
        if kind in (FabricKind.STATIC_OPTICAL, FabricKind.RFABRIC):
            self._optical: _Optical | None = _Optical(cluster, options, self, job_transfers)
            self._electrical_up: FloatArray = np.zeros(0)
        else:
            self._optical = None
            ratio = options.oversubscription if kind is FabricKind.OVERSUBSCRIBED else 1.0
            self._electrical_up = (self._pod_nodes * node_bps / ratio).astype(np.float64)
        self._node_cap = np.full(n, node_bps)

    # -- traffic ---------------------------------------------------------------------

    def run_phase(
        self, phase: str, transfers: Sequence[Transfer], idle_window_s: float = 0.0
    ) -> PhaseResult:
        """Simulate one phase's transfers, all starting together (see the module doc)."""
        reconfig_s, reconfigured, reason = self.prepare_phase(phase, transfers, idle_window_s)
        src, dst, nbytes = self._arrays(transfers)
        cap, classes, owner, sbytes, es, el = self._flows(src, dst, nbytes)
        res = simulate_indexed(cap, owner, sbytes, es, el, np.zeros(src.shape[0]))
        transfer_s = float(res.finish.max()) if src.size else 0.0
        if math.isinf(transfer_s):
            raise errors.FailedPrecondition(
                f"{self.kind.value}: phase {phase!r} has a transfer with no path"
            )
        util = _utilisation(cap, classes, res.link_bytes, transfer_s)
        return PhaseResult(
            seconds=transfer_s + reconfig_s,
            reconfig_s=reconfig_s,
            reconfigured=reconfigured,
            reason=reason,
            link_utilisation=util,
            transfer_s=transfer_s,
            circuits=self._optical.circuit_count if self._optical is not None else 0,
        )

    def prepare_phase(
        self, phase: str, transfers: Sequence[Transfer], idle_window_s: float = 0.0
    ) -> tuple[float, bool, str]:
        """The reconfiguration part of :meth:`run_phase` alone: RFabric plans circuits for
        the phase's pod-to-pod bytes (all of ``transfers``, e.g. every collective of a
        training step together) and applies the slack gate. Returns (seconds charged,
        rewired, reason); other fabrics return (0, False, "")."""
        if phase not in PHASES:
            raise errors.field_error("phase", phase, f"one of {', '.join(PHASES)}")
        if not idle_window_s >= 0:
            raise errors.field_error("idle_window_s", idle_window_s, "a number >= 0")
        if self._optical is None:
            return 0.0, False, ""
        src, dst, nbytes = self._arrays(transfers)
        return self._optical.prepare(phase, src, dst, nbytes, idle_window_s)

    def transfer_seconds(self, transfers: Sequence[Transfer], method: str = "flow") -> float:
        """Completion time of ``transfers`` started together on the current circuits,
        without planning any: ``flow`` simulates them (max-min fair, :mod:`.flows`);
        ``bottleneck`` is the closed form ``max over links of bytes / capacity`` (ECMP
        splits as in the flow model), which a schedule keeping the busiest link busy
        reaches and which max-min fair flows reach when every flow crosses a link as
        loaded as the busiest one (the symmetric collectives here; tested)."""
        return self.measure(transfers, method)[0]

    def measure(
        self, transfers: Sequence[Transfer], method: str = "flow"
    ) -> tuple[float, dict[str, float]]:
        """:meth:`transfer_seconds` and the mean utilisation per link class."""
        src, dst, nbytes = self._arrays(transfers)
        if not src.size:
            return 0.0, {}
        cap, classes, owner, sbytes, es, el = self._flows(src, dst, nbytes)
        if method == "flow":
            res = simulate_indexed(cap, owner, sbytes, es, el, np.zeros(src.shape[0]))
            seconds = float(res.finish.max())
            load = res.link_bytes
        elif method == "bottleneck":
            load = np.bincount(el, weights=sbytes[es], minlength=cap.shape[0]).astype(np.float64)
            used = load > 0
            with np.errstate(divide="ignore"):
                seconds = float((load[used] / cap[used]).max())
        else:
            raise errors.field_error("method", method, "one of flow, bottleneck")
        if math.isinf(seconds):
            raise errors.FailedPrecondition(f"{self.kind.value}: a transfer has no path")
        return seconds, _utilisation(cap, classes, load, seconds)

    def cost(self, prices: Prices = DEFAULT_PRICES) -> CostBreakdown:
        c, o = self.cluster, self.options
        endpoints = c.nodes * c.nics_per_node
        if self.kind is FabricKind.FAT_TREE:
            return fat_tree_cost(endpoints, o.switch_radix, 1.0, prices)
        if self.kind is FabricKind.OVERSUBSCRIBED:
            return fat_tree_cost(endpoints, o.switch_radix, o.oversubscription, prices)
        if self.kind is FabricKind.RAIL:
            return rail_cost(c.nodes, c.nics_per_node, o.switch_radix, prices)
        assert self._optical is not None
        if c.pods == 1:  # nothing above the one pod's leaves: no uplinks, no OCS
            return optical_cost(endpoints, 0, 0, o.ocs_ports, prices)
        uplinks = self._optical.uplinks
        return optical_cost(endpoints, uplinks, self._optical.ocs_count, o.ocs_ports, prices)

    @property
    def circuits(self) -> frozenset[Circuit]:
        """Optical fabrics: the circuits now (empty for electrical fabrics)."""
        return self._optical.current if self._optical is not None else frozenset()

    # -- internals -------------------------------------------------------------------

    def _arrays(self, transfers: Sequence[Transfer]) -> tuple[IntArray, IntArray, FloatArray]:
        n = self.cluster.nodes
        src = np.fromiter((t.src for t in transfers), dtype=np.int64, count=len(transfers))
        dst = np.fromiter((t.dst for t in transfers), dtype=np.int64, count=len(transfers))
        nbytes = np.fromiter((t.nbytes for t in transfers), dtype=np.float64, count=len(transfers))
        for name, arr in (("src", src), ("dst", dst)):
            bad = np.flatnonzero((arr < 0) | (arr >= n))
            if bad.size:
                raise errors.field_error(
                    f"transfers[{int(bad[0])}].{name}", int(arr[bad[0]]), f"a node index 0..{n - 1}"
                )
        bad = np.flatnonzero(~(nbytes >= 0) | ~np.isfinite(nbytes))
        if bad.size:
            raise errors.field_error(
                f"transfers[{int(bad[0])}].nbytes", float(nbytes[bad[0]]), "a finite number >= 0"
            )
        keep = (src != dst) & (nbytes > 0)  # a node to itself never touches the network
        return src[keep], dst[keep], nbytes[keep]

    def _flows(self, src: IntArray, dst: IntArray, nbytes: FloatArray) -> _FlowArrays:
        """Links (capacity, class of each) and the sub-flows (owner, bytes, entries)."""
        n = self.cluster.nodes
        if self._optical is not None:
            return self._optical.flows(src, dst, nbytes)
        p = self.cluster.pods
        cap = np.concatenate(
            [self._node_cap, self._node_cap, self._electrical_up, self._electrical_up]
        )
        classes = ["nic"] * (2 * n) + ["tor-up"] * (2 * p)
        m = src.shape[0]
        ps, pd = self._pod[src], self._pod[dst]
        cross = ps != pd
        hops = np.where(cross, 4, 2)
        es = np.repeat(np.arange(m, dtype=np.int64), hops)
        starts = (np.cumsum(hops) - hops).astype(np.int64)
        el = np.empty(int(hops.sum()), dtype=np.int64)
        el[starts] = src
        el[starts + hops - 1] = n + dst
        xs = starts[cross]
        el[xs + 1] = 2 * n + ps[cross]
        el[xs + 2] = 2 * n + p + pd[cross]
        owner = np.arange(m, dtype=np.int64)
        return cap, classes, owner, nbytes, es, el


def _utilisation(
    cap: FloatArray, classes: Sequence[str], link_bytes: FloatArray, seconds: float
) -> dict[str, float]:
    """Mean utilisation over the physical links of each class: bytes carried over
    capacity x time, summed over the class (a modelled link aggregates equal physical
    links, so this is the plain mean over them)."""
    out: dict[str, float] = {}
    cls = np.asarray(classes)
    for name in dict.fromkeys(classes):
        sel = cls == name
        total = float((cap[sel] * seconds).sum())
        out[name] = float(link_bytes[sel].sum()) / total if total > 0 else 0.0
    return out


def pod_name(pod: int) -> str:
    return f"pod{pod:03d}"


def optical_wiring(cluster: ClusterSpec, options: FabricOptions, roles: Sequence[Role]) -> Wiring:
    """The wiring the network planner sees for an optical fabric: one ToR group per pod
    with one uplink per NIC of its nodes (1:1; one per ``optical_oversubscription`` NICs
    for an oversubscribed core), spread over as few OCSes as the ports
    allow, every pod with the same number of ports on each OCS (so any pod pair can
    meet on any OCS)."""
    pods = cluster.pods
    per = options.ocs_ports // pods
    if per < 1:
        raise errors.field_error(
            "fabric.ocs_ports", options.ocs_ports, f"at least one port per pod ({pods} pods)"
        )
    sizes = [
        min(cluster.nodes_per_pod, cluster.nodes - i * cluster.nodes_per_pod) for i in range(pods)
    ]
    ratio = options.optical_oversubscription
    uplinks = [max(1, math.floor(s * cluster.nics_per_node / ratio + 1e-9)) for s in sizes]
    count = -(-max(uplinks) // per)
    ocses = tuple(
        Ocs(f"ocs{j:02d}", "", options.ocs_ports, options.ocs_switching_s) for j in range(count)
    )
    tors = []
    pod_list = []
    for i in range(pods):
        ups = tuple(
            Uplink(f"u{k}", f"ocs{k // per:02d}", i * per + k % per) for k in range(uplinks[i])
        )
        tors.append(Tor(f"tor-{pod_name(i)}", pod_name(i), ups))
        first = i * cluster.nodes_per_pod
        pod_list.append(
            Pod(
                pod_name(i),
                roles[i],
                tuple(f"n{x:06d}" for x in range(first, first + sizes[i])),
                (f"tor-{pod_name(i)}",),
            )
        )
    return Wiring("orl-sim", "", tuple(pod_list), (), tuple(tors), ocses)


class _Optical:
    """Circuits between pods, and routing over them."""

    def __init__(
        self,
        cluster: ClusterSpec,
        options: FabricOptions,
        fabric: Fabric,
        job_transfers: Sequence[Transfer],
    ) -> None:
        self.cluster = cluster
        self.options = options
        self.reconfigurable = fabric.kind is FabricKind.RFABRIC
        pods = cluster.pods
        train_pods = sorted({cluster.pod_of(x) for x in fabric.train_nodes})
        gen_pods = sorted({cluster.pod_of(x) for x in fabric.gen_nodes})
        roles = [Role.TRAIN if i in train_pods else Role.GEN for i in range(pods)]
        self.wiring = optical_wiring(cluster, options, roles)
        self.ocs_count = len(self.wiring.ocses)
        self.uplinks = sum(len(t.uplinks) for t in self.wiring.tors)
        self._pod_of_port = {
            (u.ocs, u.ocs_port): int(t.pod[3:]) for t in self.wiring.tors for u in t.uplinks
        }
        demand: dict[PodPair, float] = defaultdict(float)
        if job_transfers:
            for t in job_transfers:
                a, b = cluster.pod_of(t.src), cluster.pod_of(t.dst)
                if a != b and t.nbytes > 0:
                    demand[pair(pod_name(a), pod_name(b))] += t.nbytes
        else:
            for a, b in combinations(train_pods, 2):
                demand[pair(pod_name(a), pod_name(b))] += 1.0
            for a in train_pods:
                for b in gen_pods:
                    if a != b:
                        demand[pair(pod_name(a), pod_name(b))] += 1.0
        self.current: frozenset[Circuit] = allocate(self.wiring, demand)

    @property
    def circuit_count(self) -> int:
        return len(self.current)

    def _counts(self, circuits: frozenset[Circuit]) -> npt.NDArray[np.int64]:
        pods = self.cluster.pods
        count = np.zeros((pods, pods), dtype=np.int64)
        for c in circuits:
            a = self._pod_of_port.get((c.ocs, c.a))
            b = self._pod_of_port.get((c.ocs, c.b))
            if a is not None and b is not None and a != b:
                count[a, b] += 1
                count[b, a] += 1
        return count

    def _reaches(self, circuits: frozenset[Circuit], need: Sequence[tuple[int, int]]) -> bool:
        adj = self._counts(circuits) > 0
        return all(_bfs_dist(adj, a)[b] >= 0 for a, b in need)

    def prepare(
        self, phase: str, src: IntArray, dst: IntArray, nbytes: FloatArray, window: float
    ) -> tuple[float, bool, str]:
        """RFabric: plan this phase's circuits and gate the change. Returns (seconds
        charged, rewired, reason)."""
        if not self.reconfigurable:
            return 0.0, False, ""
        pods = self.cluster.pods
        ps, pd = src // self.cluster.nodes_per_pod, dst // self.cluster.nodes_per_pod
        cross = ps != pd
        lo, hi = np.minimum(ps[cross], pd[cross]), np.maximum(ps[cross], pd[cross])
        mat = np.zeros(pods * pods)
        np.add.at(mat, lo * pods + hi, nbytes[cross])
        need = [(int(k) // pods, int(k) % pods) for k in np.flatnonzero(mat)]
        if not self.options.reconfigure:
            return 0.0, False, "reconfiguration disabled: the initial (static) circuits stay"
        workloads = [
            Workload.between(pod_name(a), pod_name(b), float(mat[a * pods + b])) for a, b in need
        ]
        plan = plan_network(
            self.wiring,
            workloads,
            self.current,
            config=NetworkConfig(uplink_gbps=self.cluster.nic_gbps),
        )
        if plan.circuits.empty:
            return 0.0, False, f"{phase}: the current circuits serve the phase; no change"
        switching = self.options.ocs_switching_s
        margin = self.options.settle_margin_s
        needed = switching + margin
        moves = f"{len(plan.circuits.add)} circuit(s) added, {len(plan.circuits.remove)} removed"
        if not self.options.slack_gate:
            self.current = plan.circuits.desired
            charged = max(0.0, needed - window)
            return (
                charged,
                True,
                (
                    f"{phase}: rewired without the slack gate ({moves}); "
                    f"{charged * 1000:.1f} ms of switching + settling not hidden"
                ),
            )
        gate = (
            slack_gate(window, switching, margin)
            if window > 0
            else GateDecision(
                False,
                f"kept the current topology: no idle window before the phase "
                f"(OCS switching {switching * 1000:.1f} ms + settling {margin * 1000:.1f} ms)",
                needed,
                0.0,
            )
        )
        if gate.reconfigure:
            self.current = plan.circuits.desired
            return 0.0, True, f"{phase}: rewired ({moves}); {gate.reason}"
        if not self._reaches(self.current, need):
            self.current = plan.circuits.desired
            charged = max(0.0, needed - window)
            return (
                charged,
                True,
                (
                    f"{phase}: rewired on the critical path ({moves}, {charged * 1000:.1f} ms "
                    f"charged): the current circuits reach no path between some pods of the "
                    f"phase, and {gate.reason[0].lower()}{gate.reason[1:]}"
                ),
            )
        return 0.0, False, f"{phase}: {gate.reason}"

    def flows(self, src: IntArray, dst: IntArray, nbytes: FloatArray) -> _FlowArrays:
        n, pods = self.cluster.nodes, self.cluster.pods
        node_bps = self.cluster.node_bytes_per_s
        circuit_bps = self.cluster.nic_gbps * 1e9 / 8.0
        count = self._counts(self.current)
        cap = np.concatenate(
            [np.full(2 * n, node_bps), (count * circuit_bps).reshape(-1).astype(np.float64)]
        )
        classes = ["nic"] * (2 * n) + ["ocs"] * (pods * pods)
        adj = count > 0
        ps, pd = src // self.cluster.nodes_per_pod, dst // self.cluster.nodes_per_pod
        key = ps * pods + pd
        order = np.argsort(key, kind="stable")
        bounds = np.flatnonzero(np.diff(key[order])) + 1
        owner_parts: list[IntArray] = []
        bytes_parts: list[FloatArray] = []
        es_parts: list[IntArray] = []
        el_parts: list[IntArray] = []
        next_sub = 0
        dist_cache: dict[int, npt.NDArray[np.int64]] = {}
        for group in np.split(order, bounds) if order.size else []:
            a, b = int(ps[group[0]]), int(pd[group[0]])
            if a == b:
                paths: list[list[int]] = [[]]
            else:
                paths = _shortest_paths(adj, a, b, dist_cache)
                if not paths:
                    raise errors.FailedPrecondition(
                        f"no circuit path from {pod_name(a)} to {pod_name(b)}"
                    )
            k = len(paths)
            m = group.size
            for path in paths:
                hops = [2 * n + x * pods + y for x, y in pairwise(path)]
                length = 2 + len(hops)
                subs = np.arange(next_sub, next_sub + m, dtype=np.int64)
                next_sub += m
                owner_parts.append(group.astype(np.int64))
                bytes_parts.append(nbytes[group] / k)
                es_parts.append(np.repeat(subs, length))
                links = np.empty((m, length), dtype=np.int64)
                links[:, 0] = src[group]
                links[:, 1 : length - 1] = hops
                links[:, length - 1] = n + dst[group]
                el_parts.append(links.reshape(-1))

        def cat(parts: list[IntArray]) -> IntArray:
            return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)

        owner = cat(owner_parts)
        sbytes = np.concatenate(bytes_parts) if bytes_parts else np.zeros(0)
        return cap, classes, owner, sbytes, cat(es_parts), cat(el_parts)


_MAX_PATHS = 64


def _bfs_dist(adj: npt.NDArray[np.bool_], a: int) -> npt.NDArray[np.int64]:
    dist = np.full(adj.shape[0], -1, dtype=np.int64)
    dist[a] = 0
    queue = deque([a])
    while queue:
        x = queue.popleft()
        for y in np.flatnonzero(adj[x] & (dist < 0)):
            dist[y] = dist[x] + 1
            queue.append(int(y))
    return dist


def _shortest_paths(
    adj: npt.NDArray[np.bool_], a: int, b: int, cache: dict[int, npt.NDArray[np.int64]]
) -> list[list[int]]:
    """Every shortest pod path from a to b over circuits (at most 64, in pod order)."""
    if b not in cache:
        cache[b] = _bfs_dist(adj, b)  # distance to b
    to_b = cache[b]
    if to_b[a] < 0:
        return []
    paths: list[list[int]] = []

    def walk(x: int, acc: list[int]) -> None:
        if len(paths) >= _MAX_PATHS:
            return
        if x == b:
            paths.append(acc)
            return
        for y in np.flatnonzero(adj[x] & (to_b == to_b[x] - 1)):
            walk(int(y), [*acc, int(y)])

    walk(a, [a])
    return paths


def build_fabric(
    kind: FabricKind,
    cluster: ClusterSpec,
    options: FabricOptions = FabricOptions(),
    train_nodes: Sequence[int] = (),
    gen_nodes: Sequence[int] = (),
    job_transfers: Sequence[Transfer] = (),
) -> Fabric:
    """A fabric of ``kind`` under ``cluster`` (see the module docstring)."""
    return Fabric(kind, cluster, options, train_nodes, gen_nodes, job_transfers)
