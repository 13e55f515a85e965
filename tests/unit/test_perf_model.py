"""The performance model: shapes, terms, the TP trade-off it must show, calibration."""

from __future__ import annotations

import dataclasses
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrrl import errors
from scheduler.perf_model import (
    A100,
    H100,
    H800,
    HARDWARE,
    MODELS,
    QWEN25_14B,
    QWEN25_32B,
    QWEN25_72B,
    SOURCES,
    Efficiency,
    PerfModel,
    ProfilePoint,
    default_model,
    model_from_config,
)

pytestmark = pytest.mark.unit


@pytest.fixture
def pm() -> PerfModel:
    return PerfModel(QWEN25_14B, H800)


@pytest.mark.parametrize(
    ("model", "published_billions"),
    [(QWEN25_14B, 14.7), (QWEN25_32B, 32.5), (QWEN25_72B, 72.7)],
)
def test_parameter_counts_match_the_published_sizes(
    model: object, published_billions: float
) -> None:
    assert isinstance(model, type(QWEN25_14B))
    assert model.params / 1e9 == pytest.approx(published_billions, rel=0.015)


def test_kv_bytes_per_token_is_k_and_v_of_every_layer() -> None:
    # 48 layers x 8 KV heads x 128 head dim x (K, V) x 2 bytes
    assert QWEN25_14B.kv_bytes_per_token == 48 * 8 * 128 * 2 * 2
    assert QWEN25_72B.kv_bytes_per_token == 80 * 8 * 128 * 2 * 2


def test_every_constant_has_its_source() -> None:
    for hw in HARDWARE.values():
        assert hw.source
    for m in MODELS.values():
        assert m.source
    documented = " ".join(SOURCES)
    for f in dataclasses.fields(Efficiency):
        assert f.name in documented, f"Efficiency.{f.name} has no source in SOURCES"


def test_model_given_by_shape_and_validation() -> None:
    m = model_from_config(
        "llama-ish", layers=32, hidden=4096, heads=32, kv_heads=8, ffn=14336, vocab=128256
    )
    assert m.head_dim == 128
    assert m.params / 1e9 == pytest.approx(8.0, rel=0.02)
    with pytest.raises(errors.InvalidArgument, match="kv_heads"):
        model_from_config("bad", layers=2, hidden=64, heads=6, kv_heads=4, ffn=8, vocab=10)
    with pytest.raises(errors.InvalidArgument, match="layers"):
        model_from_config("bad", layers=0, hidden=64, heads=4, kv_heads=4, ffn=8, vocab=10)
    with pytest.raises(errors.InvalidArgument, match="one of"):
        default_model("Qwen2.5-3B")
    with pytest.raises(errors.InvalidArgument, match="one of"):
        default_model(hardware="B300")


def test_weight_shards_split_the_model(pm: PerfModel) -> None:
    total = QWEN25_14B.weight_bytes
    for tp in (1, 2, 4, 8):
        shard = pm.weight_bytes_per_shard(tp)
        assert total <= tp * shard < total * 1.001  # only norms are replicated
    assert pm.weight_bytes_per_shard(1) == pytest.approx(total)


def test_72b_does_not_fit_two_80gb_gpus() -> None:
    pm = PerfModel(QWEN25_72B, H800)
    assert not pm.fits(1) and not pm.fits(2)
    assert pm.fits(4) and pm.fits(8)


def test_kv_capacity_grows_faster_than_tp(pm: PerfModel) -> None:
    """Weights shrink per GPU as TP grows, so a TP group holds more KV per GPU."""
    caps = [pm.kv_capacity_tokens(t) / t for t in (1, 2, 4, 8)]
    assert caps == sorted(caps)
    assert pm.kv_capacity_tokens(2) > 2 * pm.kv_capacity_tokens(1)


def test_decode_time_grows_with_batch_and_context(pm: PerfModel) -> None:
    for tp in (1, 2, 8):
        times = [pm.decode_iteration_time(tp, b, 2000) for b in (1, 8, 64, 256)]
        assert times == sorted(times)
        assert pm.decode_iteration_time(tp, 64, 8000) > pm.decode_iteration_time(tp, 64, 1000)
    assert pm.decode_iteration_time(8, 0, 1000) == 0.0


def test_tp_trade_off_latency_versus_throughput(pm: PerfModel) -> None:
    """Large TP: lower per-token latency; small TP: more tokens per GPU at small batch;
    and TP never scales linearly (fixed per-kernel and all-reduce costs)."""
    t1 = pm.decode_iteration_time(1, 1, 4000)
    t8 = pm.decode_iteration_time(8, 1, 4000)
    assert t8 < t1 / 2  # much faster per token
    assert t8 > t1 / 8  # but far from 8x
    per_gpu_tp1 = pm.decode_tokens_per_s(1, 8, 4000)
    per_gpu_tp8 = pm.decode_tokens_per_s(8, 8, 4000) / 8
    assert per_gpu_tp1 > 2 * per_gpu_tp8


def test_terms_beyond_roofline(pm: PerfModel) -> None:
    b8 = pm.decode_breakdown(8, 64, 2000)
    b1 = pm.decode_breakdown(1, 64, 2000)
    assert b1.allreduce_s == 0.0 < b8.allreduce_s
    assert b8.kernels_s == b1.kernels_s > 0  # TP does not shrink per-kernel costs
    # all-reduce: latency grows with TP, bandwidth term with the batch
    assert pm.allreduce_time(8, 1024) > pm.allreduce_time(2, 1024)
    assert pm.allreduce_time(4, 64 * 2**20) > pm.allreduce_time(4, 2**20)
    # GEMM efficiency falls as shards get narrow (large M, wave quantisation)
    assert pm.gemm_shape_efficiency(8, 4096) < pm.gemm_shape_efficiency(1, 4096)
    # host work per sequence binds only at large batches
    assert b8.host_s == pytest.approx(64 * Efficiency().host_per_sequence_s)


def test_pure_roofline_would_always_pick_tp8() -> None:
    """The DESIGN warning: with the extra terms removed, TP8 is never worse per GPU."""
    ideal = Efficiency(
        kernel_fixed_s=0.0,
        allreduce_base_s=0.0,
        allreduce_per_peer_s=0.0,
        iteration_overhead_s=0.0,
        host_per_sequence_s=0.0,
        link_efficiency=1.0,
    )
    pm = PerfModel(QWEN25_14B, H800, ideal)
    for per_gpu_batch in (1, 8, 32):
        tp1 = pm.decode_tokens_per_s(1, per_gpu_batch, 2000)
        tp8 = pm.decode_tokens_per_s(8, 8 * per_gpu_batch, 2000) / 8
        assert tp8 >= tp1 * 0.99


def test_prefill_is_compute_bound_for_long_prompts(pm: PerfModel) -> None:
    t1 = pm.prefill_time(2, 4096)
    t2 = pm.prefill_time(2, 8192)
    assert 1.8 < t2 / t1 < 2.6
    assert pm.prefill_time(8, 4096) < pm.prefill_time(2, 4096)
    assert pm.prefill_time(2, 0) == 0.0
    assert pm.recompute_time(4, 10_000) > pm.prefill_time(4, 8192)


def test_transfers(pm: PerfModel) -> None:
    kv_local = pm.kv_move_time(4000, same_node=True, src_tp=2, dst_tp=2)
    kv_remote = pm.kv_move_time(4000, same_node=False, src_tp=2, dst_tp=2)
    assert 0 < kv_local < kv_remote
    # more NICs in parallel when both groups are wide
    assert pm.kv_move_time(4000, same_node=False, src_tp=8, dst_tp=8) < kv_remote
    nbytes = 4000 * QWEN25_14B.kv_bytes_per_token
    expected = nbytes / (2 * H800.nic_bandwidth * Efficiency().network_efficiency)
    assert kv_remote == pytest.approx(expected + Efficiency().network_latency_s)
    assert pm.weight_sync_time(50e9) == pytest.approx(
        QWEN25_14B.weight_bytes / (50e9 * 0.8) + Efficiency().network_latency_s
    )
    assert pm.network_transfer_time(1e9, bandwidth=0.0) == math.inf


def test_training_step(pm: PerfModel) -> None:
    tokens, gpus = 1_000_000, 64
    compute = 6 * QWEN25_14B.params * tokens / (gpus * H800.peak_flops * 0.52)
    assert pm.training_step_time(tokens, gpus) == pytest.approx(compute)
    with_sync = pm.training_step_time(tokens, gpus, dp_degree=8, network_bandwidth=100e9)
    assert with_sync > compute
    faster_net = pm.training_step_time(tokens, gpus, dp_degree=8, network_bandwidth=400e9)
    assert compute < faster_net < with_sync
    with pytest.raises(errors.InvalidArgument):
        pm.training_step_time(tokens, 0)


def test_reshard_costs(pm: PerfModel) -> None:
    assert pm.reshard_time([2] * 8, [2] * 8) == 0.0
    # merging needs no weight bytes (every GPU already holds a superset), splitting does
    assert pm.reshard_weight_time([2] * 8, [8] * 8) == 0.0
    split = pm.reshard_weight_time([8] * 8, [2] * 8)
    assert split == pytest.approx(
        (0.5 - 0.125) * QWEN25_14B.weight_bytes / (H800.nvlink_bandwidth * 0.8)
    )
    assert pm.reshard_time([8] * 8, [2] * 8) > pm.reshard_time([2] * 8, [8] * 8)
    with pytest.raises(errors.InvalidArgument):
        pm.reshard_weight_time([1, 1], [2, 2, 2, 2])


layouts = st.sampled_from(
    [(8,) * 8, (4,) * 8, (2,) * 8, (1,) * 8, (4, 4, 4, 4, 2, 2, 2, 2), (4, 4, 4, 4, 1, 1, 1, 1)]
)


@settings(max_examples=40)
@given(a=layouts, b=layouts, c=layouts)
def test_reshard_cost_obeys_the_triangle_inequality(
    a: tuple[int, ...], b: tuple[int, ...], c: tuple[int, ...]
) -> None:
    """Plans are stable only if going A->C never costs more than A->B->C."""
    pm = PerfModel(QWEN25_14B, H800)
    assert pm.reshard_time(a, c) <= pm.reshard_time(a, b) + pm.reshard_time(b, c) + 1e-12


def test_calibration_reproduces_the_profile(pm: PerfModel) -> None:
    points = [
        ProfilePoint(2, 8, 2000, 0.020),
        ProfilePoint(2, 64, 2000, 0.040),
        ProfilePoint(8, 8, 2000, 0.010),
    ]
    cal = pm.calibrated(points)
    for p in points:
        assert cal.decode_iteration_time(p.tp, p.batch, p.context_tokens) == pytest.approx(
            p.seconds
        )
    # interpolated between measured batches of one TP, flat outside
    mid = cal.decode_iteration_time(2, 32, 2000)
    assert 0.020 < mid < 0.040
    r8 = 0.010 / pm.decode_iteration_time(8, 8, 2000)
    assert cal.decode_iteration_time(8, 64, 2000) == pytest.approx(
        pm.decode_iteration_time(8, 64, 2000) * r8
    )
    # a TP degree without points uses the median ratio
    ratios = sorted(
        p.seconds / pm.decode_iteration_time(p.tp, p.batch, p.context_tokens) for p in points
    )
    assert cal.decode_iteration_time(4, 16, 2000) == pytest.approx(
        pm.decode_iteration_time(4, 16, 2000) * ratios[1]
    )
    with pytest.raises(errors.InvalidArgument):
        pm.calibrated([ProfilePoint(2, 0, 100, 0.01)])


def test_other_hardware_is_slower_or_equal() -> None:
    for hw in (H100, A100):
        pm = PerfModel(QWEN25_32B, hw)
        assert pm.decode_iteration_time(4, 32, 2000) > 0
    a100 = PerfModel(QWEN25_32B, A100).decode_iteration_time(4, 32, 2000)
    h100 = PerfModel(QWEN25_32B, H100).decode_iteration_time(4, 32, 2000)
    assert a100 > h100
