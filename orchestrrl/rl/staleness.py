"""Asynchronous RL on real gateways: the pure decisions of :mod:`orchestrrl.rl.async_groups`.

The rules are the simulator's (:mod:`scheduler.async_rollout`): a group may start only
while the groups started in all stay within ``(v + 1 + max_staleness) x N`` (AReaL's
admission rule, :func:`scheduler.async_rollout.admission_limit`; ``v x N`` groups the
trainer has consumed); the trainer takes complete groups oldest first and a group whose
oldest token is more than ``max_lag`` versions behind the weights it would be trained on
is dropped whole and counted, never trained (:func:`scheduler.async_rollout.take_batch`).
What the real path adds: weight versions arrive as the gateways' labels (the trainer's
version count as text, ``"0"``, ``"1"``, ...), one per token; a group's first version is
its oldest token's; and how many groups to start now also respects a cap on the groups
in flight.

Nothing here reads a clock or talks to a gateway.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence

from orchestrrl import errors
from orchestrrl.checkpoint import version_count
from scheduler.async_rollout import CompleteGroup, admission_limit, version_lag

__all__ = [
    "STALE",
    "bad_token_versions",
    "complete_group",
    "first_version",
    "gateway_stopped",
    "groups_to_start",
    "split_stale",
    "tokens_by_version",
    "version_number",
]


STALE = "stale"  # the finish reason of a response a gateway stopped beyond max_staleness


def gateway_stopped(finish_reasons: Iterable[str]) -> bool:
    """Whether a gateway stopped one of a group's responses as over-stale (finish reason
    ``"stale"``: new weights landed more than ``max_staleness`` versions past its oldest
    token): the group is over-stale, dropped whole like one the trainer finds too old."""
    return any(r == STALE for r in finish_reasons)


def version_number(label: str) -> int:
    """A weight version label as the trainer's count (``"3"`` -> 3); InvalidArgument
    naming a label that is not one (the engines ran weights this loop did not push)."""
    count = version_count(label)
    if count is None:
        raise errors.field_error(
            "weight_version", label, "the trainer's version count as digits (e.g. '3')"
        )
    return count


def first_version(samples: Iterable[Sequence[str]], started_at: int) -> int:
    """The version of a group's oldest token from its samples' per-token labels;
    ``started_at`` (the trainer's version when it started) when no sample has a token."""
    versions = [version_number(v) for s in samples for v in s]
    return min(versions) if versions else started_at


def tokens_by_version(samples: Iterable[Sequence[str]]) -> dict[int, int]:
    """Tokens per version over a group's samples."""
    out: dict[int, int] = {}
    for s in samples:
        for v in s:
            k = version_number(v)
            out[k] = out.get(k, 0) + 1
    return out


def complete_group(
    name: str,
    samples: Sequence[Sequence[str]],
    prompt_tokens: int,
    started_at: int,
) -> CompleteGroup:
    """A finished group as the trainer's batch rule sees it (``samples``: each response's
    per-token version labels)."""
    return CompleteGroup(
        name,
        first_version(samples, started_at),
        prompt_tokens * len(samples) + sum(len(s) for s in samples),
        len(samples),
    )


def groups_to_start(
    max_staleness: float,
    consumed_groups: int,
    batch_groups: int,
    started_groups: int,
    in_flight_groups: int,
    max_in_flight_groups: int,
) -> int:
    """Groups to start now: as many as the admission bound leaves (``floor(consumed +
    (1 + max_staleness) x N) - started``) and the cap on groups in flight allows, never
    fewer than 0."""
    if started_groups < 0 or in_flight_groups < 0 or in_flight_groups > started_groups:
        raise errors.field_error(
            "in_flight_groups",
            in_flight_groups,
            f"an integer from 0 to the groups started ({started_groups})",
        )
    if max_in_flight_groups < 1:
        raise errors.field_error("max_in_flight_groups", max_in_flight_groups, "an integer >= 1")
    limit = admission_limit(max_staleness, consumed_groups, batch_groups)
    return max(0, min(limit - started_groups, max_in_flight_groups - in_flight_groups))


def bad_token_versions(versions: Sequence[str], newest: int) -> bool:
    """Whether a response's per-token labels are wrong for a trainer that has pushed up
    to ``newest``: a version beyond it (weights nobody pushed), or a token of an older
    version after a newer one (an engine went back)."""
    vs = [version_number(v) for v in versions]
    return any(b < a for a, b in itertools.pairwise(vs)) or any(v > newest for v in vs)


def split_stale(
    queue: Sequence[CompleteGroup], version: int, max_lag: int
) -> tuple[tuple[CompleteGroup, ...], tuple[CompleteGroup, ...]]:
    """``(keep, stale)``: the waiting groups still trainable at ``version`` and those
    beyond ``max_lag``, each in queue order. A group's lag only grows with the trainer's
    version, so a stale group is dropped as soon as it is seen: waiting for a full batch
    first would keep it under the admission bound and could stall the producer."""
    keep = tuple(g for g in queue if version_lag(version, g.first_version) <= max_lag)
    stale = tuple(g for g in queue if version_lag(version, g.first_version) > max_lag)
    return keep, stale
