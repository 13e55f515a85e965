"""The performance model shared by the compute planner and the simulator.

Pure arithmetic over frozen data. Every constant lives in this module with its public
source next to it; nothing here is fitted to make a planner result come out a certain
way. A user with GPUs replaces the defaults with a measured profile
(:meth:`PerfModel.calibrated`).

Decode iteration of an instance with tensor-parallel degree ``t`` and batch ``b``::

    gpu  = max(compute, memory) + per-kernel fixed costs + TP all-reduces
    time = max(gpu, host per-sequence work * b) + exposed engine overhead

    compute  = FLOPs / (t * peak * gemm_efficiency(shapes of the shard))
    memory   = (weights / t + KV of the batch / min(t, kv_heads)) / (HBM bandwidth * hbm_efficiency)
    kernels  = layers * kernels_per_layer * kernel_fixed_s          # TP does not shrink these
    allreduce= 2 * layers * (alpha(t) + 2 (t-1)/t * b * hidden * 2 B / (NVLink * link_efficiency))
    host     = scheduling, input preparation, sampling and output processing per sequence;
               modern engines overlap it with the GPU, so it binds only when larger
    overhead = engine host time per step that is not hidden behind the GPU

The terms beyond pure roofline are what make small TP win on throughput and large TP
win on per-token latency (see DESIGN.md, "Performance model"):

- ``gemm_efficiency`` falls as shards get narrow: tile and wave quantisation of the
  GEMMs (NVIDIA, "Matrix Multiplication Background User's Guide", sections on tile and
  wave quantization) computed from the actual per-shard shapes;
- per-kernel fixed costs that TP does not shrink (``kernel_fixed_s``);
- all-reduce latency that grows with TP (``alpha``) and bandwidth cost that grows with
  the batch;
- host work per sequence, which grows with the batch of one instance and not with TP;
- the KV-cache capacity per instance, which limits the batch a small-TP instance can hold.

MoE decode (``model.experts`` > 0; Qwen3-235B-A22B, Qwen3-30B-A3B). An instance of ``n``
GPUs is one node (``n`` dividing its GPUs) or ``N = n / g`` whole nodes of ``g`` GPUs:
attention tensor-parallel over each node's ``t = min(n, g)`` GPUs and data-parallel across
its nodes (each node holds ``b / N`` of the sequences and their KV); the ``E`` experts
split evenly over all ``n`` GPUs (expert parallelism, ``n`` divides ``E``). Per iteration::

    touched  = E (1 - (1 - k/E)^b)          # expected distinct experts per layer, top-k
    compute  = b (2 active params + attention FLOPs) / (n * peak * gemm_efficiency)
    memory   = ((attention + router + LM head) / t + layers * touched * expert / n
                + norms) * bytes + b/N * ctx * KV per token / min(t, kv_heads)
               all / (HBM bandwidth * hbm_efficiency)
    kernels  = layers * (kernels_per_layer - 3 + moe_kernels_per_layer + q/k norms) * fixed
    allreduce= 2 * layers * allreduce(t, b/N * hidden * 2 B)   # NVLink: attention, and the
               # sum of the node's experts (tokens are replicated in the node: no dispatch)
    network  = layers * 2 * (latency + (b/n) k hidden 2 B (N-1)/N / (bw * network_eff))
               # dispatch + combine across nodes over each GPU's NIC (0 when N = 1)
    time     = max(max(compute, memory) + kernels + allreduce + network, host) + overhead

``bw`` is the NIC (or what a fabric gives each GPU; the simulator passes it) and the
latency and efficiency are the dense model's network ones. Stated simplifications: the
expert reads are the mean over GPUs (the most loaded GPU reads more), routing is uniform,
a token sent to several experts of one node is sent once per expert (no de-duplication),
the expert GEMMs get ``gemm_efficiency`` without shape quantisation, the embedding rows
read are ignored, and nothing overlaps the dispatch/combine with compute.

Units: seconds, bytes, FLOP, bytes per second. Token counts are plain ints.
"""

from __future__ import annotations

import bisect
import functools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property

from orchestrrl import errors

GB = 1e9
GIB = 1024.0**3
# Host-to-device copy rate of a Hopper GPU on PCIe Gen5 x16: nvbandwidth's
# host_to_device_memcpy_sm measured 35.0-35.4 GB/s per GPU on an H100 cluster, and a
# second user reports the same on H20 and H800 (NVIDIA/nvbandwidth#24)
H2D_HOPPER = 35.0e9

# --------------------------------------------------------------------------------------
# Hardware (data, with sources)
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Hardware:
    """One GPU type and the node it comes in. Bandwidths are per GPU, per direction."""

    name: str
    peak_flops: float  # dense BF16 FLOP/s
    hbm_bytes: float
    hbm_bandwidth: float  # B/s
    nvlink_bandwidth: float  # B/s per direction per GPU
    sms: int  # streaming multiprocessors (for wave quantisation)
    gpus_per_node: int
    nic_bandwidth: float  # B/s per NIC (one NIC per GPU on these nodes)
    hbm_efficiency: float  # achievable fraction of hbm_bandwidth for streaming reads
    # host memory -> GPU copy rate (B/s per GPU): how fast an engine loads new weights
    # from a relay copy in its host's memory (0: unknown)
    h2d_bandwidth: float = 0.0
    # the achievable fraction of peak_flops of a large BF16 GEMM measured on this GPU
    # (0: the engine's Efficiency.gemm_efficiency, an H100 measurement)
    gemm_efficiency: float = 0.0
    source: str = field(default="", compare=False)


H800 = Hardware(
    name="H800-SXM",
    peak_flops=989e12,
    hbm_bytes=80 * GB,
    hbm_bandwidth=3.35e12,
    # NVLink 400 GB/s per GPU (bidirectional), i.e. 200 GB/s each way.
    nvlink_bandwidth=200e9,
    sms=132,
    gpus_per_node=8,
    nic_bandwidth=400e9 / 8,
    hbm_efficiency=6.081 / 8.0,
    h2d_bandwidth=H2D_HOPPER,
    source=(
        "MISSION.md (989 TFLOP/s dense BF16, 80 GB HBM3 at 3.35 TB/s, NVLink 400 GB/s, "
        "8 x 400 Gb/s NICs); FlashMLA deep-dive (deepseek-ai/FlashMLA#75: H800 SXM5 "
        "3.35 TB/s, 990 TFLOP/s dense); 132 SMs as H100 SXM5 (same GH100 die). "
        "hbm_efficiency: no public measured H800/H100 streaming ceiling found; taken from "
        "a measured 6.081 TB/s streaming-read ceiling on an 8 TB/s GB200 "
        "(public decode-roofline harness, see module notes) - calibrate with a profile"
    ),
)

H100 = Hardware(
    name="H100-SXM",
    peak_flops=989.5e12,
    hbm_bytes=80 * GB,
    hbm_bandwidth=3.35e12,
    nvlink_bandwidth=450e9,
    sms=132,
    gpus_per_node=8,
    nic_bandwidth=400e9 / 8,
    hbm_efficiency=6.081 / 8.0,
    h2d_bandwidth=H2D_HOPPER,
    source=(
        "NVIDIA H100 SXM datasheet as quoted in meta-pytorch/tritonbench#78 (989.5 TFLOP/s "
        "BF16 dense, 80 GB, 3.35 TB/s); NVLink4 900 GB/s bidirectional = 450 GB/s each way "
        "(NVIDIA/nccl#1264); DGX H100: 8 x 400 Gb/s ConnectX-7; hbm_efficiency as H800"
    ),
)

A100 = Hardware(
    name="A100-SXM-80GB",
    peak_flops=312e12,
    hbm_bytes=80 * GB,
    hbm_bandwidth=2.039e12,
    nvlink_bandwidth=300e9,
    sms=108,
    gpus_per_node=8,
    nic_bandwidth=200e9 / 8,
    hbm_efficiency=1355.0 / 1555.0,
    h2d_bandwidth=25.13e9,
    source=(
        "NVIDIA A100 datasheet (312 TFLOP/s BF16 dense, 80 GB HBM2e at 2.039 TB/s, NVLink3 "
        "600 GB/s bidirectional, 108 SMs); DGX A100: 8 x 200 Gb/s HDR NICs; hbm_efficiency: "
        "measured memcopy 1355 GB/s vs 1555 GB/s datasheet on A100 "
        "(PTsolvers/gpu-workshop-JuliaCon23#7); h2d_bandwidth: nvbandwidth "
        "host_to_device_memcpy_sm 25.13 GB/s on an A100-SXM4 (NVIDIA/nvbandwidth#42)"
    ),
)

H20 = Hardware(
    name="H20",
    peak_flops=148e12,
    hbm_bytes=96 * GB,
    hbm_bandwidth=4.0e12,
    # NVLink 900 GB/s bidirectional on the H20, 450 GB/s each way
    nvlink_bandwidth=450e9,
    sms=78,
    gpus_per_node=8,
    nic_bandwidth=400e9 / 8,
    hbm_efficiency=6.081 / 8.0,
    h2d_bandwidth=H2D_HOPPER,
    gemm_efficiency=142.25 / 148.0,
    source=(
        "Hugging Face hardware page huggingface.co/hardware/h20 (148 TFLOP/s BF16 dense, "
        "96 GB, 400 W); 96 GB HBM3 at 4.0 TB/s (unanswered.io, 'NVIDIA H20 HBM memory'); "
        "NVLink 900 GB/s bidirectional, 450 GB/s one way (deepseek-ai/DeepEP#16: 'The H20 "
        "NVLink's bi-directional bandwidth is 900 GB/s'); 78 SMs (SGLang/DeepEP H20 "
        "settings: num_sms lowered 'because H20 has 78 SMs'); gemm_efficiency: a measured "
        "BF16 10240^3 matmul at 142.25 TFLOP/s on an H20 (zzc0721/torch-performance-test-"
        "data#77); NICs: 8 x 400 Gb/s as the HGX H100 board the H20 shares (an assumption: "
        "verl's README does not state its network); hbm_efficiency and h2d_bandwidth as H800 "
        "(NVIDIA/nvbandwidth#24 reports the same host-to-device figures on H20 and H800)"
    ),
)

HARDWARE: dict[str, Hardware] = {h.name: h for h in (H800, H100, A100, H20)}


# --------------------------------------------------------------------------------------
# Models (data, with sources)
# --------------------------------------------------------------------------------------


def check_experts(experts: int, active_experts: int, expert_ffn: int) -> None:
    """The MoE settings of a model with ``experts`` >= 1: each token uses 1..experts of
    them, each an MLP of width ``expert_ffn`` >= 1; errors name the ``model.`` field."""
    if not 1 <= active_experts <= experts:
        raise errors.field_error("model.active_experts", active_experts, f"1..experts ({experts})")
    if expert_ffn < 1:
        raise errors.field_error("model.expert_ffn", expert_ffn, "an integer >= 1")


@dataclass(frozen=True)
class ModelShape:
    """A dense decoder-only transformer (Llama/Qwen2 family: GQA attention, SwiGLU MLP)."""

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    head_dim: int = 0  # 0: hidden // heads
    tied_embeddings: bool = False
    qkv_bias: bool = True
    dtype_bytes: int = 2  # BF16 weights
    kv_dtype_bytes: int = 2  # BF16 KV cache
    # mixture of experts (0: dense): every block's MLP is ``experts`` SwiGLU experts of
    # width ``expert_ffn`` plus a router, of which each token uses ``active_experts``
    experts: int = 0
    active_experts: int = 0
    expert_ffn: int = 0
    qk_norm: bool = False  # per-head q/k RMSNorm (Qwen3)
    source: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        for name in ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise errors.field_error(f"model.{name}", value, "a positive integer")
        if self.experts < 0:
            raise errors.field_error("model.experts", self.experts, "0 (dense) or >= 1")
        if self.experts:
            check_experts(self.experts, self.active_experts, self.expert_ffn)
        if self.heads % self.kv_heads:
            raise errors.field_error(
                "model.kv_heads", self.kv_heads, f"a divisor of heads ({self.heads})"
            )
        if self.head_dim == 0:
            if self.hidden % self.heads:
                raise errors.field_error(
                    "model.heads", self.heads, f"a divisor of hidden ({self.hidden})"
                )
            object.__setattr__(self, "head_dim", self.hidden // self.heads)

    # -- parameter counts --

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    @cached_property
    def layer_params(self) -> int:
        """Parameters of one transformer block (attention, MLP, norms, QKV bias)."""
        if self.moe:
            return (
                self.attn_params
                + self.experts * self.expert_params
                + self.router_params
                + (2 * self.hidden)
            )
        attn = self.hidden * (self.q_dim + 2 * self.kv_dim) + self.q_dim * self.hidden
        bias = (self.q_dim + 2 * self.kv_dim) if self.qkv_bias else 0
        mlp = 3 * self.hidden * self.ffn
        return attn + bias + mlp + 2 * self.hidden

    # -- mixture of experts --

    @property
    def moe(self) -> bool:
        return self.experts > 0

    @property
    def attn_params(self) -> int:
        """Attention of one block: projections, QKV bias, per-head q/k norms."""
        proj = self.hidden * (self.q_dim + 2 * self.kv_dim) + self.q_dim * self.hidden
        bias = (self.q_dim + 2 * self.kv_dim) if self.qkv_bias else 0
        norm = 2 * self.head_dim if self.qk_norm else 0
        return proj + bias + norm

    @property
    def expert_params(self) -> int:
        """One SwiGLU expert of one block (0 for a dense model)."""
        return 3 * self.hidden * self.expert_ffn if self.moe else 0

    @property
    def all_expert_params(self) -> int:
        """Every expert of every block (sharded by expert parallelism; 0 if dense)."""
        return self.layers * self.experts * self.expert_params

    @property
    def dense_params(self) -> int:
        """Everything but the experts (replicated across expert-parallel ranks)."""
        return self.params - self.all_expert_params

    @property
    def router_params(self) -> int:
        return self.hidden * self.experts

    @cached_property
    def active_params(self) -> int:
        """Parameters a token's FLOPs count: all but the experts it does not use
        (embeddings included, as the dense 6 x params x tokens; = params if dense)."""
        unused = self.layers * (self.experts - self.active_experts) * self.expert_params
        return self.params - unused

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def lm_head_params(self) -> int:
        return 0 if self.tied_embeddings else self.vocab * self.hidden

    @cached_property
    def params(self) -> int:
        return (
            self.layers * self.layer_params
            + self.embedding_params
            + self.lm_head_params
            + self.hidden  # final norm
        )

    @property
    def weight_bytes(self) -> float:
        return float(self.params * self.dtype_bytes)

    @cached_property
    def kv_bytes_per_token(self) -> float:
        """K and V of every layer for one token (all KV heads)."""
        return float(2 * self.layers * self.kv_dim * self.kv_dtype_bytes)


def model_from_config(
    name: str,
    *,
    layers: int,
    hidden: int,
    heads: int,
    kv_heads: int,
    ffn: int,
    vocab: int,
    head_dim: int = 0,
    tied_embeddings: bool = False,
    qkv_bias: bool = True,
) -> ModelShape:
    """A model given by its shape (for example from a Hugging Face ``config.json``)."""
    return ModelShape(
        name,
        layers,
        hidden,
        heads,
        kv_heads,
        ffn,
        vocab,
        head_dim,
        tied_embeddings,
        qkv_bias,
        source="user-supplied shape",
    )


_QWEN_SOURCE = (
    "MISSION.md facts; Hugging Face config.json of Qwen/{name} (num_hidden_layers, "
    "hidden_size, num_attention_heads, num_key_value_heads, intermediate_size, vocab_size, "
    "tie_word_embeddings=false)"
)
QWEN25_14B = ModelShape(
    "Qwen2.5-14B", 48, 5120, 40, 8, 13824, 152064, source=_QWEN_SOURCE.format(name="Qwen2.5-14B")
)
QWEN25_32B = ModelShape(
    "Qwen2.5-32B", 64, 5120, 40, 8, 27648, 152064, source=_QWEN_SOURCE.format(name="Qwen2.5-32B")
)
QWEN25_72B = ModelShape(
    "Qwen2.5-72B", 80, 8192, 64, 8, 29568, 152064, source=_QWEN_SOURCE.format(name="Qwen2.5-72B")
)
# Qwen2.5-Math-7B is built on Qwen2.5-7B (its model card: base_model Qwen/Qwen2.5-7B): 28
# layers, hidden 3584, 28 heads, 4 KV heads (k/v projections 512 x 3584), FFN 18944, vocab
# 152064, untied; verl's fully-async recipe raises max_position_embeddings to 32768
QWEN25_MATH_7B = ModelShape(
    "Qwen2.5-Math-7B",
    28,
    3584,
    28,
    4,
    18944,
    152064,
    source=_QWEN_SOURCE.format(name="Qwen2.5-Math-7B"),
)

# Llama 3 (the models of the public H100 measurements the calibration tests hold this
# model to): no QKV bias, untied embeddings, vocab 128256, GQA with 8 KV heads.
_LLAMA_SOURCE = (
    "Hugging Face config.json of meta-llama/{name} (num_hidden_layers, hidden_size, "
    "num_attention_heads, num_key_value_heads, intermediate_size, vocab_size, "
    "tie_word_embeddings=false, attention_bias=false); Meta's model card: 8.03B / 70.6B"
)
LLAMA3_8B = ModelShape(
    "Llama-3-8B",
    32,
    4096,
    32,
    8,
    14336,
    128256,
    qkv_bias=False,
    source=_LLAMA_SOURCE.format(name="Meta-Llama-3-8B-Instruct"),
)
LLAMA3_70B = ModelShape(
    "Llama-3-70B",
    80,
    8192,
    64,
    8,
    28672,
    128256,
    qkv_bias=False,
    source=_LLAMA_SOURCE.format(name="Meta-Llama-3-70B-Instruct"),
)

# Qwen3 MoE: every layer MoE, no shared expert, no QKV bias, per-head q/k RMSNorm.
# Hugging Face Qwen/Qwen3-235B-A22B config.json: num_hidden_layers 94, hidden_size 4096,
# num_attention_heads 64, num_key_value_heads 4, head_dim 128, num_experts 128,
# num_experts_per_tok 8, moe_intermediate_size 1536, intermediate_size 12288 (unused:
# decoder_sparse_step 1, no mlp_only_layers), vocab_size 151936, tie_word_embeddings
# false. Qwen/Qwen3-30B-A3B: 48 layers, hidden 2048, 32 heads, 4 KV heads, head_dim 128,
# 128 experts, 8 per token, moe_intermediate_size 768, intermediate_size 6144.
_QWEN3_MOE_SOURCE = "Hugging Face config.json of Qwen/{name} (values quoted above)"
QWEN3_235B_A22B = ModelShape(
    "Qwen3-235B-A22B",
    94,
    4096,
    64,
    4,
    12288,
    151936,
    head_dim=128,
    qkv_bias=False,
    experts=128,
    active_experts=8,
    expert_ffn=1536,
    qk_norm=True,
    source=_QWEN3_MOE_SOURCE.format(name="Qwen3-235B-A22B"),
)
QWEN3_30B_A3B = ModelShape(
    "Qwen3-30B-A3B",
    48,
    2048,
    32,
    4,
    6144,
    151936,
    head_dim=128,
    qkv_bias=False,
    experts=128,
    active_experts=8,
    expert_ffn=768,
    qk_norm=True,
    source=_QWEN3_MOE_SOURCE.format(name="Qwen3-30B-A3B"),
)

MODELS: dict[str, ModelShape] = {
    m.name: m
    for m in (
        QWEN25_14B,
        QWEN25_32B,
        QWEN25_72B,
        QWEN25_MATH_7B,
        LLAMA3_8B,
        LLAMA3_70B,
        QWEN3_235B_A22B,
        QWEN3_30B_A3B,
    )
}


# --------------------------------------------------------------------------------------
# Software efficiency terms (data, with sources)
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Efficiency:
    """What a vLLM/SGLang-class engine achieves beyond pure roofline.

    Every default is a public measurement; see ``SOURCES`` for the citation of each.
    """

    gemm_efficiency: float = 518.6 / 989.5
    tile_m: int = 64
    tile_n: int = 128
    kernel_fixed_s: float = 2.0e-6
    kernels_per_layer: int = 9
    allreduce_base_s: float = 4.5e-6
    allreduce_per_peer_s: float = 1.5e-6
    link_efficiency: float = 0.8
    network_efficiency: float = 0.8
    network_latency_s: float = 30e-6
    iteration_overhead_s: float = 0.25e-3
    tp_iteration_overhead_s: float = 0.6e-3
    host_per_sequence_s: float = 12.7e-6
    gpu_memory_utilization: float = 0.9
    activation_reserve_bytes: float = 2.38 * GIB
    training_mfu: float = 0.52
    reshard_fixed_s: float = 2.0
    # the engine's cap on concurrently running sequences per instance: the default and
    # per-TP overrides ((tp, cap), ...); see PerfModel.max_num_seqs
    max_num_seqs: int = 256
    max_num_seqs_by_tp: tuple[tuple[int, int], ...] = ()
    moe_kernels_per_layer: int = 7

    def __post_init__(self) -> None:
        for name in (
            "gemm_efficiency",
            "link_efficiency",
            "network_efficiency",
            "gpu_memory_utilization",
            "training_mfu",
        ):
            value = getattr(self, name)
            if not 0.0 < value <= 1.0:
                raise errors.field_error(f"efficiency.{name}", value, "a fraction in (0, 1]")
        for name in (
            "kernel_fixed_s",
            "allreduce_base_s",
            "allreduce_per_peer_s",
            "network_latency_s",
            "iteration_overhead_s",
            "tp_iteration_overhead_s",
            "host_per_sequence_s",
            "activation_reserve_bytes",
            "reshard_fixed_s",
        ):
            value = getattr(self, name)
            if value < 0:
                raise errors.field_error(f"efficiency.{name}", value, "a number >= 0")
        if not isinstance(self.moe_kernels_per_layer, int) or self.moe_kernels_per_layer < 1:
            raise errors.field_error(
                "efficiency.moe_kernels_per_layer", self.moe_kernels_per_layer, ">= 1"
            )
        if not isinstance(self.max_num_seqs, int) or self.max_num_seqs < 1:
            raise errors.field_error("efficiency.max_num_seqs", self.max_num_seqs, ">= 1")
        for pair in self.max_num_seqs_by_tp:
            tp, cap = pair
            if not (isinstance(tp, int) and isinstance(cap, int) and tp >= 1 and cap >= 1):
                raise errors.field_error(
                    "efficiency.max_num_seqs_by_tp", pair, "(tp, cap) with tp >= 1 and cap >= 1"
                )


SOURCES: dict[str, str] = {
    "gemm_efficiency": (
        "cuBLAS BF16 8192^3 GEMM measured at 518.6 TFLOP/s on H100 (pranjalssh/fast.cu#13), "
        "i.e. 0.52 of the 989.5 TFLOP/s dense peak"
    ),
    "tile_m/tile_n": (
        "64-row (one Hopper WGMMA) by 128-column CTA tiles; tile and wave quantisation per "
        "NVIDIA 'Matrix Multiplication Background User's Guide'; GEMMs with fewer tiles than "
        "SMs are assumed to split K and fill the GPU"
    ),
    "kernel_fixed_s": (
        "minimum duration of a tiny cuBLAS GEMM 2.9-4.1 us (JuliaGPU/GemmKernels.jl#169 "
        "baseline column) and ~0.6 us per node of a replayed CUDA graph "
        "(ahrefs/ocannl#488): 2 us per kernel that TP does not shrink"
    ),
    "kernels_per_layer": (
        "vLLM Qwen2 decoder layer: fused add+RMSNorm x2, QKV GEMM, rotary, attention with "
        "KV write, O GEMM, gate_up GEMM, SiLU-and-mul, down GEMM (collectives counted apart)"
    ),
    "allreduce_base_s/allreduce_per_peer_s": (
        "NVLS all-reduce ~6 us on 2 H100 with CUDA graphs (NVIDIA/nccl#1259); one-shot "
        "intra-node all-reduce 6-15 us on 8 H100 (pytorch/pytorch#131739, PR #114001): "
        "alpha(t) = 4.5 us + 1.5 us * (t - 1) gives 6 us at t=2 and 15 us at t=8"
    ),
    "link_efficiency": (
        "NCCL protocol overhead ~20%: 370 of 450 GB/s effective on NVLink4 "
        "(sjeaugey in NVIDIA/nccl-tests#212); p2p 376-380 of 450 GB/s (NVIDIA/nccl#1264)"
    ),
    "network_efficiency": "assumed equal to the NCCL protocol overhead on NVLink (20%)",
    "network_latency_s": (
        "8-byte all_reduce between two 8-GPU nodes measured at ~30 us "
        "(sjeaugey's all_reduce_perf output in NVIDIA/nccl#757)"
    ),
    "iteration_overhead_s": (
        "vLLM v0.6.0 blog (2024-09-05): before its fixes only 38% of a Llama-3-8B step on "
        "one H100 was GPU work; after them Lambda measured GPU power at ~95% "
        "(LambdaLabsML/vllm-benchmark); vLLM V1 blog: ~5 ms GPU time per step for Llama-8B. "
        "~5% of a 5 ms step = 0.25 ms of exposed host time per iteration"
    ),
    "tp_iteration_overhead_s": (
        "host time per decode step that only a TP group pays (the driver serialises the "
        "step's inputs and broadcasts them to the other TP workers, which then launch; "
        "vllm-project/vllm#4440, #5399: shared-memory broadcast alone gave Llama-2-7B TP8 "
        "on H100 +3.5% throughput). No direct public measurement found: inferred from "
        "Lambda's vLLM v0.6.0 Llama-3-8B H100 runs (LambdaLabsML/vllm-benchmark, "
        "results/prompt_10, median TPOT 7.56/5.26/3.88/3.26 ms at TP1/2/4/8): after the "
        "GPU terms TP1 is matched within 6% while TP2/4/8 leave 0.80/0.84/0.64 ms per step; "
        "0.6 ms is the smallest of those, rounded down. Llama-3-70B (TP2/4/8) is the "
        "independent check (tests/unit/test_perf_model_calibration.py)"
    ),
    "moe_kernels_per_layer": (
        "vLLM's fused-MoE path replaces the dense MLP's 3 kernels (gate_up GEMM, "
        "SiLU-and-mul, down GEMM) by 7: router GEMM, topk_softmax, moe_align_block_size, "
        "fused_moe (w13), silu_and_mul, fused_moe (w2), moe_sum "
        "(vllm/model_executor/layers/fused_moe/fused_moe.py); Qwen3's q/k RMSNorm adds 2"
    ),
    "max_num_seqs/max_num_seqs_by_tp": (
        "vLLM's default EngineArgs.max_num_seqs = 256 (also Lambda's benchmark setting, "
        "LambdaLabsML/vllm-benchmark benchmark_v0.md); per-TP overrides in "
        "max_num_seqs_by_tp. Bulk throughput per GPU depends on it: the simulator's result "
        "swings with it (issue 15)"
    ),
    "host_per_sequence_s": (
        "vLLM 0.27.1 all-decode scheduler cost 12.7 us per running request at the cap "
        "(openfabric-systems/simllm#204, profiled engine loop); older vLLM spent ~20 ms per "
        "step at batch 200 on sampling, input preparation, output processing and scheduling "
        "together (vllm-project/vllm#6801), i.e. ~100 us per sequence, before async output "
        "processing and multi-step scheduling overlapped it with the GPU (vllm#6854)"
    ),
    "gpu_memory_utilization/activation_reserve_bytes": (
        "vLLM default gpu_memory_utilization=0.9 and an activation peak of 2.38 GiB in a "
        "vLLM startup log (kubernetes-sigs/gateway-api-inference-extension#550)"
    ),
    "training_mfu": (
        "Megatron-LM (Narayanan et al. 2021, arXiv 2104.04473): 163 TFLOP/s per A100, 52% of peak"
    ),
    "reshard_fixed_s": (
        "re-capturing decode CUDA graphs after a layout change: ~35 shapes at 0.05 s each "
        "(vllm-project/vllm#23184 logs), plus communicator setup: ~2 s per reshard"
    ),
    "tp_vs_dp": (
        "Lambda's vLLM benchmark (LambdaLabsML/vllm-benchmark, benchmark_v0.md): data "
        "parallelism outperforms tensor parallelism on throughput when the model fits; "
        "e.g. Mistral-7B on H100: 3281 tok/s at TP1 vs 4397 tok/s at TP8 (320 prompts). "
        "Measured on vLLM v0.5.4: its TPOT (27.2 ms at TP1, 21.6 ms at TP8, ~90 requests "
        "in flight) exceeds this model's GPU time for that batch (11-16 ms, 3.3-3.9 ms at "
        "1-2k tokens of context) by 11-18 ms of host time per step at both TPs, which "
        "v0.5.4 did not overlap (38% of a step was GPU work, vLLM v0.6.0 blog). That host "
        "time, not GPU efficiency, makes the measured per-GPU advantage of TP1 6x; this "
        "model's defaults describe the overlapped engine (iteration_overhead_s), where the "
        "advantage at equal batch is smaller (2.3x for Qwen2.5-14B on H800 at batch 256)"
    ),
}


# --------------------------------------------------------------------------------------
# Calibration profile
# --------------------------------------------------------------------------------------


@dataclass(frozen=True, order=True)
class ProfilePoint:
    """One measured decode iteration: TP degree, batch, mean context tokens, seconds."""

    tp: int
    batch: int
    context_tokens: int
    seconds: float


@dataclass(frozen=True)
class DecodeBreakdown:
    compute_s: float
    memory_s: float
    kernels_s: float
    allreduce_s: float
    host_s: float
    overhead_s: float
    calibration: float = 1.0

    @property
    def gpu_s(self) -> float:
        return _gpu_s(self.compute_s, self.memory_s, self.kernels_s, self.allreduce_s)

    @property
    def total_s(self) -> float:
        return _total_s(self.gpu_s, self.host_s, self.overhead_s, self.calibration)


@dataclass(frozen=True)
class MoEDecodeBreakdown:
    """One decode iteration of a MoE instance (see the module doc, "MoE decode").
    ``allreduce_s``: the intra-node (NVLink) all-reduces; ``network_a2a_s``: the expert
    dispatch + combine over the scale-out network (0 on one node); ``experts_touched``:
    distinct experts per layer the batch routes to (expected value)."""

    compute_s: float
    memory_s: float
    kernels_s: float
    allreduce_s: float
    network_a2a_s: float
    host_s: float
    overhead_s: float
    experts_touched: float

    @property
    def gpu_s(self) -> float:
        return _gpu_s(self.compute_s, self.memory_s, self.kernels_s, self.allreduce_s) + (
            self.network_a2a_s
        )

    @property
    def total_s(self) -> float:
        return _total_s(self.gpu_s, self.host_s, self.overhead_s, 1.0)


def experts_touched(experts: int, active: int, tokens: float) -> float:
    """Expected distinct experts one layer routes a batch of ``tokens`` tokens to, each
    picking ``active`` of ``experts`` (uniform, independent tokens):
    ``E x (1 - (1 - k/E)^B)``: each expert is missed by a token with probability
    ``1 - k/E``."""
    if experts < 1 or not 1 <= active <= experts:
        raise errors.field_error("active", active, f"1..experts ({experts})")
    if tokens <= 0:
        return 0.0
    miss: float = (1.0 - active / experts) ** tokens
    return experts * (1.0 - miss)


def _gpu_s(compute: float, memory: float, kernels: float, allreduce: float) -> float:
    """The GPU's part of a decode iteration: the slower of compute and memory, then the
    kernel launches and the all-reduce."""
    return max(compute, memory) + kernels + allreduce


def _total_s(gpu: float, host: float, overhead: float, calibration: float) -> float:
    """A decode iteration: the GPU's part or the host's, whichever is longer, plus the
    fixed overhead, times the calibration."""
    return (max(gpu, host) + overhead) * calibration


# --------------------------------------------------------------------------------------
# The model
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PerfModel:
    """Performance of one model on one hardware type under one engine's efficiency."""

    model: ModelShape
    hardware: Hardware
    efficiency: Efficiency = Efficiency()
    profile: tuple[ProfilePoint, ...] = ()
    # gemm_shape_efficiency per (tp, tokens): a pure function of the fields above, asked
    # for the same few shapes again and again by the planners (not part of the value)
    _gemm_memo: dict[tuple[int, int], float] = field(
        default_factory=dict, init=False, repr=False, compare=False, hash=False
    )

    # -- sizes --

    def weight_bytes_per_shard(self, tp: int) -> float:
        """Weights one GPU of a TP group holds: layers and embeddings split, norms replicated
        (MoE: :meth:`moe_weight_bytes_per_gpu` of an instance of ``tp`` GPUs)."""
        self._check_tp(tp)
        m = self.model
        if m.moe:
            return self.moe_weight_bytes_per_gpu(tp)
        split = m.layers * (m.layer_params - 2 * m.hidden) + m.embedding_params + m.lm_head_params
        replicated = m.layers * 2 * m.hidden + m.hidden
        return (split / tp + replicated) * m.dtype_bytes

    def kv_bytes_per_token(self) -> float:
        return self.model.kv_bytes_per_token

    def kv_bytes_per_token_per_gpu(self, tp: int) -> float:
        """KV heads split across the group; beyond kv_heads they are replicated (MoE: the
        attention group is one node's part of the instance)."""
        if self.model.moe:
            tp = self.moe_instance(tp)[1]
        return self.model.kv_bytes_per_token / min(tp, self.model.kv_heads)

    def kv_capacity_tokens(self, tp: int) -> int:
        """Tokens of KV cache an instance of TP ``tp`` can hold (vLLM-style memory budget)."""
        e = self.efficiency
        budget = self.hardware.hbm_bytes * e.gpu_memory_utilization
        free = budget - self.weight_bytes_per_shard(tp) - e.activation_reserve_bytes
        if free <= 0:
            return 0
        nodes = self.moe_instance(tp)[0] if self.model.moe else 1  # attention DP over nodes
        return int(nodes * free / self.kv_bytes_per_token_per_gpu(tp))

    def max_num_seqs(self, tp: int) -> int:
        """The engine's cap on running sequences of one TP ``tp`` instance (the per-TP
        override, else the default; see ``Efficiency.max_num_seqs``)."""
        self._check_tp(tp)
        for t, cap in self.efficiency.max_num_seqs_by_tp:
            if t == tp:
                return cap
        return self.efficiency.max_num_seqs

    def batch_limit(self, tp: int, final_context_tokens: float) -> int:
        """Sequences a TP ``tp`` instance runs at once: ``max_num_seqs(tp)`` or as many
        as its KV cache holds at ``final_context_tokens`` each, whichever is fewer."""
        kv = int(self.kv_capacity_tokens(tp) / max(1.0, final_context_tokens))
        return max(0, min(self.max_num_seqs(tp), kv))

    def fits(self, tp: int) -> bool:
        return tp <= self.model.heads and self.kv_capacity_tokens(tp) > 0

    # -- decode --

    def decode_breakdown(self, tp: int, batch: int, context_tokens: float) -> DecodeBreakdown:
        """The terms of one decode iteration (``context_tokens``: mean per sequence)."""
        return DecodeBreakdown(*self._decode_terms(tp, batch, context_tokens))

    def _decode_terms(
        self, tp: int, batch: int, context_tokens: float
    ) -> tuple[float, float, float, float, float, float, float]:
        self._check_tp(tp)
        if batch <= 0:
            return 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0
        if self.model.moe:
            b = self.moe_decode_breakdown(tp, batch, context_tokens)
            comm = b.allreduce_s + b.network_a2a_s
            calibration = self._calibration(tp, batch)
            return b.compute_s, b.memory_s, b.kernels_s, comm, b.host_s, b.overhead_s, calibration
        m, h, e = self.model, self.hardware, self.efficiency
        ctx = max(0.0, float(context_tokens))
        dense = m.layers * (m.layer_params - 2 * m.hidden) + m.lm_head_params
        attn_flops = 4.0 * m.layers * m.q_dim * ctx  # QK^T and AV per token
        flops = batch * (2.0 * dense + attn_flops)
        compute = flops / (
            tp * h.peak_flops * e.gemm_efficiency * self.gemm_shape_efficiency(tp, batch)
        )
        weights = self.weight_bytes_per_shard(tp)
        kv = batch * ctx * self.kv_bytes_per_token_per_gpu(tp)
        memory = (weights + kv) / (h.hbm_bandwidth * h.hbm_efficiency)
        kernels = m.layers * e.kernels_per_layer * e.kernel_fixed_s
        allreduce = 2 * m.layers * self.allreduce_time(tp, batch * m.hidden * m.dtype_bytes)
        calibration = self._calibration(tp, batch)
        host = e.host_per_sequence_s * batch
        overhead = e.iteration_overhead_s + (e.tp_iteration_overhead_s if tp > 1 else 0.0)
        return compute, memory, kernels, allreduce, host, overhead, calibration

    def decode_iteration_time(self, tp: int, batch: int, context_tokens: float) -> float:
        """``decode_breakdown(...).total_s``, without building the breakdown."""
        compute, memory, kernels, allreduce, host, overhead, calibration = self._decode_terms(
            tp, batch, context_tokens
        )
        return _total_s(_gpu_s(compute, memory, kernels, allreduce), host, overhead, calibration)

    def decode_tokens_per_s(self, tp: int, batch: int, context_tokens: float) -> float:
        t = self.decode_iteration_time(tp, batch, context_tokens)
        return batch / t if t > 0 else 0.0

    # -- prefill --

    def prefill_time(self, tp: int, tokens: int, cached_tokens: int = 0) -> float:
        """Prefill of ``tokens`` new tokens (one chunk) after ``cached_tokens`` of context.

        Compute bound for any realistic chunk; the weights are still read once.
        """
        self._check_tp(tp)
        if tokens <= 0:
            return 0.0
        if self.model.moe:
            return self.moe_prefill_time(tp, tokens, cached_tokens)
        m, h, e = self.model, self.hardware, self.efficiency
        dense = m.layers * (m.layer_params - 2 * m.hidden)
        mean_ctx = cached_tokens + tokens / 2.0  # causal attention
        flops = tokens * (2.0 * dense + 4.0 * m.layers * m.q_dim * mean_ctx)
        flops += 2.0 * m.vocab * m.hidden  # logits of the last token only
        compute = flops / (
            tp * h.peak_flops * e.gemm_efficiency * self.gemm_shape_efficiency(tp, tokens)
        )
        memory = self.weight_bytes_per_shard(tp) / (h.hbm_bandwidth * h.hbm_efficiency)
        kernels = m.layers * e.kernels_per_layer * e.kernel_fixed_s
        allreduce = 2 * m.layers * self.allreduce_time(tp, tokens * m.hidden * m.dtype_bytes)
        return max(compute, memory) + kernels + allreduce + e.iteration_overhead_s

    def gemm_shape_efficiency(self, tp: int, tokens: int) -> float:
        """Tile x wave quantisation of the four GEMMs of a layer, FLOP-weighted.

        Column-parallel GEMMs (QKV, gate_up) get narrower output with TP; row-parallel
        ones (O, down) keep their width but fewer FLOPs per tile. ``tokens`` is M.
        """
        hit = self._gemm_memo.get((tp, tokens))
        if hit is not None:
            return hit
        m, e, h = self.model, self.efficiency, self.hardware
        shapes = (  # (N per shard, K per shard)
            ((m.q_dim + 2 * m.kv_dim) / tp, m.hidden),
            (m.hidden, m.q_dim / tp),
            (2 * m.ffn / tp, m.hidden),
            (m.hidden, m.ffn / tp),
        )
        total = 0.0
        weighted = 0.0
        for n, k in shapes:
            work = n * k
            total += work
            weighted += work * _quantisation(max(1, tokens), max(1.0, n), e.tile_m, e.tile_n, h.sms)
        if len(self._gemm_memo) > 4096:
            self._gemm_memo.clear()
        hit = self._gemm_memo[(tp, tokens)] = weighted / total
        return hit

    # -- mixture of experts (see the module doc, "MoE decode") --

    def moe_instance(self, gpus: int) -> tuple[int, int]:
        """(nodes, attention TP degree) of a MoE instance of ``gpus`` GPUs: one node
        (``gpus`` dividing the node's GPUs) or ``gpus / gpus_per_node`` whole nodes,
        attention tensor-parallel over each node's GPUs and data-parallel across nodes;
        experts split evenly over every GPU (``gpus`` must divide the experts)."""
        self._check_tp(gpus)
        m, g = self.model, self.hardware.gpus_per_node
        if not m.moe:
            raise errors.field_error("model", m.name, "a mixture-of-experts model")
        if (gpus <= g and g % gpus) or (gpus > g and gpus % g):
            raise errors.field_error(
                "gpus", gpus, f"a divisor of gpus_per_node ({g}) or a multiple of it"
            )
        if m.experts % gpus:
            raise errors.field_error(
                "gpus", gpus, f"a divisor of the experts ({m.experts}): expert parallelism"
            )
        return (1, gpus) if gpus <= g else (gpus // g, g)

    def moe_weight_bytes_per_gpu(self, gpus: int) -> float:
        """Weights one GPU of a MoE instance holds: its ``experts / gpus`` experts of
        every layer, and a ``1 / attention TP`` shard of the rest (attention, router,
        embeddings, LM head); norms replicated."""
        _, t_a = self.moe_instance(gpus)
        m = self.model
        experts = m.all_expert_params
        rest = m.layers * (m.attn_params + m.router_params) + m.embedding_params
        rest += m.lm_head_params
        replicated = m.layers * 2 * m.hidden + m.hidden
        return (experts / gpus + rest / t_a + replicated) * m.dtype_bytes

    def moe_a2a_network_bytes(self, gpus: int, tokens: float) -> float:
        """Bytes one GPU sends over its NIC in one layer's expert dispatch (the combine
        returns as many): its ``tokens / gpus`` tokens, each to ``active_experts``
        experts, ``hidden x dtype`` bytes each, of which the share ``(nodes - 1) / nodes``
        held on other nodes (uniform routing; no per-node de-duplication). 0 on one node."""
        nodes, _ = self.moe_instance(gpus)
        if nodes == 1:
            return 0.0
        m = self.model
        per_gpu = tokens / gpus * m.active_experts * m.hidden * m.dtype_bytes
        return per_gpu * (nodes - 1) / nodes

    def moe_a2a_time(
        self, gpus: int, tokens: float, network_bandwidth: float | None = None
    ) -> float:
        """Dispatch + combine of one layer over the scale-out network (0 on one node):
        ``2 x (network latency + bytes / (bandwidth x network efficiency))`` with
        :meth:`moe_a2a_network_bytes`; ``network_bandwidth`` (B/s per GPU) is what the
        fabric gives each GPU, None: its NIC."""
        nbytes = self.moe_a2a_network_bytes(gpus, tokens)
        if nbytes <= 0:
            return 0.0
        bw = self.hardware.nic_bandwidth if network_bandwidth is None else network_bandwidth
        return 2.0 * self.network_transfer_time(nbytes, bandwidth=bw)

    def moe_decode_breakdown(
        self,
        gpus: int,
        batch: int,
        context_tokens: float,
        network_bandwidth: float | None = None,
    ) -> MoEDecodeBreakdown:
        """The terms of one decode iteration of a MoE instance of ``gpus`` GPUs running
        ``batch`` sequences of ``context_tokens`` mean context (module doc, "MoE decode")."""
        nodes, t_a = self.moe_instance(gpus)
        if batch <= 0:
            return MoEDecodeBreakdown(0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
        m, h, e = self.model, self.hardware, self.efficiency
        ctx = max(0.0, float(context_tokens))
        dense = m.layers * (m.attn_params + m.router_params) + m.lm_head_params
        active = dense + m.layers * m.active_experts * m.expert_params
        flops = batch * (2.0 * active + 4.0 * m.layers * m.q_dim * ctx)
        compute = flops / (gpus * h.peak_flops * e.gemm_efficiency)
        touched = experts_touched(m.experts, m.active_experts, batch)
        weights = (dense / t_a + m.layers * touched * m.expert_params / gpus) * m.dtype_bytes + (
            m.layers * 2 * m.hidden + m.hidden
        ) * m.dtype_bytes
        kv = batch / nodes * ctx * m.kv_bytes_per_token / min(t_a, m.kv_heads)
        memory = (weights + kv) / (h.hbm_bandwidth * h.hbm_efficiency)
        per_layer = e.kernels_per_layer - 3 + e.moe_kernels_per_layer + (2 if m.qk_norm else 0)
        kernels = m.layers * per_layer * e.kernel_fixed_s
        node_tokens = batch / nodes
        allreduce = 2 * m.layers * self.allreduce_time(t_a, node_tokens * m.hidden * m.dtype_bytes)
        network = m.layers * self.moe_a2a_time(gpus, batch, network_bandwidth)
        host = e.host_per_sequence_s * batch
        overhead = e.iteration_overhead_s + (e.tp_iteration_overhead_s if gpus > 1 else 0.0)
        return MoEDecodeBreakdown(
            compute, memory, kernels, allreduce, network, host, overhead, touched
        )

    def moe_prefill_time(
        self,
        gpus: int,
        tokens: int,
        cached_tokens: int = 0,
        network_bandwidth: float | None = None,
    ) -> float:
        """Prefill of ``tokens`` new tokens (one chunk, spread over the instance's nodes)
        after ``cached_tokens`` of context on a MoE instance: active-parameter FLOPs,
        the touched experts read once, the all-reduces and the dispatch/combine as in
        decode."""
        nodes, t_a = self.moe_instance(gpus)
        if tokens <= 0:
            return 0.0
        m, h, e = self.model, self.hardware, self.efficiency
        dense = m.layers * (m.attn_params + m.router_params)
        active = dense + m.layers * m.active_experts * m.expert_params
        mean_ctx = cached_tokens + tokens / 2.0
        flops = tokens * (2.0 * active + 4.0 * m.layers * m.q_dim * mean_ctx)
        flops += 2.0 * m.vocab * m.hidden
        compute = flops / (gpus * h.peak_flops * e.gemm_efficiency)
        touched = experts_touched(m.experts, m.active_experts, tokens)
        weights = (dense / t_a + m.layers * touched * m.expert_params / gpus) * m.dtype_bytes
        memory = weights / (h.hbm_bandwidth * h.hbm_efficiency)
        per_layer = e.kernels_per_layer - 3 + e.moe_kernels_per_layer + (2 if m.qk_norm else 0)
        kernels = m.layers * per_layer * e.kernel_fixed_s
        node_tokens = tokens / nodes
        allreduce = 2 * m.layers * self.allreduce_time(t_a, node_tokens * m.hidden * m.dtype_bytes)
        network = m.layers * self.moe_a2a_time(gpus, tokens, network_bandwidth)
        return max(compute, memory) + kernels + allreduce + network + e.iteration_overhead_s

    # -- collectives and transfers --

    def allreduce_time(self, tp: int, message_bytes: float) -> float:
        """One intra-node all-reduce of ``message_bytes`` among ``tp`` GPUs over NVLink."""
        if tp <= 1:
            return 0.0
        e, h = self.efficiency, self.hardware
        alpha = e.allreduce_base_s + e.allreduce_per_peer_s * (tp - 1)
        bw = h.nvlink_bandwidth * e.link_efficiency
        return alpha + 2.0 * (tp - 1) / tp * message_bytes / bw

    def nvlink_transfer_time(self, nbytes: float, streams: int = 1) -> float:
        """Move ``nbytes`` between GPUs of one node, spread over ``streams`` GPU pairs."""
        if nbytes <= 0:
            return 0.0
        e, h = self.efficiency, self.hardware
        return e.allreduce_base_s + nbytes / (
            max(1, streams) * h.nvlink_bandwidth * e.link_efficiency
        )

    def network_transfer_time(
        self, nbytes: float, streams: int = 1, bandwidth: float | None = None
    ) -> float:
        """Move ``nbytes`` between nodes over ``streams`` NICs (or a given bandwidth, B/s)."""
        if nbytes <= 0:
            return 0.0
        e = self.efficiency
        bw = bandwidth if bandwidth is not None else max(1, streams) * self.hardware.nic_bandwidth
        if bw <= 0:
            return math.inf
        return e.network_latency_s + nbytes / (bw * e.network_efficiency)

    def kv_move_time(
        self, tokens: int, *, same_node: bool, src_tp: int = 1, dst_tp: int = 1
    ) -> float:
        """Move one request's KV cache: NVLink within a node, RDMA across nodes.

        Both groups hold the KV split by heads, so ``min(src_tp, dst_tp)`` GPU pairs
        (and NICs) carry it in parallel.
        """
        nbytes = tokens * self.kv_bytes_per_token()
        streams = max(1, min(src_tp, dst_tp, self.model.kv_heads))
        if same_node:
            return self.nvlink_transfer_time(nbytes, streams)
        return self.network_transfer_time(nbytes, streams)

    def recompute_time(self, tp: int, tokens: int, chunk: int = 8192) -> float:
        """Rebuild a request's KV cache by prefilling ``tokens`` (in chunks) on TP ``tp``."""
        total = 0.0
        done = 0
        while done < tokens:
            n = min(chunk, tokens - done)
            total += self.prefill_time(tp, n, done)
            done += n
        return total

    def reshard_weight_time(self, old: Sequence[int], new: Sequence[int]) -> float:
        """Weight bytes a node's GPUs must receive to go from TP layout ``old`` to ``new``.

        ``old``/``new`` are per-GPU TP degrees (same length). GPUs are interchangeable on
        an NVSwitch node, so the executor pairs the GPU that needs the largest new shard
        with the one holding the largest old shard; a GPU receives only the part of its
        new shard it does not hold (shards of power-of-two groups nest).
        """
        if len(old) != len(new):
            raise errors.InvalidArgument(
                f"reshard between layouts of {len(old)} and {len(new)} GPUs"
            )
        worst = 0.0
        for t_old, t_new in zip(sorted(old), sorted(new), strict=True):
            worst = max(worst, 1.0 / t_new - 1.0 / t_old)
        if worst <= 0:
            return 0.0
        h, e = self.hardware, self.efficiency
        return worst * self.model.weight_bytes / (h.nvlink_bandwidth * e.link_efficiency)

    def kv_relayout_bound_time(self, old_tp: int) -> float:
        """Upper bound for re-laying out a node's KV cache in a reshard: every GPU sends its
        whole KV pool over NVLink (state independent, so plans are stable)."""
        e, h = self.efficiency, self.hardware
        pool = (
            h.hbm_bytes * e.gpu_memory_utilization
            - self.weight_bytes_per_shard(old_tp)
            - e.activation_reserve_bytes
        )
        if pool <= 0:
            return 0.0
        return pool / (h.nvlink_bandwidth * e.link_efficiency)

    def reshard_time(self, old: Sequence[int], new: Sequence[int]) -> float:
        """Pause of one node changing TP layout (per-GPU TP degrees); 0 when unchanged."""
        if sorted(old) == sorted(new):
            return 0.0
        return (
            self.efficiency.reshard_fixed_s
            + self.reshard_weight_time(old, new)
            + max(self.kv_relayout_bound_time(t) for t in set(old))
        )

    # -- training and weight sync --

    def training_step_time(
        self,
        tokens: int,
        gpus: int,
        *,
        dp_degree: int = 1,
        network_bandwidth: float | None = None,
        grad_bytes_per_param: int = 2,
    ) -> float:
        """One optimizer step: 6 * params * tokens FLOPs on ``gpus`` GPUs, plus the data-
        parallel gradient reduce-scatter + all-gather over the network.

        ``network_bandwidth`` (B/s) is what each data-parallel replica gets from the
        fabric; None means one NIC per GPU of the replica.
        """
        if gpus <= 0:
            raise errors.field_error("gpus", gpus, "a positive integer")
        m, h, e = self.model, self.hardware, self.efficiency
        counted = m.active_params if m.moe else m.params
        compute = 6.0 * counted * tokens / (gpus * h.peak_flops * e.training_mfu)
        if dp_degree <= 1:
            return compute
        replica_gpus = max(1, gpus // dp_degree)
        bw = network_bandwidth if network_bandwidth is not None else replica_gpus * h.nic_bandwidth
        grad_bytes = m.params * grad_bytes_per_param
        sync = 2.0 * (dp_degree - 1) / dp_degree * grad_bytes
        return compute + self.network_transfer_time(sync, bandwidth=bw)

    def weight_sync_time(self, bandwidth: float, nbytes: float | None = None) -> float:
        """Model bytes (or ``nbytes``) over the bandwidth the fabric gives the transfer."""
        total = self.model.weight_bytes if nbytes is None else nbytes
        return self.network_transfer_time(total, bandwidth=bandwidth)

    # -- calibration --

    def calibrated(self, points: Iterable[ProfilePoint]) -> PerfModel:
        """This model corrected by measured decode iterations (a table per TP and batch).

        The correction is the ratio measured / modelled at each point, interpolated
        linearly in batch within a TP degree (held flat outside the measured range);
        TP degrees without measurements use the median ratio of all points.
        """
        pts = tuple(sorted(points))
        for p in pts:
            self._check_tp(p.tp)
            if p.batch <= 0 or p.seconds <= 0 or p.context_tokens < 0:
                raise errors.field_error(
                    "profile point", p, "batch > 0, seconds > 0 and context_tokens >= 0"
                )
        return replace(self, profile=pts)

    def _calibration(self, tp: int, batch: int) -> float:
        if not self.profile:
            return 1.0
        table = _ratio_table(self)
        by_tp = table.get(tp)
        if by_tp is None:
            return table[0][1][0]  # median over every point
        batches, ratios = by_tp
        i = bisect.bisect_left(batches, batch)
        if i == 0:
            return ratios[0]
        if i >= len(batches):
            return ratios[-1]
        b0, b1 = batches[i - 1], batches[i]
        f = (batch - b0) / (b1 - b0)
        return ratios[i - 1] + f * (ratios[i] - ratios[i - 1])

    def _check_tp(self, tp: int) -> None:
        if not isinstance(tp, int) or tp <= 0:
            raise errors.field_error("tp", tp, "a positive integer")


@functools.lru_cache(maxsize=64)  # a pure value of the (hashable, frozen) model
def _ratio_table(model: PerfModel) -> dict[int, tuple[list[int], list[float]]]:
    """Per TP: sorted batches and measured/modelled ratios; key 0 holds the median (the
    cached table is shared: callers only read it)."""
    raw = replace(model, profile=())
    by_tp: dict[int, dict[int, list[float]]] = {}
    every: list[float] = []
    for p in model.profile:
        ratio = p.seconds / raw.decode_iteration_time(p.tp, p.batch, p.context_tokens)
        by_tp.setdefault(p.tp, {}).setdefault(p.batch, []).append(ratio)
        every.append(ratio)
    table: dict[int, tuple[list[int], list[float]]] = {}
    for tp, rows in by_tp.items():
        batches = sorted(rows)
        table[tp] = (batches, [sum(rows[b]) / len(rows[b]) for b in batches])
    every.sort()
    n = len(every)
    median = every[n // 2] if n % 2 else 0.5 * (every[n // 2 - 1] + every[n // 2])
    table[0] = ([0], [median])
    return table


def _quantisation(m: int, n: float, tile_m: int, tile_n: int, sms: int) -> float:
    """Useful fraction of a GEMM's CTA tiles (tile quantisation) times the fraction of
    the last wave of tiles that keeps SMs busy (wave quantisation)."""
    tiles_m = math.ceil(m / tile_m)
    tiles_n = math.ceil(n / tile_n)
    tile_util = (m * n) / (tiles_m * tile_m * tiles_n * tile_n)
    tiles = tiles_m * tiles_n
    if tiles < sms:
        return tile_util  # skinny GEMMs split K to occupy every SM
    waves = math.ceil(tiles / sms)
    wave_util = tiles / (waves * sms)
    return tile_util * wave_util


def default_model(model: str = "Qwen2.5-14B", hardware: str = "H800-SXM") -> PerfModel:
    """A performance model from the built-in tables (names as in MODELS / HARDWARE)."""
    try:
        shape = MODELS[model]
    except KeyError:
        raise errors.field_error("model", model, f"one of {', '.join(MODELS)}") from None
    try:
        hw = HARDWARE[hardware]
    except KeyError:
        raise errors.field_error("hardware", hardware, f"one of {', '.join(HARDWARE)}") from None
    if hw.gemm_efficiency > 0:  # a GEMM efficiency measured on this GPU
        return PerfModel(shape, hw, Efficiency(gemm_efficiency=hw.gemm_efficiency))
    return PerfModel(shape, hw)
