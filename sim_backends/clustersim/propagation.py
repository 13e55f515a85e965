"""Version propagation: from the trainer's step end to the last rollout engine on the new weights.

The asynchronous mode's headline figure for the fabric (issue 32): a 32B model
(Qwen2.5-32B, 65.5 GB in BF16) pushed from a 64-GPU trainer pool to 64 rollout GPUs on
a 4:1 oversubscribed core, with circuit leases against the same core left static.

The job: 16 H800 nodes in pods of 4 nodes (each under its ToR group); the trainer holds
pods 0-1, the rollout pods 2-3. The core above the ToRs has a quarter of the pods' NIC
bandwidth (4:1): an electrical Fat-Tree (``fat-tree-oversub``), or an optical core with
one OCS uplink per 4 NICs whose circuits are either planned once for the job's standing
traffic (``static-optical``: MixNet's allocation over the training collectives and the
weight sync, :func:`.pipeline.make_fabric`) or re-pointed for each broadcast wave by a
short lease (``rfabric``: the wave's circuits planned by :func:`scheduler.network.plan_network`,
set up during the trainer's last optimizer step, when its own traffic is idle, so the
switching hides in that window; charged when there is none).

A version propagates in three parts (:class:`PropagationRow`):

- the push: every trainer node sends its shard (the model over the trainer's nodes) to
  one relay per rollout pod (the pod's first node, its host memory), timed on the fabric
  by the flow model; ``p2p`` instead sends every shard to every rollout node;
- the chain: each relay streams the version down its pod's nodes in 256 MiB chunks
  (pipelined: the model once over a node's NICs plus a chunk per hop);
- the load: each engine copies its shard from its node's relay copy into GPU memory
  (host to device, ``Hardware.h2d_bandwidth``); that copy is the only time an engine
  stops decoding (its rollout stall): the relay receives in the background.

Not modelled: the trainer's own collectives running beside the wave (the trainer pushes
between optimizer steps), and the relays' host-memory bandwidth.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from orchestrrl import errors
from sim_backends.clustersim.async_rl import RELAY_CHUNK_BYTES
from sim_backends.clustersim.fabrics import Fabric, Transfer
from sim_backends.clustersim.pipeline import (
    cluster_spec,
    make_fabric,
    perf_model,
    pools,
    train_shape,
    training_step,
)
from sim_backends.clustersim.scenario import Scenario, parse_scenario

TARGET_S = 2.0  # the targets: propagation and rollout stall
STALL_TARGET_S = 0.2


@dataclass(frozen=True)
class PropagationRow:
    fabric: str
    schedule: str  # relay (a relay per rollout pod, then a chain) or p2p
    lease: str  # "none", "hidden" (set up in the trainer's idle window) or "charged"
    push_s: float
    chain_s: float
    load_s: float
    reconfig_s: float  # switching charged to the wave
    propagation_s: float
    stall_s: float
    circuits: int
    reason: str


def propagation_scenario(
    *, model: str = "Qwen2.5-32B", hardware: str = "H800-SXM", oversubscription: float = 4.0
) -> Scenario:
    """The figure's job (module doc): 8 trainer nodes, 8 rollout nodes, pods of 4."""
    return parse_scenario(
        {
            "name": "propagation-32b",
            "cluster": {"nodes": 16, "nodes_per_pod": 4, "hardware": hardware},
            "model": {"name": model},
            "split": {"train_gpus": 64, "gen_gpus": 64},
            "workload": {"prompts_per_step": 64, "samples_per_prompt": 16},
            "fabric": {
                "kind": "rfabric",
                "oversubscription": oversubscription,
                "optical_oversubscription": oversubscription,
            },
        },
        where="propagation",
    )


def _relay_plan(s: Scenario) -> tuple[list[tuple[int, list[int]]], list[int], list[int]]:
    train, gen = pools(s)
    c = cluster_spec(s)
    by_pod: dict[int, list[int]] = {}
    for n in gen:
        by_pod.setdefault(c.pod_of(n), []).append(n)
    return [(nodes[0], nodes[1:]) for _, nodes in sorted(by_pod.items())], list(train), list(gen)


def propagation(
    s: Scenario,
    fabric: Fabric,
    *,
    schedule: str = "relay",
    lease: str = "none",
    window_s: float = 0.0,
    tp: int = 8,
) -> PropagationRow:
    """One way of pushing a version on ``fabric`` (``lease``: "none" times the wave on
    the standing circuits; "hidden"/"charged" re-point them for it, with ``window_s`` of
    idle traffic before it or none)."""
    if schedule not in ("relay", "p2p"):
        raise errors.field_error("schedule", schedule, "one of relay, p2p")
    if lease not in ("none", "hidden", "charged"):
        raise errors.field_error("lease", lease, "one of none, hidden, charged")
    perf = perf_model(s)
    weights = train_shape(s, perf).weight_bytes
    heads, train, gen = _relay_plan(s)
    shard = weights / len(train)
    targets = [h for h, _ in heads] if schedule == "relay" else gen
    push = [Transfer(t, g, shard, "version push") for g in targets for t in train]
    reconfig = 0.0
    reason = ""
    if lease == "none":
        push_s = fabric.transfer_seconds(push)
    else:
        res = fabric.run_phase(
            "weight-sync", push, idle_window_s=window_s if lease == "hidden" else 0.0
        )
        push_s, reconfig, reason = res.seconds, res.reconfig_s, res.reason
    chain = 0.0
    if schedule == "relay":
        node_bw = cluster_spec(s).node_bytes_per_s
        full = perf.network_transfer_time(weights, bandwidth=node_bw)
        hop = perf.network_transfer_time(min(RELAY_CHUNK_BYTES, weights), bandwidth=node_bw)
        longest = max((len(rest) for _, rest in heads), default=0)
        chain = full + (longest - 1) * hop if longest else 0.0
    bw = perf.hardware.h2d_bandwidth
    load = perf.weight_bytes_per_shard(tp) / bw if bw > 0 else 0.0
    return PropagationRow(
        fabric=fabric.kind.value,
        schedule=schedule,
        lease=lease,
        push_s=push_s,
        chain_s=chain,
        load_s=load,
        reconfig_s=reconfig,
        propagation_s=push_s + chain + load,
        stall_s=load,
        circuits=len(fabric.circuits),
        reason=reason,
    )


def propagation_figure(tp: int = 8) -> dict[str, Any]:
    """The issue's figure: relay and p2p pushes on the 4:1 electrical core, the 4:1
    optical core left static, and the same optical core with a lease per wave (set up in
    the trainer's last optimizer step, and charged); the ratio static / leased."""
    s = propagation_scenario()
    perf = perf_model(s)
    w = s.workload
    tokens = int(w.requests_per_step * (w.prompt_tokens + w.median_response_tokens))
    traffic = training_step(s, perf, tokens)
    window = traffic.update_compute_s  # the last optimizer step's compute: no DP traffic
    rows: list[PropagationRow] = []
    for kind in ("fat-tree-oversub", "static-optical"):
        fabric = make_fabric(s, perf, kind)
        for schedule in ("relay", "p2p"):
            rows.append(propagation(s, fabric, schedule=schedule, tp=tp))
    for schedule in ("relay", "p2p"):
        for lease in ("hidden", "charged"):
            fabric = make_fabric(s, perf, "rfabric")
            # the standing partition during training: circuits planned for training
            fabric.prepare_phase("training", traffic.demand(s.parallelism.algorithm), window)
            rows.append(
                propagation(s, fabric, schedule=schedule, lease=lease, window_s=window, tp=tp)
            )
    static = next(r for r in rows if r.fabric == "static-optical" and r.schedule == "relay")
    leased = next(
        r for r in rows if r.fabric == "rfabric" and r.schedule == "relay" and r.lease == "hidden"
    )
    electrical = next(r for r in rows if r.fabric == "fat-tree-oversub" and r.schedule == "relay")
    return {
        "model": s.model.name,
        "weight_bytes": train_shape(s, perf).weight_bytes,
        "rollout_gpus": s.split.gen_gpus,
        "train_gpus": s.split.train_gpus,
        "nodes_per_pod": s.cluster.nodes_per_pod,
        "oversubscription": s.fabric.optical_oversubscription,
        "engine_tp": tp,
        "window_s": window,
        "rows": [asdict(r) for r in rows],
        "leased_s": leased.propagation_s,
        "static_s": static.propagation_s,
        "electrical_s": electrical.propagation_s,
        "ratio": static.propagation_s / leased.propagation_s,
        "ratio_electrical": electrical.propagation_s / leased.propagation_s,
        "stall_s": leased.stall_s,
        "target_s": TARGET_S,
        "stall_target_s": STALL_TARGET_S,
    }


__all__ = ["PropagationRow", "propagation", "propagation_figure", "propagation_scenario"]
