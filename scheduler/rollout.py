"""Partial rollout: when an RL step's generation ends, what the trainer gets, what is carried.

Pure decisions, shared by the cluster simulator and the real-engine path (the controller
or the RL client ends a step; the gateways abort the unfinished requests, keep their ids
and generated tokens, and resubmit them on the next weights). Nothing here reads a clock
or touches an engine: the caller passes the step's progress and gets a verdict back.

The rule (:class:`RolloutRule`), in the words of the systems that use it:

- ``full`` (verl's default): a step generates ``N`` prompt groups and ends when all of
  them are complete; the trainer takes all ``N``.
- ``partial`` (Kimi k1.5's partial rollout, AReaL's interruptible rollout, APRIL's
  over-provisioning, RollPacker's tail batching): a step keeps ``over_provision x N``
  groups in flight (fresh prompts fill up to that number; carried and waiting groups
  count) and ends by ``end``:

  - ``groups``: once ``N`` groups are complete (APRIL: 2x over-provisioning, stop at the
    original number of groups; RollPacker: 1.25x);
  - ``tokens``: once the step generated ``token_budget`` tokens (Kimi k1.5's fixed
    output-token budget per iteration);
  - ``time``: ``time_budget_s`` seconds after the step started;

  and, whatever the rule, once nothing is in flight. A step never ends before
  ``min_end_s`` (in one-step-asynchronous RL: until the trainer has finished the
  previous batch, since the weights it pushes are what the next step runs on;
  generation goes on meanwhile). At the end, the unfinished responses are carried into
  the next step with their generated prefix (abort, keep the ids, resubmit on the new
  weights; the KV cache computed under the old weights is recomputed, as AReaL does),
  and every token keeps the weight version that produced it.

Staleness. A response's staleness in a batch is the batch's weight version minus the
version of its oldest token: 0 for a response generated within one step (the pipeline's
own one-step lag is not counted: it is the same for every mode). A group is carried (or
waits, complete, for the next batch) only while all of its responses would still be
trainable there, ``(version + 1) - first <= max_staleness``; otherwise it is dropped
whole (the trainer receives only complete groups), its finished responses included.
Dropped responses are counted, never trained on.

What the trainer gets (:func:`close_step`): with ``end = groups`` the ``N`` oldest complete
groups (oldest first token first, then arrival order), the other complete groups waiting
for the next batch (dropped if that would make them too stale); with the other rules
every complete group. ``StepClose`` says which responses were carried, which groups were
dropped, and the trained tokens per weight version (the off-policy share is the part of
them older than the step's own version).

The step's length: :func:`step_seconds`, one function for every mode.

- ``async`` (AReaL, verl's ``fully_async_policy``, Laminar, StaleFlow): the trainer and
  the rollout engines run at once; a "step" is one weight version, the trainer's
  ``N`` groups. New groups start only while they stay within the staleness bound
  (:attr:`RolloutRule.admission_bound`, AReaL's integer ``max_staleness`` or verl's
  fractional ``staleness_threshold``: at most ``(version + 1 + bound) x N`` groups
  started in all, :func:`scheduler.async_rollout.admission_limit`); weights reach the
  engines without a global phase. The step lasts the trainer's training plus its wait
  for samples plus the part of the weight push it blocks on
  (:func:`step_seconds`). The rules of that mode are in :mod:`scheduler.async_rollout`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum

from orchestrrl import errors
from scheduler.compute_state import StepGoal

MIN_OVER_PROVISION = 1.0
MAX_OVER_PROVISION = 2.0  # APRIL and Seer's Partial Rollout baseline issue 2x the prompts
MAX_STALENESS_LIMIT = 16  # AReaL's largest bound is 8 (math); twice that is allowed


class RolloutMode(StrEnum):
    """How a step's generation ends: every group (``full``), by a rule with carry-over
    (``partial``), or never: trainer and rollout run at once (``async``)."""

    FULL = "full"
    PARTIAL = "partial"
    ASYNC = "async"


class StepEnd(StrEnum):
    """The rule that ends a step's generation (``all`` is full rollout's)."""

    ALL = "all"
    GROUPS = "groups"
    TOKENS = "tokens"
    TIME = "time"


PARTIAL_ENDS = (StepEnd.GROUPS, StepEnd.TOKENS, StepEnd.TIME)


@dataclass(frozen=True)
class RolloutRule:
    """The step-end rule (validated by :meth:`problems` / :meth:`check`).

    ``over_provision``: groups kept in flight per group the trainer takes (1.0-2.0;
    1.0 in full mode). ``max_staleness``: weight versions a response may span beyond the
    pipeline's own lag (0-16; AReaL's eta). ``token_budget`` (tokens) and
    ``time_budget_s`` (seconds) are the budgets of ``end = tokens`` and ``end = time``
    and must be 0 otherwise. ``staleness_threshold``: verl's fractional form of the
    asynchronous mode's bound (0-16; 0: ``max_staleness`` is the bound); only with
    ``mode = async``, whose ``end`` is ``all`` (no step end: the trainer takes its
    groups as they complete)."""

    mode: RolloutMode = RolloutMode.FULL
    over_provision: float = 1.0
    max_staleness: int = 1
    end: StepEnd = StepEnd.ALL
    token_budget: int = 0
    time_budget_s: float = 0.0
    staleness_threshold: float = 0.0

    @property
    def partial(self) -> bool:
        return self.mode is RolloutMode.PARTIAL

    @property
    def asynchronous(self) -> bool:
        return self.mode is RolloutMode.ASYNC

    @property
    def admission_bound(self) -> float:
        """The asynchronous mode's staleness bound ``eta``: at most ``(version + 1 +
        eta) x N`` groups started in all (verl's ``staleness_threshold`` when set, else
        AReaL's ``max_staleness``)."""
        if self.staleness_threshold > 0:
            return float(self.staleness_threshold)
        return float(self.max_staleness)

    def problems(self, prefix: str = "rollout") -> list[str]:
        """Every problem of this rule, each naming the key, the value and what is
        allowed (``prefix`` + "." + key)."""
        out: list[str] = []

        def bad(key: str, value: object, allowed: str) -> None:
            out.append(str(errors.field_error(f"{prefix}.{key}", value, allowed)))

        modes = ", ".join(m.value for m in RolloutMode)
        if not isinstance(self.mode, RolloutMode):
            bad("mode", self.mode, f"one of {modes}")
            return out
        op = self.over_provision
        if not (MIN_OVER_PROVISION <= op <= MAX_OVER_PROVISION) or math.isnan(op):
            bad(
                "over_provision",
                op,
                f"a number from {MIN_OVER_PROVISION} to {MAX_OVER_PROVISION} "
                "(prompts started / prompts the trainer takes)",
            )
        elif not self.partial and op != 1.0:
            bad("over_provision", op, '1.0 unless rollout.mode = "partial"')
        st = self.staleness_threshold
        if (
            not isinstance(st, int | float)
            or isinstance(st, bool)
            or math.isnan(st)
            or not 0.0 <= st <= MAX_STALENESS_LIMIT
        ):
            bad(
                "staleness_threshold",
                st,
                f"a number from 0 to {MAX_STALENESS_LIMIT} (verl's fractional bound; 0: "
                "max_staleness is the bound)",
            )
        elif st != 0 and not self.asynchronous:
            bad("staleness_threshold", st, '0 unless rollout.mode = "async"')
        if (
            not isinstance(self.max_staleness, int)
            or isinstance(self.max_staleness, bool)
            or not 0 <= self.max_staleness <= MAX_STALENESS_LIMIT
        ):
            bad(
                "max_staleness",
                self.max_staleness,
                f"an integer from 0 to {MAX_STALENESS_LIMIT} (weight versions a response may span)",
            )
        if not isinstance(self.end, StepEnd):
            bad("end", self.end, "one of " + ", ".join(e.value for e in StepEnd))
            return out
        if self.partial and self.end not in PARTIAL_ENDS:
            bad("end", self.end.value, 'one of groups, tokens, time with rollout.mode = "partial"')
        if not self.partial and self.end is not StepEnd.ALL:
            bad(
                "end",
                self.end.value,
                f'all with rollout.mode = "{self.mode.value}" (full: a step ends when all are '
                "done; async: the trainer takes groups as they complete)",
            )
        for key, value, rule in (
            ("token_budget", self.token_budget, StepEnd.TOKENS),
            ("time_budget_s", self.time_budget_s, StepEnd.TIME),
        ):
            wanted = self.end is rule
            if wanted and not value > 0:
                bad(key, value, f'a number > 0 with rollout.end = "{rule.value}"')
            elif not wanted and value != 0:
                bad(key, value, f'0 unless rollout.end = "{rule.value}"')
        return out

    def check(self, prefix: str = "rollout") -> RolloutRule:
        """This rule, or InvalidArgument listing every problem."""
        found = self.problems(prefix)
        if found:
            raise errors.InvalidArgument("; ".join(found))
        return self


FULL = RolloutRule()


def build_rule(
    *,
    mode: str = "full",
    end: str = "",
    over_provision: float = 1.0,
    max_staleness: int = 1,
    token_budget: int = 0,
    time_budget_s: float = 0.0,
    staleness_threshold: float = 0.0,
    prefix: str = "rollout",
) -> tuple[RolloutRule | None, list[str]]:
    """A rule from plain values (a config file, command-line flags): the rule, or None and
    every problem (each naming ``prefix.key``, the value and what is allowed). ``end``
    empty means the mode's own (``all`` for full, ``groups`` for partial)."""
    problems: list[str] = []
    modes = [m.value for m in RolloutMode]
    if mode not in modes:
        problems.append(
            str(errors.field_error(f"{prefix}.mode", mode, "one of " + ", ".join(modes)))
        )
        return None, problems
    m = RolloutMode(mode)
    ends = [e.value for e in StepEnd]
    if end and end not in ends:
        problems.append(str(errors.field_error(f"{prefix}.end", end, "one of " + ", ".join(ends))))
        return None, problems
    e = StepEnd(end) if end else (StepEnd.GROUPS if m is RolloutMode.PARTIAL else StepEnd.ALL)
    rule = RolloutRule(
        m, over_provision, max_staleness, e, token_budget, time_budget_s, staleness_threshold
    )
    problems += rule.problems(prefix)
    return (None if problems else rule), problems


def groups_in_flight(rule: RolloutRule, groups_per_step: int) -> int:
    """Groups a step keeps open: ``ceil(over_provision x N)``."""
    if groups_per_step < 1:
        raise errors.field_error("groups_per_step", groups_per_step, "an integer >= 1")
    return math.ceil(rule.over_provision * groups_per_step - 1e-9)


def groups_to_start(rule: RolloutRule, groups_per_step: int, open_groups: int) -> int:
    """Fresh prompt groups a step starts: up to :func:`groups_in_flight`, counting the
    ``open_groups`` it begins with (carried unfinished groups and complete groups waiting
    for a batch)."""
    if open_groups < 0:
        raise errors.field_error("open_groups", open_groups, "an integer >= 0")
    return max(0, groups_in_flight(rule, groups_per_step) - open_groups)


@dataclass(frozen=True)
class StepProgress:
    """Where a step's generation stands: seconds since it started, complete groups
    (waiting ones included), tokens generated in this step, responses still in flight
    (running or queued), and the earliest time it may end (``min_end_s``)."""

    elapsed_s: float
    complete_groups: int
    tokens: int
    in_flight: int
    min_end_s: float = 0.0


def step_deadline(rule: RolloutRule, min_end_s: float) -> float:
    """The time (since the step started) at which the step must be checked even if no
    response finishes then: ``min_end_s``, and a ``time`` budget."""
    if rule.end is StepEnd.TIME:
        return max(min_end_s, rule.time_budget_s)
    return min_end_s


def rule_met(rule: RolloutRule, groups_per_step: int, p: StepProgress) -> bool:
    """The rule's own condition (without ``min_end_s``): nothing in flight, or the
    ``end`` condition."""
    if p.in_flight <= 0:
        return True
    if rule.end is StepEnd.GROUPS:
        return p.complete_groups >= groups_per_step
    if rule.end is StepEnd.TOKENS:
        return p.tokens >= rule.token_budget
    if rule.end is StepEnd.TIME:
        return p.elapsed_s >= rule.time_budget_s
    return False


def step_done(rule: RolloutRule, groups_per_step: int, p: StepProgress) -> bool:
    """Whether the step's generation ends now: the rule is met and ``min_end_s`` passed."""
    return p.elapsed_s >= p.min_end_s and rule_met(rule, groups_per_step, p)


def step_goal(rule: RolloutRule, groups_per_step: int, p: StepProgress) -> StepGoal | None:
    """What the compute planner must reach for the step to end under ``rule``, from the
    step's progress ``p`` (None under full rollout: every request must finish).

    ``groups``: the groups still to complete, ``N`` less those complete; ``tokens``: the
    budget less the tokens generated; ``time``: neither (the step ends at the budget or
    when nothing is in flight). ``floor_s``: seconds until the step may end,
    ``min_end_s`` (and a time budget) less the time elapsed."""
    if not rule.partial:
        return None
    if groups_per_step < 1:
        raise errors.field_error("groups_per_step", groups_per_step, "an integer >= 1")
    floor = max(0.0, step_deadline(rule, p.min_end_s) - p.elapsed_s)
    if rule.end is StepEnd.GROUPS:
        return StepGoal(groups=max(0, groups_per_step - p.complete_groups), floor_s=floor)
    if rule.end is StepEnd.TOKENS:
        return StepGoal(tokens=max(0, rule.token_budget - p.tokens), floor_s=floor)
    return StepGoal(floor_s=floor)


# -- closing a step --


@dataclass(frozen=True)
class Piece:
    """``tokens`` tokens generated under weight ``version``."""

    version: int
    tokens: int


@dataclass(frozen=True)
class ResponseState:
    """One response at a step's end: its generated tokens by weight version (oldest
    first) and whether it is finished."""

    id: str
    pieces: tuple[Piece, ...] = ()
    done: bool = False

    @property
    def tokens(self) -> int:
        return sum(p.tokens for p in self.pieces)

    @property
    def first_version(self) -> int | None:
        """The version of its oldest token (None: no token yet)."""
        versions = [p.version for p in self.pieces if p.tokens > 0]
        return min(versions) if versions else None


@dataclass(frozen=True)
class GroupState:
    """A prompt group at a step's end: the responses started for it (``size`` make it
    complete) and its arrival order (earlier groups are trained first)."""

    id: str
    size: int
    order: int
    responses: tuple[ResponseState, ...]

    @property
    def complete(self) -> bool:
        return len(self.responses) >= self.size and all(r.done for r in self.responses)

    @property
    def first_version(self) -> int | None:
        versions = [v for r in self.responses if (v := r.first_version) is not None]
        return min(versions) if versions else None

    @property
    def tokens(self) -> int:
        return sum(r.tokens for r in self.responses)


@dataclass(frozen=True)
class StepClose:
    """What a step's end decides.

    ``trained``: the groups of this step's batch, in training order; ``waiting``:
    complete groups kept for the next batch; ``carried``: the unfinished responses
    resumed in the next step (their groups are ``carried_groups``); ``dropped``: groups
    dropped for staleness, with ``dropped_responses`` and ``dropped_tokens`` (every
    response and generated token of them). ``trained_by_version``: the trained batch's
    response tokens per weight version (oldest first)."""

    version: int
    trained: tuple[str, ...]
    waiting: tuple[str, ...]
    carried: tuple[str, ...]
    carried_groups: tuple[str, ...]
    dropped: tuple[str, ...]
    trained_responses: int
    trained_tokens: int
    dropped_responses: int
    dropped_tokens: int
    trained_by_version: tuple[tuple[int, int], ...]

    @property
    def offpolicy_tokens(self) -> int:
        """Trained tokens generated under a version older than this step's."""
        return sum(t for v, t in self.trained_by_version if v < self.version)


def _stale(first: int | None, version: int, max_staleness: int) -> bool:
    return first is not None and version - first > max_staleness


def close_step(
    rule: RolloutRule, version: int, groups_per_step: int, groups: Iterable[GroupState]
) -> StepClose:
    """The end of a step that generated under weight ``version`` (see the module doc).

    Full mode carries nothing: an unfinished response at its end (which its rule does
    not produce) is dropped with its group."""
    if groups_per_step < 1:
        raise errors.field_error("groups_per_step", groups_per_step, "an integer >= 1")
    every = list(groups)
    seen: set[str] = set()
    for g in every:
        if g.id in seen:
            raise errors.field_error("groups", g.id, "distinct group ids")
        seen.add(g.id)
    carry_limit = rule.max_staleness if rule.partial else -1
    complete = sorted(
        (g for g in every if g.complete),
        key=lambda g: (g.first_version if g.first_version is not None else version, g.order, g.id),
    )
    trained: list[GroupState] = []
    waiting: list[GroupState] = []
    dropped: list[GroupState] = []
    for g in complete:
        if _stale(g.first_version, version, rule.max_staleness if rule.partial else 0):
            dropped.append(g)
        elif rule.end is not StepEnd.GROUPS or len(trained) < groups_per_step:
            trained.append(g)
        elif _stale(g.first_version, version + 1, carry_limit):
            dropped.append(g)
        else:
            waiting.append(g)
    carried: list[str] = []
    carried_groups: list[str] = []
    for g in sorted((g for g in every if not g.complete), key=lambda g: (g.order, g.id)):
        if not rule.partial or _stale(g.first_version, version + 1, carry_limit):
            dropped.append(g)  # a response (finished or not) would be too stale to train
            continue
        unfinished = [r for r in g.responses if not r.done]
        carried_groups.append(g.id)
        carried += [r.id for r in unfinished]
    by_version: dict[int, int] = {}
    for g in trained:
        for r in g.responses:
            for p in r.pieces:
                by_version[p.version] = by_version.get(p.version, 0) + p.tokens
    return StepClose(
        version=version,
        trained=tuple(g.id for g in trained),
        waiting=tuple(g.id for g in waiting),
        carried=tuple(carried),
        carried_groups=tuple(carried_groups),
        dropped=tuple(g.id for g in dropped),
        trained_responses=sum(len(g.responses) for g in trained),
        trained_tokens=sum(g.tokens for g in trained),
        dropped_responses=sum(len(g.responses) for g in dropped),
        dropped_tokens=sum(g.tokens for g in dropped),
        trained_by_version=tuple(sorted((v, t) for v, t in by_version.items() if t)),
    )


# -- the step's length --


@dataclass(frozen=True)
class StepPhases:
    """One RL step's phases: generation (until its rule ended it), training of the
    previous batch (overlapped), and the weight sync after both. ``wait_s`` (asynchronous
    mode): the time the trainer waited for complete groups during the step."""

    gen_s: float
    train_s: float
    sync_s: float
    wait_s: float = 0.0


def step_seconds(mode: RolloutMode, phases: StepPhases) -> float:
    """The step's length. Full and partial rollout run one step asynchronous: generation
    of step k overlaps training on step k-1's batch, and the weight sync waits for both,
    ``max(generation, training) + sync`` (a partial step's generation already lasts at
    least as long as the training, :attr:`StepProgress.min_end_s`). Asynchronous mode:
    generation never pauses the trainer, so a step (one weight version) is the trainer's
    own time: its wait for samples, its training, and the part of the weight push it
    blocks on, ``wait + training + sync``."""
    if mode in (RolloutMode.FULL, RolloutMode.PARTIAL):
        return max(phases.gen_s, phases.train_s) + phases.sync_s
    if mode is RolloutMode.ASYNC:
        return phases.wait_s + phases.train_s + phases.sync_s
    raise errors.field_error("mode", mode, "one of " + ", ".join(m.value for m in RolloutMode))
