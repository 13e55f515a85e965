"""Asynchronous RL: the rules of a run whose trainer and rollout engines never wait for a phase.

Pure decisions, shared by the cluster simulator and the real-engine path. In this mode
(:attr:`scheduler.rollout.RolloutMode.ASYNC`) the trainer trains version ``v`` of the
weights on ``N`` complete prompt groups, pushes version ``v + 1`` and goes on, while the
engines keep generating; a group's tokens each carry the version that produced them.

- **Admission** (:func:`admission_limit`): a new group may start only while the groups
  started in all stay within ``(v + 1 + eta) x N``, ``v`` the trainer's version (the
  ``v x N`` groups it has consumed). With an integer ``eta`` that is AReaL's rule
  (arXiv 2505.24298, section 5: ``N_r <= (i + eta + 1) B``); verl's fully-async recipe
  writes the same rule with a fractional ``staleness_threshold`` (its rollouter starts at
  most ``(1 + staleness_threshold) x N`` groups between two syncs, counting those still
  in flight or queued from before: ``fully_async_rollouter.py``, ``max_required_samples``
  and ``staleness_samples``).
- **Lag** (:func:`version_lag`): a trained group's lag is the trainer's version minus the
  version of its oldest token. A group whose lag exceeds ``max_lag`` is dropped whole and
  counted, never trained on (:func:`take_batch`; verl drops none: ``max_lag`` None).
- **The batch** (:func:`take_batch`): the trainer takes complete groups oldest first
  (completion order, as verl's message queue hands them out).
- **Weights** (:class:`WeightUpdate`): ``global`` is verl's: the trainer syncs every
  engine at once and they pause (partial rollout aborts the requests in flight and resumes
  them after, their KV cache recomputed); ``relay`` is Laminar's: the trainer pushes once
  to relay copies in the rollout nodes' host memory and goes on; an engine loads the new
  version from its node's relay when its running batch drains (``pull = drain``) or at
  once, aborting and resuming its requests (``pull = abort``):
  :func:`update_action`.
- **Circuit leases** (:func:`leased_transfer_s`): a weight-broadcast wave or a bulk
  repack move gets extra circuits for ``lease_s`` seconds; what is left after the lease
  runs on the standing circuits.

Every bad setting is reported with its key, its value and what is allowed
(:meth:`AsyncPolicy.problems`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum

from orchestrrl import errors

MAX_LAG_LIMIT = 64  # versions; AReaL's largest bound is 8
MAX_LOCAL_UPDATES = 64  # verl's trigger_parameter_sync_step is 1-16 in its recipes
MAX_LEASE_S = 600.0


class WeightUpdate(StrEnum):
    """How a new version reaches the engines."""

    GLOBAL = "global"  # verl: one sync to every engine, all of them paused
    RELAY = "relay"  # Laminar: push once to relays, engines load on their own


class Pull(StrEnum):
    """When an engine loads a version its relay holds (``relay`` updates)."""

    DRAIN = "drain"  # once its running batch is empty (no new request admitted meanwhile)
    ABORT = "abort"  # at once: abort, load, resume (KV recomputed)


class Action(StrEnum):
    """What an engine does when its relay holds a newer version (:func:`update_action`)."""

    LOAD = "load"  # nothing runs: load now
    ABORT = "abort"  # abort the running requests, load, resume them
    DRAIN = "drain"  # admit nothing new; load once the running ones finish
    KEEP = "keep"  # already on the newest version


def admission_limit(bound: float, consumed_groups: int, batch_groups: int) -> int:
    """Groups that may have been started in all: ``floor(consumed + (1 + bound) x N)``
    (the module doc; ``consumed`` = the trainer's version x ``N``)."""
    if not (bound >= 0 and math.isfinite(bound)):
        raise errors.field_error("bound", bound, "a finite number >= 0")
    if consumed_groups < 0:
        raise errors.field_error("consumed_groups", consumed_groups, "an integer >= 0")
    if batch_groups < 1:
        raise errors.field_error("batch_groups", batch_groups, "an integer >= 1")
    return math.floor(consumed_groups + (1.0 + bound) * batch_groups + 1e-9)


def version_lag(train_version: int, first_version: int) -> int:
    """Versions between a group's oldest token and the weights it is trained on (the
    trainer trains version ``train_version`` into ``train_version + 1``)."""
    if first_version > train_version:
        raise errors.field_error(
            "first_version", first_version, f"at most the trainer's version {train_version}"
        )
    return train_version - first_version


@dataclass(frozen=True)
class CompleteGroup:
    """A complete group waiting for the trainer: its name, the version of its oldest
    token, its tokens (prompt and response) and responses."""

    name: str
    first_version: int
    tokens: int
    responses: int


@dataclass(frozen=True)
class BatchTake:
    """What the trainer takes for one (local) update: ``trained`` (oldest first),
    ``dropped`` (over-stale, counted, never trained), ``rest`` (left waiting), and the
    lag of every trained group."""

    trained: tuple[CompleteGroup, ...]
    dropped: tuple[CompleteGroup, ...]
    rest: tuple[CompleteGroup, ...]
    lags: tuple[int, ...]

    @property
    def tokens(self) -> int:
        return sum(g.tokens for g in self.trained)


def take_batch(
    queue: Sequence[CompleteGroup], version: int, groups: int, max_lag: int | None
) -> BatchTake | None:
    """The trainer's next ``groups`` groups from ``queue`` (oldest first) to train
    version ``version``, over-stale ones (lag > ``max_lag``) dropped on the way; None
    while fewer than ``groups`` trainable groups wait."""
    if groups < 1:
        raise errors.field_error("groups", groups, "an integer >= 1")
    if max_lag is not None and max_lag < 0:
        raise errors.field_error("max_lag", max_lag, "an integer >= 0 or None")
    trained: list[CompleteGroup] = []
    dropped: list[CompleteGroup] = []
    lags: list[int] = []
    scanned = 0
    for g in queue:
        if len(trained) == groups:
            break
        scanned += 1
        lag = version_lag(version, g.first_version)
        if max_lag is not None and lag > max_lag:
            dropped.append(g)
        else:
            trained.append(g)
            lags.append(lag)
    if len(trained) < groups:
        return None
    return BatchTake(tuple(trained), tuple(dropped), tuple(queue[scanned:]), tuple(lags))


def update_action(
    engine_version: int, relay_version: int, running: int, pull: Pull, *, pinned: bool = False
) -> Action:
    """What an engine on ``engine_version`` does when its relay holds ``relay_version``
    with ``running`` requests in its batch: nothing newer, keep; nothing running, load;
    otherwise abort-and-resume or drain per ``pull`` (``pinned``: the engine holds a
    repacked tail that keeps its version until it drains)."""
    if relay_version <= engine_version:
        return Action.KEEP
    if running <= 0:
        return Action.LOAD
    if pinned or pull is Pull.DRAIN:
        return Action.DRAIN
    return Action.ABORT


def leased_transfer_s(leased_s: float, standing_s: float, lease_s: float) -> float:
    """A transfer that takes ``leased_s`` on its lease's circuits and ``standing_s`` on
    the standing ones, when the lease lasts ``lease_s``: done within the lease, or the
    lease's share done at the leased rate and the rest at the standing rate."""
    for name, v in (("leased_s", leased_s), ("standing_s", standing_s), ("lease_s", lease_s)):
        if not v >= 0:
            raise errors.field_error(name, v, "a number >= 0")
    if leased_s <= lease_s or leased_s <= 0:
        return leased_s
    done = lease_s / leased_s
    return lease_s + (1.0 - done) * standing_s


@dataclass(frozen=True)
class AsyncPolicy:
    """How an asynchronous run moves weights, repacks its tail and splits its GPUs.

    ``weight_update``: ``global`` (verl: every engine paused for the sync, its requests
    aborted and resumed) or ``relay`` (the trainer pushes once to relays; engines load
    per ``pull``). ``local_updates``: optimizer updates per version, each on ``N /
    local_updates`` groups as they complete (verl's ``trigger_parameter_sync_step``).
    ``max_lag``: a group more versions behind is dropped (0..64; -1: none, verl's).
    ``repack``: consolidate the draining engines' batches onto few engines (best fit, KV
    moved) every ``repack_interval_s`` (default 5 s, the compute planner's re-plan
    interval) and at each new version, engines at ``tail_fraction`` of their seats or
    below counted (default 1.0: every draining engine; a repack frees an engine only when
    its requests fit elsewhere); ``reshard``: whole nodes are emptied instead, and a node
    left holding a tail reshards to one engine of its width when that frees it sooner.
    ``plan_split``: the split planner moves GPUs between the pools every ``plan_every``
    versions, within
    ``[min_train_gpus, max_train_gpus]`` (0: any). ``lease_s``: circuit lease of a
    weight-broadcast wave (0: no lease, the standing partition only);
    ``repack_lease_s``: of a bulk repack move."""

    weight_update: WeightUpdate = WeightUpdate.RELAY
    pull: Pull = Pull.DRAIN
    local_updates: int = 1
    max_lag: int = -1
    repack: bool = False
    reshard: bool = False
    tail_fraction: float = 1.0
    repack_interval_s: float = 5.0
    plan_split: bool = False
    plan_every: int = 2
    min_train_gpus: int = 0
    max_train_gpus: int = 0
    lease_s: float = 0.0
    repack_lease_s: float = 0.0
    label: str = field(default="", compare=False)

    @property
    def lag_limit(self) -> int | None:
        return None if self.max_lag < 0 else self.max_lag

    def problems(self, prefix: str = "async", gpus: int = 0, unit: int = 1) -> list[str]:
        """Every problem, each naming ``prefix.key``, the value and what is allowed
        (``gpus``: the pools' total, for the split bounds; ``unit``: what the split
        moves by)."""
        out: list[str] = []

        def bad(key: str, value: object, allowed: str) -> None:
            out.append(str(errors.field_error(f"{prefix}.{key}", value, allowed)))

        if not isinstance(self.weight_update, WeightUpdate):
            bad("weight_update", self.weight_update, "one of global, relay")
        if not isinstance(self.pull, Pull):
            bad("pull", self.pull, "one of drain, abort")
        if not _int_in(self.local_updates, 1, MAX_LOCAL_UPDATES):
            bad("local_updates", self.local_updates, f"an integer from 1 to {MAX_LOCAL_UPDATES}")
        if not _int_in(self.max_lag, -1, MAX_LAG_LIMIT):
            bad("max_lag", self.max_lag, f"-1 (no limit) or an integer from 0 to {MAX_LAG_LIMIT}")
        if not _num_in(self.tail_fraction, 0.0, 1.0) or self.tail_fraction == 0:
            bad(
                "tail_fraction",
                self.tail_fraction,
                "a number in (0, 1] (a share of an engine's seats)",
            )
        if not _num_in(self.repack_interval_s, 0.1, 3600.0):
            bad("repack_interval_s", self.repack_interval_s, "a number from 0.1 to 3600 seconds")
        if self.reshard and not self.repack:
            bad("reshard", self.reshard, "false unless async.repack = true (its targets reshard)")
        if not _int_in(self.plan_every, 1, 1000):
            bad("plan_every", self.plan_every, "an integer from 1 to 1000 versions")
        for key in ("lease_s", "repack_lease_s"):
            v = getattr(self, key)
            if not _num_in(v, 0.0, MAX_LEASE_S):
                bad(key, v, f"a number from 0 (no lease) to {MAX_LEASE_S:g} seconds")
        lo, hi = self.min_train_gpus, self.max_train_gpus
        top = gpus - unit if gpus else 10**9
        for key, v in (("min_train_gpus", lo), ("max_train_gpus", hi)):
            if not _int_in(v, 0, max(0, top)) or (v and unit and v % unit):
                bad(
                    key,
                    v,
                    f"0 (no bound) or a multiple of {unit} GPUs from {unit} to {max(unit, top)}"
                    " (both pools keep some GPUs)",
                )
        if lo and hi and lo > hi:
            bad("min_train_gpus", lo, f"at most async.max_train_gpus ({hi})")
        return out


def _int_in(v: object, lo: int, hi: int) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi


def _num_in(v: object, lo: float, hi: float) -> bool:
    if not isinstance(v, int | float) or isinstance(v, bool) or math.isnan(v):
        return False
    return lo <= v <= hi
