"""Values the compute planner reads and returns: the rollout state and the plan.

A *layout* of a node is a partition of its GPUs into TP groups (instances). The state
lists the instances of every node and every request of the step (running on an
instance, queued at an instance, or queued globally). A plan is a frozen value:
reshard actions per node, a placement per request, predicted times and a reason.
``apply_plan`` gives the state the plan leads to (used by tests and the simulator).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import Enum

from orchestrrl import errors


@dataclass(frozen=True, order=True)
class Instance:
    """A rollout engine instance: a TP group of GPUs on one node."""

    id: str
    node: str
    gpus: tuple[int, ...]

    @property
    def tp(self) -> int:
        return len(self.gpus)


@dataclass(frozen=True)
class Request:
    """One rollout request of the current step.

    ``instance`` None: queued globally (not yet dispatched). ``running`` False with an
    instance: dispatched but not started (no KV cache yet). ``running`` True: decoding,
    with ``prompt_tokens + generated_tokens`` of KV cache on its instance.
    ``group``: the request's sample group (the GRPO samples of one prompt share its
    difficulty, so finished siblings predict the rest; see
    :func:`scheduler.forecast.group_scales`); None: no group known.
    """

    id: str
    prompt_tokens: int
    generated_tokens: int = 0
    instance: str | None = None
    running: bool = False
    group: str | None = None

    @property
    def context_tokens(self) -> int:
        return self.prompt_tokens + self.generated_tokens

    @property
    def has_kv(self) -> bool:
        return self.running and self.instance is not None


@dataclass(frozen=True)
class NodeGpus:
    name: str
    gpus: tuple[int, ...]
    # its engine can take a request with its KV cache moved from elsewhere; otherwise a
    # request that moves to it (or stays across its reshard) is recomputed by prefill
    kv_import: bool = True
    # the pause of its last reshard as its agent measured it (0: none measured yet): a
    # reshard of this node is planned at no less than this, whatever the perf model says
    # (restarting a vLLM instance at another TP takes a minute, the model's estimate a
    # few seconds)
    reshard_pause_s: float = 0.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.reshard_pause_s < math.inf:
            raise errors.field_error("reshard_pause_s", self.reshard_pause_s, "finite seconds >= 0")


@dataclass(frozen=True)
class StepGoal:
    """What ends the step's generation under partial rollout (:mod:`scheduler.rollout`),
    as the compute planner scores a plan: the step does not wait for its last request,
    only until the rule is met, and never ends before ``floor_s``.

    ``groups``: sample groups that must still complete (``end = groups``: the trainer's
    groups less those complete); ``tokens``: tokens still to generate (``end = tokens``);
    neither (``end = time``): every request in flight, or the time budget, whichever
    comes first, so only ``floor_s`` is known. ``floor_s``: seconds from now before the
    step may end at all (the trainer's previous batch; a time budget's end).
    :func:`scheduler.rollout.step_goal` makes it from a rule and the step's progress."""

    groups: int | None = None
    tokens: int | None = None
    floor_s: float = 0.0

    def __post_init__(self) -> None:
        if self.groups is not None and self.tokens is not None:
            raise errors.InvalidArgument("a step goal counts groups or tokens, not both")
        for name in ("groups", "tokens"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or value < 0):
                raise errors.field_error(f"goal.{name}", value, "an integer >= 0 or None")
        if not 0.0 <= self.floor_s < float("inf"):
            raise errors.field_error("goal.floor_s", self.floor_s, "a finite number >= 0")


@dataclass(frozen=True)
class ComputeState:
    """Instances per node and the requests of the step, validated on construction."""

    nodes: tuple[NodeGpus, ...]
    instances: tuple[Instance, ...]
    requests: tuple[Request, ...]

    def __post_init__(self) -> None:
        problems: list[str] = []
        node_gpus: dict[str, set[int]] = {}
        for n in self.nodes:
            if n.name in node_gpus:
                problems.append(f"node {n.name!r} is listed twice")
            if len(set(n.gpus)) != len(n.gpus) or not n.gpus:
                problems.append(f"node {n.name!r}: GPU indices {n.gpus} must be distinct, >= 1")
            node_gpus[n.name] = set(n.gpus)
        used: dict[str, set[int]] = {name: set() for name in node_gpus}
        ids: set[str] = set()
        for inst in self.instances:
            if inst.id in ids:
                problems.append(f"instance {inst.id!r} is listed twice")
            ids.add(inst.id)
            if inst.node not in node_gpus:
                problems.append(f"instance {inst.id!r} is on unknown node {inst.node!r}")
                continue
            gpus = set(inst.gpus)
            if not gpus or len(gpus) != len(inst.gpus):
                problems.append(f"instance {inst.id!r}: GPUs {inst.gpus} must be distinct")
            if not gpus <= node_gpus[inst.node]:
                problems.append(
                    f"instance {inst.id!r} uses GPUs {sorted(gpus - node_gpus[inst.node])} "
                    f"that node {inst.node!r} does not have"
                )
            if gpus & used[inst.node]:
                problems.append(
                    f"instance {inst.id!r} shares GPUs {sorted(gpus & used[inst.node])} "
                    "with another instance"
                )
            used[inst.node] |= gpus
        for name, gpus in node_gpus.items():
            if used[name] != gpus:
                problems.append(
                    f"node {name!r}: GPUs {sorted(gpus - used[name])} belong to no instance "
                    "(every GPU of a node must be in one TP group)"
                )
        rids: set[str] = set()
        for r in self.requests:
            if r.id in rids:
                problems.append(f"request {r.id!r} is listed twice")
            rids.add(r.id)
            if r.prompt_tokens < 0 or r.generated_tokens < 0:
                problems.append(f"request {r.id!r}: token counts must be >= 0")
            if r.instance is not None and r.instance not in ids:
                problems.append(f"request {r.id!r} is on unknown instance {r.instance!r}")
            if r.running and r.instance is None:
                problems.append(f"request {r.id!r} is running but has no instance")
        if problems:
            raise errors.InvalidArgument(
                "invalid compute state:\n" + "\n".join(f"  - {p}" for p in problems)
            )

    def instances_on(self, node: str) -> tuple[Instance, ...]:
        return tuple(i for i in self.instances if i.node == node)

    def layout(self) -> dict[str, tuple[int, ...]]:
        """Per node, the TP degrees of its instances (descending)."""
        out: dict[str, list[int]] = {n.name: [] for n in self.nodes}
        for inst in self.instances:
            out[inst.node].append(len(inst.gpus))  # == inst.tp, without the property call
        return {k: tuple(sorted(v, reverse=True)) for k, v in out.items()}


def canonical_instances(
    node: str, gpus: Iterable[int], pattern: Iterable[int]
) -> tuple[Instance, ...]:
    """Instances for a layout ``pattern`` (TP degrees) on ``node``: contiguous GPU blocks in
    descending TP order, named ``{node}/tp{t}-g{first gpu}``."""
    ordered = sorted(gpus)
    degrees = sorted(pattern, reverse=True)
    if sum(degrees) != len(ordered) or min(degrees, default=1) < 1:
        raise errors.InvalidArgument(
            f"layout {tuple(pattern)} uses {sum(degrees)} GPUs but node {node!r} has {len(ordered)}"
        )
    out: list[Instance] = []
    k = 0
    for t in degrees:
        block = tuple(ordered[k : k + t])
        out.append(Instance(f"{node}/tp{t}-g{block[0]}", node, block))
        k += t
    return tuple(out)


class MoveMethod(Enum):
    DISPATCH = "dispatch"  # a request without KV cache goes to an instance
    RELAYOUT = "relayout"  # KV re-laid out inside a node during its reshard
    KV_NVLINK = "kv-nvlink"  # KV cache moved to another instance of the node
    KV_NETWORK = "kv-network"  # KV cache moved to another node over RDMA
    RECOMPUTE = "recompute"  # KV cache rebuilt by prefill on the target


@dataclass(frozen=True)
class Migration:
    request: str
    source: str | None
    target: str
    method: MoveMethod
    cost_s: float


@dataclass(frozen=True)
class Reshard:
    """One node changing its TP layout."""

    node: str
    before: tuple[int, ...]
    after: tuple[int, ...]
    removed: tuple[str, ...]
    added: tuple[Instance, ...]
    pause_s: float


@dataclass(frozen=True)
class Candidate:
    """A layout the planner considered, with its score (for the explanation)."""

    label: str
    makespan_s: float
    switching_s: float

    @property
    def score_s(self) -> float:
        return self.makespan_s + self.switching_s


@dataclass(frozen=True)
class Prediction:
    keep_makespan_s: float  # if nothing changes (current layout and placement)
    planned_makespan_s: float  # after the plan, including its pauses and migrations
    steady_makespan_s: float  # after the plan, once its costs are paid
    switching_s: float  # longest node pause
    migration_s: float  # total migration time (sum over requests)

    @property
    def gain_s(self) -> float:
        return self.keep_makespan_s - self.planned_makespan_s


@dataclass(frozen=True)
class CostHold:
    """A layout change the planner left out because its nodes' measured reshard pause
    (:attr:`NodeGpus.reshard_pause_s`) costs more than it gains: the model's own pause
    estimate made it pay."""

    label: str  # the layout it would have switched to
    gain_s: float  # what it gains on the step before its pause (keep - its makespan)
    pause_s: float  # its pause at the measured figures (the longest node's)
    model_pause_s: float  # its pause as the perf model estimates it
    nodes: tuple[str, ...]  # the nodes whose measured pause is above the model's

    def explain(self) -> str:
        return (
            f"{self.label} would gain {self.gain_s:.2f} s, not more than its measured reshard "
            f"pause {self.pause_s:.2f} s on {', '.join(self.nodes)} (the model says "
            f"{self.model_pause_s:.2f} s) plus the margin"
        )


@dataclass(frozen=True)
class ComputePlan:
    """What to change: reshards per node and a placement for every request.

    ``assignment`` gives every placed request its instance after the plan.
    ``dispatched`` names the requests taken from the global queue (their instance is in
    ``assignment``). ``migrations`` lists the requests that leave an instance for another
    by the planner's choice (KV moved or recomputed; or re-dispatched before starting).
    Requests of a resharding node that stay on it are re-laid out by the reshard itself
    (their new instance is in ``assignment``).
    """

    now: float
    reshards: tuple[Reshard, ...]
    migrations: tuple[Migration, ...]
    dispatched: tuple[str, ...]  # requests taken from the queue
    assignment: tuple[tuple[str, str], ...]  # (request, instance), every placed request
    unplaced: tuple[str, ...]  # requests no instance can hold
    instances: tuple[Instance, ...]  # the instances after the plan
    prediction: Prediction
    reason: str
    candidates: tuple[Candidate, ...] = field(default=(), compare=False)
    # the placed requests without KV cache in the order engines should admit them
    # (predicted longest first; the rest of the queue keeps its order after them)
    admit_order: tuple[str, ...] = field(default=(), compare=False)
    # a layout change left out for its measured reshard cost (None: none was)
    cost_hold: CostHold | None = field(default=None, compare=False)

    @property
    def empty(self) -> bool:
        """Nothing to do: no reshard, no dispatch, no request changes instance."""
        return not self.reshards and not self.migrations and not self.dispatched

    def explain(self) -> str:
        p = self.prediction
        lines = [f"compute plan at t={self.now:.3f}: {self.reason}"]
        lines.append(
            f"  predicted rest of step: keep {p.keep_makespan_s:.2f} s -> plan "
            f"{p.planned_makespan_s:.2f} s (steady {p.steady_makespan_s:.2f} s; "
            f"switching {p.switching_s:.2f} s, migrations {p.migration_s:.2f} s total)"
        )
        for r in self.reshards:
            before = "+".join(f"TP{t}" for t in r.before)
            after = "+".join(f"TP{t}" for t in r.after)
            lines.append(f"  reshard {r.node}: {before} -> {after} (pause {r.pause_s:.2f} s)")
        if self.dispatched:
            lines.append(f"  dispatch {len(self.dispatched)} queued request(s)")
        moved = [m for m in self.migrations if m.source != m.target]
        by_method: dict[MoveMethod, int] = {}
        for m in moved:
            by_method[m.method] = by_method.get(m.method, 0) + 1
        if moved:
            summary = ", ".join(
                f"{n} {k.value}" for k, n in sorted(by_method.items(), key=lambda x: x[0].value)
            )
            lines.append(f"  requests moved: {len(moved)} ({summary})")
            for m in moved[:10]:
                src = m.source or "queue"
                lines.append(
                    f"    {m.request}: {src} -> {m.target} by {m.method.value} ({m.cost_s:.3f} s)"
                )
            if len(moved) > 10:
                lines.append(f"    ... and {len(moved) - 10} more")
        if self.unplaced:
            lines.append(
                f"  {len(self.unplaced)} request(s) fit no instance's KV cache and stay queued: "
                + ", ".join(self.unplaced[:5])
            )
        if self.candidates:
            lines.append("  layouts considered (best first):")
            for c in self.candidates[:5]:
                lines.append(
                    f"    {c.label}: makespan {c.makespan_s:.2f} s + switching "
                    f"{c.switching_s:.2f} s = {c.score_s:.2f} s"
                )
        return "\n".join(lines)


def apply_plan(state: ComputeState, plan: ComputePlan) -> ComputeState:
    """The state right after ``plan`` is carried out (no time passes)."""
    placed: Mapping[str, str] = dict(plan.assignment)
    requests = []
    for r in state.requests:
        target = placed.get(r.id)
        if target is None:
            requests.append(
                Request(r.id, r.prompt_tokens, r.generated_tokens, None, False, r.group)
            )
        else:
            requests.append(
                Request(r.id, r.prompt_tokens, r.generated_tokens, target, r.has_kv, r.group)
            )
    return ComputeState(state.nodes, plan.instances, tuple(requests))
