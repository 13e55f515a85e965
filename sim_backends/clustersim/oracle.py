"""A clairvoyant compute scheduler for the simulator: the ``oracle`` policy.

It knows every request's true response length, and nothing else a real scheduler would
not have: the same performance model, the same instances (whole TP groups on one node),
and it pays what the simulator charges the adaptive policy for the same actions (a node
pauses for ``PerfModel.reshard_time`` when its layout changes, through
:func:`scheduler.compute_problem.node_pause`; a running request that moves stalls its
target for ``min(PerfModel.kv_move_time, PerfModel.recompute_time)``). It is a strong,
honest baseline, not an optimum: it shows how much of a step's generation time a
scheduler that knew the lengths would save with these rules, so the adaptive policy's
gain can be read as a share of it.

Rules (:func:`oracle_plan`, called at the step start and at every re-plan):

1. **Per-TP speed.** An instance of TP ``t`` runs ``slots(t)`` sequences at once
   (``max_num_seqs``, the model's per-TP cap, and as many as the KV cache holds at the
   step's time-averaged context) and then takes ``tau(t)`` =
   ``decode_iteration_time(t, slots(t), context)`` per token.
2. **Longest-first list schedule.** Every request not yet started is (re)dispatched in
   order of decreasing length; each goes to the instance slot where it would finish
   first (a slot frees when its current request is predicted to finish: remaining tokens
   x ``tau``). The instance's queue is that order, so its longest requests start first.
   A request's predicted finish in this schedule is its deadline.
3. **Starting layout and lanes** (layout: first plan of a step, nothing started): every
   uniform layout and every mix of ``k`` nodes at the largest TP with the others at one
   smaller TP is scored by the list schedule's makespan, the nodes that change starting
   after their reshard pause; the best is taken (ties: fewer reshards, then larger TP).
   In a mixed layout the instances of the largest TP may run as *lanes*: at most
   ``b`` sequences each (``b`` from ``lane_slots``), at the faster per-token time of
   that batch, so the longest requests (placed first) run on them at a small batch
   while the bulk fills the small instances. Whether and at which ``b`` is scored by
   the list schedule as well, at the step start and at every re-plan while requests
   wait; a lane takes a request only into a slot that frees before the next re-plan
   (``dispatch_ahead_s``), so nothing waits for a lane, and it is given only those.
   This is the clairvoyant policy of issue 15's outside analysis (a mixed layout from
   the start, longest-first, the long requests on large TP at a small batch).
4. **Late requests move.** Once nothing is queued, the straggler (the running request
   predicted to finish last, at its instance's current batch) moves to the instance
   of larger TP where it would finish soonest, if that beats its current finish by more than
   ``margin`` and the target's own requests, delayed by the move's stall, still finish
   before the straggler would have; repeated up to ``max_moves`` times per plan.
5. **Small nodes grow.** Once nothing is queued, a node whose instances are all smaller
   than the largest TP is resharded to the largest TP when it is idle, or when its
   requests (re-laid out by the reshard itself) would finish sooner after the pause at
   the larger TP's speed.

The decision is a pure function of the state, the lengths and ``now``; the simulator
applies the plan exactly as it applies the adaptive planner's.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from scheduler.compute_problem import node_pause
from scheduler.compute_state import (
    ComputePlan,
    ComputeState,
    Instance,
    Migration,
    MoveMethod,
    Prediction,
    Request,
    Reshard,
    canonical_instances,
)
from scheduler.perf_model import PerfModel

Pattern = tuple[int, ...]


@dataclass(frozen=True)
class OracleConfig:
    max_num_seqs: int = 256
    tps: tuple[int, ...] = (1, 2, 4, 8)  # TP degrees the oracle may use
    margin: float = 0.02  # a move or a tail reshard must gain this share of the finish
    max_moves: int = 8  # running requests moved per plan
    # batch limits a lane (an instance of the largest TP kept for the longest requests)
    # may run at; the list schedule picks the one that ends the step first (rule 3)
    lane_slots: tuple[int, ...] = (8, 16, 32, 64)
    # requests the schedule starts on a lane within this long are dispatched to it now
    # (the simulator re-plans every replan_interval_s, 5 s by default)
    dispatch_ahead_s: float = 5.0


@dataclass(frozen=True)
class Speeds:
    """Slots and per-token time of each TP degree under full load (rule 1)."""

    slots: Mapping[int, int]
    tau: Mapping[int, float]
    context: float


def speeds(perf: PerfModel, reqs: Sequence[tuple[int, int]], config: OracleConfig) -> Speeds:
    """``reqs``: (prompt tokens, response tokens) of the step's requests."""
    tokens = sum(n for _, n in reqs)
    ctx = (
        sum(n * (p + n / 2.0) for p, n in reqs) / tokens
        if tokens
        else (sum(p for p, _ in reqs) / max(1, len(reqs)))
    )
    slots: dict[int, int] = {}
    tau: dict[int, float] = {}
    for t in config.tps:
        cap = min(config.max_num_seqs, perf.max_num_seqs(t))
        b = max(1, min(cap, int(perf.kv_capacity_tokens(t) // max(1.0, ctx))))
        slots[t] = b
        tau[t] = perf.decode_iteration_time(t, b, ctx)
    return Speeds(slots, tau, ctx)


def list_schedule(
    instances: Sequence[tuple[str, int, float]],
    busy: Mapping[str, Sequence[float]],
    pending: Sequence[tuple[str, int]],
    sp: Speeds,
    *,
    lanes: Mapping[str, tuple[int, float]] | None = None,
    lane_horizon: float = math.inf,
    starts: dict[str, float] | None = None,
) -> tuple[list[tuple[str, str]], float]:
    """Rule 2. ``instances``: (id, tp, ready time); ``busy``: per instance the predicted
    finish of each running request; ``pending``: (request, tokens to generate) in the
    order to place them; ``lanes``: instances run with fewer slots at a faster per-token
    time, (slots, tau) (rule 3), which take a request only into a slot free by
    ``lane_horizon`` (a request never waits for a lane). Returns ((request, instance) in
    that order, makespan); ``starts`` (when given) receives every placed request's
    predicted start."""
    lanes = lanes or {}
    # slots (free time, rank in its instance, instance) per class of interchangeable
    # instances (TP, slots, tau): equal times fill instances round robin, so no instance
    # takes all of the longest requests
    heaps: dict[tuple[int, int, float], list[tuple[float, int, str]]] = {}
    makespan = 0.0
    for iid, tp, ready in instances:
        slots, tau = lanes.get(iid, (sp.slots[tp], sp.tau[tp]))
        h = heaps.setdefault((tp, slots, tau), [])
        running = sorted(busy.get(iid, ()))
        makespan = max([makespan, *running])
        free = max(0, slots - len(running))
        h.extend((ready, k, iid) for k in range(free))
        # slots beyond the free ones open as running requests finish (earliest first)
        h.extend(
            (max(ready, f), free + k, iid) for k, f in enumerate(running[: max(0, slots - free)])
        )
    for h in heaps.values():
        heapq.heapify(h)
    out: list[tuple[str, str]] = []
    for rid, n in pending:
        best: tuple[float, int, int, tuple[int, int, float]] | None = None
        for cls, h in heaps.items():
            if not h or (h[0][0] > lane_horizon and cls[1] < sp.slots[cls[0]]):
                continue
            finish = h[0][0] + n * cls[2]
            key = (finish, -cls[0], -cls[1], cls)
            if best is None or key < best:
                best = key
        if best is None:
            break
        finish, cls = best[0], best[3]
        start, rank, iid = heaps[cls][0]
        heapq.heapreplace(heaps[cls], (finish, rank, iid))
        out.append((rid, iid))
        if starts is not None:
            starts[rid] = start
        makespan = max(makespan, finish)
    return out, makespan


def lane_options(
    perf: PerfModel, sp: Speeds, tp: int, config: OracleConfig
) -> list[tuple[int, float]]:
    """(slots, tau) a lane of TP ``tp`` may run at: ``config.lane_slots`` below the full
    slot count, each at its decode iteration time at the step's mean context."""
    return [
        (b, perf.decode_iteration_time(tp, b, sp.context))
        for b in sorted(set(config.lane_slots))
        if 0 < b < sp.slots[tp]
    ]


def candidate_layouts(
    nodes: Sequence[str], gpus: int, tps: Sequence[int]
) -> list[dict[str, Pattern]]:
    """Rule 3: uniform layouts and ``k`` nodes at the largest TP + the rest at a smaller one."""
    fit = sorted(t for t in tps if t <= gpus and gpus % t == 0)
    big = fit[-1]
    out: list[dict[str, Pattern]] = []
    for t in fit:
        out.append({n: (t,) * (gpus // t) for n in nodes})
    for small in fit[:-1]:
        for k in range(1, len(nodes)):
            out.append(
                {
                    n: (big,) * (gpus // big) if i < k else (small,) * (gpus // small)
                    for i, n in enumerate(nodes)
                }
            )
    return out


def choose_layout(
    state: ComputeState,
    lengths: Mapping[str, int],
    perf: PerfModel,
    sp: Speeds,
    config: OracleConfig,
    now: float = 0.0,
) -> dict[str, Pattern]:
    """Rule 3 at the step start: the candidate layout whose list schedule ends first."""
    current = state.layout()
    gpus = {n.name: len(n.gpus) for n in state.nodes}
    size = max(gpus.values())
    names = sorted(gpus)
    pending = _longest_first(state.requests, lengths)
    tps = [t for t in config.tps if t in sp.tau]
    best: tuple[float, int, int, dict[str, Pattern]] | None = None
    for layout in candidate_layouts(names, size, tps):
        if any(sum(layout[n]) != gpus[n] for n in names):
            continue
        insts: list[tuple[str, int, float]] = []
        changes = 0
        for n in names:
            pause = 0.0
            if sorted(layout[n]) != sorted(current[n]):
                pause = node_pause(perf, current[n], layout[n])
                changes += 1
            for i, t in enumerate(layout[n]):
                insts.append((f"{n}/{i}", t, now + pause))
        _, makespan = best_lanes(insts, {}, pending, sp, perf, config, now)
        key = (makespan, changes, -max(max(p) for p in layout.values()))
        if best is None or key < best[:3]:
            best = (*key, layout)
    assert best is not None
    return best[3]


def best_lanes(
    instances: Sequence[tuple[str, int, float]],
    remaining: Mapping[str, Sequence[int]],
    pending: Sequence[tuple[str, int]],
    sp: Speeds,
    perf: PerfModel,
    config: OracleConfig,
    now: float = 0.0,
) -> tuple[dict[str, tuple[int, float]], float]:
    """Rule 3's lanes: in a layout of mixed TP degrees, the instances of the largest TP
    either run at full batch or all at one of the lane batch limits, whichever list
    schedule ends first (ties: no lanes, then the larger limit). ``remaining``: per
    instance, the tokens its running requests still generate. Returns (the lanes,
    (slots, tau) per lane instance; the makespan)."""
    if not instances:
        return {}, 0.0
    big = max(tp for _, tp, _ in instances)
    bigs = [iid for iid, tp, _ in instances if tp == big]
    best: tuple[float, int, int, dict[str, tuple[int, float]]] | None = None
    # lanes need instances for the bulk: a layout of one TP degree has none
    options = lane_options(perf, sp, big, config) if len(bigs) < len(instances) else []
    for opt in [None, *options]:
        lanes = dict.fromkeys(bigs, opt) if opt is not None else {}
        busy = {
            iid: [ready + n * lanes.get(iid, (0, sp.tau[tp]))[1] for n in remaining.get(iid, ())]
            for iid, tp, ready in instances
        }
        _, makespan = list_schedule(
            instances, busy, pending, sp, lanes=lanes, lane_horizon=now + config.dispatch_ahead_s
        )
        key = (makespan, 0 if opt is None else 1, -(opt[0] if opt else 0))
        if best is None or key < best[:3]:
            best = (*key, lanes)
    assert best is not None
    return best[3], best[0]


def _longest_first(
    requests: Sequence[Request], lengths: Mapping[str, int]
) -> list[tuple[str, int]]:
    todo = [(r.id, max(0, lengths[r.id] - r.generated_tokens)) for r in requests if not r.has_kv]
    todo.sort(key=lambda x: (-x[1], x[0]))
    return todo


def move_cost(perf: PerfModel, ctx: int, src: Instance, dst: Instance) -> tuple[float, MoveMethod]:
    """What the simulator charges a running request moving from ``src`` to ``dst``: its
    KV cache over NVLink or RDMA, or a recompute by prefill, whichever is cheaper."""
    same = src.node == dst.node
    kv = perf.kv_move_time(ctx, same_node=same, src_tp=src.tp, dst_tp=dst.tp)
    rec = perf.recompute_time(dst.tp, ctx)
    if rec < kv:
        return rec, MoveMethod.RECOMPUTE
    return kv, MoveMethod.KV_NVLINK if same else MoveMethod.KV_NETWORK


class _Live:
    """An instance's running requests during rules 4-5 (private working state)."""

    def __init__(self, inst: Instance, ready: float) -> None:
        self.inst = inst
        self.ready = ready
        self.reqs: dict[str, tuple[int, int]] = {}  # id -> (context, remaining)

    def finish(self, perf: PerfModel, extra: tuple[int, int] | None = None) -> float:
        reqs = list(self.reqs.values()) + ([extra] if extra else [])
        if not reqs:
            return self.ready
        ctx = sum(c for c, _ in reqs) / len(reqs)
        tau = perf.decode_iteration_time(self.inst.tp, len(reqs), ctx)
        return self.ready + max(r for _, r in reqs) * tau


def oracle_plan(
    state: ComputeState,
    lengths: Mapping[str, int],
    perf: PerfModel,
    now: float,
    config: OracleConfig = OracleConfig(),
) -> ComputePlan:
    """The oracle's plan for ``state`` at ``now`` (rules 1-5 of the module docstring)."""
    by_id = {r.id: r for r in state.requests}
    sp = speeds(perf, [(r.prompt_tokens, lengths[r.id]) for r in state.requests], config)
    current = state.layout()
    gpus_of = {n.name: n.gpus for n in state.nodes}
    big = max(
        t for t in config.tps if t in sp.tau and all(len(g) % t == 0 for g in gpus_of.values())
    )
    started = any(r.has_kv or r.generated_tokens for r in state.requests)
    pending = _longest_first(state.requests, lengths)
    target: dict[str, Pattern] = dict(current)
    reason = ""
    if not started and pending:
        target = choose_layout(state, lengths, perf, sp, config, now)
        reason = "oracle: starting layout " + _describe(target)
    reshards: list[Reshard] = []
    instances: list[Instance] = []
    ready: dict[str, float] = {}
    live: dict[str, _Live] = {}
    running_on: dict[str, list[Request]] = {}
    for r in state.requests:
        if r.has_kv and r.instance is not None:
            running_on.setdefault(r.instance, []).append(r)
    if not pending:  # rule 5: grow small nodes once nothing is queued
        for n in sorted(gpus_of):
            if max(current[n]) >= big:
                continue
            mine = [r for i in state.instances_on(n) for r in running_on.get(i.id, [])]
            new = (big,) * (len(gpus_of[n]) // big)
            pause = node_pause(perf, current[n], new)
            if not mine:
                target[n] = new
                continue
            ctx = [r.context_tokens for r in mine]
            rem = [lengths[r.id] - r.generated_tokens for r in mine]
            if len(mine) > sp.slots[big] * len(new) or sum(ctx) + sum(rem) > (
                perf.kv_capacity_tokens(big) * len(new)
            ):
                continue
            before = 0.0
            for i in state.instances_on(n):
                lv = _Live(i, now)
                for r in running_on.get(i.id, []):
                    lv.reqs[r.id] = (r.context_tokens, lengths[r.id] - r.generated_tokens)
                before = max(before, lv.finish(perf))
            after = (
                now
                + pause
                + max(rem)
                * perf.decode_iteration_time(
                    big, math.ceil(len(mine) / len(new)), sum(ctx) / len(ctx)
                )
            )
            if after < before - config.margin * (before - now):
                target[n] = new
    migrations: list[Migration] = []
    assignment: dict[str, str] = {}
    for n in sorted(gpus_of):
        olds = state.instances_on(n)
        if sorted(target[n]) == sorted(current[n]):
            for i in olds:
                instances.append(i)
                ready[i.id] = now
            continue
        pause = node_pause(perf, current[n], target[n])
        added = canonical_instances(n, gpus_of[n], target[n])
        reshards.append(
            Reshard(n, current[n], tuple(target[n]), tuple(i.id for i in olds), added, pause)
        )
        instances.extend(added)
        for i in added:
            ready[i.id] = now + pause
        # running requests stay on the node, re-laid out by the reshard (round robin)
        mine = sorted(
            (r for i in olds for r in running_on.get(i.id, [])),
            key=lambda r: (-(lengths[r.id] - r.generated_tokens), r.id),
        )
        for k, r in enumerate(mine):
            dst = added[k % len(added)]
            assignment[r.id] = dst.id
            migrations.append(Migration(r.id, r.instance, dst.id, MoveMethod.RELAYOUT, 0.0))
    for i in instances:
        live[i.id] = _Live(i, ready[i.id])
    for r in state.requests:
        if r.has_kv:
            iid = assignment.get(r.id, r.instance)
            assert iid is not None
            assignment.setdefault(r.id, iid)
            live[iid].reqs[r.id] = (r.context_tokens, lengths[r.id] - r.generated_tokens)
    if not pending:  # rule 4: move the stragglers
        moved = 0
        while moved < config.max_moves:
            src = max(live.values(), key=lambda lv: (lv.finish(perf), lv.inst.id))
            if not src.reqs:
                break
            worst = src.finish(perf)
            rid = max(src.reqs, key=lambda x: (src.reqs[x][1], x))
            c_r, n_r = src.reqs[rid]
            choice: tuple[float, str, float, MoveMethod] | None = None
            for cand in live.values():
                if cand.inst.tp <= src.inst.tp or len(cand.reqs) >= sp.slots.get(cand.inst.tp, 1):
                    continue
                cost, method = move_cost(perf, c_r, src.inst, cand.inst)
                shifted = _Live(cand.inst, max(cand.ready, now) + cost)
                shifted.reqs = cand.reqs
                fin = shifted.finish(perf, (c_r, n_r))
                if fin < worst - config.margin * (worst - now) and (
                    choice is None or fin < choice[0]
                ):
                    choice = (fin, cand.inst.id, cost, method)
            if choice is None:
                break
            _, did, cost, method = choice
            dst_live = live[did]
            del src.reqs[rid]
            dst_live.reqs[rid] = (c_r, n_r)
            dst_live.ready = max(dst_live.ready, now) + cost
            first_src = by_id[rid].instance
            assignment[rid] = did
            migrations = [m for m in migrations if m.request != rid]
            migrations.append(Migration(rid, first_src, did, method, cost))
            moved += 1
        if moved:
            reason = (reason + "; " if reason else "oracle: ") + f"{moved} late request(s) moved"
    if reshards and not reason:
        reason = "oracle: queue empty, " + ", ".join(
            f"{x.node} -> {_describe({x.node: x.after})}" for x in reshards
        )
    slots = [(i.id, i.tp, ready[i.id]) for i in instances]
    remaining = {iid: [r for _, r in lv.reqs.values()] for iid, lv in live.items()}
    lanes: dict[str, tuple[int, float]] = {}
    if pending:
        lanes, _ = best_lanes(slots, remaining, pending, sp, perf, config, now)
    busy = {
        iid: [lv.ready + r * lanes.get(iid, (0, sp.tau[lv.inst.tp]))[1] for r in remaining[iid]]
        for iid, lv in live.items()
    }
    starts: dict[str, float] = {}
    ahead = now + config.dispatch_ahead_s
    scheduled, makespan = list_schedule(
        slots, busy, pending, sp, lanes=lanes, lane_horizon=ahead, starts=starts
    )
    # a lane runs only its own slots (the engine would admit more at once, at a larger
    # batch): it is given only what starts on it before the next re-plan
    placed = [(rid, iid) for rid, iid in scheduled if iid not in lanes or starts[rid] <= ahead]
    dispatched = tuple(rid for rid, _ in placed)
    for rid, iid in placed:
        migrations.append(Migration(rid, by_id[rid].instance, iid, MoveMethod.DISPATCH, 0.0))
    order = [*placed, *sorted((k, v) for k, v in assignment.items())]
    unplaced = tuple(rid for rid, _ in pending[len(scheduled) :])
    if lanes:
        held = len(scheduled) - len(placed)
        reason = (reason + "; " if reason else "oracle: ") + (
            f"{len(lanes)} lane(s) at {next(iter(lanes.values()))[0]} sequences"
            + (f", {held} request(s) held for them" if held else "")
        )
    stall = sum(m.cost_s for m in migrations)
    pause = max((x.pause_s for x in reshards), default=0.0)
    return ComputePlan(
        now=now,
        reshards=tuple(reshards),
        migrations=tuple(m for m in migrations if m.source != m.target),
        dispatched=dispatched,
        assignment=tuple(order),
        unplaced=unplaced,
        instances=tuple(sorted(instances, key=lambda i: i.id)),
        prediction=Prediction(makespan - now, makespan - now, makespan - now, pause, stall),
        reason=reason or "oracle: dispatch longest first",
    )


def _describe(layout: Mapping[str, Sequence[int]]) -> str:
    counts: dict[str, int] = {}
    for p in layout.values():
        key = "+".join(f"TP{t}" for t in p)
        counts[key] = counts.get(key, 0) + 1
    return ", ".join(f"{n} x {k}" for k, n in sorted(counts.items()))


__all__ = [
    "OracleConfig",
    "best_lanes",
    "candidate_layouts",
    "lane_options",
    "list_schedule",
    "move_cost",
    "oracle_plan",
]
