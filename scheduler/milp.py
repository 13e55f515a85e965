"""The exact compute plan for small cases: a MILP solved by HiGHS (``highspy``).

Same model as the heuristic in :mod:`scheduler.compute` (the same
:class:`~scheduler.compute.Problem`): choose one layout per node and one instance per
request to minimise the latest instance's finish time::

    min z + u
    s.t.  sum_P y[n,P] = 1                                  one layout per node
          sum_s x[r,s] = 1                                  every request placed once
          x[r,s] <= y[n(s),P(s)]                            only on instances that exist
          u >= pause(n,P) y[n,P]                            switching: the longest pause
          w[s] >= q_r x[r,s],  slots_t w[s] >= sum_r m_r x[r,s]   iterations of s
          z >= a_t w[s] + sum_r (c_t m_r + p_t pre_r + move(r,s)) x[r,s]

``move(r, s)`` is the cost of the request ending on ``s`` from where it is now (moving
its KV or recomputing it, whichever is cheaper; free inside a node that reshards).
Used by the tests to bound the heuristic's gap; ``highspy`` is an optional dependency
(``pip install orchestrrl[milp]``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from orchestrrl import errors
from scheduler.compute import Pattern, Problem
from scheduler.compute_state import Instance


@dataclass(frozen=True)
class MilpResult:
    objective_s: float
    layout: Mapping[str, Pattern]
    assignment: tuple[tuple[str, str], ...]
    optimal: bool
    status: str


def solve_exact(prob: Problem, *, time_limit_s: float = 60.0) -> MilpResult:
    try:
        import highspy
        import numpy as np
    except ImportError:  # pragma: no cover - depends on the installation
        raise errors.FailedPrecondition(
            "the exact planner needs highspy: pip install 'orchestrrl[milp]'"
        ) from None

    cap = max((c.capacity_tokens for c in prob.costs.values()), default=0)
    reqs = [r for r in range(len(prob.rids)) if prob.has_kv[r] or prob.ctx[r] + prob.q[r] <= cap]

    highs: Any = highspy.Highs
    h = highs()
    h.setOptionValue("output_flag", False)
    h.setOptionValue("time_limit", float(time_limit_s))
    h.setOptionValue("mip_rel_gap", 1e-7)
    h.setOptionValue("random_seed", 0)
    h.setOptionValue("threads", 1)
    inf = highspy.kHighsInf

    lower: list[float] = []
    upper: list[float] = []
    cost: list[float] = []
    integer: list[int] = []

    def var(lo: float, hi: float, c: float = 0.0, is_int: bool = False) -> int:
        lower.append(lo)
        upper.append(hi)
        cost.append(c)
        if is_int:
            integer.append(len(lower) - 1)
        return len(lower) - 1

    rows: list[tuple[float, float, list[int], list[float]]] = []

    z = var(0.0, inf, 1.0)
    u = var(0.0, inf, 1.0)
    y: dict[tuple[str, int], int] = {}
    slots: list[tuple[str, int, int, Instance]] = []  # (node, option, var w, instance)
    for n in prob.nodes:
        opts = prob.options[n]
        for p in range(len(opts)):
            y[(n, p)] = var(0.0, 1.0, 0.0, True)
            pause = prob.node_pause_at(n, prob.current_pattern[n], opts[p])
            if pause > 0:
                rows.append((0.0, inf, [u, y[(n, p)]], [1.0, -pause]))
        rows.append((1.0, 1.0, [y[(n, p)] for p in range(len(opts))], [1.0] * len(opts)))
        for p, pattern in enumerate(opts):
            for inst in prob.instances_for(n, pattern):
                slots.append((n, p, var(0.0, inf), inst))

    x: dict[tuple[int, int], int] = {}
    for r in reqs:
        idx = []
        for s, (_n, _p, _w, inst) in enumerate(slots):
            if prob.feasible(r, inst.tp) or prob.current[r] == inst.id:
                x[(r, s)] = var(0.0, 1.0, 0.0, True)
                idx.append(x[(r, s)])
        if not idx:
            raise errors.FailedPrecondition(
                f"request {prob.rids[r]!r} fits no instance in any layout option"
            )
        rows.append((1.0, 1.0, idx, [1.0] * len(idx)))

    by_slot: dict[int, list[int]] = {}
    for (r, s), v in x.items():
        by_slot.setdefault(s, []).append(r)
        n, p, _w, _inst = slots[s]
        rows.append((-inf, 0.0, [v, y[(n, p)]], [1.0, -1.0]))

    for s, (n, p, w, inst) in enumerate(slots):
        c = prob.costs[inst.tp]
        members = by_slot.get(s, [])
        # w >= q_r x_r
        for r in members:
            rows.append((0.0, inf, [w, x[(r, s)]], [1.0, -prob.q[r]]))
        # slots * w >= sum m_r x_r
        if members:
            rows.append(
                (
                    0.0,
                    inf,
                    [w, *(x[(r, s)] for r in members)],
                    [float(c.slots), *(-prob.m[r] for r in members)],
                )
            )
        # z >= a w + sum (c m + p pre + move) x
        changes = p != 0  # option 0 is the current layout
        idx = [z, w]
        val = [1.0, -c.iteration_s]
        for r in members:
            cur = prob.current[r]
            same_node_changes = changes and cur is not None and prob.instances[cur].node == n
            move = prob.move(r, inst, same_node_changes)[0]
            idx.append(x[(r, s)])
            val.append(-(c.per_sequence_s * prob.m[r] + c.prefill_per_token_s * prob.pre[r] + move))
        rows.append((0.0, inf, idx, val))

    n_var = len(lower)
    h.addVars(n_var, np.array(lower, dtype=np.float64), np.array(upper, dtype=np.float64))
    h.changeColsCost(n_var, np.arange(n_var, dtype=np.int32), np.array(cost, dtype=np.float64))
    if integer:
        h.changeColsIntegrality(
            len(integer),
            np.array(integer, dtype=np.int32),
            np.array([highspy.HighsVarType.kInteger] * len(integer)),
        )
    for lo, hi, idx, val in rows:
        h.addRow(lo, hi, len(idx), np.array(idx, dtype=np.int32), np.array(val, dtype=np.float64))
    h.changeObjectiveSense(highspy.ObjSense.kMinimize)
    h.run()
    status = h.getModelStatus()
    status_s = h.modelStatusToString(status)
    optimal = status == highspy.HighsModelStatus.kOptimal
    if not optimal and h.getInfo().primal_solution_status != 2:
        raise errors.FailedPrecondition(f"MILP not solved: {status_s}")
    values = list(h.getSolution().col_value)
    layout: dict[str, Pattern] = {}
    for (n, p), v in y.items():
        if values[v] > 0.5:
            layout[n] = prob.options[n][p]
    assignment = []
    for (r, s), v in sorted(x.items()):
        if values[v] > 0.5:
            inst = slots[s][3]
            assignment.append((prob.rids[r], inst.id))
    return MilpResult(
        objective_s=float(h.getInfo().objective_function_value),
        layout=layout,
        assignment=tuple(sorted(assignment)),
        optimal=optimal,
        status=status_s,
    )
