"""The bytes each training traffic pattern moves, derived from the model's shape (never
a free knob).

The shapes are ``scheduler.perf_model``'s ``ModelShape`` (dense and mixture-of-experts,
with their parameter counts and sources): the generation side's decode model and the
training side share one shape. This module adds what only training traffic needs: the
bytes of an expert all-to-all.

Bytes per pattern (``dtype_bytes`` = 2, BF16):

- expert-parallel all-to-all, per token, per MoE layer and per pass (forward, or
  backward): dispatch ``active_experts x hidden x bytes`` plus combine as much again
  (:func:`a2a_bytes_per_token_layer`); no de-duplication of a token sent to
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

from collections.abc import Mapping

from orchestrrl import errors
from scheduler.perf_model import MODELS as PERF_MODELS
from scheduler.perf_model import QWEN3_30B_A3B, QWEN3_235B_A22B, ModelShape

__all__ = [
    "QWEN3_30B_A3B",
    "QWEN3_235B_A22B",
    "SHAPES",
    "a2a_bytes_per_token_layer",
    "shape",
]


def a2a_bytes_per_token_layer(m: ModelShape) -> float:
    """Expert-parallel dispatch + combine of one token in one MoE layer and one pass."""
    return float(2 * m.active_experts * m.hidden * m.dtype_bytes)


# Qwen3-235B-A22B and Qwen3-30B-A3B are among them (values from their Hugging Face
# config.json, quoted in ``scheduler.perf_model``: 94/48 layers, hidden 4096/2048, 64/32
# heads, 4 KV heads, head_dim 128, 128 experts of width 1536/768, 8 per token, every layer
# MoE with no shared expert, vocab 151936, untied, q/k RMSNorm per head, no QKV bias).
SHAPES: Mapping[str, ModelShape] = PERF_MODELS


def shape(name: str, field_name: str = "training.model") -> ModelShape:
    """The shape called ``name``, or a clear error listing the known ones."""
    if name not in SHAPES:
        raise errors.field_error(field_name, name, "one of " + ", ".join(SHAPES))
    return SHAPES[name]
