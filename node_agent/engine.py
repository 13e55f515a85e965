"""The rollout-engine adapter: what the agent needs from a generation engine.

A real adapter (vLLM, SGLang) and the simulated engine in ``sim_backends.engine``
both satisfy :class:`RolloutEngine`. The layout rule lives here, as a pure function,
so every adapter rejects the same layouts with the same message.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from orchestrrl import errors


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


class RolloutEngine(Protocol):
    """The node's rollout instances, seen as one engine with a tensor-parallel layout."""

    @property
    def gpus(self) -> int: ...

    @property
    def state(self) -> EngineState: ...

    @property
    def tp_layout(self) -> tuple[int, ...]: ...

    def stats(self) -> EngineStats: ...

    async def drain(self) -> None:
        """Stop admitting requests; running requests continue to completion."""

    async def resume(self) -> None:
        """Admit requests again."""

    async def reshard(self, new_layout: Sequence[int]) -> ReshardResult:
        """Pause, change the layout, resume to the prior state; report stage timings."""


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
