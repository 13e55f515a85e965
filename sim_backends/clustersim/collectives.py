"""Traffic of collectives and of weight synchronisation, as node-to-node transfers.

- :func:`ring_allreduce`: ring reduce-scatter + all-gather, the bandwidth-optimal
  all-reduce NCCL uses at scale: every node sends ``2 (n-1)/n * nbytes`` to its ring
  neighbour, all neighbours at once (the ring follows the given node order; sorted
  node indexes keep all but one hop per pod inside the pod).
- :func:`weight_sync_transfers`: the transfers of ``scheduler.weight_sync``'s schedule
  (every training node sends its shard; point-to-point or a two-level tree, whichever
  that planner predicts faster), with node names mapped back to indexes.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from typing import TYPE_CHECKING

from orchestrrl import errors
from orchestrrl.model import Nic, Node, Ocs, Pod, Role, Tor, Uplink, Wiring
from scheduler.circuits import allocate
from scheduler.network import Workload, demand_matrix
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
    return _plan(tuple(train), tuple(gen), float(nbytes), cluster, ratio)


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
