"""The adaptive compute scheduler: TP layout per node and a placement per request.

Given the instances of every node, the requests of the step and a forecast of their
remaining lengths, choose the TP layout of every node and the instance of every request
that minimise the predicted rest of the step (the makespan: the latest instance to
finish) plus the cost of getting there (node pauses to reshard, KV moves or recompute).
It switches only when the predicted gain beats the cost by a stated margin.

Under partial rollout the step ends when its rule is met (``StepGoal``), not when its
last request does: the plan is scored on the time until then (work and critical paths cut
where the goal is met, never below the earliest end), and layouts change only at the
step's start (:func:`layout_frozen`).

The instance model (how long an instance takes for a set of requests) is in
:mod:`scheduler.compute_problem`, shared with the exact MILP (:mod:`scheduler.milp`).

How the planner decides (and why a plan is stable: planning again right after applying
it changes nothing):

The objective is the predicted makespan plus the switching cost (the longest node pause
of the reshards; every instance is taken to wait for it) plus, per instance, the moves
into it: ``max_n pause_n + max_i (moves_i + run_i)``.

1. Layout. Every candidate layout is a *profile* (how many nodes of each GPU count use
   each pattern). Its makespan ``M`` is scored from the requests alone (not from where
   they sit): exactly by LPT + local search for small cases, by a fluid bound for large
   ones (the longest requests one per instance on the fastest instances, the rest spread
   by throughput). Its switching cost ``C`` is the exact minimum, over which node takes
   which pattern, of the longest node pause. Node pauses satisfy the triangle inequality,
   so ``score = M + C`` of any layout seen from the chosen one is never below the chosen
   layout's own makespan: re-planning keeps it.
2. Placement. Requests on surviving instances stay; requests on removed instances stay
   on their node (their KV is re-laid out during the pause); queued requests go by LPT
   (longest first to the instance that would finish earliest); then reactive balancing
   moves single requests off the bottleneck instance while a move pays for itself
   (``max(src, dst + cost) + move_margin < src`` on the steady-state run times), each
   move choosing between moving the KV cache and recomputing it by the cost model; on
   small clusters it also tries exchanging two requests when no single move helps. The
   stopping condition is a property of the final placement, so it holds again on re-plan.
   Under partial rollout (``PlannerConfig.carry_tail``) queued requests go in arrival
   order to the shortest line instead, and nothing is moved off stragglers.
3. Admission order. Requests of sample groups the forecast predicts long (their
   finished or long-running siblings say so: ``LengthForecast.group_log_scale``) are
   named in ``ComputePlan.admit_order``, predicted longest first: engines admit them
   ahead of the rest of their queue, which keeps its order. Without group information
   the order is empty and queues stay first come, first served.

Scale: layout scoring, LPT and balancing look at the least-loaded instances of each TP
degree (instances of one degree are interchangeable), so a plan for 1024 instances and
thousands of requests takes tens of milliseconds (``bench/planner.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from operator import attrgetter

import numpy as np

from scheduler.compute_problem import (
    DEFAULT_CONFIG,
    EPS,
    SCALE,
    MoveCost,
    Pattern,
    PlannerConfig,
    Problem,
    TpCost,
    allowed_tps,
    build_problem,
    expand,
    pattern_label,
    tp_costs,
)
from scheduler.compute_state import (
    Candidate,
    ComputePlan,
    ComputeState,
    CostHold,
    Migration,
    MoveMethod,
    Prediction,
    Reshard,
    StepGoal,
)
from scheduler.forecast import LengthForecast
from scheduler.layout import REPORTED, LayoutChoice, choose_layout, switch_margin
from scheduler.perf_model import PerfModel
from scheduler.placement import MoveCostFrom, Placement, keep_makespan, place_on_node

_by_id = attrgetter("id")  # instance ids are unique: the same order as sorting instances


def plan_compute(
    state: ComputeState,
    forecast: LengthForecast,
    perf: PerfModel,
    now: float,
    config: PlannerConfig = DEFAULT_CONFIG,
    *,
    allow_reshard: bool = True,
    goal: StepGoal | None = None,
) -> ComputePlan:
    """Proactive re-plan: layout of every node and the instance of every request.

    ``goal``: under partial rollout, what ends the step (see
    :func:`scheduler.compute_problem.build_problem`). Layouts then change only at the
    step's start, while no request holds a KV cache (carried requests are recomputed on
    the new weights), and only on a forecast that has seen a finished length: the
    choice holds for the whole step, scored over its expected work with the pause paid
    once. Inside the step the rule, not the last instance, ends it, so a switch gains
    only until the goal is met, and its predicted gain is of the order of the
    prediction's error there (see :func:`layout_frozen`)."""
    prob = build_problem(state, forecast, perf, config, goal)
    if layout_frozen(prob, forecast, goal):
        allow_reshard = False
    return solve(prob, now, allow_reshard=allow_reshard)


def layout_frozen(prob: Problem, forecast: LengthForecast, goal: StepGoal | None) -> bool:
    """Whether a plan under ``goal`` must keep every node's layout: a request holds a KV
    cache (the step is under way), or the forecast has seen no finished length (a
    decision that holds for a step must rest on evidence, not the prior). False under
    full rollout (no goal), whose re-plans correct a choice as lengths come in."""
    if goal is None:
        return False
    return bool(prob.kv_array.any()) or forecast.events == 0


def balance(
    state: ComputeState,
    forecast: LengthForecast,
    perf: PerfModel,
    now: float,
    config: PlannerConfig = DEFAULT_CONFIG,
    *,
    goal: StepGoal | None = None,
) -> ComputePlan:
    """Reactive balancing between re-plans: layouts stay, requests move off stragglers."""
    return plan_compute(state, forecast, perf, now, config, allow_reshard=False, goal=goal)


def solve(prob: Problem, now: float, *, allow_reshard: bool = True) -> ComputePlan:
    """The plan for a built problem (``plan_compute`` = ``build_problem`` + this).

    ``allow_reshard`` False keeps every node's layout (reactive balancing).
    """
    config = prob.config
    cap = max((c.capacity_tokens for c in prob.costs.values()), default=0)
    has_kv = prob.has_kv
    q_a, _, _, ctx_a = prob.arrays
    kv_a = prob.kv_array
    fits_a = kv_a | (ctx_a + q_a <= cap)
    placeable: list[int] = np.flatnonzero(fits_a).tolist()
    unplaceable: list[int] = np.flatnonzero(~fits_a).tolist()

    if allow_reshard and placeable:
        target, choices, _ = choose_layout(prob, placeable)
    else:
        target, choices = dict(prob.current_pattern), []
    hold = None
    if prob.measured_pause and choices:
        target, hold = hold_for_cost(prob, target, choices)
    # patterns are sorted (descending) wherever the problem makes them
    changed = {n for n in prob.nodes if target[n] != prob.current_pattern[n]}

    # instances after the plan
    after_by_node = {n: prob.instances_for(n, target[n]) for n in prob.nodes}
    new_instances = [i for insts in after_by_node.values() for i in insts]
    new_instances.sort(key=_by_id)
    n_inst = len(new_instances)
    n_req, work = len(placeable), config.all_candidates_work
    all_cand = (
        n_inst <= config.all_candidates_limit
        and n_req * n_inst <= work
        and n_req * n_req <= work * n_inst
    )

    # the plan's placement: requests on surviving instances stay (vectorised over the
    # requests through codes: per request its current instance, per current instance
    # its index after the plan (-1: removed) and its node)
    pl = Placement(prob, new_instances, all_cand)
    index = pl.index
    current = prob.current
    node_code = {n: c for c, n in enumerate(prob.nodes)}
    old_ids = list(prob.instances)
    none = len(old_ids)  # the code of "no instance" (queued); its entries are sentinels
    old_new = np.array([index.get(iid, -1) for iid in old_ids] + [-2], dtype=np.int64)
    old_node = np.array(
        [node_code[prob.instances[iid].node] for iid in old_ids] + [-1], dtype=np.int64
    )
    cur_all = prob.current_index  # codes: positions in old_ids
    plc = np.array(placeable, dtype=np.int64)
    cur_p = cur_all[plc]
    k_p = old_new[cur_p]
    stay = k_p >= 0
    queued_p = cur_p == none
    displaced_p = ~stay & ~queued_p & kv_a[plc]  # KV re-laid out within its resharding node
    new_queue: list[int] = plc[~stay & ~displaced_p].tolist()
    pl.load_arrays(plc[stay], k_p[stay])

    # keep: current layout, current placement, queued dispatched by LPT
    if changed:
        keep_s = keep_makespan(prob, placeable, all_cand)
    cost_fn = MoveCostFrom(prob, pl)
    # displaced requests: LPT over their node's new instances; a node with one instance
    # takes all that fit, at once
    disp_r = plc[displaced_p]
    disp_node = old_node[cur_p[displaced_p]]
    single = np.full(len(prob.nodes) + 1, -1, dtype=np.int64)
    for node, pool in pl.by_node.items():
        if len(pool) == 1:
            single[node_code[node]] = pool[0]
    one_k = single[disp_node]
    one = one_k >= 0
    r1, k1 = disp_r[one], one_k[one]
    fit1 = ctx_a[r1] + q_a[r1] <= np.array(pl.cap, dtype=np.int64)[k1]
    pl.load_arrays(r1[fit1], k1[fit1])
    left_by_node: dict[int, list[int]] = {}
    for c, r in zip(disp_node[one][~fit1].tolist(), r1[~fit1].tolist(), strict=True):
        left_by_node.setdefault(c, []).append(r)
    relaid_pairs: list[tuple[int, int]] = []
    several = disp_node[~one]
    several_r = disp_r[~one]
    for c in np.unique(several).tolist():
        reqs = several_r[several == c].tolist()
        pairs, left = place_on_node(pl, reqs, pl.by_node[prob.nodes[c]])
        relaid_pairs.extend(pairs)
        if left:
            left_by_node.setdefault(c, []).extend(left)
    pl.load(relaid_pairs)
    # KV that fits nowhere on its node: cheapest feasible instance elsewhere, or the
    # largest instance of the node (the engine preempts) when none fits anywhere
    for c in sorted(left_by_node):
        node = prob.nodes[c]
        for r in left_by_node[c]:
            ks = [k for k in range(n_inst) if pl.fits(r, k)]
            if ks:
                k = min(ks, key=lambda k: (pl.run_with(k, r) + cost_fn(r, k), pl.inst[k].id))
            else:
                k = max(pl.by_node[node], key=lambda k: (pl.cost[k].capacity_tokens, pl.inst[k].id))
            pl.add(r, k)
    if config.carry_tail:
        # partial rollout: the step ends when groups complete, and groups complete in
        # the order they arrived; dispatching in that order to the shortest line keeps
        # every instance at the same place in it (longest first would not)
        left = pl.place_in_line(sorted(new_queue, key=prob.arrival.__getitem__))
    else:
        left = pl.place_lpt(new_queue)
    unplaceable.extend(left)
    if not changed:
        keep_s = max(pl.queued_runs(), default=0.0)
    if not config.carry_tail:
        # under partial rollout the step does not wait for its last instance (the tail
        # is carried into the next step): evening out predicted finishes buys nothing
        pl.balance(cost_fn, max(config.move_margin_s, EPS))

    # predicted times, migrations, reshards
    pauses = {n: prob.node_pause_at(n, prob.current_pattern[n], target[n]) for n in changed}
    rids = prob.rids
    ids = pl.ids
    node_of_instance = {i.id: i.node for i in prob.state.instances}
    # which placed requests stay, are dispatched, re-laid out or moved: vectorised over
    # the requests (only the moves, a few, are looked at one by one)
    where = pl.where
    req_a = np.fromiter(where.keys(), dtype=np.int64, count=len(where))
    dst_a = np.fromiter(where.values(), dtype=np.int64, count=len(where))
    order = np.argsort(req_a, kind="stable")
    req_a, dst_a = req_a[order], dst_a[order]
    placed_r: list[int] = req_a.tolist()
    placed_k: list[int] = dst_a.tolist()
    assignment = list(
        zip(map(rids.__getitem__, placed_r), map(ids.__getitem__, placed_k), strict=True)
    )
    # requests without KV cache of groups predicted long, in the order to admit them
    # (predicted longest first) ahead of every other waiting request
    waiting = req_a[~kv_a[req_a] & prob.long_group_array[req_a]]
    waiting = waiting[np.argsort(prob.rank_array[waiting], kind="stable")]
    admit_order = tuple(map(rids.__getitem__, waiting.tolist()))
    new_node = np.array([node_code[n] for n in pl.node], dtype=np.int64)
    node_changes = np.zeros(len(prob.nodes) + 1, dtype=np.bool_)
    node_changes[[node_code[n] for n in changed]] = True
    cur_a = cur_all[req_a]
    stays = old_new[cur_a] == dst_a
    queued = cur_a == none
    src_node = old_node[cur_a]
    relaid_mask = ~stays & kv_a[req_a] & (src_node == new_node[dst_a]) & node_changes[src_node]
    relaid = int(np.count_nonzero(relaid_mask))
    dispatched = [rids[r] for r in req_a[queued].tolist()]
    migrations: list[Migration] = []
    stall = [0.0] * n_inst
    migration_total = 0.0
    for j in np.flatnonzero(~(stays | queued | relaid_mask)).tolist():
        r, k = placed_r[j], placed_k[j]
        rid, cur, dst_id = rids[r], current[r], ids[k]
        assert cur is not None
        if not has_kv[r]:
            migrations.append(Migration(rid, cur, dst_id, MoveMethod.DISPATCH, 0.0))
            continue
        dst = pl.inst[k]
        cost, method = prob.move(r, dst, node_of_instance[cur] in changed)
        migrations.append(Migration(rid, cur, dst.id, method, cost))
        stall[k] += cost
        migration_total += cost
    switching = max(pauses.values(), default=0.0)
    runs = pl.queued_runs()
    planned = switching + max((stall[k] + runs[k] for k in range(n_inst)), default=0.0)
    steady = max(runs, default=0.0)
    reshards = []
    for n in sorted(changed):
        before = prob.by_node[n]  # sorted by id
        after = sorted(after_by_node[n], key=_by_id)
        # instances of one node are equal when id and GPUs are (tuples hash in C)
        kept = {(i.id, i.gpus) for i in before} & {(i.id, i.gpus) for i in after}
        reshards.append(
            Reshard(
                n,
                prob.current_pattern[n],
                tuple(sorted((len(i.gpus) for i in after), reverse=True)),
                tuple(i.id for i in before if (i.id, i.gpus) not in kept),
                tuple(i for i in after if (i.id, i.gpus) not in kept),
                pauses[n],
            )
        )
    reason = _reason(
        changed,
        choices,
        migrations,
        relaid,
        len(dispatched),
        keep_s,
        planned,
        allow_reshard,
        hold,
        switching,
    )
    return ComputePlan(
        now=now,
        reshards=tuple(reshards),
        migrations=tuple(migrations),
        dispatched=tuple(dispatched),
        assignment=tuple(assignment),
        unplaced=tuple(sorted(prob.rids[r] for r in unplaceable)),
        instances=tuple(new_instances),
        prediction=Prediction(keep_s, planned, steady, switching, migration_total),
        reason=reason,
        candidates=tuple(
            Candidate(c.label, c.makespan_s, c.switching_s) for c in choices[:REPORTED]
        ),
        admit_order=admit_order,
        cost_hold=hold,
    )


def hold_for_cost(
    prob: Problem, target: dict[str, Pattern], choices: Sequence[LayoutChoice]
) -> tuple[dict[str, Pattern], CostHold | None]:
    """The layout chosen on the model's pauses (``target``, ``choices[0]``), kept when it
    still beats the current one by the margin at its nodes' measured pauses
    (:meth:`Problem.node_pause_at`); else the current layout and why (a
    :class:`CostHold`)."""
    changed = [n for n in prob.nodes if target[n] != prob.current_pattern[n]]
    if not changed:
        return target, None
    best = choices[0]
    real = max(prob.node_pause_at(n, prob.current_pattern[n], target[n]) for n in changed)
    if real <= best.switching_s:
        return target, None
    current = next(c for c in choices if c.is_current)
    at_cost = max(best.makespan_s + real, best.floor_s)
    if current.score - at_cost > switch_margin(prob, current.score):
        return target, None
    model = {n: prob.node_cost(prob.current_pattern[n], target[n]) for n in changed}
    slow = tuple(n for n in changed if prob.measured_pause.get(n, 0.0) > model[n])
    gain = current.score - max(best.makespan_s, best.floor_s)
    return dict(prob.current_pattern), CostHold(best.label, gain, real, best.switching_s, slow)


def _reason(
    changed: set[str],
    choices: Sequence[LayoutChoice],
    migrations: Sequence[Migration],
    relaid: int,
    queued: int,
    keep: float,
    planned: float,
    allow_reshard: bool,
    hold: CostHold | None = None,
    switching: float = 0.0,
) -> str:
    moving = (MoveMethod.KV_NVLINK, MoveMethod.KV_NETWORK, MoveMethod.RECOMPUTE)
    moved = sum(1 for m in migrations if m.method in moving)
    dispatched = queued + sum(1 for m in migrations if m.method is MoveMethod.DISPATCH)
    parts = []
    if changed:
        best = choices[0]
        cur = next(c for c in choices if c.is_current)
        parts.append(
            f"reshard {len(changed)} node(s) to {best.label}: predicted {best.makespan_s:.2f} s "
            f"+ switching {max(switching, best.switching_s):.2f} s beats keeping {cur.label} "
            f"({cur.makespan_s:.2f} s) by more than the margin"
        )
    elif allow_reshard and choices:
        cur = next(c for c in choices if c.is_current)
        best = choices[0]
        if hold is not None:
            parts.append(f"keep layout {cur.label}: {hold.explain()}")
        elif best.is_current:
            parts.append(f"keep layout {cur.label}: no candidate predicts a shorter step")
        else:
            parts.append(
                f"keep layout {cur.label}: best alternative {best.label} gains "
                f"{cur.score - best.score:.2f} s, not more than the margin"
            )
    if relaid:
        parts.append(f"re-lay out the KV cache of {relaid} request(s) within their nodes")
    if moved:
        parts.append(f"move {moved} request(s) off stragglers")
    if dispatched:
        parts.append(f"dispatch {dispatched} queued request(s)")
    if not parts:
        parts.append("nothing to change")
    return "; ".join(parts) + f" (predicted {keep:.2f} s -> {planned:.2f} s)"


def plan_objective(prob: Problem, plan: ComputePlan) -> float:
    """The objective both solvers minimise, evaluated on a plan: the longest node pause
    (switching) plus the latest instance's finish (its run plus the moves into it)."""
    changed = {r.node for r in plan.reshards}
    idx = {rid: k for k, rid in enumerate(prob.rids)}
    members: dict[str, list[int]] = {}
    for rid, iid in plan.assignment:
        members.setdefault(iid, []).append(idx[rid])
    after: dict[str, list[int]] = {}
    for inst in plan.instances:
        after.setdefault(inst.node, []).append(inst.tp)
    switching = max(
        (prob.node_pause_at(n, prob.current_pattern[n], tuple(after[n])) for n in changed),
        default=0.0,
    )
    worst = 0.0
    for inst in plan.instances:
        ms = members.get(inst.id, [])
        moves = 0.0
        for r in ms:
            cur = prob.current[r]
            node_changes = cur is not None and prob.instances[cur].node in changed
            moves += prob.move(r, inst, node_changes)[0]
        worst = max(worst, moves + prob.run(inst.tp, ms))
    return switching + worst


__all__ = [
    "SCALE",
    "MoveCost",
    "Pattern",
    "PlannerConfig",
    "Problem",
    "TpCost",
    "allowed_tps",
    "balance",
    "build_problem",
    "expand",
    "pattern_label",
    "plan_compute",
    "plan_objective",
    "solve",
    "tp_costs",
]
