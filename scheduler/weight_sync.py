"""Weight synchronisation schedule: every trainer sends, no single-sender funnel.

The training nodes of the source pods each hold an equal share of the model (as after
a sharded optimizer step); every generation node needs the whole model. Two schedules:

- ``p2p``: every training node writes its shard to every generation node directly
  (point-to-point RDMA writes on a precomputed schedule). Cross-pod bytes: the model
  once per generation *node*.
- ``tree``: every training node writes its shard to one head node per generation pod
  (cross-pod bytes: the model once per generation *pod*), and the head streams the model
  down a chain through the pod's ToR, in chunks, so the two levels overlap.

The predicted time of each is the slowest of its constraints: every pod pair's circuits
(count x uplink speed), every sender's and receiver's NICs, plus, for the tree, the
pipelined chain (model over one node's NICs plus one chunk per hop to fill the pipe).
The faster one is chosen. The floor of both is model bytes over the bandwidth the fabric
gives the transfer (MISSION.md).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import pairwise
from operator import attrgetter

from orchestrrl import errors
from orchestrrl.model import Circuit, Role, Wiring
from scheduler.circuits import PodPair, pair

DEFAULT_NODE_NIC_GBPS = 8 * 400.0  # H800 node: 8 x 400 Gb/s RDMA NICs (MISSION.md)


@dataclass(frozen=True, order=True)
class Transfer:
    """Bytes from one node to another: stage 1 crosses pods over circuits, stage 2 stays
    inside a generation pod (through its ToR). ``offset`` is where the piece starts in
    the flattened model."""

    stage: int
    source: str
    target: str
    offset: float
    nbytes: float


@dataclass(frozen=True)
class WeightSyncPlan:
    mode: str  # "p2p" or "tree"
    transfers: tuple[Transfer, ...]
    predicted_s: float
    p2p_s: float
    tree_s: float
    senders: int
    explanation: str


def plan_weight_sync(
    wiring: Wiring,
    circuits: Iterable[Circuit],
    model_bytes: float,
    *,
    sources: Sequence[str] | None = None,
    targets: Sequence[str] | None = None,
    uplink_gbps: float = 400.0,
    link_efficiency: float = 0.8,
    chunk_bytes: float = 256 * 2**20,
    latency_s: float = 10e-6,
) -> WeightSyncPlan:
    """The faster of the p2p and tree schedules on the given circuits."""
    if model_bytes <= 0:
        raise errors.field_error("model_bytes", model_bytes, "a number > 0")
    src_pods = tuple(sorted(sources if sources is not None else wiring.pods_with_role(Role.TRAIN)))
    dst_pods = tuple(sorted(targets if targets is not None else wiring.pods_with_role(Role.GEN)))
    senders = [n for p in src_pods for n in sorted(wiring.pod(p).nodes)]
    if not senders:
        raise errors.FailedPrecondition("weight sync has no sending node (no training pod)")
    receivers = {p: sorted(wiring.pod(p).nodes) for p in dst_pods}
    node_pod = {n.name: n.pod for n in wiring.nodes}

    count: dict[PodPair, int] = defaultdict(int)
    for c in circuits:
        a, b = wiring.circuit_pods(c)
        if a and b and a != b:
            count[pair(a, b)] += 1
    per_circuit = uplink_gbps * 1e9 / 8.0 * link_efficiency

    def nic(node: str) -> float:
        gbps = sum(x.gbps for x in wiring.node(node).nics) or DEFAULT_NODE_NIC_GBPS
        return gbps * 1e9 / 8.0 * link_efficiency

    shard = model_bytes / len(senders)
    n_recv = sum(len(v) for v in receivers.values())

    # p2p: each sender -> each receiver node, one shard
    p2p = 0.0
    pair_bytes: dict[PodPair, float] = defaultdict(float)
    for s in senders:
        p2p = max(p2p, shard * n_recv / nic(s))
    for pod, nodes in receivers.items():
        for r in nodes:
            p2p = max(p2p, model_bytes / nic(r))
        for s in senders:
            pair_bytes[pair(node_pod[s], pod)] += shard * len(nodes)
    p2p = max(p2p, _pairs_time(pair_bytes, count, per_circuit))
    p2p += latency_s

    # tree: each sender -> head of each pod, then a pipelined chain inside the pod
    tree1 = 0.0
    head_bytes: dict[PodPair, float] = defaultdict(float)
    for s in senders:
        tree1 = max(tree1, shard * len(receivers) / nic(s))
    tree2 = 0.0
    for pod, nodes in receivers.items():
        if not nodes:
            continue
        tree1 = max(tree1, model_bytes / nic(nodes[0]))
        for s in senders:
            head_bytes[pair(node_pod[s], pod)] += shard
        slowest = min(nic(n) for n in nodes)
        hops = len(nodes) - 1
        if hops:
            tree2 = max(
                tree2, model_bytes / slowest + hops * min(chunk_bytes, model_bytes) / slowest
            )
    tree1 = max(tree1, _pairs_time(head_bytes, count, per_circuit))
    tree = max(tree1, tree2) + min(chunk_bytes, model_bytes) / per_circuit + latency_s
    if math.isinf(tree1):
        tree = math.inf

    mode = "p2p" if p2p <= tree else "tree"
    predicted = min(p2p, tree)
    transfers: list[Transfer] = []
    if not math.isinf(predicted):
        for i, s in enumerate(senders):
            offset = i * shard
            for nodes in receivers.values():
                targets_of = nodes if mode == "p2p" else nodes[:1]
                transfers.extend(Transfer(1, s, r, offset, shard) for r in targets_of)
        if mode == "tree":
            for nodes in receivers.values():
                transfers.extend(Transfer(2, a, b, 0.0, model_bytes) for a, b in pairwise(nodes))
    transfers.sort(key=attrgetter("stage", "source", "target", "offset", "nbytes"))
    if math.isinf(predicted):
        missing = sorted(
            f"{node_pod[s]}<->{pod}"
            for s in senders
            for pod in receivers
            if count.get(pair(node_pod[s], pod), 0) == 0
        )
        explanation = "weight sync impossible on these circuits: no circuit for " + ", ".join(
            sorted(set(missing))[:8]
        )
    else:
        explanation = (
            f"weight sync: {mode} from {len(senders)} senders to {n_recv} nodes in "
            f"{len(receivers)} pod(s), predicted {predicted:.3f} s "
            f"(p2p {_fmt(p2p)}, tree {_fmt(tree)}; {model_bytes / 1e9:.1f} GB)"
        )
    return WeightSyncPlan(mode, tuple(transfers), predicted, p2p, tree, len(senders), explanation)


def _pairs_time(
    nbytes: dict[PodPair, float], count: dict[PodPair, int], per_circuit: float
) -> float:
    worst = 0.0
    for p, b in nbytes.items():
        if b <= 0:
            continue
        n = count.get(p, 0)
        if n == 0:
            return math.inf
        worst = max(worst, b / (n * per_circuit))
    return worst


def _fmt(t: float) -> str:
    return "impossible" if math.isinf(t) else f"{t:.3f} s"
