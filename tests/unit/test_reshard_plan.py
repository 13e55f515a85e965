"""The pure reshard planner: shards of a layout and transfer plans between layouts."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from node_agent.reshard.plan import (
    ModelSpec,
    ReshardPlan,
    Span,
    Split,
    TensorSpec,
    check_fits,
    instance_ranks,
    placement,
    plan_reshard,
    shard_bytes,
    shard_span,
    synthetic_model,
)
from orchestrrl import errors

pytestmark = pytest.mark.unit

MODEL = synthetic_model(layers=2, hidden=64, ffn=128, vocab=64)
COL, ROW, REP = (
    MODEL.tensor("layers.0.q_proj"),
    MODEL.tensor("layers.0.o_proj"),
    MODEL.tensor("norm"),
)


@st.composite
def layouts(draw: st.DrawFn, gpus: int) -> tuple[int, ...]:
    """Any valid layout of ``gpus`` GPUs: powers of two summing to it, in any order."""
    out: list[int] = []
    left = gpus
    while left:
        options = [t for t in (1, 2, 4, 8) if t <= left]
        out.append(draw(st.sampled_from(options)))
        left -= out[-1]
    return tuple(out)


@st.composite
def layout_pairs(draw: st.DrawFn) -> tuple[tuple[int, ...], tuple[int, ...]]:
    gpus = draw(st.integers(1, 8))
    return draw(layouts(gpus)), draw(layouts(gpus))


def apply(plan: ReshardPlan, model: ModelSpec) -> dict[tuple[int, str], list[int | None]]:
    """Run ``plan`` on simulated holdings: each slot holds the global index (along the split
    dim) of the line it came from. Fails on a line filled twice or read from a rank that
    does not hold it."""
    old = {
        (r, t.name): list(range(*_bounds(shard_span(t, plan.old_layout, r))))
        for r in range(plan.gpus)
        for t in model.tensors
    }
    new: dict[tuple[int, str], list[int | None]] = {
        (r, t.name): [None] * len(shard_span(t, plan.new_layout, r))
        for r in range(plan.gpus)
        for t in model.tensors
    }

    def fill(src: list[int], src_span: Span, dst: list[int | None], dst_span: Span) -> None:
        assert len(src_span) == len(dst_span) > 0
        assert src_span.stop <= len(src)
        for i, j in zip(range(*_bounds(src_span)), range(*_bounds(dst_span)), strict=True):
            assert dst[j] is None, "a line arrives twice"
            dst[j] = src[i]

    for c in plan.local:
        fill(old[c.rank, c.tensor], c.src, new[c.rank, c.tensor], c.dst)
    for m in plan.moves:
        fill(old[m.src_rank, m.tensor], m.src, new[m.dst_rank, m.tensor], m.dst)
    return new


def _bounds(span: Span) -> tuple[int, int]:
    return span.start, span.stop


def test_shards_of_a_mixed_layout() -> None:
    layout = (4, 2, 2)
    assert [placement(layout, r).instance for r in range(8)] == [0, 0, 0, 0, 1, 1, 2, 2]
    assert [placement(layout, r).local_rank for r in range(8)] == [0, 1, 2, 3, 0, 1, 0, 1]
    assert instance_ranks(layout) == (range(0, 4), range(4, 6), range(6, 8))
    assert [shard_span(COL, layout, r) for r in (0, 3, 4, 5)] == [
        Span(0, 16),
        Span(48, 64),
        Span(0, 32),
        Span(32, 64),
    ]
    assert shard_span(ROW, layout, 7) == Span(32, 64)  # dim 1 of o_proj
    assert {shard_span(REP, layout, r) for r in range(8)} == {Span(0, 1)}
    # a TP=4 rank holds a quarter of every split tensor and all of every replicated one
    split = sum(t.shape[0] * t.shape[1] for t in MODEL.tensors if t.split is not Split.REPLICATED)
    rep = sum(t.shape[0] * t.shape[1] for t in MODEL.tensors if t.split is Split.REPLICATED)
    assert shard_bytes(MODEL, layout, 0) == (split // 4 + rep) * 2


def test_tp1_to_tp2_keeps_half_and_moves_nothing() -> None:
    plan = plan_reshard(MODEL, (1,) * 8, (2, 2, 2, 2))
    assert plan.is_empty  # every rank held the whole model
    assert plan.bytes_kept == sum(shard_bytes(MODEL, (2, 2, 2, 2), r) for r in range(8))


def test_tp8_to_tp4_pairs_fetch_the_missing_halves() -> None:
    plan = plan_reshard(MODEL, (8,), (4, 4))
    # rank 0 now needs eighths 0-1 of q_proj: it has 0, only rank 1 has 1
    q = [m for m in plan.moves if m.tensor == "layers.0.q_proj" and m.dst_rank == 0]
    assert [(m.src_rank, m.src, m.dst) for m in q] == [(1, Span(0, 8), Span(8, 16))]
    assert q[0].nbytes == 8 * 64 * 2
    # rank 4 (first of the second instance) holds eighth 4 and needs eighths 0-1
    q4 = [m for m in plan.moves if m.tensor == "layers.0.q_proj" and m.dst_rank == 4]
    assert sorted((m.src_rank, m.dst) for m in q4) == [(0, Span(0, 8)), (1, Span(8, 16))]


def test_sending_is_spread_over_every_holder() -> None:
    # (4, 4) -> (8,): a needed eighth is held by two ranks, one per old instance
    plan = plan_reshard(MODEL, (4, 4), (8,))
    sent = [plan.sent_bytes(r) for r in range(8)]
    senders = [s for s in sent if s]
    assert len(senders) >= 4
    assert max(sent) <= 2 * plan.bytes_moved / len(senders)
    # (1,)*8 -> (8,) is free, and (8,) -> (1,)*8 makes every rank send 7/8 of its shard
    plan = plan_reshard(MODEL, (8,), (1,) * 8)
    assert len({plan.sent_bytes(r) for r in range(8)}) == 1
    split = sum(t.shape[0] * t.shape[1] for t in MODEL.tensors if t.split is not Split.REPLICATED)
    assert plan.bytes_moved == 7 * split * MODEL.itemsize


@settings(max_examples=150)
@given(layout_pairs())
def test_every_rank_ends_with_exactly_its_new_shard(
    pair: tuple[tuple[int, ...], tuple[int, ...]],
) -> None:
    old, new = pair
    plan = plan_reshard(MODEL, old, new)
    held = apply(plan, MODEL)
    for (rank, name), lines in held.items():
        expected = list(range(*_bounds(shard_span(MODEL.tensor(name), new, rank))))
        assert lines == expected, (rank, name)


@settings(max_examples=150)
@given(layout_pairs())
def test_bytes_are_conserved_and_nobody_sends_to_itself(
    pair: tuple[tuple[int, ...], tuple[int, ...]],
) -> None:
    old, new = pair
    plan = plan_reshard(MODEL, old, new)
    gpus = sum(old)
    assert all(m.src_rank != m.dst_rank for m in plan.moves)
    assert all(m.nbytes > 0 for m in plan.moves)
    kept = Counter[int]()
    for c in plan.local:
        kept[c.rank] += c.nbytes
    for r in range(gpus):
        assert kept[r] + plan.received_bytes(r) == shard_bytes(MODEL, new, r)
    assert sum(plan.sent_bytes(r) for r in range(gpus)) == plan.bytes_moved
    assert plan.bytes_moved + plan.bytes_kept == sum(
        shard_bytes(MODEL, new, r) for r in range(gpus)
    )
    # replicated tensors never travel
    assert not [m for m in plan.moves if MODEL.tensor(m.tensor).split is Split.REPLICATED]


@settings(max_examples=60)
@given(st.integers(1, 8).flatmap(layouts))
def test_planning_the_same_layout_is_empty(layout: tuple[int, ...]) -> None:
    plan = plan_reshard(MODEL, layout, layout)
    assert plan.is_empty
    assert plan.moves == ()
    assert plan.bytes_moved == 0
    for c in plan.local:  # everything stays where it is
        assert c.src == c.dst == Span(0, len(shard_span(MODEL.tensor(c.tensor), layout, c.rank)))


def test_plan_indexes_are_shared_by_both_ends() -> None:
    plan = plan_reshard(MODEL, (2, 2, 2, 2), (8,))
    for rank in range(8):
        for index, move in plan.moves_of(rank):
            assert plan.moves[index] == move
            assert rank in (move.src_rank, move.dst_rank)


@pytest.mark.parametrize(
    ("layout", "rule"),
    [
        ((4, 2), "sum to the node's GPU count 8"),
        ((3, 5), "power of two"),
        ((16,), "power of two in 1..8"),
    ],
)
def test_check_fits_rejects_bad_layouts(layout: tuple[int, ...], rule: str) -> None:
    with pytest.raises(errors.InvalidArgument) as info:
        check_fits(MODEL, layout, 8, None)
    assert str(info.value).startswith(f"tp_layout={list(layout)!r} is not valid")
    assert rule in str(info.value)


def test_check_fits_rejects_a_layout_whose_shards_exceed_gpu_memory() -> None:
    tp1 = shard_bytes(MODEL, (1,) * 8, 0)
    tp2 = shard_bytes(MODEL, (2, 2, 2, 2), 0)
    assert check_fits(MODEL, (2, 2, 2, 2), 8, tp2) == (2, 2, 2, 2)
    with pytest.raises(errors.InvalidArgument) as info:
        check_fits(MODEL, (1,) * 8, 8, tp2)
    assert "use larger TP degrees" in str(info.value)
    assert f"{tp1 / 2**30:.2f} GiB" in str(info.value)


def test_check_fits_rejects_splitting_finer_than_the_model_allows() -> None:
    model = synthetic_model(layers=1, hidden=16, ffn=32, vocab=16, max_tp=4)
    with pytest.raises(errors.InvalidArgument) as info:
        check_fits(model, (8,), 8, None)
    assert "splits at most 4 ways" in str(info.value)


@pytest.mark.parametrize(
    ("kwargs", "text"),
    [
        ({"dtype": "int8"}, "dtype='int8'"),
        ({"max_tp": 6}, "max_tp=6"),
        ({"tensors": ()}, "at least one tensor"),
        (
            {"tensors": (TensorSpec("a", (4, 4), Split.COLUMN),) * 2},
            "names must be unique",
        ),
        ({"tensors": (TensorSpec("a", (12, 4), Split.COLUMN),)}, "divide by max_tp=8"),
        ({"tensors": (TensorSpec("a", (0, 4), Split.REPLICATED),)}, "both dims >= 1"),
    ],
)
def test_model_spec_validation(kwargs: dict[str, object], text: str) -> None:
    base: dict[str, object] = {"tensors": (TensorSpec("a", (8, 8), Split.ROW),)}
    with pytest.raises(errors.InvalidArgument, match="is not valid") as info:
        ModelSpec(**{**base, **kwargs})  # type: ignore[arg-type]
    assert text in str(info.value)


def test_synthetic_model_shapes() -> None:
    model = synthetic_model(layers=1, hidden=32, vocab=64)
    names = [t.name for t in model.tensors]
    assert names[0] == "embed_tokens"
    assert names[-2:] == ["norm", "lm_head"]
    assert model.tensor("layers.0.down_proj").shape == (32, 128)
    assert model.tensor("layers.0.down_proj").split is Split.ROW
    assert model.tensor("layers.0.gate_proj").split is Split.COLUMN
    assert model.nbytes == sum(t.shape[0] * t.shape[1] for t in model.tensors) * 2
    with pytest.raises(errors.NotFound):
        model.tensor("nope")
