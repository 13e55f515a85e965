"""RFabric's network planner: workloads -> pod-to-pod demand -> OCS circuits + routes.

Pure: a function of the wiring, the active workloads, the circuits the switches hold,
the failed ports and ``now``. Steps:

1. Demand. Every workload adds bytes between pod pairs:
   - a training collective (all-reduce of ``nbytes`` over ``P`` pods) sends
     ``2 (P-1)/P * nbytes`` out of each pod, spread evenly over its ``P-1`` partners:
     ``2 * nbytes / P`` per pod pair;
   - generation stays inside its pod (no inter-pod demand);
   - weight sync: every target pod receives the model once, split evenly over the
     source pods (``nbytes / |sources|`` per pair), so that every sender works;
   - explicit pod-pair demand for anything else.
2. Circuits: bottleneck first (MixNet): the next circuit goes to the pod pair with the
   worst demand per circuit, within every pod's ports on every OCS
   (:func:`scheduler.circuits.allocate`, which reuses a pair's existing circuits first).
   When the circuits the switches already hold serve the demand within
   ``keep_tolerance`` of the new allocation's bottleneck time, they stay: no port moves
   for a near-equal result.
3. Slack gate: a change is committed only when it completes inside the predicted idle
   window (:func:`scheduler.gate.slack_gate`); otherwise the current topology stays and
   the plan says so.
4. Routes: for every ToR and every other pod it has circuits to, one route to that pod's
   prefix whose ECMP next hops are exactly the ToR's uplink ports whose circuits reach
   that pod (:class:`PodRoute`). No route ever names a circuit the plan does not have.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from itertools import combinations

from orchestrrl import errors
from orchestrrl.model import Circuit, Phase, Role, Wiring
from scheduler.circuits import CircuitPlan, PodPair, allocate, diff, pair
from scheduler.gate import GateDecision, slack_gate
from scheduler.weight_sync import WeightSyncPlan, plan_weight_sync

DEFAULT_UPLINK_GBPS = 400.0  # ToR uplinks run at the NIC speed of H800 nodes (MISSION.md)


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
    # weight sync schedule (see scheduler.weight_sync)
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
    demand: tuple[tuple[PodPair, float], ...]  # bytes per pod pair, sorted
    explanation: str
    planned_at: float = 0.0
    gate: GateDecision | None = None
    kept_current: bool = False
    bottleneck_s: float = 0.0  # time the busiest pod pair needs on the chosen circuits
    ports_moved: int = 0
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
                per_pair = w.nbytes / len(w.pods)
                for s in w.pods:
                    for t in w.targets:
                        if s != t:
                            out[pair(s, t)] += per_pair
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
) -> tuple[Workload, ...]:
    """Default workloads of a phase: the controller's phase templates as workloads.

    Their demand is proportional to :func:`scheduler.circuits.template_demand`, so the
    allocation is the same as the template's.
    """
    train = wiring.pods_with_role(Role.TRAIN)
    gen = wiring.pods_with_role(Role.GEN)
    if phase is Phase.TRAINING:
        return (Workload.training(train, grad_bytes),)
    if phase is Phase.GENERATION:
        return tuple(Workload.generation(g) for g in gen)
    return (Workload.weight_sync(train, gen, model_bytes),)


def bottleneck_time(
    wiring: Wiring,
    demand: Mapping[PodPair, float],
    circuits: Iterable[Circuit],
    uplink_gbps: float,
) -> float:
    """Seconds the worst pod pair needs to move its demand over its circuits."""
    count: dict[PodPair, int] = defaultdict(int)
    for c in circuits:
        a, b = wiring.circuit_pods(c)
        if a and b and a != b:
            count[pair(a, b)] += 1
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
    the time from ``now`` to the earliest ``starts_at`` of the workloads (ungated when
    no workload says when it starts).
    """
    down = frozenset(unavailable_ports)
    observed = frozenset(observed_circuits)
    ours = frozenset(
        c
        for c in observed
        if wiring.port_owner(c.ocs, c.a) is not None or wiring.port_owner(c.ocs, c.b) is not None
    )
    demand = demand_matrix(wiring, workloads)
    fresh = allocate(wiring, demand, ours, down)
    usable = frozenset(
        c
        for c in ours
        if (c.ocs, c.a) not in down
        and (c.ocs, c.b) not in down
        and all(wiring.circuit_pods(c))
        and len(set(wiring.circuit_pods(c))) == 2
    )
    gbps = config.uplink_gbps
    t_fresh = bottleneck_time(wiring, demand, fresh, gbps)
    t_keep = bottleneck_time(wiring, demand, usable, gbps)
    notes: list[str] = []
    kept = False
    if (
        config.keep_tolerance is not None
        and usable == ours
        and t_keep <= t_fresh * (1.0 + config.keep_tolerance)
    ):
        desired = ours
        kept = True
        if fresh != ours:
            notes.append(
                f"kept the {len(ours)} current circuits: bottleneck {_fmt_s(t_keep)} vs "
                f"{_fmt_s(t_fresh)} after rewiring, within {config.keep_tolerance:.0%}"
            )
    else:
        desired = fresh
    plan = diff(ours, desired)

    gate: GateDecision | None = None
    if not plan.empty:
        touched = {c.ocs for c in plan.add | plan.remove}
        switching = max(wiring.ocs(o).switching_time_s for o in touched)
        window = idle_window_s
        if window is None:
            starts = [w.starts_at for w in workloads if w.starts_at is not None]
            window = (min(starts) - now) if starts else None
        gate = slack_gate(window, switching)
        if not gate.reconfigure:
            notes.append(gate.reason)
            desired = ours
            plan = diff(ours, ours)
            kept = True
        else:
            notes.append(gate.reason)

    routes = routes_for(wiring, desired)
    bottleneck = bottleneck_time(wiring, demand, desired, gbps)
    moved = 2 * (len(plan.add) + len(plan.remove))

    ws: WeightSyncPlan | None = None
    syncs = [w for w in workloads if w.kind is WorkloadKind.WEIGHT_SYNC and w.nbytes > 0]
    if syncs:
        w0 = syncs[0]
        ws = plan_weight_sync(
            wiring,
            desired,
            w0.nbytes,
            sources=w0.pods,
            targets=w0.targets,
            uplink_gbps=gbps,
            link_efficiency=config.link_efficiency,
            chunk_bytes=config.chunk_bytes,
        )

    explanation = _explain(wiring, demand, plan, routes, bottleneck, moved, kept, notes, ws)
    return NetworkPlan(
        circuits=plan,
        routes=routes,
        demand=tuple(sorted(demand.items())),
        explanation=explanation,
        planned_at=now,
        gate=gate,
        kept_current=kept,
        bottleneck_s=bottleneck,
        ports_moved=moved,
        weight_sync=ws,
    )


def _fmt_s(t: float) -> str:
    return "unreachable" if math.isinf(t) else f"{t * 1000:.1f} ms"


def _explain(
    wiring: Wiring,
    demand: Mapping[PodPair, float],
    plan: CircuitPlan,
    routes: Sequence[PodRoute],
    bottleneck: float,
    moved: int,
    kept: bool,
    notes: Sequence[str],
    ws: WeightSyncPlan | None,
) -> str:
    lines = []
    total = sum(demand.values())
    lines.append(
        f"demand: {len(demand)} pod pair(s), {total / 1e9:.2f} GB; circuits: "
        f"{len(plan.desired)} (+{len(plan.add)} -{len(plan.remove)}, {moved} OCS port moves); "
        f"bottleneck {_fmt_s(bottleneck)}"
    )
    count: dict[PodPair, int] = defaultdict(int)
    for c in plan.desired:
        a, b = wiring.circuit_pods(c)
        if a and b and a != b:
            count[pair(a, b)] += 1
    for p, nbytes in sorted(demand.items(), key=lambda x: -x[1])[:8]:
        lines.append(
            f"  {p[0]} <-> {p[1]}: {nbytes / 1e9:.2f} GB over {count.get(p, 0)} circuit(s)"
        )
    if len(demand) > 8:
        lines.append(f"  ... and {len(demand) - 8} more pair(s)")
    lines.append(f"routes: {len(routes)} (ToR, destination pod) ECMP groups")
    if kept and not plan.add and not plan.remove:
        lines.append("topology: unchanged")
    lines.extend(notes)
    if ws is not None:
        lines.append(ws.explanation)
    return "\n".join(lines)
