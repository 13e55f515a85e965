"""Pure helpers of a reconciliation: ours vs foreign circuits, make-before-break
steps, per-switch batches, verification."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
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
    return frozenset(
        c
        for c in circuits
        if wiring.port_owner(c.ocs, c.a) is not None or wiring.port_owner(c.ocs, c.b) is not None
    )


def converge(wiring: Wiring, observed: Iterable[Circuit], target: Iterable[Circuit]) -> CircuitPlan:
    """The change that takes the switches from ``observed`` to exactly ``target`` on our ports."""
    return diff(ours(wiring, observed), target)


def batches_by_ocs(plan: CircuitPlan) -> dict[str, tuple[list[PortPair], list[PortPair]]]:
    """(disconnect, connect) port pairs per OCS, sorted, only for switches that change."""
    out: dict[str, tuple[list[PortPair], list[PortPair]]] = defaultdict(lambda: ([], []))
    for c in sorted(plan.remove):
        out[c.ocs][0].append((c.a, c.b))
    for c in sorted(plan.add):
        out[c.ocs][1].append((c.a, c.b))
    return dict(sorted(out.items()))


def steps(plan: CircuitPlan) -> list[list[Batch]]:
    """Make-before-break: first every new circuit whose ports are free now ("make"),
    then the removals with the remaining additions ("break"). Each step is a list of
    per-OCS batches; an empty step is omitted."""
    busy = {p for c in plan.remove for p in c.ports()}
    make = frozenset(c for c in plan.add if not any(p in busy for p in c.ports()))
    first = CircuitPlan(plan.desired, make, frozenset())
    second = CircuitPlan(plan.desired, plan.add - make, plan.remove)
    out = []
    for part in (first, second):
        batches = [Batch(ocs, tuple(d), tuple(c)) for ocs, (d, c) in batches_by_ocs(part).items()]
        if batches:
            out.append(batches)
    return out


def check_applied(plan: CircuitPlan, observed: Iterable[Circuit]) -> list[str]:
    """Problems found when reading the switches back after programming them."""
    seen = frozenset(observed)
    problems = [f"circuit {c} is missing" for c in sorted(plan.desired - seen)]
    problems += [f"circuit {c} is still connected" for c in sorted(plan.remove & seen)]
    return problems
