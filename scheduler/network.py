"""RFabric's network planner: workloads -> pod-to-pod demand -> OCS circuits + routes.

Pure: a function of the wiring, the active workloads, the circuits the switches hold,
the failed ports and ``now``. Steps:

1. Demand. Every workload adds bytes between pod pairs:
   - a training collective (all-reduce of ``nbytes`` over ``P`` pods) sends
     ``2 (P-1)/P * nbytes`` out of each pod, spread evenly over its ``P-1`` partners:
     ``2 * nbytes / P`` per pod pair;
   - generation stays inside its pod (no inter-pod demand);
   - weight sync: every target pod receives the model once, split over the source
     pods in proportion to their nodes (each training node holds an equal shard after
     a sharded optimizer step, as in :mod:`scheduler.weight_sync`; evenly when the
     sources have no nodes), so that every sender works;
   - explicit pod-pair demand for anything else.
2. Circuits: bottleneck first (MixNet): the next circuit goes to the pod pair with the
   worst demand per circuit, within every pod's ports on every OCS
   (:func:`scheduler.circuits.allocate`, which reuses a pair's existing circuits first).
   When the circuits the switches already hold serve the demand within
   ``keep_tolerance`` of the new allocation (bytes left without a direct circuit, then
   the bottleneck time), they stay: no port moves for a near-equal result. With no
   inter-pod demand at all (generation alone) they stay too, unless ``release_idle``
   asks to release them (pods isolated, as the controller's generation phase does).
   On a large fabric a pod has fewer uplinks than partners, so some pairs get no direct
   circuit; the plan reports those bytes (``unserved_bytes``) and the bottleneck of
   the pairs that have circuits.
3. Slack gate: a change is committed only when it completes inside the predicted idle
   window (:func:`scheduler.gate.slack_gate`); otherwise the current topology stays and
   the plan says so.
4. Routes: for every ToR and every other pod it has circuits to, one route to that pod's
   prefix whose ECMP next hops are exactly the ToR's uplink ports whose circuits reach
   that pod (:class:`PodRoute`). No route ever names a circuit the plan does not have.
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from itertools import combinations
from operator import itemgetter

from orchestrrl import errors
from orchestrrl.model import Circuit, Phase, Role, Wiring
from scheduler.circuits import (
    CircuitPlan,
    Counts,
    PodPair,
    circuit_counts,
    diff,
    pair,
    place,
    plan_phase,
)
from scheduler.gate import GateDecision, slack_gate
from scheduler.perf_model import QWEN25_14B
from scheduler.weight_sync import WeightSyncPlan, plan_weight_sync

DEFAULT_UPLINK_GBPS = 400.0  # ToR uplinks run at the NIC speed of H800 nodes (MISSION.md)
# Default demand of the phases when the operator gives none: Qwen2.5-14B (MISSION.md) in
# BF16. Weight sync moves the model's weights once to every generation pod; a training
# step all-reduces BF16 gradients of the same size across the data-parallel pods.
DEFAULT_MODEL_BYTES = QWEN25_14B.weight_bytes  # 29.5 GB
DEFAULT_TRAINING_BYTES = QWEN25_14B.weight_bytes


class WorkloadKind(Enum):
    TRAINING = "training"
    GENERATION = "generation"
    WEIGHT_SYNC = "weight-sync"
    PAIR = "pair"


@dataclass(frozen=True)
class Workload:
    """Traffic the fabric must carry. Build with the constructors below."""

    kind: WorkloadKind
    pods: tuple[str, ...]  # participants (training pool, a generation pod, sources)
    nbytes: float = 0.0  # collective size, model bytes, or pair bytes
    targets: tuple[str, ...] = ()  # weight sync destinations; the other end of a pair
    starts_at: float | None = None  # when its traffic starts (s, same clock as ``now``)

    @staticmethod
    def training(pods: Iterable[str], nbytes: float, starts_at: float | None = None) -> Workload:
        return Workload(WorkloadKind.TRAINING, tuple(sorted(pods)), nbytes, (), starts_at)

    @staticmethod
    def generation(pod: str, starts_at: float | None = None) -> Workload:
        return Workload(WorkloadKind.GENERATION, (pod,), 0.0, (), starts_at)

    @staticmethod
    def weight_sync(
        sources: Iterable[str],
        targets: Iterable[str],
        model_bytes: float,
        starts_at: float | None = None,
    ) -> Workload:
        return Workload(
            WorkloadKind.WEIGHT_SYNC,
            tuple(sorted(sources)),
            model_bytes,
            tuple(sorted(targets)),
            starts_at,
        )

    @staticmethod
    def between(a: str, b: str, nbytes: float, starts_at: float | None = None) -> Workload:
        return Workload(WorkloadKind.PAIR, (a,), nbytes, (b,), starts_at)


@dataclass(frozen=True, order=True)
class PodRoute:
    """At ``tor``, traffic to ``destination_pod``'s prefix leaves by ECMP over
    ``uplink_ports`` (ToR port names, sorted); each carries a circuit to that pod."""

    tor: str
    destination_pod: str
    uplink_ports: tuple[str, ...]


@dataclass(frozen=True)
class NetworkConfig:
    uplink_gbps: float = DEFAULT_UPLINK_GBPS
    keep_tolerance: float | None = 0.05  # None: always take the fresh allocation
    # False: leave out the weight sync schedule (see scheduler.weight_sync) and the
    # routes (the controller derives its ToR routes itself and runs no transfer): on a
    # large fabric they cost more than the circuits
    weight_sync_schedule: bool = True
    routes: bool = True
    # with no inter-pod demand at all: True releases every circuit (pods isolated),
    # False keeps them (no port moves while nothing needs the network)
    release_idle: bool = False
    link_efficiency: float = 0.8
    chunk_bytes: float = 256 * 2**20

    def __post_init__(self) -> None:
        if self.uplink_gbps <= 0:
            raise errors.field_error("uplink_gbps", self.uplink_gbps, "a number > 0")
        if self.keep_tolerance is not None and self.keep_tolerance < 0:
            raise errors.field_error("keep_tolerance", self.keep_tolerance, ">= 0 or None")


@dataclass(frozen=True)
class NetworkPlan:
    circuits: CircuitPlan
    routes: tuple[PodRoute, ...]
    demand: tuple[tuple[PodPair, float], ...]  # bytes per pod pair, in workload order
    explanation: str
    planned_at: float = 0.0
    gate: GateDecision | None = None  # None: no idle window known, not gated
    kept_current: bool = False
    bottleneck_s: float = 0.0  # time the busiest pod pair with circuits needs on them
    ports_moved: int = 0
    unserved_bytes: float = 0.0  # demand of pod pairs without a direct circuit
    weight_sync: WeightSyncPlan | None = field(default=None, compare=False)

    @property
    def demand_map(self) -> dict[PodPair, float]:
        return dict(self.demand)

    @property
    def empty(self) -> bool:
        return self.circuits.empty


def demand_matrix(wiring: Wiring, workloads: Iterable[Workload]) -> dict[PodPair, float]:
    """Bytes between pod pairs (unordered) for the workloads."""
    known = {p.name for p in wiring.pods}
    out: dict[PodPair, float] = defaultdict(float)
    for w in workloads:
        for pod in (*w.pods, *w.targets):
            if pod not in known:
                raise errors.field_error(
                    "workload pod", pod, f"a pod of the wiring ({', '.join(sorted(known))})"
                )
        if w.nbytes < 0:
            raise errors.field_error("workload.nbytes", w.nbytes, "a number >= 0")
        if w.kind is WorkloadKind.TRAINING:
            n = len(w.pods)
            if n >= 2 and w.nbytes > 0:
                per_pair = 2.0 * w.nbytes / n
                for a, b in combinations(w.pods, 2):
                    out[pair(a, b)] += per_pair
        elif w.kind is WorkloadKind.WEIGHT_SYNC:
            if w.pods and w.nbytes > 0:
                nodes = {s: len(wiring.pod(s).nodes) for s in w.pods}
                total = sum(nodes.values())
                for s in w.pods:
                    share = nodes[s] / total if total else 1.0 / len(w.pods)
                    per_pair = w.nbytes * share
                    for t in w.targets:
                        if s != t:
                            out[(s, t) if s <= t else (t, s)] += per_pair
        elif w.kind is WorkloadKind.PAIR:
            a, b = w.pods[0], w.targets[0]
            if a != b and w.nbytes > 0:
                out[pair(a, b)] += w.nbytes
    return dict(out)


def workloads_for_phase(
    wiring: Wiring,
    phase: Phase,
    *,
    grad_bytes: float = 1.0,
    model_bytes: float = 1.0,
    without: Iterable[str] = (),
) -> tuple[Workload, ...]:
    """Default workloads of a phase: what the phase templates stand for, with bytes.

    Training all-reduces ``grad_bytes`` across the training pods; weight sync sends
    ``model_bytes`` from the training pods to every generation pod; generation stays
    inside each pod. Pods in ``without`` (for example every node down) take no part.
    On a wiring whose training pods have equal node counts the demand is proportional to
    :func:`scheduler.circuits.template_demand`, so the allocation is the template's.
    """
    gone = set(without)
    train = tuple(p for p in wiring.pods_with_role(Role.TRAIN) if p not in gone)
    gen = tuple(p for p in wiring.pods_with_role(Role.GEN) if p not in gone)
    if phase is Phase.TRAINING:
        return (Workload.training(train, grad_bytes),)
    if phase is Phase.GENERATION:
        return tuple(Workload.generation(g) for g in gen)
    if phase is Phase.ASYNC:  # trainer and rollout at once: all three on one topology
        return (
            Workload.training(train, grad_bytes),
            *(Workload.generation(g) for g in gen),
            Workload.weight_sync(train, gen, model_bytes),
        )
    return (Workload.weight_sync(train, gen, model_bytes),)


def bottleneck_time(
    wiring: Wiring,
    demand: Mapping[PodPair, float],
    circuits: Iterable[Circuit],
    uplink_gbps: float,
) -> float:
    """Seconds the worst pod pair needs to move its demand over its circuits."""
    count = _pair_counts(wiring, circuits)
    per_circuit = uplink_gbps * 1e9 / 8.0
    worst = 0.0
    for p, nbytes in demand.items():
        if nbytes <= 0:
            continue
        n = count.get(p, 0)
        if n == 0:
            return math.inf
        worst = max(worst, nbytes / (n * per_circuit))
    return worst


def _pair_counts(wiring: Wiring, circuits: Iterable[Circuit]) -> dict[PodPair, int]:
    """Circuits per (unordered) pod pair; circuits inside a pod or to no pod are left out."""
    owner = wiring.port_owner
    count: dict[PodPair, int] = defaultdict(int)
    for c in circuits:
        a = owner(c.ocs, c.a)
        b = owner(c.ocs, c.b)
        if a and b and a != b:
            count[(a, b) if a <= b else (b, a)] += 1
    return count


def _service(
    demand: Mapping[PodPair, float], count: Mapping[PodPair, int], per_circuit: float
) -> tuple[float, float, int]:
    """(bytes of pairs without a circuit, seconds the busiest pair with circuits needs,
    pairs with demand and circuits). Walks the circuits' pairs, not the demand: on a
    large fabric there are far more pairs with demand than circuits."""
    served = 0.0
    pairs = 0
    worst = 0.0
    for p, n in count.items():
        nbytes = demand.get(p, 0.0)
        if nbytes > 0 and n > 0:
            served += nbytes
            pairs += 1
            if nbytes / n > worst:
                worst = nbytes / n
    return max(0.0, _summary(demand)[0] - served), worst / per_circuit, pairs


def routes_for(wiring: Wiring, circuits: Iterable[Circuit]) -> tuple[PodRoute, ...]:
    """ECMP routes per ToR and destination pod over exactly these circuits."""
    owner: dict[tuple[str, int], tuple[str, str, str]] = {}  # (ocs, port) -> tor, port, pod
    for tor in wiring.tors:
        for u in tor.uplinks:
            owner[(u.ocs, u.ocs_port)] = (tor.name, u.port, tor.pod)
    hops: dict[tuple[str, str], set[str]] = defaultdict(set)
    for c in circuits:
        end_a = owner.get((c.ocs, c.a))
        end_b = owner.get((c.ocs, c.b))
        if end_a is None or end_b is None or end_a[2] == end_b[2]:
            continue
        hops[(end_a[0], end_b[2])].add(end_a[1])
        hops[(end_b[0], end_a[2])].add(end_b[1])
    return tuple(
        PodRoute(tor, pod, tuple(sorted(ports))) for (tor, pod), ports in sorted(hops.items())
    )


def plan_network(
    wiring: Wiring,
    workloads: Sequence[Workload],
    observed_circuits: Iterable[Circuit],
    unavailable_ports: Iterable[tuple[str, int]] = (),
    now: float = 0.0,
    *,
    idle_window_s: float | None = None,
    config: NetworkConfig = NetworkConfig(),
) -> NetworkPlan:
    """Circuits and routes for the active workloads.

    ``idle_window_s``: the traffic's predicted idle time for switching; when None it is
    the time from ``now`` to the earliest ``starts_at`` of the workloads (ungated, and
    ``gate`` None, when no workload says when it starts).
    """
    down = frozenset(unavailable_ports)
    observed = frozenset(observed_circuits)
    owner = wiring.port_owner
    ours = frozenset(c for c in observed if owner(c.ocs, c.a) is not None or owner(c.ocs, c.b))
    demand, counts_fresh = _demand_and_counts(wiring, workloads, down)
    fresh = place(wiring, counts_fresh, ours, down)
    per_circuit = config.uplink_gbps * 1e9 / 8.0
    notes: list[str] = []
    kept = False
    # per pair, the fresh allocation has what pass 1 decided (no need to walk it)
    fresh_counts: dict[PodPair, int] = defaultdict(int)
    for (p, _), n in counts_fresh:
        fresh_counts[p] += n
    scores: dict[frozenset[Circuit], tuple[float, float, int]] = {}  # see _service
    may_keep = config.keep_tolerance is not None and (
        (demand and fresh != ours) or (not demand and not config.release_idle)
    )
    keep_counts = _pair_counts(wiring, ours) if may_keep else {}
    # every current circuit joins two pods and uses no failed port: it could stay
    usable = bool(may_keep) and (
        sum(keep_counts.values()) == len(ours)
        and not any((c.ocs, c.a) in down or (c.ocs, c.b) in down for c in ours)
    )
    # circuits that serve no pair with demand cannot be near-equal to an allocation
    # that serves some (the common case: the phase changed): no scoring then
    if demand and may_keep and usable and any(p in demand for p in keep_counts):
        assert config.keep_tolerance is not None  # (may_keep)
        tol = 1.0 + config.keep_tolerance
        u_fresh, t_fresh, _ = scores[fresh] = _service(demand, fresh_counts, per_circuit)
        u_keep, t_keep, _ = scores[ours] = _service(demand, keep_counts, per_circuit)
        if u_keep <= u_fresh * tol and t_keep <= t_fresh * tol:
            kept = True
            notes.append(
                f"kept the {len(ours)} current circuits: bottleneck {_fmt_s(t_keep)} vs "
                f"{_fmt_s(t_fresh)} after rewiring"
                + (
                    f", {u_keep / 1e9:.2f} vs {u_fresh / 1e9:.2f} GB without a circuit"
                    if u_keep or u_fresh
                    else ""
                )
                + f", within {config.keep_tolerance:.0%}"
            )
    if config.keep_tolerance is not None and fresh == ours:
        kept = True  # the allocation is what the switches hold
    elif not demand and config.keep_tolerance is not None and usable and not config.release_idle:
        kept = True
        if ours:
            notes.append(f"no inter-pod demand: kept the {len(ours)} current circuits")
    desired = ours if kept else fresh
    if not demand and ours and not kept:
        notes.append("no inter-pod demand: every circuit released, pods isolated")
    plan = diff(ours, desired)

    gate: GateDecision | None = None
    if not plan.empty:
        window = idle_window_s
        if window is None:
            starts = [w.starts_at for w in workloads if w.starts_at is not None]
            window = (min(starts) - now) if starts else None
        if window is not None:
            touched = {c.ocs for c in plan.add | plan.remove}
            switching = max(wiring.ocs(o).switching_time_s for o in touched)
            gate = slack_gate(window, switching)
            notes.append(gate.reason)
            if not gate.reconfigure:
                desired = ours
                plan = diff(ours, ours)
                kept = True

    routes = routes_for(wiring, desired) if config.routes else ()
    counts = (
        fresh_counts
        if desired is fresh
        else keep_counts
        if desired is ours and may_keep
        else _pair_counts(wiring, desired)
    )
    unserved, bottleneck, served_pairs = scores.get(desired) or _service(
        demand, counts, per_circuit
    )
    moved = 2 * (len(plan.add) + len(plan.remove))

    ws: WeightSyncPlan | None = None
    syncs = [w for w in workloads if w.kind is WorkloadKind.WEIGHT_SYNC and w.nbytes > 0]
    if syncs and config.weight_sync_schedule:
        w0 = syncs[0]
        ws = plan_weight_sync(
            wiring,
            desired,
            w0.nbytes,
            sources=w0.pods,
            targets=w0.targets,
            uplink_gbps=config.uplink_gbps,
            link_efficiency=config.link_efficiency,
            chunk_bytes=config.chunk_bytes,
        )

    explanation = _explain(
        demand, counts, plan, routes if config.routes else None, bottleneck, unserved,
        served_pairs, moved, kept, notes, ws,
    )  # fmt: skip
    return NetworkPlan(
        circuits=plan,
        routes=routes,
        demand=tuple(demand.items()),
        explanation=explanation,
        planned_at=now,
        gate=gate,
        kept_current=kept,
        bottleneck_s=bottleneck,
        ports_moved=moved,
        unserved_bytes=unserved,
        weight_sync=ws,
    )


_Summary = tuple[float, tuple[tuple[PodPair, float], ...]]


def _summary(demand: Mapping[PodPair, float]) -> _Summary:
    """Total bytes and the 8 largest pairs (ties: first in order) of a demand matrix;
    memoized with pass 1, so a large matrix is not walked again on every plan."""
    for _wiring, d, _counts, summary in _pass1.values():
        if d is demand:
            return summary
    total = sum(b for b in demand.values() if b > 0)
    return total, tuple(heapq.nlargest(8, demand.items(), key=itemgetter(1)))


# Pass 1 of the allocation (and the demand) depends on the wiring, the workloads and the
# failed ports, not on the circuits the switches hold: a controller walking the phases
# re-plans the same workloads over ever different circuits, so it is memoized (a pure
# function's results, keyed by its inputs; the wiring by identity, kept alive here).
_PASS1_SIZE = 16
_pass1: OrderedDict[
    tuple[int, tuple[Workload, ...], frozenset[tuple[str, int]]],
    tuple[Wiring, dict[PodPair, float], Counts, _Summary],
] = OrderedDict()


def _demand_and_counts(
    wiring: Wiring, workloads: Sequence[Workload], down: frozenset[tuple[str, int]]
) -> tuple[dict[PodPair, float], Counts]:
    """The demand matrix and the circuit counts for it (callers must not modify them)."""
    key = (id(wiring), tuple(workloads), down)
    hit = _pass1.get(key)
    if hit is not None and hit[0] is wiring:
        _pass1.move_to_end(key)
        return hit[1], hit[2]
    demand = demand_matrix(wiring, workloads)
    counts = circuit_counts(wiring, demand, down)
    _pass1[key] = (wiring, demand, counts, _summary(demand))
    while len(_pass1) > _PASS1_SIZE:
        _pass1.popitem(last=False)
    return demand, counts


def _fmt_s(t: float) -> str:
    return "unreachable" if math.isinf(t) else f"{t * 1000:.1f} ms"


def _explain(
    demand: Mapping[PodPair, float],
    count: Mapping[PodPair, int],
    plan: CircuitPlan,
    routes: Sequence[PodRoute] | None,
    bottleneck: float,
    unserved: float,
    served_pairs: int,
    moved: int,
    kept: bool,
    notes: Sequence[str],
    ws: WeightSyncPlan | None,
) -> str:
    lines = []
    total, top = _summary(demand)
    lines.append(
        f"demand: {len(demand)} pod pair(s), {total / 1e9:.2f} GB; circuits: "
        f"{len(plan.desired)} (+{len(plan.add)} -{len(plan.remove)}, {moved} OCS port moves); "
        f"bottleneck {_fmt_s(bottleneck)}"
    )
    if unserved > 0:
        without = len(demand) - served_pairs  # every entry of a demand matrix is > 0
        lines.append(
            f"  {without} pod pair(s), {unserved / 1e9:.2f} GB, without a direct circuit "
            "(more partners than OCS ports)"
        )
    for p, nbytes in top:
        lines.append(
            f"  {p[0]} <-> {p[1]}: {nbytes / 1e9:.2f} GB over {count.get(p, 0)} circuit(s)"
        )
    if len(demand) > 8:
        lines.append(f"  ... and {len(demand) - 8} more pair(s)")
    if routes is not None:
        lines.append(f"routes: {len(routes)} (ToR, destination pod) ECMP groups")
    if kept and not plan.add and not plan.remove:
        lines.append("topology: unchanged")
    lines.extend(notes)
    if ws is not None:
        lines.append(ws.explanation)
    return "\n".join(lines)


# -- the controller's use: a phase's circuits, planned from demand, template as fallback --


@dataclass(frozen=True)
class PhaseDemand:
    """The bytes behind each phase's traffic (the controller's configuration).

    0 means unknown: that phase then uses its template (:mod:`scheduler.circuits`).
    """

    model_bytes: float = DEFAULT_MODEL_BYTES  # weight sync: the model's weights
    training_bytes: float = DEFAULT_TRAINING_BYTES  # training: all-reduced per step

    def __post_init__(self) -> None:
        for name in ("model_bytes", "training_bytes"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value >= 0):
                raise errors.field_error(name, value, "bytes, a finite number >= 0 (0: unknown)")


@dataclass(frozen=True)
class PhaseCircuits:
    """A phase's circuits relative to the committed ones, and how they were chosen."""

    circuits: CircuitPlan
    planner: str  # "network" (traffic-driven) or "template" (the fallback)
    explanation: str


CONTROLLER_NETWORK_CONFIG = NetworkConfig(
    weight_sync_schedule=False, routes=False, release_idle=True
)


def plan_phase_circuits(
    wiring: Wiring,
    phase: Phase,
    committed: Iterable[Circuit],
    unavailable_ports: Iterable[tuple[str, int]] = (),
    *,
    without_pods: Iterable[str] = (),
    demand: PhaseDemand = PhaseDemand(),
    config: NetworkConfig = CONTROLLER_NETWORK_CONFIG,
    now: float = 0.0,
) -> PhaseCircuits:
    """The circuits of ``phase`` from the traffic-driven planner (:func:`plan_network`
    over :func:`workloads_for_phase` with ``demand``'s bytes), relative to ``committed``.

    Falls back to the phase template (:func:`scheduler.circuits.plan_phase`) when the
    phase's bytes are unknown (0), when the planner fails, or when it cannot place a
    single circuit for a demand that exists; the explanation says which and why.
    ``without_pods`` (every node down) take no part; ``unavailable_ports`` are never used.
    """
    committed = frozenset(committed)
    down = frozenset(unavailable_ports)
    gone = tuple(sorted(set(without_pods)))

    def template(reason: str) -> PhaseCircuits:
        plan = plan_phase(wiring, phase, committed, down)
        return PhaseCircuits(
            plan,
            "template",
            f"phase template {phase.value}: {len(plan.desired)} circuit(s) "
            f"(+{len(plan.add)} -{len(plan.remove)}); {reason}",
        )

    needs = {
        Phase.TRAINING: (("training_bytes", demand.training_bytes),),
        Phase.WEIGHT_SYNC: (("model_bytes", demand.model_bytes),),
        Phase.ASYNC: (
            ("training_bytes", demand.training_bytes),
            ("model_bytes", demand.model_bytes),
        ),
    }.get(phase, ())
    for name, nbytes in needs:
        if nbytes <= 0:
            return template(f"no demand information ({name} is 0)")
    workloads = workloads_for_phase(
        wiring,
        phase,
        grad_bytes=demand.training_bytes,
        model_bytes=demand.model_bytes,
        without=gone,
    )
    try:
        net = plan_network(wiring, workloads, committed, down, now, config=config)
    except errors.OrlError as exc:
        return template(f"the network planner failed: {exc}")
    if net.demand and net.bottleneck_s == 0:  # no pair with demand got a circuit
        return template("the network planner could place no circuit for the demand")
    header = (
        f"network planner ({phase.value}): bottleneck-first circuits for the phase's "
        f"pod-to-pod demand"
    )
    return PhaseCircuits(net.circuits, "network", f"{header}\n{net.explanation}")
