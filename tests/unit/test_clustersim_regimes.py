"""Traffic regimes: bytes per pattern from the model shape, collectives against closed
forms on the fabrics, and the regime map's verdicts."""

from __future__ import annotations

import pytest

from orchestrrl import errors
from scheduler.perf_model import ModelShape
from sim_backends.clustersim.collectives import all_to_all, allgather, allreduce
from sim_backends.clustersim.fabrics import ClusterSpec, FabricKind, FabricOptions, build_fabric
from sim_backends.clustersim.models import (
    QWEN3_30B_A3B,
    QWEN3_235B_A22B,
    SHAPES,
    a2a_bytes_per_token_layer,
)
from sim_backends.clustersim.parallel import Parallelism, time_training, training_traffic
from sim_backends.clustersim.pipeline import scattered_pools
from sim_backends.clustersim.regimes import verdicts

pytestmark = pytest.mark.unit

GB = 1e9
# 16 nodes in 4 pods of 4: small enough for the flow simulation of every pair
SMALL = ClusterSpec(16, nodes_per_pod=4)
NODE_BPS = SMALL.node_bytes_per_s


def _fabric(kind: FabricKind, ratio: float = 3.0) -> object:
    return build_fabric(kind, SMALL, FabricOptions(oversubscription=ratio), range(16), ())


# -- bytes from the model shape -------------------------------------------------------------


def test_qwen3_235b_shape_by_hand() -> None:
    s = QWEN3_235B_A22B
    attn = 4096 * (64 * 128 + 2 * 4 * 128) + 64 * 128 * 4096 + 2 * 128
    experts = 128 * 3 * 4096 * 1536
    layer = attn + experts + 4096 * 128 + 2 * 4096
    assert s.params == 94 * layer + 2 * 151936 * 4096 + 4096
    assert s.params == pytest.approx(235.09e9, rel=1e-3)  # "235B"
    assert s.weight_bytes == pytest.approx(470.2e9, rel=1e-3)  # weight sync in BF16
    assert s.active_params == s.params - 94 * 120 * 3 * 4096 * 1536
    assert s.active_params == pytest.approx(22.19e9, rel=1e-3)  # "A22B", embeddings in
    # dispatch + combine of one token in one layer: 2 x 8 experts x 4096 x 2 bytes
    assert a2a_bytes_per_token_layer(s) == 2 * 8 * 4096 * 2
    # forward + backward over 94 layers: the issue's ~24 MB per token
    assert 2 * 94 * a2a_bytes_per_token_layer(s) == pytest.approx(24.6e6, rel=1e-2)


def test_qwen3_30b_and_dense_72b_shapes() -> None:
    assert QWEN3_30B_A3B.params == pytest.approx(30.5e9, rel=1e-2)
    assert QWEN3_30B_A3B.active_params == pytest.approx(3.3e9, rel=0.1)
    q72 = SHAPES["Qwen2.5-72B"]
    assert q72.params == 72_706_203_648 and q72.active_params == q72.params
    with pytest.raises(errors.InvalidArgument, match=r"model\.active_experts=9"):
        ModelShape("x", 2, 8, 2, 1, 4, 10, experts=8, active_experts=9, expert_ffn=4)


def _traffic(
    shape: ModelShape, layout: Parallelism, nodes: int = 16, tokens: int = 2**24
) -> object:
    return training_traffic(
        shape,
        layout,
        list(range(nodes)),
        8,
        SMALL.pod_of,
        tokens=tokens,
        mini_batches=4,
        flops_per_gpu=1e15,
    )


def test_pattern_bytes_match_hand_computation() -> None:
    q72 = SHAPES["Qwen2.5-72B"]
    tokens = 2**24
    # FSDP: per micro-batch two all-gathers of the weights, one reduce-scatter of grads
    fsdp = _traffic(q72, Parallelism("fsdp", micro_batch_tokens=16384), tokens=tokens)
    pats = {p.name: p for p in fsdp.patterns}  # type: ignore[attr-defined]
    micro = tokens / 4 / 128 / 16384  # tokens per GPU per mini-batch / micro-batch tokens
    assert pats["fsdp all-gather"].per_minibatch == 2 * micro
    assert pats["fsdp all-gather"].nbytes == pytest.approx(16 * 15 / 16 * q72.params * 2)
    assert pats["fsdp reduce-scatter"].nbytes == pytest.approx(15 * q72.params * 2)
    # Megatron ZeRO-1: one all-reduce of the gradients per mini-batch, ring: 2 (n-1)/n S
    meg = _traffic(q72, Parallelism("megatron"))
    (ar,) = meg.patterns  # type: ignore[attr-defined]
    assert ar.per_minibatch == 1 and ar.nbytes == pytest.approx(16 * 2 * 15 / 16 * q72.params * 2)
    # EP over 64 GPUs = 8 nodes: each node sends 7/8 of its tokens' dispatch + combine
    s = QWEN3_235B_A22B
    ep = _traffic(s, Parallelism("ep", ep=64), tokens=tokens)
    pats = {p.name: p for p in ep.patterns}  # type: ignore[attr-defined]
    a2a = pats["ep all-to-all"]
    per_node = tokens / 4 / 16 * 94 * 2 * 8 * 4096 * 2
    assert a2a.per_minibatch == 2  # forward and backward
    assert a2a.nbytes == pytest.approx(16 * per_node * 7 / 8)
    assert pats["ep all-to-all (log-prob)"].nbytes == pytest.approx(4 * 16 * per_node * 7 / 8)
    # expert gradients: each node holds 8/64 of the experts, reduced over 2 replicas
    assert pats["expert-grad all-reduce"].nbytes == pytest.approx(
        16 * 2 * 1 / 2 * s.all_expert_params / 8 * 2
    )


# -- collectives against closed forms ---------------------------------------------------------


@pytest.mark.parametrize("method", ["flow", "bottleneck"])
def test_all_to_all_matches_closed_form_on_a_non_blocking_fabric(method: str) -> None:
    fabric = _fabric(FabricKind.FAT_TREE)
    per_node = 8 * GB
    c = all_to_all([list(range(16))], per_node)
    expected = 15 / 16 * per_node / NODE_BPS
    got = fabric.transfer_seconds(c.transfers, method)  # type: ignore[attr-defined]
    assert got == pytest.approx(expected, rel=0.01)


@pytest.mark.parametrize("method", ["flow", "bottleneck"])
@pytest.mark.parametrize("algorithm", ["ring", "hierarchical"])
def test_fsdp_all_gather_matches_closed_form_on_a_non_blocking_fabric(
    method: str, algorithm: str
) -> None:
    fabric = _fabric(FabricKind.FAT_TREE)
    weights = 10 * GB
    c = allgather(list(range(16)), weights, algorithm, SMALL.pod_of)
    got = fabric.transfer_seconds(c.transfers, method)  # type: ignore[attr-defined]
    assert got == pytest.approx(15 / 16 * weights / NODE_BPS, rel=0.01)
    ar = allreduce(list(range(16)), weights, algorithm, SMALL.pod_of)
    got = fabric.transfer_seconds(ar.transfers, method)  # type: ignore[attr-defined]
    assert got == pytest.approx(2 * 15 / 16 * weights / NODE_BPS, rel=0.01)


@pytest.mark.parametrize("method", ["flow", "bottleneck"])
@pytest.mark.parametrize("ratio", [2.0, 3.0])
def test_core_bound_patterns_degrade_by_the_oversubscription(method: str, ratio: float) -> None:
    """Every node's traffic leaves its pod (pod p's nodes exchange with pod p+1's):
    the oversubscribed core is the bottleneck, ``ratio`` times slower."""
    full = _fabric(FabricKind.FAT_TREE)
    thin = _fabric(FabricKind.OVERSUBSCRIBED, ratio)
    pairs = (
        [[i, (i + 4) % 16] for i in range(0, 16, 8)]
        + [[i, i + 4] for i in range(1, 4)]
        + [[i, i + 4] for i in range(9, 12)]
    )
    a2a = all_to_all(pairs, 4 * GB).transfers
    base = full.transfer_seconds(a2a, method)  # type: ignore[attr-defined]
    assert base == pytest.approx(0.5 * 4 * GB / NODE_BPS, rel=0.01)
    assert thin.transfer_seconds(a2a, method) == pytest.approx(  # type: ignore[attr-defined]
        ratio * base, rel=0.01
    )
    # FSDP all-gather as a ring in rank order over scattered ranks: every hop crosses pods
    train, _ = scattered_pools(16, 0, 4)
    ring = allgather(list(train), 8 * GB, "ring", SMALL.pod_of).transfers
    t_full = full.transfer_seconds(ring, method)  # type: ignore[attr-defined]
    assert t_full == pytest.approx(15 / 16 * 8 * GB / NODE_BPS, rel=0.01)
    assert thin.transfer_seconds(ring, method) == pytest.approx(  # type: ignore[attr-defined]
        ratio * t_full, rel=0.01
    )
    # the pod-aware algorithm crosses pods once per pod: the core is no longer the limit
    hier = allgather(list(train), 8 * GB, "hierarchical", SMALL.pod_of).transfers
    assert thin.transfer_seconds(hier, method) == pytest.approx(  # type: ignore[attr-defined]
        t_full, rel=0.01
    )


def test_scattered_placement_deals_ranks_round_robin_over_pods() -> None:
    train, gen = scattered_pools(4, 4, 4)
    assert train == (0, 4, 1, 5) and gen == (2, 3, 6, 7)


def test_overlap_hides_communication_up_to_its_share_of_compute() -> None:
    fabric = _fabric(FabricKind.FAT_TREE)
    traffic = _traffic(SHAPES["Qwen2.5-72B"], Parallelism("megatron"))

    def run(overlap: float) -> object:
        return time_training(
            traffic,  # type: ignore[arg-type]
            lambda ts: fabric.transfer_seconds(ts, "bottleneck"),  # type: ignore[attr-defined]
            algorithm="ring",
            overlap=overlap,
            latency_s=0.0,
        )

    none, half = run(0.0), run(1.0)
    assert none.exposed_s == pytest.approx(none.comm_s)  # type: ignore[attr-defined]
    per_mb_comm = none.comm_s / 4  # type: ignore[attr-defined]
    upd = traffic.update_compute_s  # type: ignore[attr-defined]
    assert half.exposed_s == pytest.approx(4 * max(0.0, per_mb_comm - upd))  # type: ignore[attr-defined]
    assert none.choices == {"dp-grad all-reduce (ZeRO-1)": "ring"}  # type: ignore[attr-defined]


def test_bad_layouts_name_field_value_and_what_is_allowed() -> None:
    q72 = SHAPES["Qwen2.5-72B"]
    problems = Parallelism("ep", ep=3, overlap=2.0, algorithm="mesh").problems(q72, 16, 8)
    text = "\n".join(problems)
    assert "parallelism.strategy='ep' is not valid: a dense strategy" in text
    assert "parallelism.overlap=2.0 is not valid: a number in [0, 1]" in text
    assert (
        "parallelism.algorithm='mesh' is not valid: one of ring, tree, hierarchical, auto" in text
    )
    assert Parallelism("megatron", pp=3).problems(q72, 16, 8) == [
        "parallelism.pp=3 is not valid: a divisor of the training nodes (16)"
    ]


def test_verdicts_compare_rfabric_with_the_best_static_fabric() -> None:
    def row(fabric: str, ppc: float, ah: float | None) -> dict[str, object]:
        return {
            "workload": "w",
            "gpus": 1024,
            "placement": "scattered",
            "fabric": fabric,
            "perf_per_cost": ppc,
            "perf_per_cost_above_hosts": ah,
            "perf_per_cost_norm": ppc / 1.0,
            "exposed_share": 0.5,
        }

    rows = [row("fat-tree", 1.0, 1.0), row("fat-tree-oversub", 1.5, None), row("rfabric", 1.8, 2.0)]
    (v,) = verdicts(rows)
    assert v["best_static"] == "fat-tree-oversub" and v["rfabric_vs_best"] == pytest.approx(1.2)
    assert v["best_static_above_hosts"] == "fat-tree" and v["rfabric_vs_best_above_hosts"] == 2.0
    assert v["rfabric_vs_fat_tree"] == 1.8
