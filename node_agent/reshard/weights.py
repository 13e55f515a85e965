"""Deterministic synthetic weights and checksums of full tensors (torch, no distributed).

A tensor is cut along its split dimension into ``model.max_tp`` blocks (one block for a
replicated tensor), each filled from its own generator seeded by (seed, tensor, block).
A rank therefore generates only the blocks of its own shard, and the shards of any layout
assemble to the same full tensor.

The checksum of a full tensor is SHA-256 over the SHA-256 digests of its blocks in order
(a two-level hash tree over that fixed grid). It is a function of the full tensor alone,
the same for every layout, yet the ranks of an instance compute it on their own shards in
parallel and no tensor is gathered anywhere: :func:`block_digests` on each rank,
:func:`combine` over the instance. :func:`expected_checksums` computes it in one process.
"""

from __future__ import annotations

import ctypes
import hashlib
from collections.abc import Sequence

import torch

from node_agent.reshard.plan import ModelSpec, Span, Split, TensorSpec, shard_shape

DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
}
INIT_SCALE = 0.02  # uniform in [-0.02, 0.02): the order of magnitude of real init


def torch_dtype(model: ModelSpec) -> torch.dtype:
    return DTYPES[model.dtype]


def block_span(model: ModelSpec, spec: TensorSpec) -> int:
    """Length of one generation block along the split dimension."""
    return spec.extent if spec.split is Split.REPLICATED else spec.extent // model.max_tp


def generate_shard(
    model: ModelSpec,
    spec: TensorSpec,
    span: Span,
    seed: int,
    device: torch.device | None = None,
) -> torch.Tensor:
    """The ``span`` of ``spec`` along its split dimension, as a contiguous tensor."""
    block = block_span(model, spec)
    if span.start % block or span.stop % block:
        raise ValueError(f"{spec.name}: span {span} does not align to blocks of {block}")
    out = torch.empty(shard_shape(spec, span), dtype=torch_dtype(model), device=device)
    for b in range(span.start // block, span.stop // block):
        gen = torch.Generator().manual_seed(block_seed(seed, spec.name, b))
        part = torch.empty(shard_shape(spec, Span(0, block)), dtype=out.dtype)
        part.uniform_(-INIT_SCALE, INIT_SCALE, generator=gen)
        out.narrow(spec.dim, b * block - span.start, block).copy_(part)
    return out


def block_seed(seed: int, name: str, block: int) -> int:
    digest = hashlib.blake2b(f"{seed}/{name}/{block}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1  # torch seeds are below 2**64


def tensor_sha256(tensor: torch.Tensor) -> bytes:
    """SHA-256 of the tensor's bytes in row-major order (any dtype, any device)."""
    flat = tensor.detach().to("cpu").contiguous()
    nbytes = flat.numel() * flat.element_size()
    if nbytes == 0:
        return hashlib.sha256(b"").digest()
    raw = (ctypes.c_ubyte * nbytes).from_address(flat.data_ptr())
    digest = hashlib.sha256(memoryview(raw)).digest()
    del raw  # the buffer borrows flat's memory; flat is alive until here
    return digest


def block_digests(
    model: ModelSpec, spec: TensorSpec, shard: torch.Tensor, span: Span
) -> list[bytes]:
    """SHA-256 of each block of ``shard`` (which holds ``span`` of ``spec``), in order."""
    block = block_span(model, spec)
    if span.start % block or span.stop % block:
        raise ValueError(f"{spec.name}: span {span} does not align to blocks of {block}")
    return [
        tensor_sha256(shard.narrow(spec.dim, k * block, block)) for k in range(len(span) // block)
    ]


def combine(digests: Sequence[bytes]) -> str:
    """The checksum of a full tensor from the digests of all its blocks, in order."""
    return hashlib.sha256(b"".join(digests)).hexdigest()


def tensor_checksum(model: ModelSpec, spec: TensorSpec, full: torch.Tensor) -> str:
    return combine(block_digests(model, spec, full, Span(0, spec.extent)))


def expected_checksums(model: ModelSpec, seed: int) -> dict[str, str]:
    """The checksum of every full tensor of the model generated from ``seed``."""
    return {
        spec.name: tensor_checksum(
            model, spec, generate_shard(model, spec, Span(0, spec.extent), seed)
        )
        for spec in model.tensors
    }
