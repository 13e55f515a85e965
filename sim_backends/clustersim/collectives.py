"""Traffic of collectives and of weight synchronisation, as node-to-node transfers.

- :func:`ring_allreduce`: ring reduce-scatter + all-gather, the bandwidth-optimal
  all-reduce NCCL uses at scale: every node sends ``2 (n-1)/n * nbytes`` to its ring
  neighbour, all neighbours at once (the ring follows the given node order; sorted
  node indexes keep all but one hop per pod inside the pod).
- :func:`allreduce`, :func:`allgather`, :func:`reduce_scatter`, :func:`all_to_all`: the
  node-level traffic of each collective under an algorithm of :data:`ALGORITHMS`, every
  fabric given the same choices. A node stands for its GPUs: NCCL runs one channel per
  NIC rail and moves data between a node's GPUs over NVLink (PXN), so a collective over
  every GPU of ``n`` nodes puts on each node's NICs what a node-level collective of the
  node's share puts on one link of ``nics x nic_gbps`` (the fabric module's node model).

  - ``ring``: a ring in the group's rank order (what a topology-unaware launcher gets:
    scattered ranks cross pods at every hop). All-reduce: every node sends
    ``2 (n-1)/n S`` to its successor, ``2 (n-1)`` latency steps; all-gather and
    reduce-scatter half of that.
  - ``tree`` (all-reduce only; NCCL has no tree all-gather): NCCL's double binary tree,
    two heap-shaped trees over the rank order, the second mirrored, each carrying half
    the data up (reduce) and down (broadcast); ``2 ceil(log2 n)`` latency steps.
  - ``hierarchical``: pod-aware two-level algorithm, a ring within each pod then across
    pods; its bytes on the links equal those of a ring ordered by pod (each pod sends
    ``2 (P-1)/P S`` over its uplinks for an all-reduce), so that is its traffic, with
    ``2 (k-1) + 2 (P-1)`` latency steps (``k`` nodes in the largest pod, ``P`` pods).
  - all-to-all: direct (every pair at once), one latency step per call, for every fabric.
- :func:`weight_sync_transfers`: the transfers of ``scheduler.weight_sync``'s schedule
  (every training node sends its shard; point-to-point or a two-level tree, whichever
  that planner predicts faster), with node names mapped back to indexes.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING

from orchestrrl import errors
from orchestrrl.model import Nic, Node, Ocs, Pod, Role, Tor, Uplink, Wiring
from scheduler.circuits import allocate
from scheduler.network import Workload, demand_matrix
from scheduler.weight_sync import Transfer as WsTransfer
from scheduler.weight_sync import WeightSyncPlan, plan_weight_sync
from sim_backends.clustersim.fabrics import ClusterSpec, FabricKind, Transfer

if TYPE_CHECKING:
    from sim_backends.clustersim.fabrics import Fabric


def ring_allreduce(nodes: Sequence[int], nbytes: float, tag: str = "allreduce") -> list[Transfer]:
    """Concurrent neighbour flows of a ring all-reduce of ``nbytes`` over ``nodes``."""
    if not nbytes >= 0:
        raise errors.field_error("nbytes", nbytes, "a number >= 0")
    if len(set(nodes)) != len(nodes):
        raise errors.field_error("nodes", list(nodes), "distinct node indexes")
    n = len(nodes)
    if n < 2 or nbytes == 0:
        return []
    per = 2.0 * (n - 1) / n * nbytes
    return [Transfer(nodes[i], nodes[(i + 1) % n], per, tag) for i in range(n)]


ALGORITHMS = ("ring", "tree", "hierarchical")


@dataclass(frozen=True)
class CollectiveTraffic:
    """One collective call's node-to-node transfers under ``algorithm``, and the number of
    sequential latency steps a call takes."""

    algorithm: str
    transfers: tuple[Transfer, ...]
    steps: int


def _check(nodes: Sequence[int], nbytes: float) -> None:
    if not nbytes >= 0:
        raise errors.field_error("nbytes", nbytes, "a number >= 0")
    if len(set(nodes)) != len(nodes):
        raise errors.field_error("nodes", list(nodes), "distinct node indexes")


def _by_pod(nodes: Sequence[int], pod_of: Callable[[int], int]) -> tuple[list[int], int, int]:
    """Nodes ordered by pod (stable), the size of the largest pod part and the pod count."""
    order = sorted(nodes, key=pod_of)
    sizes: dict[int, int] = {}
    for x in nodes:
        sizes[pod_of(x)] = sizes.get(pod_of(x), 0) + 1
    return order, max(sizes.values(), default=0), len(sizes)


def _ring(order: Sequence[int], per: float, tag: str) -> tuple[Transfer, ...]:
    n = len(order)
    if n < 2 or per <= 0:
        return ()
    return tuple(Transfer(order[i], order[(i + 1) % n], per, tag) for i in range(n))


def _unknown(algorithm: str, allowed: Sequence[str]) -> errors.InvalidArgument:
    return errors.field_error("algorithm", algorithm, "one of " + ", ".join(allowed))


def allreduce(
    nodes: Sequence[int],
    nbytes: float,
    algorithm: str,
    pod_of: Callable[[int], int],
    tag: str = "allreduce",
) -> CollectiveTraffic:
    """All-reduce of ``nbytes`` per node over ``nodes`` (rank order) with ``algorithm``."""
    _check(nodes, nbytes)
    n = len(nodes)
    if algorithm == "ring":
        return CollectiveTraffic("ring", tuple(ring_allreduce(nodes, nbytes, tag)), 2 * (n - 1))
    if algorithm == "hierarchical":
        order, k, pods = _by_pod(nodes, pod_of)
        per = 2.0 * (n - 1) / n * nbytes if n else 0.0
        return CollectiveTraffic(
            "hierarchical", _ring(order, per, tag), 2 * (k - 1) + 2 * max(0, pods - 1)
        )
    if algorithm == "tree":
        pairs: dict[tuple[int, int], float] = {}
        for order in (list(nodes), list(reversed(nodes))):
            for i in range(1, n):
                child, parent = order[i], order[(i - 1) // 2]
                for a, b in ((child, parent), (parent, child)):  # reduce up, broadcast down
                    pairs[(a, b)] = pairs.get((a, b), 0.0) + nbytes / 2.0
        transfers = tuple(Transfer(a, b, v, tag) for (a, b), v in pairs.items() if v > 0)
        depth = math.ceil(math.log2(n)) if n > 1 else 0
        return CollectiveTraffic("tree", transfers, 2 * depth)
    raise _unknown(algorithm, ALGORITHMS)


def allgather(
    nodes: Sequence[int],
    nbytes: float,
    algorithm: str,
    pod_of: Callable[[int], int],
    tag: str = "allgather",
) -> CollectiveTraffic:
    """All-gather of ``nbytes`` in all (each node ends with ``nbytes``, its own ``1/n``
    to start with): a ring in rank order or ordered by pod (``hierarchical``)."""
    _check(nodes, nbytes)
    n = len(nodes)
    per = (n - 1) / n * nbytes if n else 0.0
    if algorithm == "ring":
        return CollectiveTraffic("ring", _ring(list(nodes), per, tag), max(0, n - 1))
    if algorithm == "hierarchical":
        order, k, pods = _by_pod(nodes, pod_of)
        return CollectiveTraffic("hierarchical", _ring(order, per, tag), (k - 1) + (pods - 1))
    raise _unknown(algorithm, ("ring", "hierarchical"))


def reduce_scatter(
    nodes: Sequence[int],
    nbytes: float,
    algorithm: str,
    pod_of: Callable[[int], int],
    tag: str = "reduce-scatter",
) -> CollectiveTraffic:
    """Reduce-scatter of ``nbytes`` per node: the traffic of :func:`allgather` reversed
    in time (the same bytes on the same ring edges)."""
    return allgather(nodes, nbytes, algorithm, pod_of, tag)


def all_to_all(
    groups: Sequence[Sequence[int]], nbytes_per_node: float, tag: str = "all-to-all"
) -> CollectiveTraffic:
    """Direct all-to-all within each group: every node spreads ``nbytes_per_node``
    evenly over the group's members (its own share stays local), so it sends
    ``(g-1)/g x nbytes_per_node`` over its NICs."""
    if not nbytes_per_node >= 0:
        raise errors.field_error("nbytes_per_node", nbytes_per_node, "a number >= 0")
    transfers: list[Transfer] = []
    for group in groups:
        _check(group, nbytes_per_node)
        g = len(group)
        if g < 2 or nbytes_per_node == 0:
            continue
        share = nbytes_per_node / g
        transfers += [Transfer(a, b, share, tag) for a in group for b in group if a != b]
    return CollectiveTraffic("direct", tuple(transfers), 1)


def weight_sync_plan(
    train_nodes: Sequence[int],
    gen_nodes: Sequence[int],
    nbytes: float,
    cluster: ClusterSpec,
    fabric_hint: Fabric | None = None,
) -> WeightSyncPlan:
    """``scheduler.weight_sync.plan_weight_sync`` on a planning wiring of the cluster.

    The planner sees every pod's training part and generation part as pods of their
    own (``pod003-train``, ``pod003-gen``), each with one uplink per NIC of its nodes
    (divided by the oversubscription when ``fabric_hint`` is an oversubscribed
    fat-tree), and the circuits ``scheduler.circuits.allocate`` gives the weight-sync
    demand on them: the capacity a non-blocking or reconfigured fabric offers the phase.
    """
    if not nbytes > 0:
        raise errors.field_error("nbytes", nbytes, "a number > 0")
    train = sorted(set(train_nodes))
    gen = sorted(set(gen_nodes))
    if not train:
        raise errors.field_error("train_nodes", list(train_nodes), "at least one node")
    if not gen:
        raise errors.field_error("gen_nodes", list(gen_nodes), "at least one node")
    for name, group in (("train_nodes", train), ("gen_nodes", gen)):
        if group[0] < 0 or group[-1] >= cluster.nodes:
            bad = group[0] if group[0] < 0 else group[-1]
            raise errors.field_error(name, bad, f"node indexes 0..{cluster.nodes - 1}")
    if set(train) & set(gen):
        raise errors.field_error("gen_nodes", min(set(train) & set(gen)), "not a training node")
    ratio = 1.0
    if fabric_hint is not None and fabric_hint.kind is FabricKind.OVERSUBSCRIBED:
        ratio = fabric_hint.options.oversubscription
    plan = _plan(tuple(train), tuple(gen), float(nbytes), cluster, ratio)
    if plan.transfers:
        return plan
    if fabric_hint is not None and fabric_hint.kind in (
        FabricKind.STATIC_OPTICAL,
        FabricKind.RFABRIC,
    ):
        raise errors.FailedPrecondition(f"weight sync cannot be planned: {plan.explanation}")
    # An electrical fabric connects every pair of nodes, but the planning wiring gives
    # each pod part only its NICs (its share of the uplinks when oversubscribed) as
    # circuit ports: too few to reach every other part when parts are small (a training
    # pool scattered over the pods). Every sender then writes its shard to every
    # receiver over the fabric's own links, whose flow simulation charges the time.
    return _p2p_plan(train, gen, float(nbytes), plan.explanation)


def _p2p_plan(train: Sequence[int], gen: Sequence[int], nbytes: float, why: str) -> WeightSyncPlan:
    shard = nbytes / len(train)
    transfers = tuple(
        WsTransfer(1, f"n{s:06d}", f"n{r:06d}", i * shard, shard)
        for i, s in enumerate(train)
        for r in gen
    )
    return WeightSyncPlan(
        "p2p",
        transfers,
        math.inf,
        math.inf,
        math.inf,
        len(train),
        f"p2p over the fabric's own links (the planning circuits could not: {why})",
    )


@lru_cache(maxsize=64)
def _plan(
    train: tuple[int, ...], gen: tuple[int, ...], nbytes: float, cluster: ClusterSpec, ratio: float
) -> WeightSyncPlan:
    """The planner call (pure, so cached: a simulation asks the same question every step)."""
    groups: dict[str, list[int]] = {}
    for role, members in ((Role.TRAIN, train), (Role.GEN, gen)):
        for x in members:
            groups.setdefault(f"pod{cluster.pod_of(x):03d}-{role.value}", []).append(x)
    pods: list[Pod] = []
    tors: list[Tor] = []
    nodes: list[Node] = []
    port = 0
    for name, part in sorted(groups.items()):
        role = Role.TRAIN if name.endswith("-train") else Role.GEN
        n_up = max(1, int(len(part) * cluster.nics_per_node / ratio))
        ups = tuple(Uplink(f"u{k}", "plan", port + k) for k in range(n_up))
        port += n_up
        tors.append(Tor(f"tor-{name}", name, ups))
        pods.append(Pod(name, role, tuple(f"n{x:06d}" for x in part), (f"tor-{name}",)))
        for x in part:
            nics = tuple(
                Nic(f"nic{i}", f"tor-{name}", f"n{x:06d}-{i}", cluster.nic_gbps)
                for i in range(cluster.nics_per_node)
            )
            nodes.append(Node(f"n{x:06d}", name, role, "", cluster.gpus_per_node, nics))
    wiring = Wiring(
        "orl-sim-plan", "", tuple(pods), tuple(nodes), tuple(tors), (Ocs("plan", "", port, 0.0),)
    )
    sources = wiring.pods_with_role(Role.TRAIN)
    targets = wiring.pods_with_role(Role.GEN)
    demand = demand_matrix(wiring, [Workload.weight_sync(sources, targets, nbytes)])
    circuits = allocate(wiring, demand)
    return plan_weight_sync(
        wiring,
        circuits,
        nbytes,
        sources=sources,
        targets=targets,
        uplink_gbps=cluster.nic_gbps,
    )


def weight_sync_transfers(
    train_nodes: Sequence[int],
    gen_nodes: Sequence[int],
    nbytes: float,
    cluster: ClusterSpec,
    fabric_hint: Fabric | None = None,
) -> list[Transfer]:
    """The weight-sync schedule's transfers (tags ``ws-p2p``, ``ws-tree-1``,
    ``ws-tree-2``). All are meant to start together: the tree's second level streams
    chunks as they arrive (the planner's pipelining), so it runs concurrently with the
    first and shares the links with it."""
    plan = weight_sync_plan(train_nodes, gen_nodes, nbytes, cluster, fabric_hint)
    tag = "ws-p2p" if plan.mode == "p2p" else ""
    return [
        Transfer(int(t.source[1:]), int(t.target[1:]), t.nbytes, tag or f"ws-tree-{t.stage}")
        for t in plan.transfers
    ]
