"""Pure helpers of a reconciliation: per-switch batches, their inverse, verification."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

from orchestrrl.model import Circuit
from scheduler.circuits import CircuitPlan

PortPair = tuple[int, int]


def batches_by_ocs(plan: CircuitPlan) -> dict[str, tuple[list[PortPair], list[PortPair]]]:
    """(disconnect, connect) port pairs per OCS, sorted, only for switches that change."""
    out: dict[str, tuple[list[PortPair], list[PortPair]]] = defaultdict(lambda: ([], []))
    for c in sorted(plan.remove):
        out[c.ocs][0].append((c.a, c.b))
    for c in sorted(plan.add):
        out[c.ocs][1].append((c.a, c.b))
    return dict(sorted(out.items()))


def inverse(
    disconnect: Iterable[PortPair], connect: Iterable[PortPair]
) -> tuple[list[PortPair], list[PortPair]]:
    """The batch that undoes (disconnect, connect): disconnect what was connected and
    connect again what was disconnected."""
    return list(connect), list(disconnect)


def check_applied(plan: CircuitPlan, observed: Iterable[Circuit]) -> list[str]:
    """Problems found when reading the switches back after programming them."""
    seen = frozenset(observed)
    problems = [f"circuit {c} is missing" for c in sorted(plan.desired - seen)]
    problems += [f"circuit {c} is still connected" for c in sorted(plan.remove & seen)]
    return problems
