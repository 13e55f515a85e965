"""The rollout-engine adapter: what the agent needs from a generation engine.

A real adapter (vLLM, SGLang) and the simulated engine in ``sim_backends.engine``
both satisfy :class:`RolloutEngine`. The layout rule lives here, as a pure function,
so every adapter rejects the same layouts with the same message.
"""

from __future__ import annotations

import enum
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

from orchestrrl import errors
from orchestrrl.limits import MAX_ID_CHARS


class EngineState(enum.Enum):
    RUNNING = "running"
    DRAINED = "drained"
    RESHARDING = "resharding"


@dataclass(frozen=True)
class EngineStats:
    """Load of the engine at one instant."""

    queued_requests: int
    running_requests: int
    tokens_per_s: float
    kv_cache_usage: float  # 0..1, over all instances of the node
    step: int = 0  # the engine's generation-step counter (EngineProgress.step)


MAX_GROUP_CHARS = MAX_ID_CHARS


def check_group(value: object, field_name: str = "group") -> str:
    """A request's sample group: a string of at most MAX_GROUP_CHARS characters ("" =
    none). The RL framework names it (GRPO: the prompt, e.g. its dataset index); the
    controller's length forecast groups siblings by it and remembers it across epochs."""
    if not isinstance(value, str) or len(value) > MAX_GROUP_CHARS:
        shown = value[: MAX_GROUP_CHARS + 1] + "..." if isinstance(value, str) else value
        raise errors.field_error(
            field_name, shown, f"a string of at most {MAX_GROUP_CHARS} characters"
        )
    return value


class RequestProgress(NamedTuple):
    """One request of the current generation step (a named tuple: an engine builds one
    per request at every telemetry sample, so it must be cheap)."""

    request_id: str
    instance: int  # index into tp_layout; -1 while queued
    prompt_tokens: int
    generated_tokens: int
    max_tokens: int  # the request's output cap; 0 = the engine's default
    group: str = ""  # its sample group (GRPO: the prompt); "" = none


@dataclass(frozen=True)
class EngineProgress:
    """Where the current generation step stands (EngineSample.requests, .completed_lengths,
    .completed_groups, .step): every running and queued request, and the output lengths
    of the requests this engine completed in the step, in completion order, with their
    groups (empty when none had one)."""

    step: int
    requests: tuple[RequestProgress, ...] = ()
    completed_lengths: tuple[int, ...] = ()
    completed_groups: tuple[str, ...] = ()


@dataclass(frozen=True)
class StageTiming:
    stage: str
    seconds: float


@dataclass(frozen=True)
class ReshardResult:
    old_layout: tuple[int, ...]
    new_layout: tuple[int, ...]
    stages: tuple[StageTiming, ...]
    bytes_moved: int
    message: str


@dataclass(frozen=True)
class MigratingRequest:
    """One request's state while it moves between nodes (see ExportRequests)."""

    request_id: str
    prompt_tokens: int
    generated_tokens: int
    max_tokens: int  # 0: the engine's default
    source_instance: int  # index into the source's layout; -1: it was queued
    kv_bytes: int  # KV cache held for it on the source (0: none)
    prompt_token_ids: tuple[int, ...] = ()
    output_token_ids: tuple[int, ...] = ()
    engine_state: bytes = b""  # engine-specific (sampling state; the simulator's length)
    group: str = ""  # the request's sample group ("": none)


@dataclass(frozen=True)
class Destination:
    """Where exported requests went (ResolveExport): the node and its agent's address."""

    node: str
    address: str


@dataclass(frozen=True)
class ImportResult:
    admitted: tuple[str, ...]
    instance: int
    bytes_moved: int  # KV bytes received
    recomputed_tokens: int  # tokens prefilled to rebuild KV caches
    stages: tuple[StageTiming, ...]
    message: str


class RolloutEngine(Protocol):
    """The node's rollout instances, seen as one engine with a tensor-parallel layout."""

    @property
    def gpus(self) -> int: ...

    @property
    def state(self) -> EngineState: ...

    @property
    def tp_layout(self) -> tuple[int, ...]: ...

    @property
    def kv_import(self) -> bool:
        """It can admit a migrating request with its KV cache moved from elsewhere."""

    @property
    def max_num_seqs(self) -> int:
        """Sequences one instance decodes at once (0: unknown)."""

    def stats(self) -> EngineStats: ...

    def progress(self) -> EngineProgress:
        """Per-request progress of the current step (read once per telemetry sample)."""

    async def pause(self) -> None:
        """Stop generating: no admissions, no decoding; in-flight requests keep their state
        (the reshard's pause stage). Idempotent."""

    async def unpause(self) -> None:
        """Generate again after :meth:`pause` (in the drained or running state as before)."""

    async def drain(self) -> None:
        """Stop admitting requests; running requests continue to completion."""

    async def resume(self) -> None:
        """Admit requests again."""

    async def reshard(self, new_layout: Sequence[int]) -> ReshardResult:
        """Pause, change the layout, resume to the prior state; report stage timings."""

    async def export_requests(
        self, request_ids: Sequence[str]
    ) -> tuple[tuple[MigratingRequest, ...], tuple[str, ...]]:
        """Take these requests off the engine (they stop decoding) and return their state,
        and the ids the engine does not have (finished meanwhile, or unknown)."""

    async def import_requests(
        self, requests: Sequence[MigratingRequest], instance: int, recompute: bool
    ) -> ImportResult:
        """Admit every request on ``instance`` (KV moved, or recomputed when ``recompute``),
        or none: FailedPrecondition when the engine is not admitting or the instance lacks
        room, InvalidArgument for a bad instance or a request the engine already has."""

    async def restore_requests(self, requests: Sequence[MigratingRequest]) -> tuple[str, ...]:
        """Put exported requests back (their instance if it still has room, else any, else
        the queue): never refuses, so nothing is lost. Returns the ids restored."""

    async def release_requests(
        self, requests: Sequence[MigratingRequest], destination: Destination | None
    ) -> tuple[str, ...]:
        """The destination admitted exported requests: an engine whose clients read them
        here follows them there (the gateway); one that keeps no client state forgets
        them. Returns the ids released."""


def busy_fraction(stats: EngineStats) -> float:
    """A 0..1 load figure for the GPUs: idle without requests; otherwise decode kernels run
    back to back and a fuller KV cache (bigger batches) works the GPUs harder."""
    if stats.running_requests == 0:
        return 0.0
    return min(1.0, 0.5 + 0.5 * stats.kv_cache_usage)


def validate_layout(layout: Sequence[int], gpus: int, field: str = "tp_layout") -> tuple[int, ...]:
    """Return ``layout`` as a tuple if every degree is a power of two in 1..gpus and the
    degrees sum to ``gpus``; raise :class:`orchestrrl.errors.InvalidArgument` otherwise."""
    value = list(layout)
    if not value:
        raise errors.field_error(field, value, f"need at least one instance; degrees sum to {gpus}")
    bad = [t for t in value if t < 1 or t > gpus or t & (t - 1)]
    if bad:
        raise errors.field_error(
            field, value, f"every TP degree must be a power of two in 1..{gpus} (got {bad})"
        )
    if sum(value) != gpus:
        raise errors.field_error(
            field, value, f"TP degrees must sum to the node's GPU count {gpus} (sum {sum(value)})"
        )
    return tuple(value)


def check_import_ids(requests: Sequence[MigratingRequest]) -> None:
    """An import names each request once: raise :class:`orchestrrl.errors.InvalidArgument`
    naming the repeated ids otherwise (before anything is admitted)."""
    dup = sorted(i for i, n in Counter(m.request_id for m in requests).items() if n > 1)
    if dup:
        raise errors.field_error("requests", dup, "each request id once per import")


def default_layout(gpus: int) -> tuple[int, ...]:
    """TP=2 instances over the node (a common rollout default), plus TP=1 for an odd GPU."""
    return (2,) * (gpus // 2) + (1,) * (gpus % 2)


def parse_layout(text: str, gpus: int | None, field: str = "--tp-layout") -> tuple[int, ...]:
    """Parse ``2,2,2,2``; validate it against ``gpus``, or only its degrees when the GPU
    count is not known yet (it is checked again once it is)."""
    parts = [p.strip() for p in text.split(",")]
    if not all(p.isdigit() for p in parts):
        raise errors.field_error(field, text, "expected comma-separated TP degrees, e.g. 2,2,2,2")
    layout = [int(p) for p in parts]
    if gpus is not None:
        return validate_layout(layout, gpus, field)
    bad = [t for t in layout if t < 1 or t & (t - 1)]
    if bad:
        raise errors.field_error(field, text, f"every TP degree must be a power of two (got {bad})")
    return tuple(layout)
