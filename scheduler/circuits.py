"""Circuit planning: phase templates and the greedy allocator behind them.

Pure functions of the wiring, the phase and the observed circuits. The allocator
hands out circuits one at a time to the pod pair whose circuits-per-demand is
lowest (bottleneck first, as in MixNet), within each pod's OCS port budget, and
keeps circuits that already exist wherever the new layout allows, so a phase
change moves as few OCS ports as possible.
"""

from __future__ import annotations

import heapq
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from itertools import combinations

from orchestrrl.model import Circuit, Phase, Role, Wiring

PodPair = tuple[str, str]


def pair(a: str, b: str) -> PodPair:
    return (a, b) if a <= b else (b, a)


def template_demand(wiring: Wiring, phase: Phase) -> dict[PodPair, float]:
    """Relative pod-to-pod demand of a phase's template.

    - generation: pods work in isolation (no inter-pod circuits);
    - training: a mesh among the training pods;
    - weight-sync: every training pod to every generation pod;
    - async (asynchronous mode's standing topology): both of the last two at once, the
      training mesh and every training pod to every generation pod.
    """
    train = wiring.pods_with_role(Role.TRAIN)
    gen = wiring.pods_with_role(Role.GEN)
    if phase is Phase.GENERATION:
        return {}
    mesh = {pair(a, b): 1.0 for a, b in combinations(train, 2)}
    if phase is Phase.TRAINING:
        return mesh
    broadcast = {pair(t, g): 1.0 for t in train for g in gen}
    if phase is Phase.ASYNC:
        return {**mesh, **broadcast}
    return broadcast


@dataclass(frozen=True)
class CircuitPlan:
    """The circuits of a desired state and the difference to the observed one."""

    desired: frozenset[Circuit]
    add: frozenset[Circuit]
    remove: frozenset[Circuit]

    @property
    def empty(self) -> bool:
        return not self.add and not self.remove


def diff(observed: Iterable[Circuit], desired: Iterable[Circuit]) -> CircuitPlan:
    obs, des = frozenset(observed), frozenset(desired)
    return CircuitPlan(desired=des, add=des - obs, remove=obs - des)


# circuits per (pod pair, OCS), sorted: what pass 1 of ``allocate`` decides
Counts = tuple[tuple[tuple[PodPair, str], int], ...]


_Ports = tuple[
    dict[tuple[str, str], list[int]],  # (pod, ocs) -> usable ports, in order
    dict[tuple[str, int], str],  # (ocs, port) -> its ToR
    dict[tuple[str, str], dict[str, list[int]]],  # (pod, ocs) -> ToR -> ports, highest first
]
_ports_memo: dict[tuple[int, frozenset[tuple[str, int]]], tuple[Wiring, _Ports]] = {}


def _ports(wiring: Wiring, down: frozenset[tuple[str, int]]) -> _Ports:
    """Usable uplink ports per (pod, OCS) in port order, the ToR of every uplink port,
    and the usable ports per (pod, OCS) and ToR (read-only for callers; memoized per
    wiring, by identity, and failed ports: a large fabric has thousands of ports and
    they rarely change)."""
    key = (id(wiring), down)
    hit = _ports_memo.get(key)
    if hit is not None and hit[0] is wiring:
        return hit[1]
    free: dict[tuple[str, str], list[int]] = defaultdict(list)
    for pod, ocs, port in wiring.uplink_ports():
        if (ocs, port) not in down:
            free[(pod, ocs)].append(port)
    for ports in free.values():
        ports.sort()
    tor_of = {(u.ocs, u.ocs_port): t.name for t in wiring.tors for u in t.uplinks}
    by_tor: dict[tuple[str, str], dict[str, list[int]]] = defaultdict(dict)
    for (pod, ocs), ports in free.items():
        for x in reversed(ports):
            by_tor[(pod, ocs)].setdefault(tor_of[(ocs, x)], []).append(x)
    if len(_ports_memo) >= 8:
        _ports_memo.clear()
    result = (dict(free), tor_of, dict(by_tor))
    _ports_memo[key] = (wiring, result)
    return result


def allocate(
    wiring: Wiring,
    demand: Mapping[PodPair, float],
    keep: Iterable[Circuit] = (),
    unavailable_ports: Iterable[tuple[str, int]] = (),
) -> frozenset[Circuit]:
    """Allocate circuits for a pod-pair demand within every pod's OCS port budget.

    Pass 1 (:func:`circuit_counts`) decides how many circuits each pod pair gets on
    each OCS from the demand and the budgets alone; pass 2 (:func:`place`) picks ports,
    reusing ``keep`` (the circuits that exist now) wherever a pair keeps circuits on
    that OCS, then free ports spread over each pod's ToRs (fewest circuits to the other
    pod first, then the lowest port). Because the counts never depend on ``keep``,
    allocating again from the result reuses every circuit: re-planning an applied plan
    is a no-op, and pass 1 can be reused while only the circuits change.
    ``unavailable_ports`` (failed ports) are never used. Deterministic.
    """
    down = frozenset(unavailable_ports)
    return place(wiring, circuit_counts(wiring, demand, down), keep, down)


def circuit_counts(
    wiring: Wiring,
    demand: Mapping[PodPair, float],
    unavailable_ports: Iterable[tuple[str, int]] = (),
) -> Counts:
    """Pass 1 of :func:`allocate`: circuits per pod pair and OCS, bottleneck first."""
    free, _, _ = _ports(wiring, frozenset(unavailable_ports))
    budget: dict[tuple[str, str], int] = {k: len(v) for k, v in free.items()}
    count: dict[PodPair, int] = defaultdict(int)
    per_ocs: dict[tuple[PodPair, str], int] = defaultdict(int)
    ocs_names = [o.name for o in wiring.ocses]
    active = {p: w for p, w in demand.items() if w > 0 and p[0] != p[1]}
    # A heap of (circuits per unit of demand, pair): the worst-served pair comes first,
    # ties to the first pair in sorted order. Budgets only shrink, so a pair with no
    # common OCS port left never gets one again and is dropped for good.
    pod_free: dict[str, int] = defaultdict(int)  # over all OCSes: a cheap first test
    for (pod, _), n in budget.items():
        pod_free[pod] += n
    pairs = sorted(active)

    def grant(p: PodPair) -> bool:
        """One more circuit for ``p`` if some OCS has a free port on both sides."""
        if not pod_free[p[0]] or not pod_free[p[1]]:
            return False
        chosen_ocs = _choose_ocs(p, ocs_names, budget)
        if chosen_ocs is None:
            return False
        count[p] += 1
        per_ocs[(p, chosen_ocs)] += 1
        for pod in p:
            budget[(pod, chosen_ocs)] -= 1
            pod_free[pod] -= 1
        return True

    if len(set(active.values())) <= 1:
        # equal demand: the worst-served-first order is plain round-robin (a pair with
        # a pod out of ports is dropped without a call: most pairs, on a large fabric)
        while pairs:
            pairs = [p for p in pairs if pod_free[p[0]] and pod_free[p[1]] and grant(p)]
    else:
        heap = [(0.0, i) for i in range(len(pairs))]  # the index breaks ties: sorted order
        while heap:
            _, i = heapq.heappop(heap)
            if grant(pairs[i]):
                heapq.heappush(heap, (count[pairs[i]] / active[pairs[i]], i))
    return tuple(sorted(per_ocs.items()))


def place(
    wiring: Wiring,
    counts: Counts,
    keep: Iterable[Circuit] = (),
    unavailable_ports: Iterable[tuple[str, int]] = (),
) -> frozenset[Circuit]:
    """Pass 2 of :func:`allocate`: concrete ports for ``counts``; existing circuits
    first, then free ports spread over each pod's ToRs: the ToR with the fewest circuits
    to the other pod first, then the lowest port (one ToR per pod: simply the lowest
    free ports). Every ToR of a pod then has circuits, hence routes, to the pods it
    talks to."""
    down = frozenset(unavailable_ports)
    if not counts:
        return frozenset()
    _, tor_of, ports_by_tor = _ports(wiring, down)
    existing: dict[tuple[PodPair, str], list[Circuit]] = defaultdict(list)
    owner = wiring.port_owner
    for c in sorted(set(keep)):
        pod_a, pod_b = owner(c.ocs, c.a), owner(c.ocs, c.b)
        if not pod_a or not pod_b or pod_a == pod_b or (c.ocs, c.a) in down or (c.ocs, c.b) in down:
            continue
        existing[(pair(pod_a, pod_b), c.ocs)].append(c)
    load: dict[tuple[str, str], int] = defaultdict(int)  # (tor, other pod) -> circuits
    taken: set[tuple[str, int]] = set()
    chosen: list[Circuit] = []
    for (p, ocs), n in counts:
        kept = existing.get((p, ocs), [])[:n]
        chosen.extend(kept)
        for c in kept:
            taken.update(c.ports())
            for end, other_end in ((c.a, c.b), (c.b, c.a)):
                load[(tor_of[(ocs, end)], wiring.port_owner(ocs, other_end) or "")] += 1
    # free ports per (pod, OCS) and ToR, each list highest first (the lowest pops first),
    # copied from the wiring's on first use, without the ports the kept circuits hold
    spare: dict[tuple[str, str], dict[str, list[int]]] = {}

    def free_ports(pod: str, ocs: str) -> dict[str, list[int]]:
        got = spare.get((pod, ocs))
        if got is None:
            template = ports_by_tor.get((pod, ocs), {})
            got = spare[(pod, ocs)] = {
                tor: [x for x in ports if (ocs, x) not in taken] if taken else ports[:]
                for tor, ports in template.items()
            }
        return got

    def pick(pod: str, other: str, ocs: str) -> int:
        """The lowest free port among the pod's ToRs with the fewest circuits to other."""
        by_tor = spare.get((pod, ocs))
        if by_tor is None:
            by_tor = free_ports(pod, ocs)
        if len(by_tor) == 1:  # one ToR: its lowest free port
            ((tor, ports),) = by_tor.items()
            load[(tor, other)] += 1
            return ports.pop()
        best: tuple[int, int, str] | None = None
        for tor, ports in by_tor.items():
            if ports:
                key = (load[(tor, other)], ports[-1], tor)
                if best is None or key < best:
                    best = key
        assert best is not None
        tor = best[2]
        load[(tor, other)] += 1
        return by_tor[tor].pop()

    for (p, ocs), n in counts:
        for _ in range(n - min(n, len(existing.get((p, ocs), [])))):
            port_a = pick(p[0], p[1], ocs)
            port_b = pick(p[1], p[0], ocs)
            chosen.append(Circuit(ocs, port_a, port_b))
    return frozenset(chosen)


def _choose_ocs(
    p: PodPair, ocs_names: list[str], budget: Mapping[tuple[str, str], int]
) -> str | None:
    """The OCS for the pair's next circuit: the one with the most ports free on both
    sides (the first in wiring order on a tie), or None when no OCS has room."""
    best: tuple[int, str] | None = None
    for ocs in ocs_names:
        room = min(budget.get((p[0], ocs), 0), budget.get((p[1], ocs), 0))
        if room > 0 and (best is None or room > best[0]):
            best = (room, ocs)
    return None if best is None else best[1]


def plan_phase(
    wiring: Wiring,
    phase: Phase,
    observed: Iterable[Circuit],
    unavailable_ports: Iterable[tuple[str, int]] = (),
) -> CircuitPlan:
    """The circuits of ``phase``'s template and the change from ``observed``.

    Observed circuits on ports the wiring does not cable to any pod are left alone
    (they are not ours to move); every other observed circuit is kept, moved or removed.
    """
    observed = frozenset(observed)
    ours = frozenset(
        c
        for c in observed
        if wiring.port_owner(c.ocs, c.a) is not None or wiring.port_owner(c.ocs, c.b) is not None
    )
    desired = allocate(wiring, template_demand(wiring, phase), ours, unavailable_ports)
    return diff(ours, desired)
