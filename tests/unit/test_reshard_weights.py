"""Synthetic weights: shards of any layout assemble to one full tensor; checksums."""

from __future__ import annotations

import pytest
import torch

from node_agent.reshard.plan import Span, Split, shard_span, synthetic_model
from node_agent.reshard.weights import (
    block_digests,
    combine,
    expected_checksums,
    generate_shard,
    tensor_checksum,
    tensor_sha256,
)
from node_agent.reshard.workers import choose_backend

pytestmark = pytest.mark.unit

MODEL = synthetic_model(layers=1, hidden=32, ffn=64, vocab=32)


@pytest.mark.parametrize("layout", [(8,), (4, 4), (2, 2, 2, 2), (4, 2, 1, 1)])
def test_shards_of_every_instance_assemble_to_the_same_full_tensor(
    layout: tuple[int, ...],
) -> None:
    for spec in MODEL.tensors:
        full = generate_shard(MODEL, spec, Span(0, spec.extent), seed=9)
        assert full.shape == spec.shape
        assert full.dtype == torch.bfloat16
        first = 0
        for tp in layout:
            parts = [
                generate_shard(MODEL, spec, shard_span(spec, layout, r), seed=9)
                for r in range(first, first + tp)
            ]
            if spec.split is Split.REPLICATED:
                assert all(torch.equal(p, full) for p in parts)
            else:
                assert torch.equal(torch.cat(parts, dim=spec.dim), full)
            first += tp


def test_weights_depend_on_the_seed_and_look_like_an_init() -> None:
    spec = MODEL.tensor("layers.0.q_proj")
    a = generate_shard(MODEL, spec, Span(0, 32), seed=1)
    b = generate_shard(MODEL, spec, Span(0, 32), seed=2)
    assert not torch.equal(a, b)
    assert float(a.abs().max()) <= 0.02 * 1.01  # bfloat16 rounding
    assert float(a.float().std()) > 0.005


def test_a_span_off_the_block_grid_is_refused() -> None:
    with pytest.raises(ValueError, match="does not align"):
        generate_shard(MODEL, MODEL.tensor("lm_head"), Span(1, 5), seed=0)


def test_raw_digests() -> None:
    t = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    assert tensor_sha256(t) == tensor_sha256(t.clone())
    assert tensor_sha256(t) != tensor_sha256(t.t())  # row-major bytes: layout matters
    assert tensor_sha256(t.t()) == tensor_sha256(t.t().contiguous())
    assert tensor_sha256(torch.empty(0)) == bytes.fromhex(
        "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
    )


@pytest.mark.parametrize("layout", [(8,), (4, 4), (2, 2, 2, 2), (1,) * 8, (2, 4, 1, 1)])
def test_a_full_tensors_checksum_is_composed_from_any_layouts_shards(
    layout: tuple[int, ...],
) -> None:
    sums = expected_checksums(MODEL, seed=4)
    for spec in MODEL.tensors:
        full = generate_shard(MODEL, spec, Span(0, spec.extent), seed=4)
        assert tensor_checksum(MODEL, spec, full) == sums[spec.name]
        first = 0
        for tp in layout:
            ranks = range(first, first + tp) if spec.split is not Split.REPLICATED else [first]
            digests = [
                d
                for r in ranks
                for d in block_digests(
                    MODEL,
                    spec,
                    generate_shard(MODEL, spec, shard_span(spec, layout, r), seed=4),
                    shard_span(spec, layout, r),
                )
            ]
            assert combine(digests) == sums[spec.name]
            first += tp


def test_checksums_see_content_and_order() -> None:
    sums = expected_checksums(MODEL, seed=4)
    assert list(sums) == [t.name for t in MODEL.tensors]
    assert sums == expected_checksums(MODEL, seed=4)
    other = expected_checksums(MODEL, seed=5)
    assert all(sums[name] != other[name] for name in sums)
    spec = MODEL.tensor("layers.0.down_proj")  # row-parallel: blocks are column ranges
    full = generate_shard(MODEL, spec, Span(0, spec.extent), seed=4)
    block = spec.extent // MODEL.max_tp
    swapped = torch.cat([full[:, block : 2 * block], full[:, :block], full[:, 2 * block :]], 1)
    assert tensor_checksum(MODEL, spec, swapped) != sums[spec.name]
    flipped = full.clone()
    flipped[3, 5] = -flipped[3, 5]
    assert tensor_checksum(MODEL, spec, flipped) != sums[spec.name]


def test_gloo_without_cuda() -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert choose_backend(8) == ("gloo", "CUDA is not available")
    assert choose_backend(8, "gloo") == ("gloo", "requested")
