"""The fluid lower bound: below every schedule the simulator runs, and hand-computed."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrrl import errors
from scheduler.compute_problem import DEFAULT_CONFIG
from scheduler.perf_model import H800, Efficiency, PerfModel, default_model
from sim_backends.clustersim.bound import (
    BIN_TOKENS,
    fluid_bound,
    prefill_gpu_s_per_token,
)
from sim_backends.clustersim.generation import simulate_step, uniform_layout
from sim_backends.clustersim.workload import RolloutRequest

pytestmark = pytest.mark.unit

PERF = default_model("Qwen2.5-14B", "H800-SXM")
# the same decode times with a KV cache that never fills (HBM is read only for capacity)
UNLIMITED_KV = replace(PERF, hardware=replace(H800, hbm_bytes=1e15))
# a small KV cache: TP1 holds ~20k tokens, so the cache, not max_num_seqs, caps batches
SMALL_KV = replace(PERF, efficiency=Efficiency(gpu_memory_utilization=0.41))


def _requests(lengths: list[tuple[int, int]]) -> list[RolloutRequest]:
    return [RolloutRequest(f"q{i}", i, p, n) for i, (p, n) in enumerate(lengths)]


def _sim_seconds(
    perf: PerfModel, lengths: list[tuple[int, int]], nodes: int, tp: int, policy: str, seqs: int
) -> float:
    names = tuple(f"gen{i:03d}" for i in range(nodes))
    config = replace(DEFAULT_CONFIG, max_num_seqs=seqs)
    res = simulate_step(
        perf, _requests(lengths), uniform_layout(names, 8, tp), policy=policy, config=config
    )
    return res.seconds


@settings(max_examples=10)
@given(
    st.lists(st.tuples(st.integers(16, 3000), st.integers(1, 4000)), min_size=1, max_size=120),
    st.sampled_from(["default", "small-kv"]),
    st.sampled_from([4, 32, 256]),
)
def test_the_bound_is_below_every_static_layout_and_the_oracle(
    lengths: list[tuple[int, int]], model: str, seqs: int
) -> None:
    perf = PERF if model == "default" else SMALL_KV
    tps = (1, 2, 4, 8)
    bound = fluid_bound(perf, lengths, 8, tps, seqs)
    assert bound.seconds == max(bound.work_s, bound.path_s, bound.coupled_s) > 0
    assert bound.coupled_s >= bound.work_s  # nu = 0 is one of the prices tried
    for policy, tp in [*(("static", t) for t in tps), ("oracle", 8)]:
        sim = _sim_seconds(perf, lengths, 1, tp, policy, seqs)
        assert bound.seconds <= sim * (1 + 1e-9), (policy, tp, bound, sim)


def test_one_sequence_per_instance_is_the_sum_of_its_iterations() -> None:
    # max_num_seqs = 1 on eight TP1 GPUs: every token runs alone, so a token costs its
    # batch-1 iteration at its context (floored to its bin) in GPU-seconds and in time
    lengths = [(0, 64), (0, 128), (0, 32)]
    bound = fluid_bound(PERF, lengths, 8, (1,), 1)

    def alone(n: int) -> float:
        return sum(
            BIN_TOKENS * PERF.decode_iteration_time(1, 1, float(edge))
            for edge in range(0, n, BIN_TOKENS)
        )

    assert bound.prefill_s == 0.0
    assert bound.work_s == pytest.approx(sum(alone(n) for _, n in lengths) / 8, rel=1e-9)
    # three responses on eight GPUs: the longest one's own time binds (step 5 with a
    # large nu on it), within the nu grid's resolution, above the 256-token path grid
    longest = alone(128)
    assert bound.coupled_s <= longest
    assert bound.coupled_s == pytest.approx(longest, rel=1e-3)
    assert bound.path_s == pytest.approx(128 * PERF.decode_iteration_time(1, 1, 0.0))
    sim = _sim_seconds(PERF, lengths, 1, 1, "static", 1)
    assert longest <= sim <= longest * 1.2


def test_the_kv_cache_caps_the_batch_of_long_contexts() -> None:
    # 20,000-token prompts: a TP1 instance holds 10 of them (202,964 tokens of KV), so
    # the cheapest token is one of a batch of 10, not of max_num_seqs = 256
    cap = PERF.kv_capacity_tokens(1)
    assert 10 * 20016 <= cap < 11 * 20000
    lengths = [(20000, 16)] * 40
    bound = fluid_bound(PERF, lengths, 8, (1,), 256)
    per_token = min(PERF.decode_iteration_time(1, b, 20000.0) / b for b in range(1, 11))
    assert per_token == pytest.approx(PERF.decode_iteration_time(1, 10, 20000.0) / 10)
    decode = 40 * 16 * per_token / 8
    assert bound.work_s - bound.prefill_s == pytest.approx(decode, rel=1e-9)
    free = fluid_bound(UNLIMITED_KV, lengths, 8, (1,), 256)
    # a batch of 40 at once would read the weights a quarter as often
    assert free.work_s - free.prefill_s < 0.8 * decode
    assert bound.seconds <= _sim_seconds(PERF, lengths, 1, 1, "static", 256)


def test_the_per_tp_sequence_cap_is_the_lower_of_the_two() -> None:
    capped = replace(PERF, efficiency=Efficiency(max_num_seqs_by_tp=((1, 8),)))
    lengths = [(500, 700)] * 64
    by_tp = fluid_bound(capped, lengths, 8, (1,), 256)
    by_config = fluid_bound(PERF, lengths, 8, (1,), 8)
    assert by_tp.seconds == pytest.approx(by_config.seconds, rel=1e-12)
    assert by_tp.seconds > fluid_bound(PERF, lengths, 8, (1,), 256).seconds
    assert by_tp.seconds <= _sim_seconds(capped, lengths, 1, 1, "static", 256)


def test_prefill_is_charged_at_its_cheapest_gpu_seconds_per_token() -> None:
    tps = (1, 2, 4, 8)
    kappa = prefill_gpu_s_per_token(PERF, tps)
    samples = [(t, n) for t in tps for n in (1, 64, 500, 4096, 8192)]
    assert all(kappa <= t * PERF.prefill_time(t, n) / n for t, n in samples)
    lengths = [(4000, 1)] * 50
    bound = fluid_bound(PERF, lengths, 8, tps, 256)
    assert bound.prefill_s == pytest.approx(kappa * 4000 * 50 / 8)
    assert bound.work_s > bound.prefill_s > 0.5 * bound.work_s


def test_a_long_response_beside_a_bulk_raises_the_bound_past_work_and_path() -> None:
    # one 3,000-token response and a bulk of short ones on one node: at the bulk's
    # cheapest batch the long one is too slow, at its fastest TP the bulk costs more
    lengths = [(512, 3000), *([(512, 400)] * 1500)]
    tps = (1, 2, 4, 8)
    bound = fluid_bound(PERF, lengths, 8, tps, 256)
    assert bound.coupled_s > 1.02 * max(bound.work_s, bound.path_s)
    for policy, tp in [("static", 2), ("static", 8), ("oracle", 8)]:
        assert bound.seconds <= _sim_seconds(PERF, lengths, 1, tp, policy, 256)


def test_bad_input_names_the_field() -> None:
    with pytest.raises(errors.InvalidArgument, match="requests"):
        fluid_bound(PERF, [(-1, 5)], 8, (1,), 256)
    with pytest.raises(errors.InvalidArgument, match="tps"):
        fluid_bound(PERF, [(1, 5)], 8, (), 256)
    with pytest.raises(errors.InvalidArgument, match="max_num_seqs"):
        fluid_bound(PERF, [(1, 5)], 8, (1,), 0)
    assert fluid_bound(PERF, [(3, 0)], 8, (1,), 256).seconds == 0.0
