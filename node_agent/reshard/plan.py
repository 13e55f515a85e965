"""Pure planning of a tensor-parallel re-layout of one node's rollout weights.

A *layout* is a tuple of TP degrees over the node's G GPU ranks; instance ``i`` owns
consecutive ranks, so ``(4, 2, 2)`` is ranks 0-3, 4-5 and 6-7. Inside an instance of
degree ``t`` the rank with local index ``k`` holds part ``k`` of ``t`` equal parts of every
split tensor along its split dimension (Megatron-style):

- column-parallel weights (QKV, gate/up, embeddings, LM head) split dim 0;
- row-parallel weights (o_proj, down_proj) split dim 1;
- replicated weights (norms) are held whole by every rank.

:func:`plan_reshard` turns an old and a new layout into frozen values: the bytes each
rank keeps (:class:`LocalCopy`, never on the network) and the network moves (:class:`Move`).
Every needed byte comes from exactly one source; a piece that several ranks hold (one
per old instance) is taken from the one that has sent the least so far, so the sending
is spread over all holders instead of funnelled through one rank. Nothing here touches
torch, a socket or the clock.
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from node_agent.engine import validate_layout
from orchestrrl import errors

ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4}


class Split(enum.Enum):
    COLUMN = "column"  # output features: split dim 0
    ROW = "row"  # input features: split dim 1
    REPLICATED = "replicated"


@dataclass(frozen=True)
class TensorSpec:
    """A named 2-D weight and how tensor parallelism splits it."""

    name: str
    shape: tuple[int, int]
    split: Split

    @property
    def dim(self) -> int:
        """The dimension that shards cut (0 for replicated: the whole extent)."""
        return 1 if self.split is Split.ROW else 0

    @property
    def extent(self) -> int:
        """Length along :attr:`dim`."""
        return self.shape[self.dim]

    @property
    def line_elements(self) -> int:
        """Elements in one unit of :attr:`extent` (a row, or a column for ROW)."""
        return self.shape[1 - self.dim]


@dataclass(frozen=True)
class ModelSpec:
    """The weights of one model replica; every split extent divides by ``max_tp``."""

    tensors: tuple[TensorSpec, ...]
    dtype: str = "bfloat16"
    max_tp: int = 8

    def __post_init__(self) -> None:
        if self.dtype not in ITEMSIZE:
            raise errors.field_error("dtype", self.dtype, f"expected one of {', '.join(ITEMSIZE)}")
        if self.max_tp < 1 or self.max_tp & (self.max_tp - 1):
            raise errors.field_error("max_tp", self.max_tp, "expected a power of two")
        if not self.tensors:
            raise errors.field_error("tensors", [], "a model has at least one tensor")
        names = [t.name for t in self.tensors]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise errors.field_error("tensors", duplicates, "tensor names must be unique")
        for t in self.tensors:
            if min(t.shape) < 1:
                raise errors.field_error(f"tensors[{t.name}].shape", t.shape, "both dims >= 1")
            if t.split is not Split.REPLICATED and t.extent % self.max_tp:
                raise errors.field_error(
                    f"tensors[{t.name}].shape",
                    t.shape,
                    f"dim {t.dim} ({t.split.value}-parallel) must divide by max_tp={self.max_tp}",
                )

    @property
    def itemsize(self) -> int:
        return ITEMSIZE[self.dtype]

    @property
    def nbytes(self) -> int:
        return sum(t.shape[0] * t.shape[1] for t in self.tensors) * self.itemsize

    def tensor(self, name: str) -> TensorSpec:
        for t in self.tensors:
            if t.name == name:
                return t
        raise errors.NotFound(f"tensor {name!r} is not part of the model")

    def span_bytes(self, spec: TensorSpec, length: int) -> int:
        return length * spec.line_elements * self.itemsize


def synthetic_model(
    layers: int = 4,
    hidden: int = 256,
    ffn: int | None = None,
    vocab: int = 1024,
    dtype: str = "bfloat16",
    max_tp: int = 8,
) -> ModelSpec:
    """A Llama/Qwen-shaped decoder: embeddings, per-layer norms, Q/K/V/O, gate/up/down."""
    ffn = 4 * hidden if ffn is None else ffn
    col, row, rep = Split.COLUMN, Split.ROW, Split.REPLICATED
    tensors = [TensorSpec("embed_tokens", (vocab, hidden), col)]
    for i in range(layers):
        p = f"layers.{i}."
        tensors += [
            TensorSpec(p + "input_layernorm", (1, hidden), rep),
            TensorSpec(p + "q_proj", (hidden, hidden), col),
            TensorSpec(p + "k_proj", (hidden, hidden), col),
            TensorSpec(p + "v_proj", (hidden, hidden), col),
            TensorSpec(p + "o_proj", (hidden, hidden), row),
            TensorSpec(p + "post_attention_layernorm", (1, hidden), rep),
            TensorSpec(p + "gate_proj", (ffn, hidden), col),
            TensorSpec(p + "up_proj", (ffn, hidden), col),
            TensorSpec(p + "down_proj", (hidden, ffn), row),
        ]
    tensors += [TensorSpec("norm", (1, hidden), rep), TensorSpec("lm_head", (vocab, hidden), col)]
    return ModelSpec(tuple(tensors), dtype=dtype, max_tp=max_tp)


@dataclass(frozen=True, order=True)
class Span:
    """Half-open range ``[start, stop)`` along a tensor's split dimension."""

    start: int
    stop: int

    def __post_init__(self) -> None:
        if not 0 <= self.start <= self.stop:
            raise ValueError(f"bad span [{self.start}, {self.stop})")

    def __len__(self) -> int:
        return self.stop - self.start

    def contains(self, other: Span) -> bool:
        return self.start <= other.start and other.stop <= self.stop

    def intersect(self, other: Span) -> Span | None:
        start, stop = max(self.start, other.start), min(self.stop, other.stop)
        return Span(start, stop) if start < stop else None

    def relative_to(self, origin: int) -> Span:
        return Span(self.start - origin, self.stop - origin)


@dataclass(frozen=True)
class Placement:
    """Where a rank sits in a layout."""

    instance: int
    first_rank: int
    tp: int
    local_rank: int


def placement(layout: Sequence[int], rank: int) -> Placement:
    first = 0
    for i, tp in enumerate(layout):
        if first <= rank < first + tp:
            return Placement(i, first, tp, rank - first)
        first += tp
    raise errors.field_error("rank", rank, f"not in 0..{sum(layout) - 1} of layout {list(layout)}")


def instance_ranks(layout: Sequence[int]) -> tuple[range, ...]:
    """The ranks of each instance, in order."""
    out, first = [], 0
    for tp in layout:
        out.append(range(first, first + tp))
        first += tp
    return tuple(out)


def shard_span(spec: TensorSpec, layout: Sequence[int], rank: int) -> Span:
    """The part of ``spec`` (global coordinates along its split dim) ``rank`` holds."""
    if spec.split is Split.REPLICATED:
        return Span(0, spec.extent)
    p = placement(layout, rank)
    part = spec.extent // p.tp
    return Span(p.local_rank * part, (p.local_rank + 1) * part)


def shard_shape(spec: TensorSpec, span: Span) -> tuple[int, int]:
    rows, cols = spec.shape
    return (len(span), cols) if spec.dim == 0 else (rows, len(span))


def shard_bytes(model: ModelSpec, layout: Sequence[int], rank: int) -> int:
    """Weight bytes ``rank`` holds in ``layout``."""
    return sum(model.span_bytes(t, len(shard_span(t, layout, rank))) for t in model.tensors)


def check_fits(
    model: ModelSpec, layout: Sequence[int], gpus: int, memory_bytes: int | None
) -> tuple[int, ...]:
    """Validate ``layout`` for ``gpus`` GPUs of ``memory_bytes`` each (None: unchecked) and
    this model; raise :class:`orchestrrl.errors.InvalidArgument` naming what does not fit."""
    value = validate_layout(layout, gpus)
    too_wide = [t for t in value if t > model.max_tp]
    if too_wide:
        raise errors.field_error(
            "tp_layout", list(value), f"the model splits at most {model.max_tp} ways"
        )
    if memory_bytes is not None:
        need = max(shard_bytes(model, value, r) for r in range(gpus))
        if need > memory_bytes:
            raise errors.field_error(
                "tp_layout",
                list(value),
                f"a rank would hold {need / 2**30:.2f} GiB of weights but a GPU has "
                f"{memory_bytes / 2**30:.2f} GiB; use larger TP degrees",
            )
    return value


@dataclass(frozen=True)
class Move:
    """Bytes sent over the network: ``src`` is local to the sender's old shard, ``dst``
    local to the receiver's new shard, both along the tensor's split dimension."""

    src_rank: int
    dst_rank: int
    tensor: str
    src: Span
    dst: Span
    nbytes: int


@dataclass(frozen=True)
class LocalCopy:
    """Bytes a rank already holds and keeps (old shard ``src`` -> new shard ``dst``)."""

    rank: int
    tensor: str
    src: Span
    dst: Span
    nbytes: int


@dataclass(frozen=True)
class ReshardPlan:
    gpus: int
    old_layout: tuple[int, ...]
    new_layout: tuple[int, ...]
    moves: tuple[Move, ...]
    local: tuple[LocalCopy, ...]

    @property
    def is_empty(self) -> bool:
        """Nothing crosses the network."""
        return not self.moves

    @property
    def bytes_moved(self) -> int:
        return sum(m.nbytes for m in self.moves)

    @property
    def bytes_kept(self) -> int:
        return sum(c.nbytes for c in self.local)

    def sent_bytes(self, rank: int) -> int:
        return sum(m.nbytes for m in self.moves if m.src_rank == rank)

    def received_bytes(self, rank: int) -> int:
        return sum(m.nbytes for m in self.moves if m.dst_rank == rank)

    def moves_of(self, rank: int) -> Iterator[tuple[int, Move]]:
        """``(index, move)`` for the moves ``rank`` sends or receives, in plan order (the
        index is the same on both ends, so it can tag the message)."""
        for i, m in enumerate(self.moves):
            if rank in (m.src_rank, m.dst_rank):
                yield i, m


def plan_reshard(
    model: ModelSpec, old_layout: Sequence[int], new_layout: Sequence[int]
) -> ReshardPlan:
    """The transfers that take every rank from its ``old_layout`` shard to its
    ``new_layout`` shard. Both layouts must be valid for the same GPU count."""
    old, new = tuple(old_layout), tuple(new_layout)
    gpus = sum(old)
    if sum(new) != gpus:
        raise errors.field_error(
            "new_layout", list(new), f"must cover the same {gpus} GPUs as {list(old)}"
        )
    load = [0] * gpus  # bytes each rank sends so far, over all tensors
    moves: list[Move] = []
    local: list[LocalCopy] = []
    for spec in model.tensors:
        old_spans = [shard_span(spec, old, r) for r in range(gpus)]
        new_spans = [shard_span(spec, new, r) for r in range(gpus)]
        cuts = sorted({b for s in old_spans + new_spans for b in (s.start, s.stop)})
        for dst in range(gpus):
            need, have = new_spans[dst], old_spans[dst]
            kept = need.intersect(have)
            if kept is not None:
                local.append(
                    LocalCopy(
                        dst,
                        spec.name,
                        kept.relative_to(have.start),
                        kept.relative_to(need.start),
                        model.span_bytes(spec, len(kept)),
                    )
                )
            pending: Move | None = None
            for a, b in itertools.pairwise(cuts):
                piece = Span(a, b)
                if not need.contains(piece) or (kept is not None and kept.contains(piece)):
                    continue
                holders = [r for r in range(gpus) if r != dst and old_spans[r].contains(piece)]
                src = min(holders, key=lambda r: (load[r], (r - dst) % gpus))
                nbytes = model.span_bytes(spec, len(piece))
                load[src] += nbytes
                src_span = piece.relative_to(old_spans[src].start)
                dst_span = piece.relative_to(need.start)
                if (
                    pending is not None
                    and pending.src_rank == src
                    and pending.src.stop == src_span.start
                    and pending.dst.stop == dst_span.start
                ):
                    pending = Move(
                        src,
                        dst,
                        spec.name,
                        Span(pending.src.start, src_span.stop),
                        Span(pending.dst.start, dst_span.stop),
                        pending.nbytes + nbytes,
                    )
                    continue
                if pending is not None:
                    moves.append(pending)
                pending = Move(src, dst, spec.name, src_span, dst_span, nbytes)
            if pending is not None:
                moves.append(pending)
    return ReshardPlan(gpus, old, new, tuple(moves), tuple(local))
