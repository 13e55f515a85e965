"""The compute-scheduling loop's decisions: telemetry in, planner run, commands out.

Pure (no I/O, no clock: ``now`` is an argument); the shell that reads the registry and
talks to the agents is :mod:`fabric_controller.scheduler_loop`.

One round:

1. :func:`node_view` turns each generation node's latest telemetry sample into a
   :class:`NodeView` (layout, engine state, step, per-request progress, completed
   lengths); nodes that are down, silent, not running or inconsistent are skipped and
   the reason is kept;
2. :func:`build_state` makes the planner's :class:`~scheduler.compute_state.ComputeState`:
   instance ``k`` of a node with ``tp_layout`` ``[t0, t1, ...]`` holds the contiguous GPU
   block starting at ``t0 + ... + t(k-1)`` and is named ``{node}/tp{t}-g{first GPU}``
   (the planner's canonical name, so a layout the planner chose keeps its ids); a request
   on an instance is running with its KV cache there, a queued request (instance -1)
   is in the global queue;
3. :func:`observe` keeps the step tracker: the step counter (the largest any node
   reports), when the step started, and the completed lengths of recent steps (the
   forecast's history across steps);
4. :func:`decide` runs the planner: a proactive re-plan (layouts and placement) at step
   start and every :class:`~scheduler.replan.ReplanSchedule` interval (as the
   simulator's adaptive policy), reactive balancing (layouts fixed, requests off
   stragglers) between them; nothing while telemetry is older than the last action (the
   agents have not reported its effect yet);
5. :func:`commands_for` turns a plan into agent commands: one ``Reshard`` per node whose
   layout changes (the new layout in the planner's canonical order, so instance indices
   match its instances) and one migration per (source node, target instance, method)
   group of requests leaving their instance (KV moved, or recomputed by prefill).
"""

from __future__ import annotations

import collections
import json
import math
import zlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from orchestrrl import errors
from orchestrrl.limits import MAX_ID_CHARS
from orchestrrl.v1 import node_agent_pb2
from scheduler.compute import balance, plan_compute
from scheduler.compute_problem import PlannerConfig
from scheduler.compute_state import (
    ComputePlan,
    ComputeState,
    Instance,
    MoveMethod,
    NodeGpus,
    Request,
    canonical_instances,
)
from scheduler.forecast import (
    ForecastConfig,
    LengthForecast,
    PriorLengths,
    build_forecast,
    prior_log_scales,
)
from scheduler.perf_model import PerfModel
from scheduler.repack import plan_tail
from scheduler.replan import ReplanSchedule, check_seconds


def check_interval(value: float, field: str = "--compute-interval") -> float:
    """The loop's interval in seconds (reactive balancing between re-plans)."""
    return check_seconds(value, field)


def check_tail_fraction(value: float, field: str = "--compute-repack-tail") -> float:
    """The share of an instance's seats at or below which it is in the tail (0: no
    repack)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= 1:
        raise errors.field_error(field, value, "a number in [0, 1] (0: no tail repack)")
    return float(value)


@dataclass(frozen=True)
class SchedulingConfig:
    interval_s: float = 1.0
    replan: ReplanSchedule = field(default_factory=ReplanSchedule)
    planner: PlannerConfig = field(default_factory=PlannerConfig)
    forecast: ForecastConfig = field(default_factory=ForecastConfig)
    history_steps: int = 8  # completed-length sets of past steps kept for the forecast
    # sample groups (prompts) whose lengths at their last occurrence are remembered: the
    # prior for their next epoch (a DAPO-sized dataset has ~17k prompts)
    groups_remembered: int = 65536
    max_migrations: int = 64  # requests moved per round at most (the rest wait a round)
    hold_s: float = 30.0  # how long a source holds exported requests unresolved
    # a request moved is not moved again for this long: predictions from telemetry a round
    # old would otherwise send it back and forth, paying its recomputation every time
    move_cooldown_s: float = 10.0
    # async mode: the tail is repacked once at least two instances hold this share of
    # their seats or less and nothing is queued (scheduler.repack.plan_tail); 0: never
    tail_fraction: float = 0.5

    def __post_init__(self) -> None:
        check_interval(self.interval_s, "interval_s")
        check_tail_fraction(self.tail_fraction, "tail_fraction")
        if not 0 <= self.groups_remembered <= 1 << 22:
            raise errors.field_error(
                "groups_remembered", self.groups_remembered, "an integer in [0, 4194304]"
            )
        if self.history_steps < 1:
            raise errors.field_error("history_steps", self.history_steps, ">= 1")
        if self.max_migrations < 0:
            raise errors.field_error("max_migrations", self.max_migrations, ">= 0")
        if not 0 <= self.move_cooldown_s <= 3600:
            raise errors.field_error(
                "move_cooldown_s", self.move_cooldown_s, "seconds in [0, 3600]"
            )
        if not 0 < self.hold_s <= 3600:
            raise errors.field_error("hold_s", self.hold_s, "seconds in (0, 3600]")


# -- telemetry -> state -------------------------------------------------------------------


@dataclass(frozen=True)
class Progress:
    request_id: str
    instance: int  # -1: queued
    prompt_tokens: int
    generated_tokens: int
    max_tokens: int  # 0: engine default
    group: str = ""  # its sample group (GRPO: the prompt); "" = none


@dataclass(frozen=True)
class NodeView:
    """What one generation node reported, as the planner needs it."""

    node: str
    layout: tuple[int, ...]
    step: int
    timestamp: float  # of the sample, seconds since the Unix epoch
    requests: tuple[Progress, ...]
    completed: tuple[int, ...]
    kv_import: bool = True  # its engine takes a moved KV cache (else: recompute)
    max_num_seqs: int = 0  # sequences per instance of its engine (0: unknown)
    completed_groups: tuple[str, ...] = ()  # parallel to completed, or empty: none
    weight_version: str = ""  # the weights its engines serve ("" unknown)


def node_view(
    node: str,
    wired_gpus: int,
    sample: node_agent_pb2.TelemetrySample | None,
    *,
    kv_import: bool = True,
    max_num_seqs: int = 0,
) -> NodeView | str:
    """The node's view, or why it is left out of this round."""
    if sample is None:
        return "no telemetry yet"
    if sample.engine_state != node_agent_pb2.ENGINE_STATE_RUNNING:
        state = node_agent_pb2.EngineState.Name(sample.engine_state).removeprefix("ENGINE_STATE_")
        return f"engine {state.lower()}"
    if not sample.engine.has_progress:
        # Only the newest sample of each upload carries per-request progress; an empty
        # request list here means "not reported", not "idle".
        return "telemetry without per-request progress (older agent or backlog catch-up)"
    layout = tuple(int(t) for t in sample.tp_layout)
    if not layout or min(layout) < 1:
        return f"no usable TP layout {list(layout)}"
    if sum(layout) != wired_gpus:
        return f"TP layout {list(layout)} uses {sum(layout)} GPUs, the wiring says {wired_gpus}"
    progress = []
    for r in sample.engine.requests:
        if not r.request_id or not -1 <= r.instance < len(layout):
            return f"request {r.request_id!r} on instance {r.instance} of layout {list(layout)}"
        if len(r.group) > MAX_ID_CHARS:
            return f"request {r.request_id!r} has a group of {len(r.group)} characters"
        progress.append(
            Progress(
                r.request_id,
                r.instance,
                r.prompt_tokens,
                r.generated_tokens,
                r.max_tokens,
                r.group,
            )
        )
    lengths = tuple(int(x) for x in sample.engine.completed_lengths)
    groups = tuple(sample.engine.completed_groups)
    if groups and len(groups) != len(lengths):
        return f"{len(groups)} completed_groups for {len(lengths)} completed_lengths"
    if any(len(g) > MAX_ID_CHARS for g in groups):
        return f"a completed group longer than {MAX_ID_CHARS} characters"
    return NodeView(
        node,
        layout,
        int(sample.engine.step),
        sample.timestamp,
        tuple(progress),
        lengths,
        kv_import,
        max_num_seqs,
        groups,
        sample.weight_version[:MAX_ID_CHARS],
    )


def node_instances(node: str, layout: Sequence[int]) -> tuple[Instance, ...]:
    """The instances of a reported layout, in the agent's order (index = position)."""
    out = []
    first = 0
    for t in layout:
        out.append(Instance(f"{node}/tp{t}-g{first}", node, tuple(range(first, first + t))))
        first += t
    return tuple(out)


@dataclass(frozen=True)
class Snapshot:
    """The planner's state and how to address its instances on the agents."""

    state: ComputeState
    index: Mapping[str, tuple[str, int]]  # instance id -> (node, index in its layout)
    views: Mapping[str, NodeView]
    max_tokens: int | None
    duplicates: tuple[str, ...] = ()  # request ids reported by two nodes (kept once)
    queued_on: Mapping[str, str] = field(default_factory=dict)  # queued request -> its node

    @property
    def max_num_seqs(self) -> int:
        """The smallest per-instance cap the nodes report (0: none reports one)."""
        return min((v.max_num_seqs for v in self.views.values() if v.max_num_seqs), default=0)

    @property
    def layouts(self) -> dict[str, tuple[int, ...]]:
        return {n: v.layout for n, v in self.views.items()}


def build_state(
    views: Iterable[NodeView], reshard_pauses: Mapping[str, float] | None = None
) -> Snapshot:
    """The ComputeState of the nodes' reports (sorted by node; a request reported by two
    nodes, as can happen for one sample during a migration, is kept on the first).
    ``reshard_pauses``: per node, its last reshard's measured pause
    (:func:`measured_pause`); the planner costs a reshard there at no less."""
    pauses = reshard_pauses or {}
    ordered = sorted(views, key=lambda v: v.node)
    nodes: list[NodeGpus] = []
    instances: list[Instance] = []
    index: dict[str, tuple[str, int]] = {}
    requests: list[Request] = []
    seen: set[str] = set()
    dup: list[str] = []
    caps: list[int] = []
    queued_on: dict[str, str] = {}
    for v in ordered:
        nodes.append(
            NodeGpus(v.node, tuple(range(sum(v.layout))), v.kv_import, pauses.get(v.node, 0.0))
        )
        insts = node_instances(v.node, v.layout)
        instances.extend(insts)
        for k, inst in enumerate(insts):
            index[inst.id] = (v.node, k)
        for p in v.requests:
            if p.request_id in seen:
                dup.append(p.request_id)
                continue
            seen.add(p.request_id)
            caps.append(p.max_tokens)
            group = p.group or None
            if p.instance < 0:
                queued_on[p.request_id] = v.node
                requests.append(
                    Request(p.request_id, p.prompt_tokens, p.generated_tokens, group=group)
                )
            else:
                requests.append(
                    Request(
                        p.request_id,
                        p.prompt_tokens,
                        p.generated_tokens,
                        insts[p.instance].id,
                        True,
                        group,
                    )
                )
    state = ComputeState(tuple(nodes), tuple(instances), tuple(requests))
    known = [c for c in caps if c > 0]
    return Snapshot(
        state,
        index,
        {v.node: v for v in ordered},
        max(known) if known and len(known) == len(caps) else None,
        tuple(sorted(dup)),
        queued_on,
    )


# a stage timing above this is not a measurement (an agent's clock jumped, or a bug)
PAUSE_LIMIT_S = 86400.0


def measured_pause(stages: Iterable[tuple[str, float]]) -> float | None:
    """The pause a node's reshard took, from the stage timings its agent reported in the
    ``ReshardResponse`` (the stages run one after another while the node's requests
    wait: their sum); None when there are none (nothing was resharded) or one is not a
    duration in [0, 1 day]."""
    total = 0.0
    seen = False
    for _stage, seconds in stages:
        if not 0.0 <= seconds <= PAUSE_LIMIT_S:  # NaN too
            return None
        total += seconds
        seen = True
    return total if seen else None


# -- steps and the forecast history ------------------------------------------------------------


@dataclass(frozen=True)
class StepTracker:
    step: int | None = None
    started_at: float = 0.0
    completed: Mapping[str, tuple[int, ...]] = field(default_factory=dict)  # this step, per node
    history: tuple[tuple[int, ...], ...] = ()  # completed lengths of past steps, oldest first
    last_plan_at: float | None = None
    last_action_at: float | None = None  # wall time the last commands finished
    # this step, per node: the group of each completed length (empty: none reported)
    completed_groups: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    # per sample group, its lengths at its last occurrence in an earlier step (least
    # recently seen first): the prior of its next epoch
    remembered: Mapping[str, PriorLengths] = field(default_factory=dict)

    @property
    def completed_lengths(self) -> tuple[int, ...]:
        return tuple(x for n in sorted(self.completed) for x in self.completed[n])

    @property
    def completed_group_list(self) -> tuple[str, ...]:
        """The group of each of :attr:`completed_lengths` ("" where a node named none)."""
        out: list[str] = []
        for n in sorted(self.completed):
            lengths, groups = self.completed[n], self.completed_groups.get(n, ())
            out += groups if len(groups) == len(lengths) else [""] * len(lengths)
        return tuple(out)


def remember(
    memory: Mapping[str, PriorLengths],
    lengths: Sequence[int],
    groups: Sequence[str],
    limit: int,
) -> dict[str, PriorLengths]:
    """``memory`` with the groups of a finished step (their lengths now, and the step's
    log-mean length), the oldest forgotten beyond ``limit`` groups."""
    by_group: dict[str, list[int]] = {}
    for length, group in zip(lengths, groups, strict=True):
        if group and length >= 1:
            by_group.setdefault(group, []).append(length)
    if not by_group or limit == 0:
        return dict(memory)
    logs = [math.log(x) for x in lengths if x >= 1]
    step_log_mean = sum(logs) / len(logs)
    out = dict(memory)
    for group, samples in by_group.items():
        out.pop(group, None)  # re-inserted: the most recently seen come last
        out[group] = PriorLengths(tuple(samples), step_log_mean)
    for group in list(out)[: max(0, len(out) - limit)]:
        del out[group]
    return out


# -- the loop's memory across restarts and failovers --------------------------------------

MEMORY_VERSION = 1
# a saved memory stays under etcd's default request limit (1.5 MiB)
MEMORY_LIMIT_BYTES = 1 << 20
MEMORY_TEXT_LIMIT = 64 << 20  # what a saved memory may inflate to


def memory_blob(tracker: StepTracker, limit: int = MEMORY_LIMIT_BYTES) -> tuple[bytes, int]:
    """What the loop learnt that outlives a step, for the controller's store: the
    completed lengths of past steps (the forecast's history) and the groups remembered
    for their next epoch, as zlib-compressed JSON. When that exceeds ``limit`` bytes the
    least recently seen groups are left out. Returns (blob, groups left out)."""
    groups = list(tracker.remembered.items())  # least recently seen first

    def encode(kept: int) -> bytes:
        doc = {
            "version": MEMORY_VERSION,
            "history": [list(h) for h in tracker.history],
            "groups": [[g, list(p.lengths), p.step_log_mean] for g, p in groups[-kept:]]
            if kept
            else [],
        }
        return zlib.compress(json.dumps(doc, separators=(",", ":")).encode(), 6)

    blob = encode(len(groups))
    if len(blob) <= limit:
        return blob, 0
    lo, hi = 0, len(groups)  # encode(lo) fits (or lo == 0), encode(hi) does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if len(encode(mid)) <= limit:
            lo = mid
        else:
            hi = mid
    blob = encode(lo)
    if len(blob) > limit:
        raise errors.FailedPrecondition(
            f"schedule memory: {len(tracker.history)} step(s) of history alone take "
            f"{len(blob)} bytes, over the {limit}-byte limit"
        )
    return blob, len(groups) - lo


def memory_load(raw: bytes) -> tuple[tuple[tuple[int, ...], ...], dict[str, PriorLengths]]:
    """(history, remembered groups) from a :func:`memory_blob`; ``InvalidArgument``
    naming what is wrong when the bytes are not one."""
    try:
        inflate = zlib.decompressobj()
        text = inflate.decompress(raw, MEMORY_TEXT_LIMIT)
        if inflate.unconsumed_tail or not inflate.eof:
            raise ValueError(f"not a whole memory of at most {MEMORY_TEXT_LIMIT} bytes")
        doc = json.loads(text)
    except (zlib.error, ValueError) as exc:
        raise errors.InvalidArgument(f"schedule memory: not a saved memory ({exc})") from None
    if not isinstance(doc, dict) or doc.get("version") != MEMORY_VERSION:
        found = doc.get("version") if isinstance(doc, dict) else type(doc).__name__
        raise errors.field_error("schedule memory version", found, str(MEMORY_VERSION))
    history, groups = doc.get("history"), doc.get("groups")
    if not isinstance(history, list) or not all(
        isinstance(h, list) and all(type(x) is int and x >= 0 for x in h) for h in history
    ):
        raise errors.InvalidArgument(
            "schedule memory: history must be a list of lists of lengths >= 0"
        )
    remembered: dict[str, PriorLengths] = {}
    if not isinstance(groups, list):
        raise errors.InvalidArgument("schedule memory: groups must be a list")
    for i, entry in enumerate(groups):
        ok = (
            isinstance(entry, list)
            and len(entry) == 3
            and isinstance(entry[0], str)
            and 0 < len(entry[0]) <= MAX_ID_CHARS
            and isinstance(entry[1], list)
            and all(type(x) is int for x in entry[1])
            and isinstance(entry[2], int | float)
            and not isinstance(entry[2], bool)
        )
        if not ok:
            raise errors.InvalidArgument(
                f"schedule memory: groups[{i}] must be [group id, [lengths], log-mean]"
            )
        try:
            remembered[entry[0]] = PriorLengths(tuple(entry[1]), float(entry[2]))
        except errors.InvalidArgument as exc:
            raise errors.InvalidArgument(f"schedule memory: groups[{i}]: {exc}") from None
    return tuple(tuple(h) for h in history), remembered


def restored(
    history: Sequence[Sequence[int]], remembered: Mapping[str, PriorLengths]
) -> StepTracker:
    """A tracker that starts from a saved memory (the step in progress is read anew
    from the nodes' reports)."""
    return StepTracker(history=tuple(tuple(h) for h in history), remembered=dict(remembered))


def observe(
    tracker: StepTracker,
    views: Iterable[NodeView],
    now: float,
    history_steps: int,
    groups_remembered: int = SchedulingConfig.groups_remembered,
) -> StepTracker:
    """Fold a round's reports into the tracker: a larger step counter starts a new step
    (the finished one's completed lengths join the history, and its groups' lengths are
    remembered for their next occurrence); otherwise each node's completed lengths of
    this step are its latest report."""
    vs = list(views)
    if not vs:
        return tracker
    step = max(v.step for v in vs)
    if tracker.step is None or step > tracker.step:
        history, remembered = tracker.history, tracker.remembered
        done = tracker.completed_lengths
        if tracker.step is not None and done:
            history = (*history, done)[-history_steps:]
            remembered = remember(remembered, done, tracker.completed_group_list, groups_remembered)
        return StepTracker(
            step=step,
            started_at=now,
            completed={v.node: v.completed for v in vs if v.step == step},
            history=history,
            last_action_at=tracker.last_action_at,
            completed_groups={v.node: v.completed_groups for v in vs if v.step == step},
            remembered=remembered,
        )
    completed = dict(tracker.completed)
    groups = dict(tracker.completed_groups)
    for v in vs:
        if v.step == step:
            completed[v.node] = v.completed
            groups[v.node] = v.completed_groups
    return replace(tracker, completed=completed, completed_groups=groups)


# -- the decision ------------------------------------------------------------------------


@dataclass(frozen=True)
class Decision:
    # replan, balance, repack (async mode's tail), wait (telemetry older than the last
    # action), idle
    mode: str
    plan: ComputePlan | None
    why: str
    groups: int = 0  # sample groups among the step's requests and completions
    groups_with_prior: int = 0  # of them, met in an earlier step (their previous epoch)


def decide(
    tracker: StepTracker,
    snap: Snapshot,
    perf: PerfModel,
    now: float,
    config: SchedulingConfig,
    *,
    tail: bool = False,
    settled: frozenset[str] = frozenset(),
) -> Decision:
    """The round's decision. ``tail`` (the cluster is in async mode): a repack of the
    tail (:func:`scheduler.repack.plan_tail`) comes first when there is one; requests in
    ``settled`` were moved a moment ago."""
    if not snap.state.requests:
        return Decision("idle", None, "no requests in the step")
    if tracker.last_action_at is not None:
        stale = sorted(n for n, v in snap.views.items() if v.timestamp <= tracker.last_action_at)
        if stale:
            return Decision(
                "wait",
                None,
                f"waiting for telemetry newer than the last action from {', '.join(stale)}",
            )
    groups = step_groups(tracker, snap)
    forecast = forecast_for(tracker, snap, config, groups)
    due = config.replan.due(
        step_started_at=tracker.started_at,
        now=now,
        last_plan_at=tracker.last_plan_at,
    )
    planner = config.planner
    if snap.max_num_seqs:  # the engines' own cap on an instance's batch
        planner = replace(planner, max_num_seqs=snap.max_num_seqs)
    counts = (len(groups), sum(1 for g in groups if g in tracker.remembered))
    if tail and config.tail_fraction:
        repack = plan_tail(
            snap.state,
            versions={n: v.weight_version for n, v in snap.views.items()},
            seats=snap.max_num_seqs,
            perf=perf,
            forecast=forecast,
            now=now,
            tail_fraction=config.tail_fraction,
            settled=settled,
        )
        if repack is not None:
            return Decision("repack", repack, "the tail: few requests left, none queued", *counts)
    if due:
        plan = plan_compute(snap.state, forecast, perf, now, planner)
        return Decision("replan", plan, "re-plan point of the step", *counts)
    plan = balance(snap.state, forecast, perf, now, planner)
    return Decision("balance", plan, "between re-plan points", *counts)


def forecast_for(
    tracker: StepTracker,
    snap: Snapshot,
    config: SchedulingConfig,
    groups: set[str] | None = None,
) -> LengthForecast:
    """The length forecast of this step: past steps' lengths, this step's completed and
    running requests, and with sample groups their siblings and earlier epochs.
    ``groups``: :func:`step_groups`, when the caller has it already."""
    running = [r.generated_tokens for r in snap.state.requests]
    running_groups = [r.group for r in snap.state.requests]
    completed_groups = tracker.completed_group_list
    remembered = tracker.remembered
    if groups is None:
        groups = step_groups(tracker, snap)
    prior = {g: remembered[g] for g in sorted(groups) if g in remembered}
    return build_forecast(
        tracker.history,  # the same tuples at every re-plan of a step: their summary is kept
        list(tracker.completed_lengths),
        running,
        max_tokens=snap.max_tokens,
        config=config.forecast,
        completed_groups=[g or None for g in completed_groups] if any(completed_groups) else (),
        running_groups=running_groups if any(running_groups) else (),
        # each group of this step met in an earlier step (its previous epoch), the prior
        # estimated over this step's groups only, as the simulator does
        group_prior=prior_log_scales(prior, config.forecast),
    )


def step_groups(tracker: StepTracker, snap: Snapshot) -> set[str]:
    """The sample groups of this step's running, queued and completed requests."""
    return {r.group for r in snap.state.requests if r.group} | {
        g for g in tracker.completed_group_list if g
    }


def planned(tracker: StepTracker, decision: Decision, now: float) -> StepTracker:
    """The tracker after a re-plan: its time (the next is due an interval later)."""
    if decision.mode != "replan" or decision.plan is None:
        return tracker
    return replace(tracker, last_plan_at=now)


def acted(tracker: StepTracker, at: float) -> StepTracker:
    return replace(tracker, last_action_at=at)


def replan_now(tracker: StepTracker) -> StepTracker:
    """The tracker with no re-plan in this step yet: the next decision re-plans (an
    operator resumed the loop, ``PauseSchedule``)."""
    return replace(tracker, last_plan_at=None)


# -- plan -> commands --------------------------------------------------------------------


@dataclass(frozen=True)
class ReshardCommand:
    command_id: str
    node: str
    layout: tuple[int, ...]  # the planner's canonical order: index k = its k-th instance
    before: tuple[int, ...]


@dataclass(frozen=True)
class MigrateCommand:
    command_id: str
    source: str
    target: str
    target_instance: int
    recompute: bool
    request_ids: tuple[str, ...]
    method: MoveMethod
    cost_s: float


_MOVES = {
    MoveMethod.KV_NVLINK: False,
    MoveMethod.KV_NETWORK: False,
    MoveMethod.RECOMPUTE: True,
    MoveMethod.DISPATCH: True,  # a queued request: no KV cache to move
}


def after_index(plan: ComputePlan, snap: Snapshot) -> dict[str, tuple[str, int]]:
    """Instance id -> (node, index in the node's layout after the plan)."""
    out = dict(snap.index)
    for r in plan.reshards:
        insts = canonical_instances(r.node, range(sum(r.after)), r.after)
        for k, inst in enumerate(insts):
            out[inst.id] = (r.node, k)
    return out


def commands_for(
    plan: ComputePlan,
    snap: Snapshot,
    tag: str,
    max_migrations: int,
    settled: frozenset[str] = frozenset(),
) -> tuple[tuple[ReshardCommand, ...], tuple[MigrateCommand, ...]]:
    """Agent commands carrying ``plan`` out; ``tag`` makes their command ids unique;
    requests in ``settled`` (moved a moment ago) stay where they are.

    A queued request that the plan dispatches to another node's instance moves there (a
    queue does not drain across nodes by itself: an engine admits only its own) when a
    seat is free for it there; otherwise it would only wait in another queue, and moved
    back and forth between queues as predictions shift (each move a round of Export,
    Import and Resolve). One the plan dispatches on its own node is left to that node's
    admission. Requests re-laid out by their node's reshard move with it.
    """
    reshards = tuple(
        ReshardCommand(f"{tag}-reshard-{r.node}", r.node, r.after, snap.views[r.node].layout)
        for r in plan.reshards
    )
    where = after_index(plan, snap)
    groups: dict[tuple[str, str, int, MoveMethod], list[tuple[str, float]]] = {}
    count = 0
    for m in plan.migrations:
        if m.method not in _MOVES or m.method is MoveMethod.DISPATCH or m.source is None:
            continue
        if count >= max_migrations or m.request in settled:
            continue
        src_node = snap.index[m.source][0]
        dst_node, k = where[m.target]
        groups.setdefault((src_node, dst_node, k, m.method), []).append((m.request, m.cost_s))
        count += 1
    seats = _free_seats(plan, snap)
    for rid, inst in plan.assignment:
        src = snap.queued_on.get(rid)
        if src is None or count >= max_migrations or rid in settled:
            continue
        dst_node, k = where[inst]
        if dst_node == src:
            continue
        if seats is not None:
            per_instance, per_node = seats
            if per_instance[inst] <= 0 or per_node[dst_node] <= 0:
                continue  # it would only wait in another node's queue: it waits in its own
            per_instance[inst] -= 1
            per_node[dst_node] -= 1
        groups.setdefault((src, dst_node, k, MoveMethod.DISPATCH), []).append((rid, 0.0))
        count += 1
    migrations = []
    # (enum members do not order: two methods into one instance are sorted by name)
    ordered = sorted(groups.items(), key=lambda g: (*g[0][:3], g[0][3].value))
    for n, ((src, dst, k, method), items) in enumerate(ordered):
        migrations.append(
            MigrateCommand(
                f"{tag}-migrate-{n}",
                src,
                dst,
                k,
                _MOVES[method],
                tuple(rid for rid, _ in items),
                method,
                sum(c for _, c in items),
            )
        )
    return reshards, tuple(migrations)


def _free_seats(
    plan: ComputePlan, snap: Snapshot
) -> tuple[collections.Counter[str], collections.Counter[str]] | None:
    """Seats (``max_num_seqs``) left after the plan, per instance id and per node: an
    instance's cap less the running requests the plan keeps or moves there; a node's
    total less, in addition, the requests waiting in its own queue (its engines admit
    those first). None when no node reports its cap."""
    cap = snap.max_num_seqs
    if not cap:
        return None
    per_instance: collections.Counter[str] = collections.Counter()
    per_node: collections.Counter[str] = collections.Counter()
    for inst in plan.instances:
        per_instance[inst.id] += cap
        per_node[inst.node] += cap
    node_of = {inst.id: inst.node for inst in plan.instances}
    for rid, inst_id in plan.assignment:
        node = node_of[inst_id]
        queued = snap.queued_on.get(rid)
        if queued is None:
            per_instance[inst_id] -= 1
            per_node[node] -= 1
        elif queued == node:
            per_node[node] -= 1
    return per_instance, per_node


def layouts_after(plan: ComputePlan, snap: Snapshot) -> dict[str, tuple[int, ...]]:
    out = dict(snap.layouts)
    for r in plan.reshards:
        out[r.node] = r.after
    return out
