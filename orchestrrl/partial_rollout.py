"""Partial rollout on real gateways: the pure decisions of ``rollout.PartialRollout``.

Nothing here reads a clock or touches a gateway: the shell passes what it observed (the
responses of each open group, their tokens per weight version, the time since the step
began) and gets a verdict back. The rule and its semantics are the simulator's
(:mod:`scheduler.rollout`: ``over_provision``, ``max_staleness``, ``end`` = groups |
tokens | time and its budget); so is the decision at a step's end
(:func:`scheduler.rollout.close_step`: which complete groups the trainer takes, which wait,
which unfinished responses are carried and which groups are dropped as too stale).

Weight versions on the wire are labels (``"0"``, ``"step-7"``); a partial rollout orders
them by when it was first told of each (:func:`version_order`), and a token whose label it
was never told of is an error (its engine ran weights the caller did not push).

Staleness, as in the simulator: a response carried out of a step that ran on version
``v`` is trained at ``v + 1`` at the earliest; it is carried only while ``(v + 1) - first
<= max_staleness`` (``first``: the version of its oldest token), else its whole group is
dropped and counted. Complete groups are trained only while ``v - first <=
max_staleness``. An always-running (asynchronous) rollout can reuse the same pieces:
:func:`pieces_of`, :func:`group_state`, :func:`trainable_complete`, :func:`close_step`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence

from orchestrrl import errors
from scheduler.rollout import (
    GroupState,
    Piece,
    ResponseState,
    RolloutMode,
    RolloutRule,
    StepClose,
    StepEnd,
    StepProgress,
    build_rule,
    close_step,
    groups_to_start,
    step_done,
)

__all__ = [
    "GroupState",
    "Piece",
    "ResponseState",
    "RolloutRule",
    "StepClose",
    "StepEnd",
    "StepProgress",
    "check_rule",
    "close_step",
    "group_state",
    "groups_to_start",
    "offpolicy_share",
    "partial_rule",
    "pieces_from_counts",
    "pieces_of",
    "progress",
    "step_done",
    "tokens_by_version",
    "too_stale",
    "trainable_complete",
    "version_order",
]


def partial_rule(
    *,
    over_provision: float = 1.5,
    max_staleness: int = 1,
    end: str = "groups",
    token_budget: int = 0,
    time_budget_s: float = 0.0,
) -> RolloutRule:
    """The partial-rollout rule from plain values, or InvalidArgument naming every bad
    field (``rollout.<key>``, the simulator's keys), its value and the allowed range."""
    problems: list[str] = []
    for key, value, kind in (
        ("over_provision", over_provision, "a number"),
        ("max_staleness", max_staleness, "an integer"),
        ("token_budget", token_budget, "an integer"),
        ("time_budget_s", time_budget_s, "a number"),
    ):
        ok = isinstance(value, int) if kind == "an integer" else isinstance(value, int | float)
        if not ok or isinstance(value, bool):
            problems.append(str(errors.field_error(f"rollout.{key}", value, kind)))
    if not isinstance(end, str):
        problems.append(str(errors.field_error("rollout.end", end, "groups, tokens or time")))
    if problems:
        raise errors.InvalidArgument("; ".join(problems))
    rule, problems = build_rule(
        mode="partial",
        end=end or "groups",
        over_provision=float(over_provision),
        max_staleness=max_staleness,
        token_budget=token_budget,
        time_budget_s=float(time_budget_s),
    )
    if rule is None:
        raise errors.InvalidArgument("; ".join(problems))
    return rule


def check_rule(rule: RolloutRule) -> RolloutRule:
    """``rule`` if it is a valid partial-rollout rule (the shell takes only those)."""
    if not isinstance(rule, RolloutRule) or rule.mode is not RolloutMode.PARTIAL:
        raise errors.field_error(
            "rule", getattr(rule, "mode", rule), 'a RolloutRule with mode = "partial"'
        )
    return rule.check()


def version_order(known: Sequence[str], version: str) -> tuple[str, ...]:
    """The versions a rollout has run on, oldest first, after it is told ``version``
    (appended when new; a version already known must be the newest: weights never go
    back)."""
    if not isinstance(version, str) or not 1 <= len(version) <= 128:
        raise errors.field_error("version", version, "a weight version label of 1-128 characters")
    if version in known:
        if known[-1] != version:
            raise errors.field_error(
                "version",
                version,
                f"the newest version ({known[-1]!r}) or a new one: weights never go back",
            )
        return tuple(known)
    return (*known, version)


def pieces_of(versions: Sequence[str], order: Sequence[str]) -> tuple[Piece, ...]:
    """A response's tokens by version (runs, oldest first) from its per-token labels;
    FailedPrecondition naming a label not in ``order`` (weights the caller never
    announced)."""
    index = {v: i for i, v in enumerate(order)}
    out: list[Piece] = []
    for label in versions:
        k = index.get(label)
        if k is None:
            raise errors.FailedPrecondition(
                f"a token carries weight version {label!r}, which this rollout was never "
                f"told of (known: {errors.listed(order)}): did a weight update skip it?"
            )
        if out and out[-1].version == k:
            out[-1] = Piece(k, out[-1].tokens + 1)
        else:
            out.append(Piece(k, 1))
    return tuple(out)


def pieces_from_counts(counts: Mapping[int, int]) -> tuple[Piece, ...]:
    """Pieces from tokens counted per version index (a response still in flight, whose
    tokens the shell attributed to the version it was told of when they arrived)."""
    return tuple(Piece(v, t) for v, t in sorted(counts.items()) if t > 0)


def group_state(
    group_id: str,
    size: int,
    order: int,
    responses: Iterable[tuple[str, bool, Sequence[Piece]]],
) -> GroupState:
    """A group as :func:`close_step` sees it: its id, samples (``size``), arrival order,
    and per response started (id, done, pieces)."""
    return GroupState(
        group_id,
        size,
        order,
        tuple(ResponseState(rid, tuple(p), done) for rid, done, p in responses),
    )


def too_stale(first: int | None, trained_at: int, max_staleness: int) -> bool:
    """Whether a response whose oldest token is of version ``first`` (None: no token
    yet) is beyond ``max_staleness`` when trained at version ``trained_at``."""
    return first is not None and trained_at - first > max_staleness


def trainable_complete(rule: RolloutRule, version: int, groups: Iterable[GroupState]) -> int:
    """Complete groups the trainer could take at ``version`` (not too stale): what the
    ``groups`` rule counts."""
    return sum(
        1
        for g in groups
        if g.complete and not too_stale(g.first_version, version, rule.max_staleness)
    )


def progress(
    rule: RolloutRule,
    version: int,
    groups: Sequence[GroupState],
    *,
    elapsed_s: float,
    tokens: int,
) -> StepProgress:
    """Where a step stands: its complete trainable groups, the tokens it received and
    the responses still in flight (those started but unfinished, and those of a group
    not all started)."""
    if not math.isfinite(elapsed_s) or elapsed_s < 0:
        raise errors.field_error("elapsed_s", elapsed_s, "seconds >= 0")
    in_flight = sum(
        sum(1 for r in g.responses if not r.done) + max(0, g.size - len(g.responses))
        for g in groups
    )
    return StepProgress(elapsed_s, trainable_complete(rule, version, groups), tokens, in_flight)


def tokens_by_version(
    samples: Iterable[Sequence[str]],
) -> tuple[tuple[str, int], ...]:
    """Tokens per version label over the samples' per-token labels, in first-seen order."""
    counts: dict[str, int] = {}
    for versions in samples:
        for v in versions:
            counts[v] = counts.get(v, 0) + 1
    return tuple(counts.items())


def offpolicy_share(by_version: Sequence[tuple[str, int]], version: str) -> float:
    """The share of tokens made by another version than ``version`` (0 of nothing)."""
    total = sum(t for _, t in by_version)
    return sum(t for v, t in by_version if v != version) / total if total else 0.0
