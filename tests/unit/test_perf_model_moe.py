"""MoE decode in the performance model: every expected value is a hand computation from
Qwen3-235B-A22B's config.json (94 layers, hidden 4096, 64 heads, 4 KV heads, head_dim
128, 128 experts, 8 per token, expert width 1536, vocab 151936) and the H800 constants."""

from __future__ import annotations

import math

import pytest

from orchestrrl import errors
from scheduler.perf_model import (
    QWEN3_235B_A22B,
    QWEN25_14B,
    ModelShape,
    PerfModel,
    default_model,
    experts_touched,
)
from sim_backends.clustersim.models import SHAPES

pytestmark = pytest.mark.unit

# one block of Qwen3-235B-A22B, by hand from the config
ATTN = 4096 * (64 * 128 + 2 * 4 * 128) + 64 * 128 * 4096 + 2 * 128  # + q/k norms
ROUTER = 4096 * 128
EXPERT = 3 * 4096 * 1536
LM_HEAD = 151936 * 4096
NORMS = 94 * 2 * 4096 + 4096
KV_PER_TOKEN = 2 * 94 * 4 * 128 * 2  # K and V, every layer, BF16
NIC = 400e9 / 8  # B/s per GPU
EFF_NET = 0.8
LAT = 30e-6


def _perf() -> PerfModel:
    return default_model("Qwen3-235B-A22B", "H800-SXM")


def test_experts_touched_is_e_times_one_minus_miss_probability() -> None:
    assert experts_touched(128, 8, 1) == pytest.approx(8.0)
    # two tokens: 128 (1 - (120/128)^2) = 128 - 112.5
    assert experts_touched(128, 8, 2) == pytest.approx(15.5)
    assert experts_touched(128, 8, 0) == 0.0
    assert experts_touched(128, 8, 1024) == pytest.approx(128.0, abs=1e-9)
    assert experts_touched(4, 4, 3) == 4.0  # every expert used by every token
    with pytest.raises(errors.InvalidArgument, match="active"):
        experts_touched(128, 0, 5)


def test_shape_is_the_training_sides_and_matches_the_published_sizes() -> None:
    m = QWEN3_235B_A22B
    assert m.layer_params == ATTN + 128 * EXPERT + ROUTER + 2 * 4096
    assert m.params == 94 * m.layer_params + 2 * LM_HEAD + 4096
    assert SHAPES["Qwen3-235B-A22B"] is m  # the training side trains this very shape
    assert m.active_params == m.params - 94 * 120 * EXPERT
    assert m.all_expert_params == 94 * 128 * EXPERT
    assert m.dense_params == m.params - m.all_expert_params
    assert m.kv_bytes_per_token == KV_PER_TOKEN
    with pytest.raises(errors.InvalidArgument, match=r"model\.active_experts"):
        ModelShape("x", 2, 64, 4, 4, 8, 10, experts=4, active_experts=5, expert_ffn=8)
    with pytest.raises(errors.InvalidArgument, match=r"model\.expert_ffn"):
        ModelShape("x", 2, 64, 4, 4, 8, 10, experts=4, active_experts=2)


def test_instance_geometry_and_its_errors() -> None:
    p = _perf()
    assert p.moe_instance(8) == (1, 8)
    assert p.moe_instance(4) == (1, 4)
    assert p.moe_instance(32) == (4, 8)
    with pytest.raises(errors.InvalidArgument, match=r"gpus=12.*multiple"):
        p.moe_instance(12)
    with pytest.raises(errors.InvalidArgument, match=r"gpus=256.*experts \(128\)"):
        p.moe_instance(256)
    with pytest.raises(errors.InvalidArgument, match="mixture-of-experts"):
        default_model("Qwen2.5-14B").moe_instance(8)


def test_weights_and_kv_capacity_per_gpu() -> None:
    p = _perf()
    # 32 GPUs: 4 experts of every layer per GPU, the rest split over a node's 8 GPUs
    rest = 94 * (ATTN + ROUTER) + 2 * LM_HEAD
    held = (94 * 128 * EXPERT / 32 + rest / 8 + NORMS) * 2
    assert p.weight_bytes_per_shard(32) == pytest.approx(held)
    free = 80e9 * 0.9 - held - 2.38 * 1024**3
    # attention DP over 4 nodes, each node's 8 GPUs hold the KV of 4 KV heads (2 copies)
    assert p.kv_capacity_tokens(32) == int(4 * free / (KV_PER_TOKEN / 4))
    # 470 GB only fits a whole node of H800
    assert [p.fits(t) for t in (1, 2, 4, 8)] == [False, False, False, True]


def test_a2a_bytes_and_time_by_hand() -> None:
    p = _perf()
    # 1024 tokens on 32 GPUs: 32 per GPU, 8 copies of 4096 x 2 B, 3 of 4 nodes remote
    nbytes = 32 * 8 * 4096 * 2 * 3 / 4
    assert p.moe_a2a_network_bytes(32, 1024) == pytest.approx(nbytes)
    assert p.moe_a2a_network_bytes(8, 1024) == 0.0  # one node: no network
    assert p.moe_a2a_time(8, 1024) == 0.0
    # dispatch + combine, each latency + bytes / (NIC x efficiency)
    assert p.moe_a2a_time(32, 1024) == pytest.approx(2 * (LAT + nbytes / (NIC * EFF_NET)))
    assert p.moe_a2a_time(32, 1024, network_bandwidth=NIC / 3) == pytest.approx(
        2 * (LAT + 3 * nbytes / (NIC * EFF_NET))
    )


def test_decode_iteration_of_a_four_node_instance_by_hand() -> None:
    p = _perf()
    b, ctx, n = 256, 1000.0, 32
    active = 94 * (ATTN + ROUTER) + LM_HEAD + 94 * 8 * EXPERT
    compute = b * (2 * active + 4 * 94 * 64 * 128 * ctx) / (n * 989e12 * (518.6 / 989.5))
    touched = 128 * (1 - (120 / 128) ** b)
    weights = ((94 * (ATTN + ROUTER) + LM_HEAD) / 8 + 94 * touched * EXPERT / n + NORMS) * 2
    kv = b / 4 * ctx * KV_PER_TOKEN / 4
    memory = (weights + kv) / (3.35e12 * 6.081 / 8.0)
    kernels = 94 * (9 - 3 + 7 + 2) * 2e-6
    node_tokens = b / 4
    allreduce = 2 * 94 * (4.5e-6 + 1.5e-6 * 7 + 2 * 7 / 8 * node_tokens * 4096 * 2 / (200e9 * 0.8))
    net_bytes = b / n * 8 * 4096 * 2 * 3 / 4
    network = 94 * 2 * (LAT + net_bytes / (NIC * EFF_NET))
    host = 12.7e-6 * b
    total = max(max(compute, memory) + kernels + allreduce + network, host) + 0.25e-3 + 0.6e-3
    br = p.moe_decode_breakdown(n, b, ctx)
    assert br.experts_touched == pytest.approx(touched)
    assert br.compute_s == pytest.approx(compute)
    assert br.memory_s == pytest.approx(memory)
    assert br.kernels_s == pytest.approx(kernels)
    assert br.allreduce_s == pytest.approx(allreduce)
    assert br.network_a2a_s == pytest.approx(network)
    assert br.total_s == pytest.approx(total)
    # the network term only: a third of the bandwidth triples its bytes part
    slow = p.moe_decode_breakdown(n, b, ctx, network_bandwidth=NIC / 3)
    assert slow.total_s - br.total_s == pytest.approx(94 * 2 * 2 * net_bytes / (NIC * EFF_NET))


def test_one_node_instance_is_what_the_generation_simulator_sees() -> None:
    p = _perf()
    b, ctx = 64, 3000.0
    br = p.moe_decode_breakdown(8, b, ctx)
    assert br.network_a2a_s == 0.0
    # a single token reads 8 experts per layer, spread over 8 GPUs: one each on average
    one = p.moe_decode_breakdown(8, 1, 0.0)
    weights_one = ((94 * (ATTN + ROUTER) + LM_HEAD) / 8 + 94 * 8 * EXPERT / 8 + NORMS) * 2
    assert one.memory_s == pytest.approx(weights_one / (3.35e12 * 6.081 / 8.0))
    # decode_iteration_time / decode_breakdown dispatch to the MoE model
    assert p.decode_iteration_time(8, b, ctx) == pytest.approx(br.total_s)
    d = p.decode_breakdown(8, b, ctx)
    assert d.allreduce_s == pytest.approx(br.allreduce_s)
    assert d.memory_s == pytest.approx(br.memory_s)
    # more sequences touch more experts: the iteration costs more, tokens/s rises
    assert p.decode_iteration_time(8, 256, ctx) > p.decode_iteration_time(8, 64, ctx)
    assert p.decode_tokens_per_s(8, 256, ctx) > p.decode_tokens_per_s(8, 64, ctx)


def test_prefill_counts_active_flops_and_the_dispatch() -> None:
    p = _perf()
    tokens = 8192
    active = 94 * (ATTN + ROUTER) + 94 * 8 * EXPERT
    flops = tokens * (2 * active + 4 * 94 * 64 * 128 * tokens / 2) + 2 * 151936 * 4096
    compute = flops / (8 * 989e12 * (518.6 / 989.5))
    kernels = 94 * 15 * 2e-6
    allreduce = 2 * 94 * (15e-6 + 2 * 7 / 8 * tokens * 4096 * 2 / 160e9)
    assert p.prefill_time(8, tokens) == pytest.approx(compute + kernels + allreduce + 0.25e-3)
    # across 4 nodes: the compute splits 4 ways, the dispatch/combine is added
    net = 94 * 2 * (LAT + tokens / 32 * 8 * 4096 * 2 * 3 / 4 / (NIC * EFF_NET))
    allreduce4 = 2 * 94 * (15e-6 + 2 * 7 / 8 * tokens / 4 * 4096 * 2 / 160e9)
    assert p.moe_prefill_time(32, tokens) == pytest.approx(
        compute / 4 + kernels + allreduce4 + net + 0.25e-3
    )


def test_training_counts_active_parameters_for_moe_only() -> None:
    moe, dense = _perf(), default_model("Qwen2.5-14B")
    flops = 989e12 * 0.52
    assert moe.training_step_time(10**6, 64) == pytest.approx(
        6 * QWEN3_235B_A22B.active_params * 1e6 / (64 * flops)
    )
    assert dense.training_step_time(10**6, 64) == pytest.approx(
        6 * QWEN25_14B.params * 1e6 / (64 * flops)
    )
    assert not QWEN25_14B.moe and QWEN25_14B.active_params == QWEN25_14B.params
    assert math.isfinite(moe.decode_iteration_time(8, 1, 0))
