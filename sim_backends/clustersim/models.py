"""Shapes of the models the simulator trains, dense and mixture-of-experts, and the bytes
each training traffic pattern moves, derived from the shape (never a free knob).

Dense shapes are ``scheduler.perf_model.MODELS``' (the same parameter count the
generation side uses). MoE shapes are from the public Hugging Face ``config.json`` of
each model (values quoted below; slime's Megatron launch scripts
``scripts/models/qwen3-235B-A22B.sh`` / ``qwen3-30B-A3B.sh`` give the same ones).

Parameter count of one block: attention ``hidden (q + 2 kv) + q hidden`` (+ QKV bias for
Qwen2.5, + the per-head q/k RMSNorm of Qwen3), the MLP (dense: ``3 hidden ffn`` for
SwiGLU; MoE: ``experts x 3 hidden expert_ffn`` plus the router ``hidden x experts``) and
two RMSNorms; plus embeddings, the LM head (untied) and the final norm.

Bytes per pattern (``dtype_bytes`` = 2, BF16):

- expert-parallel all-to-all, per token, per MoE layer and per pass (forward, or
  backward): dispatch ``active_experts x hidden x bytes`` plus combine as much again
  (:meth:`TrainShape.a2a_bytes_per_token_layer`); no de-duplication of a token sent to
  several experts on one node (DeepEP's node-limited routing would send less);
- FSDP / ZeRO-3: every rank gathers the whole model's weights in the forward and again
  in the backward (``params x bytes`` each) and reduce-scatters the gradients
  (``params x grad bytes``), per micro-batch;
- Megatron with ZeRO-1 (distributed optimizer): one reduce-scatter of gradients and one
  all-gather of parameters per optimizer step over the data-parallel group, the bytes of
  an all-reduce of each rank's ``params / (tp pp)`` gradients;
- weight sync: ``params x bytes`` (470 GB for Qwen3-235B-A22B in BF16).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from orchestrrl import errors
from scheduler.perf_model import MODELS as PERF_MODELS
from scheduler.perf_model import QWEN3_30B_A3B as PERF_QWEN3_30B_A3B
from scheduler.perf_model import QWEN3_235B_A22B as PERF_QWEN3_235B_A22B
from scheduler.perf_model import ModelShape, check_experts


@dataclass(frozen=True)
class TrainShape:
    """A decoder-only transformer; ``experts`` 0 is dense (``ffn`` its MLP width), else
    every layer's MLP is ``experts`` experts of width ``expert_ffn`` of which each token
    uses ``active_experts``."""

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    experts: int = 0
    active_experts: int = 0
    expert_ffn: int = 0
    qkv_bias: bool = False
    qk_norm: bool = False
    tied_embeddings: bool = False
    dtype_bytes: int = 2
    source: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        for name in ("layers", "hidden", "heads", "kv_heads", "head_dim", "vocab", "dtype_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise errors.field_error(f"model.{name}", value, "an integer >= 1")
        if self.experts:
            check_experts(self.experts, self.active_experts, self.expert_ffn)
        elif self.ffn < 1:
            raise errors.field_error("model.ffn", self.ffn, "an integer >= 1 for a dense model")

    @property
    def moe(self) -> bool:
        return self.experts > 0

    @property
    def attn_params(self) -> int:
        """Attention of one block (projections, QKV bias, q/k norms)."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        bias = q + 2 * kv if self.qkv_bias else 0
        norm = 2 * self.head_dim if self.qk_norm else 0
        return self.hidden * (q + 2 * kv) + q * self.hidden + bias + norm

    @property
    def expert_params_per_layer(self) -> int:
        """Every expert of one block (0 for a dense model)."""
        return self.experts * 3 * self.hidden * self.expert_ffn

    @property
    def mlp_params(self) -> int:
        """MLP of one block: dense SwiGLU, or the experts plus the router."""
        if self.moe:
            return self.expert_params_per_layer + self.hidden * self.experts
        return 3 * self.hidden * self.ffn

    @property
    def layer_params(self) -> int:
        return self.attn_params + self.mlp_params + 2 * self.hidden

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def lm_head_params(self) -> int:
        return 0 if self.tied_embeddings else self.vocab * self.hidden

    @property
    def params(self) -> int:
        return (
            self.layers * self.layer_params
            + self.embedding_params
            + self.lm_head_params
            + self.hidden
        )

    @property
    def expert_params(self) -> int:
        """Parameters held by experts (sharded by expert parallelism)."""
        return self.layers * self.expert_params_per_layer

    @property
    def dense_params(self) -> int:
        """Everything but the experts (replicated across expert-parallel ranks)."""
        return self.params - self.expert_params

    @property
    def active_params(self) -> int:
        """Parameters that count for a token's FLOPs: all but the experts it does not
        use (the dense convention 6 x params x tokens for training counts every
        parameter, embeddings included; this is its MoE counterpart; = params if dense)."""
        unused = self.layers * (self.experts - self.active_experts) * 3 * self.hidden
        return self.params - unused * self.expert_ffn

    @property
    def weight_bytes(self) -> float:
        return float(self.params * self.dtype_bytes)

    def a2a_bytes_per_token_layer(self) -> float:
        """Expert-parallel dispatch + combine of one token in one MoE layer and one pass."""
        return float(2 * self.active_experts * self.hidden * self.dtype_bytes)


def from_perf_model(m: ModelShape) -> TrainShape:
    """A ``scheduler.perf_model`` shape (dense or MoE) as a :class:`TrainShape` (same
    params: the generation side's decode model and the training side share one shape)."""
    return TrainShape(
        m.name,
        m.layers,
        m.hidden,
        m.heads,
        m.kv_heads,
        m.head_dim,
        m.ffn,
        m.vocab,
        experts=m.experts,
        active_experts=m.active_experts,
        expert_ffn=m.expert_ffn,
        qkv_bias=m.qkv_bias,
        qk_norm=m.qk_norm,
        tied_embeddings=m.tied_embeddings,
        dtype_bytes=m.dtype_bytes,
        source=m.source,
    )


# Qwen3-235B-A22B and Qwen3-30B-A3B: the shapes of ``scheduler.perf_model`` (values from
# their Hugging Face config.json, quoted there: 94/48 layers, hidden 4096/2048, 64/32
# heads, 4 KV heads, head_dim 128, 128 experts of width 1536/768, 8 per token, every layer
# MoE with no shared expert, vocab 151936, untied, q/k RMSNorm per head, no QKV bias).
QWEN3_235B_A22B = from_perf_model(PERF_QWEN3_235B_A22B)
QWEN3_30B_A3B = from_perf_model(PERF_QWEN3_30B_A3B)

SHAPES: dict[str, TrainShape] = {name: from_perf_model(m) for name, m in PERF_MODELS.items()}


def shape(name: str, field_name: str = "training.model") -> TrainShape:
    """The shape called ``name``, or a clear error listing the known ones."""
    if name not in SHAPES:
        raise errors.field_error(field_name, name, "one of " + ", ".join(SHAPES))
    return SHAPES[name]
