"""Pure helpers of a reconciliation: ours vs foreign circuits, make-before-break
steps, per-switch batches, verification."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from orchestrrl.model import Circuit, Wiring
from scheduler.circuits import CircuitPlan, diff

PortPair = tuple[int, int]


@dataclass(frozen=True)
class Batch:
    """One atomic batch for one OCS: disconnects first, then connects."""

    ocs: str
    disconnect: tuple[PortPair, ...]
    connect: tuple[PortPair, ...]


def ours(wiring: Wiring, circuits: Iterable[Circuit]) -> frozenset[Circuit]:
    """Circuits touching a port the wiring cables to a pod (the rest are not ours)."""
    owner = wiring.port_owner
    return frozenset(
        c for c in circuits if owner(c.ocs, c.a) is not None or owner(c.ocs, c.b) is not None
    )


def converge(wiring: Wiring, observed: Iterable[Circuit], target: Iterable[Circuit]) -> CircuitPlan:
    """The change that takes the switches from ``observed`` to exactly ``target`` on our ports."""
    return diff(ours(wiring, observed), target)


def batches_by_ocs(plan: CircuitPlan) -> dict[str, tuple[list[PortPair], list[PortPair]]]:
    """(disconnect, connect) port pairs per OCS, sorted, only for switches that change."""
    out: dict[str, tuple[list[PortPair], list[PortPair]]] = defaultdict(lambda: ([], []))
    for ocs, a, b in sorted(plan.remove):
        out[ocs][0].append((a, b))
    for ocs, a, b in sorted(plan.add):
        out[ocs][1].append((a, b))
    return dict(sorted(out.items()))


def steps(plan: CircuitPlan) -> list[list[Batch]]:
    """Make-before-break: first every new circuit whose ports are free now ("make"),
    then the removals with the remaining additions ("break"). Each step is a list of
    per-OCS batches (switches and pairs sorted); an empty step is omitted."""
    busy: set[tuple[str, int]] = set()
    removals: dict[str, list[PortPair]] = defaultdict(list)
    for ocs, a, b in plan.remove:
        busy.add((ocs, a))
        busy.add((ocs, b))
        removals[ocs].append((a, b))
    make: dict[str, list[PortPair]] = defaultdict(list)
    later: dict[str, list[PortPair]] = defaultdict(list)
    for ocs, a, b in plan.add:
        ((later if (ocs, a) in busy or (ocs, b) in busy else make)[ocs]).append((a, b))
    for pairs in (*removals.values(), *make.values(), *later.values()):
        pairs.sort()  # pairs of ints: cheaper than sorting the circuits
    first = [Batch(ocs, (), tuple(make[ocs])) for ocs in sorted(make)]
    second = [
        Batch(ocs, tuple(removals.get(ocs, ())), tuple(later.get(ocs, ())))
        for ocs in sorted(removals.keys() | later.keys())
    ]
    return [s for s in (first, second) if s]


def check_applied(plan: CircuitPlan, observed: Iterable[Circuit]) -> list[str]:
    """Problems found when reading the switches back after programming them."""
    return check_tables(plan, {}, frozenset(observed))


def check_tables(
    plan: CircuitPlan,
    tables: Mapping[str, frozenset[PortPair]],
    others: frozenset[Circuit],
) -> list[str]:
    """``check_applied`` against per-OCS tables as the switches returned them, and
    ``others`` (the circuits of the switches not in ``tables``), without building a
    circuit for every entry of every table."""

    def present(c: Circuit) -> bool:
        table = tables.get(c.ocs)
        return (c.a, c.b) in table if table is not None else c in others

    missing = sorted(c for c in plan.desired if not present(c))
    still = sorted(c for c in plan.remove if present(c))
    return [f"circuit {c} is missing" for c in missing] + [
        f"circuit {c} is still connected" for c in still
    ]


def shortfall(
    wiring: Wiring, full: Iterable[Circuit], got: Iterable[Circuit]
) -> tuple[tuple[str, str, int], ...]:
    """Circuits per pod pair that ``got`` lacks against ``full`` (the same phase planned
    with every port up): ``(pod_a, pod_b, circuits)`` with ``pod_a <= pod_b``, sorted;
    empty when ``got`` has at least as many circuits as ``full`` for every pair."""

    def per_pair(circuits: Iterable[Circuit]) -> dict[tuple[str, str], int]:
        counts: dict[tuple[str, str], int] = defaultdict(int)
        for c in circuits:
            a, b = wiring.circuit_pods(c)
            counts[(a, b) if a <= b else (b, a)] += 1
        return counts

    have = per_pair(got)
    return tuple(
        (a, b, n - have.get((a, b), 0))
        for (a, b), n in sorted(per_pair(full).items())
        if n > have.get((a, b), 0)
    )


def describe_shortfall(missing: Iterable[tuple[str, str, int]]) -> str:
    """``3 circuit(s) missing (train0-train1: 2, gen0-train0: 1)`` (at most 8 pairs named)."""
    missing = list(missing)
    total = sum(n for _, _, n in missing)
    named = ", ".join(f"{a}-{b}: {n}" for a, b, n in missing[:8])
    more = f", and {len(missing) - 8} more pair(s)" if len(missing) > 8 else ""
    return f"{total} circuit(s) missing ({named}{more})"
