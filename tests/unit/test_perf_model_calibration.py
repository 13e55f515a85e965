"""The performance model held to public measurements (issue 15, "Calibration as tests").

Each case states hardware, model, TP, batch and source beside the measured number. The
model runs with its defaults (no profile): these tests fail if a change to a constant
moves the model away from what real engines measured.

Per-token decode latency at small batch, tolerance 10 %:
    Lambda's vLLM benchmark, https://github.com/LambdaLabsML/vllm-benchmark,
    results/prompt_10/{N}xH100-80GB-SXM/Meta-Llama-3-{8B,70B}-Instruct_tp{N}_len2048.json
    (vLLM v0.6.0 with --num-scheduler-steps 10 and max-num-seqs 256, benchmark_v0.md;
    BF16 weights and KV; 10 ShareGPT prompts sent at once, 8 of which decode, so the
    batch is at most 8; prompts of 4-399 tokens, outputs up to 741: mean context ~400).
    The measured number is the published ``median_tpot_ms``.

Bulk throughput per GPU, tolerance 15 %:
    TensorRT-LLM v0.14.0 perf overview, H100 80GB HBM3, FP16 column,
    https://github.com/NVIDIA/TensorRT-LLM/blob/v0.14.0/docs/source/performance/perf-overview.md
    (trtllm-bench, in-flight batching, infinite request rate; 128 input / 2048 output
    tokens, 3000 requests). Its batch is not printed: trtllm-bench sets max_batch_size
    from the KV cache, (free memory x 0.95) / (ISL + OSL) per request
    (tensorrt_llm/bench/build/tuning.py, calc_engine_setting), and its default
    scheduler admits a request only with KV for its whole length, so the running batch is
    the KV-capacity batch at ISL + OSL tokens, and the mean context is ISL + OSL / 2.

Bulk throughput per GPU at a stated batch, tolerance 15 %:
    TensorRT-LLM's performance.md up to v0.9.0 printed the batch of every row, A100 in
    FP16 (its H100 tables are FP8, which the model does not represent):
    https://github.com/NVIDIA/TensorRT-LLM/blob/v0.9.0/docs/source/performance.md (and
    v0.8.0, v0.6.1), "out tok/s/GPU", gptSessionBenchmark: static batching, every
    sequence exactly ISL in and OSL out, so the batch is the stated one throughout and the
    mean context is ISL + OSL / 2; 128-in rows are decode-bound (prefill <= 5 % of the
    run). The model passes on MHA Llama-2-7B and is 17-22 % fast at 70B TP4/TP8 and 66 %
    fast on GQA Mistral-7B. A second, H100 FP16 source with stated batches agrees
    (argonne-lcf/LLM-Inference-Bench, arXiv 2411.00136, Plots/All_results.csv, batch
    16-64, ISL = OSL 128-2048): Llama-3-70B TP4 is 1.08-1.26x fast with TensorRT-LLM and
    1.13-1.34x with vLLM, Llama-2-7B TP1/TP2 0.91-1.19x. So the known misses are the
    model's, not the inferred batches': decode at bulk batches is slower than its
    roofline terms, more so with grouped-query attention. The model credits GQA its whole
    KV-byte saving, while those TensorRT-LLM versions say their GQA decode kernels (XQA)
    were "experimental and not enabled by default" (performance.md, "Benchmarking per
    Model"). Not fixed here: a change to the decode terms moves every simulated result
    (issue 15).
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from scheduler.perf_model import A100, H100, LLAMA3_8B, LLAMA3_70B, ModelShape, PerfModel

pytestmark = pytest.mark.unit

LAMBDA = "https://github.com/LambdaLabsML/vllm-benchmark (results/prompt_10, vLLM v0.6.0)"
TRTLLM_014 = (
    "https://github.com/NVIDIA/TensorRT-LLM/blob/v0.14.0/docs/source/performance/"
    "perf-overview.md (H100 80GB HBM3, FP16, ISL/OSL 128/2048)"
)


@dataclass(frozen=True)
class LatencyCase:
    model: ModelShape
    tp: int
    batch: int
    context_tokens: int
    measured_ms: float  # median time per output token
    source: str


DECODE_LATENCY = (
    # H100-SXM, Meta-Llama-3-70B-Instruct BF16, batch <= 8 (10 prompts)
    LatencyCase(LLAMA3_70B, 2, 8, 400, 29.54, LAMBDA + " 2xH100 tp2: median_tpot_ms 29.54"),
    LatencyCase(LLAMA3_70B, 4, 8, 400, 18.12, LAMBDA + " 4xH100 tp4: median_tpot_ms 18.12"),
    LatencyCase(LLAMA3_70B, 8, 8, 400, 12.18, LAMBDA + " 8xH100 tp8: median_tpot_ms 12.18"),
    # H100-SXM, Meta-Llama-3-8B-Instruct BF16, batch <= 8 (10 prompts)
    LatencyCase(LLAMA3_8B, 1, 8, 400, 7.56, LAMBDA + " 1xH100 tp1: median_tpot_ms 7.56"),
    LatencyCase(LLAMA3_8B, 2, 8, 400, 5.26, LAMBDA + " 2xH100 tp2: median_tpot_ms 5.26"),
    LatencyCase(LLAMA3_8B, 4, 8, 400, 3.88, LAMBDA + " 4xH100 tp4: median_tpot_ms 3.88"),
    LatencyCase(LLAMA3_8B, 8, 8, 400, 3.26, LAMBDA + " 8xH100 tp8: median_tpot_ms 3.26"),
)


@pytest.mark.parametrize(
    "case", DECODE_LATENCY, ids=lambda c: f"{c.model.name}-tp{c.tp}-b{c.batch}"
)
def test_decode_latency_per_token_at_small_batch_within_10_percent(case: LatencyCase) -> None:
    pm = PerfModel(case.model, H100)
    modelled_ms = pm.decode_iteration_time(case.tp, case.batch, case.context_tokens) * 1e3
    error = modelled_ms / case.measured_ms - 1.0
    assert abs(error) <= 0.10, (
        f"{case.model.name} TP{case.tp} batch {case.batch} on H100: model "
        f"{modelled_ms:.2f} ms/token vs measured {case.measured_ms} ms ({error:+.1%}); "
        f"source: {case.source}"
    )


@dataclass(frozen=True)
class ThroughputCase:
    model: ModelShape
    tp: int
    input_tokens: int
    output_tokens: int
    measured_total: float  # output tokens/s of the whole TP group
    source: str

    @property
    def measured_per_gpu(self) -> float:
        return self.measured_total / self.tp


BULK_THROUGHPUT = (
    ThroughputCase(LLAMA3_8B, 1, 128, 2048, 9150.7477, TRTLLM_014 + " LLaMA v3.1 8B TP1"),
    ThroughputCase(LLAMA3_70B, 4, 128, 2048, 5072.0345, TRTLLM_014 + " LLaMA v3 70B TP4"),
    ThroughputCase(LLAMA3_70B, 8, 128, 2048, 7554.2141, TRTLLM_014 + " LLaMA v3 70B TP8"),
)


def _bulk_per_gpu(pm: PerfModel, case: ThroughputCase) -> tuple[float, int]:
    """Modelled output tokens/s per GPU at the KV-capacity batch (what trtllm-bench runs)."""
    final = case.input_tokens + case.output_tokens
    batch = pm.kv_capacity_tokens(case.tp) // final
    mean_context = case.input_tokens + case.output_tokens / 2
    return pm.decode_tokens_per_s(case.tp, batch, mean_context) / case.tp, batch


def test_bulk_throughput_per_gpu_tp1_within_15_percent() -> None:
    case = BULK_THROUGHPUT[0]
    pm = PerfModel(case.model, H100)
    modelled, batch = _bulk_per_gpu(pm, case)
    error = modelled / case.measured_per_gpu - 1.0
    assert abs(error) <= 0.15, (
        f"{case.model.name} TP{case.tp} batch {batch}: model {modelled:.0f} tok/s/GPU vs "
        f"{case.measured_per_gpu:.0f} ({error:+.1%}); source: {case.source}"
    )


@pytest.mark.xfail(
    strict=True,
    reason=(
        "known miss: at the KV-capacity batch (~190 at TP4, ~580 at TP8) the model is "
        "1.4x (TP4) and 2.2x (TP8) faster per GPU than TensorRT-LLM 0.14's FP16 Llama-3-70B "
        "on H100; it matches only at ~130 sequences per instance. At stated batches it is "
        "1.17-1.22x fast too (below), so part of the miss is the model's decode, not the "
        "inferred batch. Not fixed (issue 15); the simulator keeps max_num_seqs at 256"
    ),
)
@pytest.mark.parametrize("case", BULK_THROUGHPUT[1:], ids=lambda c: f"{c.model.name}-tp{c.tp}")
def test_bulk_throughput_per_gpu_large_tp_within_15_percent(case: ThroughputCase) -> None:
    pm = PerfModel(case.model, H100)
    modelled, batch = _bulk_per_gpu(pm, case)
    error = modelled / case.measured_per_gpu - 1.0
    assert abs(error) <= 0.15, (
        f"{case.model.name} TP{case.tp} batch {batch}: model {modelled:.0f} tok/s/GPU vs "
        f"{case.measured_per_gpu:.0f} ({error:+.1%}); source: {case.source}"
    )


TRTLLM_PERF = "https://github.com/NVIDIA/TensorRT-LLM/blob/{}/docs/source/performance.md"
# shapes from the ckpt_config.json printed in TensorRT-LLM v0.8.0's performance.md (the
# Hugging Face config.json values: layers, hidden, heads, KV heads, FFN, vocab)
LLAMA2_7B = ModelShape("Llama-2-7B", 32, 4096, 32, 32, 11008, 32000, qkv_bias=False)
LLAMA2_70B = ModelShape("Llama-2-70B", 80, 8192, 64, 8, 28672, 32000, qkv_bias=False)
MISTRAL_7B = ModelShape("Mistral-7B", 32, 4096, 32, 8, 14336, 32000, qkv_bias=False)


@dataclass(frozen=True)
class StatedBatchCase:
    model: ModelShape
    tp: int
    batch: int
    input_tokens: int
    output_tokens: int
    measured_per_gpu: float  # output tokens/s per GPU, as printed
    source: str


# model, TP, batch, ISL, OSL, printed tok/s/GPU, release, row; known misses: the model's
# throughput over the measured one
STATED_BATCH_ROWS: tuple[tuple[ModelShape, int, int, int, int, float, str, str, float], ...] = (
    (LLAMA2_7B, 1, 32, 128, 2048, 1484, "v0.9.0", "A100 LLaMA 7B b32", 0.0),
    (LLAMA2_7B, 1, 32, 128, 2048, 1518, "v0.8.0", "A100 LLaMA 7B b32", 0.0),
    (LLAMA2_7B, 2, 64, 2048, 2048, 782, "v0.6.1", "A100 LLaMA 7B TP2", 1.18),
    (LLAMA2_70B, 4, 128, 128, 2048, 595, "v0.8.0", "A100 LLaMA 70B TP4", 1.17),
    (LLAMA2_70B, 8, 512, 128, 2048, 684, "v0.9.0", "A100 LLaMA 70B TP8", 1.22),
    # grouped-query attention, 4 query heads per KV head
    (MISTRAL_7B, 1, 120, 128, 2048, 3776, "v0.9.0", "A100 Mistral 7B b120", 1.66),
)
STATED_BATCH = [
    pytest.param(
        StatedBatchCase(m, tp, b, isl, osl, meas, TRTLLM_PERF.format(tag) + " " + row),
        marks=[pytest.mark.xfail(strict=True, reason=f"known miss: model {miss}x")] if miss else [],
        id=f"{m.name}-tp{tp}-b{b}-{tag}",
    )
    for m, tp, b, isl, osl, meas, tag, row, miss in STATED_BATCH_ROWS
]


@pytest.mark.parametrize("case", STATED_BATCH)
def test_bulk_throughput_per_gpu_at_a_stated_batch_within_15_percent(
    case: StatedBatchCase,
) -> None:
    pm = PerfModel(case.model, A100)
    # the stated batch fits the model's KV cache: it runs as printed
    assert case.batch * (case.input_tokens + case.output_tokens) <= pm.kv_capacity_tokens(case.tp)
    mean_context = case.input_tokens + case.output_tokens / 2
    modelled = pm.decode_tokens_per_s(case.tp, case.batch, mean_context) / case.tp
    error = modelled / case.measured_per_gpu - 1.0
    assert abs(error) <= 0.15, (
        f"{case.model.name} TP{case.tp} batch {case.batch} on A100: model {modelled:.0f} "
        f"tok/s/GPU vs {case.measured_per_gpu:.0f} ({error:+.1%}); source: {case.source}"
    )


def test_max_num_seqs_is_explicit_per_tp() -> None:
    from dataclasses import replace

    from scheduler.perf_model import Efficiency

    pm = PerfModel(LLAMA3_70B, H100)
    assert {t: pm.max_num_seqs(t) for t in (1, 2, 4, 8)} == {1: 256, 2: 256, 4: 256, 8: 256}
    tuned = replace(pm, efficiency=Efficiency(max_num_seqs_by_tp=((8, 128),)))
    assert tuned.max_num_seqs(8) == 128 and tuned.max_num_seqs(4) == 256
    # the batch an instance runs: the engine cap or the KV cache, whichever is fewer
    assert tuned.batch_limit(8, 2176) == 128
    assert tuned.batch_limit(4, 2176) == tuned.kv_capacity_tokens(4) // 2176 < 256
