"""Choosing TP layouts: candidate profiles, their makespan and their switching cost.

A candidate layout is a *profile*: how many nodes of each GPU count use each pattern.
Its makespan ``M`` is scored from the requests alone (not from where they sit): exactly
by LPT + local search for small cases, by a fluid bound for large ones (the longest
requests one per instance on the fastest instances, the rest spread by throughput, plus
the delay a first-come-first-served queue puts on its longest waiting request;
candidates whose lower bound cannot reach the few a plan reports are not scored). Its
switching cost ``C`` is the exact minimum, over which node takes which pattern, of the
longest node pause (a bottleneck transportation problem on the few patterns, solved by
Hall's condition; the concrete mapping keeps as many nodes unchanged as possible). Node
pauses satisfy the triangle inequality, so ``M + C`` of any layout seen from the chosen
one is never below the chosen layout's own makespan: re-planning keeps it.
"""

from __future__ import annotations

import functools
import math
from array import array
from bisect import insort
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import combinations, combinations_with_replacement, product

import numpy as np

from orchestrrl import errors
from scheduler.compute_problem import (
    EPS,
    SCALE,
    Pattern,
    Problem,
    TpCost,
    fcfs_late,
    node_pause,
    pattern_label,
)
from scheduler.compute_state import Instance
from scheduler.perf_model import PerfModel
from scheduler.placement import Placement


def _free(r: int, k: int) -> float:
    return 0.0


def _exact_makespan(prob: Problem, tps: Sequence[int], reqs: Sequence[int]) -> float:
    insts = [Instance(f"x{k:05d}", f"n{k:05d}", tuple(range(t))) for k, t in enumerate(tps)]
    pl = Placement(prob, insts, all_candidates=True)
    left = pl.place_lpt(reqs)
    if left:
        return math.inf
    pl.balance(_free, EPS)
    return pl.makespan()


@dataclass(frozen=True)
class _Sorted:
    """Requests sorted by q descending, with prefix sums (for the fluid estimate) and
    prefix maxima of ``m`` and ``pre`` (bounds for its regime check)."""

    # Python sequences (C arrays: built by one copy, indexed to Python numbers) for the
    # few lookups per candidate; numpy for the passes over every request
    order: Sequence[int]
    q: Sequence[float]
    pm: Sequence[float]  # prefix sums of m
    pq: Sequence[float]
    pp: Sequence[float]  # prefix sums of pre
    m_max: Sequence[float]  # m_max[i]: the largest m among the first i + 1
    pre_max: Sequence[float]
    arrays: tuple[np.ndarray, np.ndarray, np.ndarray]  # q, m, pre in that order
    # whether the request starts ahead of its queue: it holds KV, or its group is
    # predicted long (the plan's admit_order); the others wait first come, first served
    ranked: np.ndarray
    # own times per TP cost, filled on first use (elementwise, so a slice of it equals
    # the same formula on the slice)
    owns: dict[TpCost, np.ndarray] = field(default_factory=dict, compare=False, repr=False)
    # per TP cost, level k holds the maxima of own times over windows of 2**k requests
    own_tables: dict[TpCost, list[np.ndarray]] = field(
        default_factory=dict, compare=False, repr=False
    )

    def own_all(self, cost: TpCost) -> np.ndarray:
        """The own time ``a q + c m + p pre`` of every request on ``cost``."""
        own = self.owns.get(cost)
        if own is None:
            q, m, pre = self.arrays
            own = cost.iteration_s * q + cost.per_sequence_s * m + cost.prefill_per_token_s * pre
            self.owns[cost] = own
        return own

    def own_max(self, cost: TpCost, lo: int, hi: int) -> float:
        """The longest own time ``a q + c m + p pre`` of requests ``lo..hi-1`` on ``cost``
        (a range-maximum query on a sparse table: two lookups instead of a slice)."""
        table = self.own_tables.get(cost)
        if table is None:
            level = self.own_all(cost)
            table = [level]
            width, n = 1, len(level)
            while 2 * width <= n:  # level k: windows of 2**k, n - 2**k + 1 of them
                level = np.maximum(level[:-width], level[width:])
                table.append(level)
                width *= 2
            self.own_tables[cost] = table
        k = (hi - lo).bit_length() - 1
        row = table[k]
        return float(max(row[lo], row[hi - (1 << k)]))


def _sorted_requests(prob: Problem, reqs: Sequence[int]) -> _Sorted:
    if len(reqs) == len(prob.by_length):  # every request (requests are distinct)
        order = prob.by_length
    else:
        wanted = set(reqs)
        order = tuple(r for r in prob.by_length if r in wanted)
    idx = np.array(order, dtype=np.int64)
    q_all, mi_all, pre_all, _ = prob.arrays
    q = q_all[idx]
    m = mi_all[idx] / SCALE  # == prob.m
    pre = pre_all[idx].astype(np.float64)
    # cumsum adds in order, as itertools.accumulate does: the same sums
    zero = np.zeros(1)
    pm = np.concatenate((zero, np.cumsum(m)))
    pq = np.concatenate((zero, np.cumsum(q)))
    pp = np.concatenate((zero, np.cumsum(pre)))
    return _Sorted(
        order,
        _doubles(q),
        _doubles(pm),
        _doubles(pq),
        _doubles(pp),
        _doubles(np.maximum.accumulate(m)),
        _doubles(np.maximum.accumulate(pre)),
        (q, m, pre),
        prob.kv_array[idx] | prob.long_group_array[idx],
    )


def _doubles(values: np.ndarray) -> array[float]:
    """The float64 values as a Python ``array`` (one copy of the bytes, not one object per
    value; indexing returns the same floats as ``tolist`` would)."""
    return array("d", np.ascontiguousarray(values, dtype=np.float64).tobytes())


def _fluid_makespan(
    prob: Problem, counts: Mapping[int, int], s: _Sorted, *, closed_form: bool = True
) -> float:
    """The longest requests one per instance on the fastest instances; the rest (the
    bulk) spread over every instance as a divisible load, so that all finish together.

    An instance of TP ``t`` with its own request ``i`` and a share ``x`` of the bulk
    (``W_m`` expected tokens, ``W_p`` tokens to prefill) runs, by the instance model,
    ``a * max(q_i, (m_i + x W_m) / slots) + c (m_i + x W_m) + p (pre_i + x W_p)``: its
    own critical path and the bulk's iterations overlap (continuous batching), so the
    larger of the two counts, not their sum. The shares solve ``sum x = 1`` at a common
    finish ``T`` (an instance whose own request alone outlasts ``T`` takes none); then
    each instance's first-come-first-served queue may start its own request late
    (:func:`_fcfs_finish`). ``closed_form`` False always takes the general sweep (tests
    compare the two).
    """
    n_req = len(s.order)
    if n_req == 0:
        return 0.0
    types = sorted(
        ((prob.costs[t], n) for t, n in counts.items() if n > 0),
        key=lambda x: (x[0].token_latency_s, -x[0].tp),
    )
    if not types:
        return math.inf
    tail = 0.0
    start = 0
    blocks: list[tuple[TpCost, int, float, int]] = []  # (cost, instances, own sum, first)
    for cost, n in types:
        end = min(n_req, start + n)
        if end > start:
            r0 = s.order[start]
            own0 = cost.run(prob.q[r0], prob.m[r0], prob.pre[r0])
            tail = max(tail, own0)
            own_sum = (
                cost.iteration_s * (s.pq[end] - s.pq[start])
                + cost.per_sequence_s * (s.pm[end] - s.pm[start])
                + cost.prefill_per_token_s * (s.pp[end] - s.pp[start])
            )
        else:
            own_sum = 0.0
        blocks.append((cost, n, own_sum, start))
        start = end
    if start >= n_req:
        return tail
    work_m = s.pm[n_req] - s.pm[start]
    work_p = s.pp[n_req] - s.pp[start]
    if work_m <= 0 and work_p <= 0:
        return tail
    t = _common_finish(blocks, s, work_m, work_p, closed_form)
    # instances taking no share finish with their own request (looked up only when its
    # bound could matter; blocks taking a share were checked against T on the way)
    finish = max(tail, t)
    for cost, n, _, lo in blocks:
        if _own_bound(cost, s, lo, lo + n) > finish:
            finish = max(finish, s.own_max(cost, lo, lo + n))
    if not math.isfinite(t) or work_m <= 0:
        return finish
    return max(finish, _fcfs_finish(blocks, s, t, work_m, work_p, start, prob.late_place))


def _common_finish(
    blocks: Sequence[tuple[TpCost, int, float, int]],
    s: _Sorted,
    work_m: float,
    work_p: float,
    closed_form: bool,
) -> float:
    """The common finish ``T`` of the instances taking a share of the bulk."""
    # The usual case has a closed form: every instance either takes no share (its own
    # request alone outlasts T) or stays in the own-critical-path regime (its q_i covers
    # its iterations), where a share x costs B_t x with B_t = c W_m + p W_p. Blocks whose
    # smallest own time (>= a q_min) reaches T drop out; the rest give T; the result is
    # exact when bounds over each block confirm both regimes, else the general sweep.
    active = [True] * len(blocks)
    b1s = [c.per_sequence_s * work_m + c.prefill_per_token_s * work_p for c, _, _, _ in blocks]
    t1 = math.inf
    for _ in range(len(blocks) + 1):
        num, den = 1.0, 0.0
        for (_, n, own_sum, _), b1, on in zip(blocks, b1s, active, strict=True):
            if on and b1 > 0:
                num += own_sum / b1
                den += n / b1
        t1 = num / den if den > 0 else math.inf
        dropped = False
        for j, (cost, n, _, lo) in enumerate(blocks):
            if active[j] and cost.iteration_s * s.q[lo + n - 1] >= t1:
                active[j] = False
                dropped = True
        if not dropped:
            break
    if closed_form and math.isfinite(t1) and all(b1 > 0 for b1 in b1s):
        exact = True
        for (cost, n, _, lo), b1, on in zip(blocks, b1s, active, strict=True):
            a = cost.iteration_s
            hi = lo + n
            q_min = s.q[hi - 1]
            if not on:
                exact = a * q_min >= t1
            else:
                m_max = s.m_max[hi - 1]  # over the first hi: a bound for the block
                exact = (_own_bound(cost, s, lo, hi) <= t1 or s.own_max(cost, lo, hi) <= t1) and (
                    work_m <= 0 or t1 <= a * q_min + b1 * (cost.slots * q_min - m_max) / work_m
                )
            if not exact:
                break
        if exact:
            return t1
        t2 = _fluid_own_regime(blocks, b1s, s, work_m)
        if t2 is not None:
            return t2
    return _fluid_sweep(blocks, s, work_m, work_p)


def _fcfs_finish(
    blocks: Sequence[tuple[TpCost, int, float, int]],
    s: _Sorted,
    t: float,
    work_m: float,
    work_p: float,
    start: int,
    place: float,
) -> float:
    """The latest finish once each instance's queue is first come, first served
    (:func:`scheduler.compute_problem.fcfs_late`), each instance holding its own request
    and its fluid share ``x(T)`` of the bulk: ``1 + x N`` requests, ``m_i + x W_m``
    tokens, and as waiting request the bulk's longest unranked one (or its own, when
    that is unranked). Without this term a layout of few wide instances, each with a
    long queue, was scored as if every request started at once: at ``max_num_seqs`` 64
    the planner chose 6 x TP8 (predicted 120 s) over 12 x TP4, and the step took 172 s
    (163 s on static TP4).
    """
    n_req = len(s.order)
    n_bulk = n_req - start
    waiting_bulk = np.flatnonzero(~s.ranked[start:])
    if len(waiting_bulk) == 0 and s.ranked[:start].all():
        return t
    # the bulk's longest waiting request (q is sorted descending) and its ranked count
    q_bulk = s.q[start + int(waiting_bulk[0])] if len(waiting_bulk) else 0.0
    ranked_bulk = n_bulk - len(waiting_bulk)
    q_a, m_a, _ = s.arrays
    finish = t
    for cost, n, _, lo in blocks:
        hi = lo + n
        q, m = q_a[lo:hi], m_a[lo:hi]
        own_ranked = s.ranked[lo:hi]
        # each instance's share x(T), as in _fluid_sweep: none before its own time, then
        # the own regime (B per unit share) up to x*, then the iteration-bound one (D)
        after = np.maximum(0.0, t - s.own_all(cost)[lo:hi])
        b1, d, x_star = _share_regimes(cost, q, m, work_m, work_p)
        if b1 > 0:
            x = np.where(after <= b1 * x_star, after / b1, x_star + (after - b1 * x_star) / d)
        else:
            x = np.where(after > 0, x_star + after / d, 0.0)
        q_w = np.where(own_ranked, np.where(x * len(waiting_bulk) > 0, q_bulk, 0.0), q)
        n_i, ranked, work = 1.0 + x * n_bulk, own_ranked + x * ranked_bulk, m + x * work_m
        late = float(fcfs_late(n_i, ranked, q, q_w, work, cost.slots, place).max())
        if late > 0:
            finish = max(finish, t + cost.iteration_s * late)
    return finish


def _share_regimes(
    cost: TpCost, q: np.ndarray, m: np.ndarray, work_m: float, work_p: float
) -> tuple[float, float, np.ndarray]:
    """How a share ``x`` of the bulk costs an instance of ``cost`` whose own requests
    have critical paths ``q`` and work ``m``: ``B`` per unit share in the own regime,
    ``D`` in the iteration-bound one, and ``x*``, the share where the first ends (inf
    when the bulk has no tokens to decode)."""
    c, p = cost.per_sequence_s, cost.prefill_per_token_s
    b1 = c * work_m + p * work_p
    d = (cost.iteration_s / cost.slots + c) * work_m + p * work_p
    if work_m > 0:
        x_star = np.maximum(0.0, (cost.slots * q - m) / work_m)
    else:
        x_star = np.full(len(q), np.inf)
    return b1, d, x_star


def _own_bound(cost: TpCost, s: _Sorted, lo: int, hi: int) -> float:
    """An upper bound of the own times of requests ``lo..hi-1`` (q is sorted descending;
    m and pre by their maxima over the first ``hi``)."""
    return (
        cost.iteration_s * s.q[lo]
        + cost.per_sequence_s * s.m_max[hi - 1]
        + cost.prefill_per_token_s * s.pre_max[hi - 1]
    )


def _fluid_own_regime(
    blocks: Sequence[tuple[TpCost, int, float, int]],
    b1s: Sequence[float],
    s: _Sorted,
    work_m: float,
) -> float | None:
    """The common finish when every instance that takes a share stays in the own
    regime but some blocks are mixed (some of their instances take none): ``F(T) = sum_i
    max(0, T - own_i) / B_t`` is piecewise linear, solved exactly over each block's
    sorted own times. None when the own regime cannot be confirmed (then the sweep)."""
    owns: list[np.ndarray] = []
    prefix: list[np.ndarray] = []
    zero = np.zeros(1)
    for cost, n, _, lo in blocks:
        own = np.sort(s.own_all(cost)[lo : lo + n])
        owns.append(own)
        prefix.append(np.concatenate((zero, np.cumsum(own))))
    inv = [1.0 / b1 for b1 in b1s]

    def taking_part(t: float) -> list[int]:
        # own time <= t (searchsorted "right" == bisect_right)
        return [int(own.searchsorted(t, "right")) for own in owns]

    def pre_sum(b: int, c: int) -> float:
        return float(prefix[b][c])

    # F(T) = sum_b (c_b T - S_b) / B_b with c_b instances of block b taking part, at every
    # breakpoint at once (the same float operations, block by block, as a scalar sum)
    points = np.sort(np.concatenate(owns))
    value = np.zeros(len(points))
    for b, own in enumerate(owns):
        part = own.searchsorted(points, "right")
        term = (part * points - prefix[b][part]) * inv[b]
        value = term if b == 0 else value + term
    # the largest breakpoint where F < 1 (F is increasing), then the root past it, with
    # the instances taking part there
    lo_i, hi_i = 0, len(points)  # F(points[j]) < 1 for j < lo_i; >= 1 from hi_i
    while lo_i < hi_i:
        mid = (lo_i + hi_i) // 2
        if value[mid] < 1.0:
            lo_i = mid + 1
        else:
            hi_i = mid
    if lo_i == 0:
        return None  # F >= 1 at the first own time: degenerate, leave it to the sweep
    counts = taking_part(float(points[lo_i - 1]))
    num = 1.0 + sum(pre_sum(b, c) * inv[b] for b, c in enumerate(counts))
    den = sum(c * inv[b] for b, c in enumerate(counts))
    t = num / den if den > 0 else math.inf
    if not math.isfinite(t):
        return None
    for (cost, n, _, lo), b1, c in zip(blocks, b1s, counts, strict=True):
        if c == 0 or work_m <= 0:
            continue
        hi = lo + n
        q_min, m_max = s.q[hi - 1], s.m_max[hi - 1]
        if t > cost.iteration_s * q_min + b1 * (cost.slots * q_min - m_max) / work_m:
            return None  # an instance may reach its iteration-bound regime
    return t


def _fluid_sweep(
    blocks: Sequence[tuple[TpCost, int, float, int]], s: _Sorted, work_m: float, work_p: float
) -> float:
    """The common finish ``T`` of the fluid bulk in general: ``sum_i x_i(T) = 1`` with
    each instance's share piecewise linear in ``T`` (none until its own time, then the
    own-critical-path regime, then the iteration-bound regime), found by sorting the
    breakpoints."""
    q_a, m_a, _ = s.arrays
    times: list[np.ndarray] = []
    slopes: list[np.ndarray] = []
    jumps: list[np.ndarray] = []
    for cost, n, _, lo in blocks:
        q, m = q_a[lo : lo + n], m_a[lo : lo + n]
        own = s.own_all(cost)[lo : lo + n]  # == a * q + c * m + p * pre on the slice
        b1, d, x_star = _share_regimes(cost, q, m, work_m, work_p)
        inv_d = 1.0 / d if d > 0 else 0.0
        if b1 > 0:
            t_star = own + b1 * x_star
            finite = np.isfinite(t_star)
            times += [own, t_star[finite]]
            slopes += [np.full(len(q), 1.0 / b1), np.full(int(finite.sum()), inv_d - 1.0 / b1)]
            jumps += [np.zeros(len(q)), np.zeros(int(finite.sum()))]
        else:  # the own regime costs nothing: the share jumps to x* at the own time
            times.append(own)
            slopes.append(np.full(len(q), inv_d))
            jumps.append(np.where(np.isfinite(x_star), x_star, 1.0))
    t = np.concatenate(times)
    order = np.argsort(t, kind="stable")
    t = t[order]
    slope_after = np.cumsum(np.concatenate(slopes)[order])
    jump = np.concatenate(jumps)[order]
    gaps = np.diff(t, prepend=t[0])
    slope_before = np.concatenate((np.zeros(1), slope_after[:-1]))
    value_after = np.cumsum(slope_before * gaps + jump)
    hit = np.flatnonzero(value_after >= 1.0)
    if len(hit) == 0:
        last_slope = float(slope_after[-1])
        if last_slope <= 0:
            return math.inf
        return float(t[-1]) + (1.0 - float(value_after[-1])) / last_slope
    k = int(hit[0])
    before = float(value_after[k] - jump[k])
    if k > 0 and before >= 1.0:
        finish = float(t[k - 1]) + (1.0 - float(value_after[k - 1])) / float(slope_before[k])
    else:
        finish = float(t[k])
    return finish


def _bottleneck_transport(
    supply: Mapping[Pattern, int], demand: Mapping[Pattern, int], cost: _PairCost
) -> float:
    """Min over assignments of nodes (current pattern -> target pattern) of the largest
    per-node cost (Hall's condition checked over every subset of targets)."""
    targets = [b for b, n in demand.items() if n > 0]
    sources = [a for a, n in supply.items() if n > 0]
    if len(sources) == 1:
        a = sources[0]
        return max((cost(a, b) for b in targets if b != a), default=0.0)
    levels = sorted({0.0, *(cost(a, b) for a in sources for b in targets)})
    for tau in levels:
        if _feasible(sources, targets, supply, demand, cost, tau):
            return tau
    return math.inf


def _feasible(
    sources: list[Pattern],
    targets: list[Pattern],
    supply: Mapping[Pattern, int],
    demand: Mapping[Pattern, int],
    cost: _PairCost,
    tau: float,
) -> bool:
    reach = {b: {a for a in sources if cost(a, b) <= tau} for b in targets}
    for size in range(1, len(targets) + 1):
        for subset in combinations(targets, size):
            need = sum(demand[b] for b in subset)
            have = sum(supply[a] for a in set().union(*(reach[b] for b in subset)))
            if need > have:
                return False
    return True


# the pause of a node going from one pattern to another (Problem.node_cost, memoised)
_PairCost = Callable[[Pattern, Pattern], float]


def _assign_nodes(
    nodes: Sequence[str],
    current: Mapping[str, Pattern],
    demand: Mapping[Pattern, int],
    cost: _PairCost,
    tau: float,
) -> dict[str, Pattern]:
    """A mapping of nodes to target patterns with every node cost <= tau that keeps as
    many nodes unchanged as possible (min-cost flow on the tiny pattern graph)."""
    supply = Counter(current[n] for n in nodes)
    sources = sorted(supply, reverse=True)
    targets = sorted((b for b in demand if demand[b] > 0), reverse=True)
    # successive shortest paths; nodes: S, sources, targets, T
    flow: dict[tuple[Pattern, Pattern], int] = {}
    left_s = dict(supply)
    left_t = {b: demand[b] for b in targets}
    total = sum(left_t.values())
    if len(sources) == 1 and total == supply[sources[0]]:
        # one current pattern: every node goes somewhere and tau admits each target (it
        # is the bottleneck cost), so the paths can only be a -> b for every demand
        flow = {(sources[0], b): left_t[b] for b in targets}
        total = 0
    for _ in range(total):
        path = _shortest_path(sources, targets, left_s, left_t, flow, cost, tau)
        if path is None:
            raise errors.FailedPrecondition("internal: node mapping infeasible at its bound")
        for (a, b), d in path:
            flow[(a, b)] = flow.get((a, b), 0) + d
        a0, b0 = path[0][0][0], path[-1][0][1]
        left_s[a0] -= 1
        left_t[b0] -= 1
    out: dict[str, Pattern] = {}
    by_pattern: dict[Pattern, list[str]] = {}
    for n in sorted(nodes):
        by_pattern.setdefault(current[n], []).append(n)
    for a in sources:
        pool = by_pattern.get(a, [])
        keep = flow.get((a, a), 0)
        i = 0
        for _ in range(keep):
            out[pool[i]] = a
            i += 1
        for b in targets:
            if b == a:
                continue
            for _ in range(flow.get((a, b), 0)):
                out[pool[i]] = b
                i += 1
    return out


def _shortest_path(
    sources: list[Pattern],
    targets: list[Pattern],
    left_s: Mapping[Pattern, int],
    left_t: Mapping[Pattern, int],
    flow: Mapping[tuple[Pattern, Pattern], int],
    cost: _PairCost,
    tau: float,
) -> list[tuple[tuple[Pattern, Pattern], int]] | None:
    """Bellman-Ford augmenting path S->a->b(->a'->b'...)->T with edge cost [a != b]."""
    inf = math.inf
    dist: dict[tuple[str, Pattern], float] = {}
    prev: dict[
        tuple[str, Pattern], tuple[tuple[str, Pattern], tuple[Pattern, Pattern], int] | None
    ] = {}
    for a in sources:
        if left_s[a] > 0:
            dist[("s", a)] = 0.0
            prev[("s", a)] = None
    for _ in range(len(sources) + len(targets) + 2):
        changed = False
        for a in sources:
            da = dist.get(("s", a), inf)
            if da == inf:
                continue
            for b in targets:
                if cost(a, b) > tau:
                    continue
                w = 0.0 if a == b else 1.0
                if da + w < dist.get(("t", b), inf) - 1e-12:
                    dist[("t", b)] = da + w
                    prev[("t", b)] = (("s", a), (a, b), 1)
                    changed = True
        for b in targets:
            db = dist.get(("t", b), inf)
            if db == inf:
                continue
            for a in sources:
                if flow.get((a, b), 0) > 0:
                    w = -(0.0 if a == b else 1.0)
                    if db + w < dist.get(("s", a), inf) - 1e-12:
                        dist[("s", a)] = db + w
                        prev[("s", a)] = (("t", b), (a, b), -1)
                        changed = True
        if not changed:
            break
    best: tuple[float, Pattern] | None = None
    for b in targets:
        d = dist.get(("t", b), inf)
        if left_t[b] > 0 and d < inf and (best is None or (d, b) < best):
            best = (d, b)
    if best is None:
        return None
    path: list[tuple[tuple[Pattern, Pattern], int]] = []
    node: tuple[str, Pattern] = ("t", best[1])
    seen = 0
    while True:
        p = prev.get(node)
        if p is None:
            break
        parent, edge, d = p
        path.append((edge, d))
        node = parent
        seen += 1
        if seen > 100:
            return None
    path.reverse()
    return path


@dataclass(frozen=True)
class LayoutChoice:
    profile: tuple[tuple[int, tuple[tuple[Pattern, int], ...]], ...]  # per GPU count
    makespan_s: float
    switching_s: float
    is_current: bool
    several_sizes: bool
    # the step cannot end before this (partial rollout's StepGoal.floor_s): a layout
    # that meets the goal sooner gains nothing over it
    floor_s: float = 0.0

    @property
    def patterns(self) -> int:
        return sum(1 for _, c in self.profile for _, k in c if k)

    @property
    def label(self) -> str:
        return "; ".join(
            (f"{g}-GPU nodes: " if self.several_sizes else "")
            + ", ".join(
                f"{k} node{'s' if k > 1 else ''} {pattern_label(p)}"
                for p, k in sorted(c, reverse=True)
                if k
            )
            for g, c in self.profile
        )

    @property
    def score(self) -> float:
        return max(self.makespan_s + self.switching_s, self.floor_s)


def _profiles(
    cur_key: ProfileKey, pats: Mapping[int, Sequence[Pattern]], enumerate_limit: int
) -> list[dict[int, Counter[Pattern]]]:
    """Candidate profiles: per GPU count, how many nodes take each pattern, from the
    current profile and the patterns each class of nodes may take."""
    cur = {g: Counter(dict(c)) for g, c in cur_key}
    sizes = {g: sum(c.values()) for g, c in cur.items()}
    out: list[dict[int, Counter[Pattern]]] = [cur]
    # exhaustive when small
    total = 1
    for g, size in sizes.items():
        total *= math.comb(size + len(pats[g]) - 1, len(pats[g]) - 1)
        if total > enumerate_limit:
            break
    if total <= enumerate_limit:
        per_class = [
            [Counter(c) for c in combinations_with_replacement(pats[g], size)]
            for g, size in sorted(sizes.items())
        ]
        keys = sorted(sizes)
        for combo in product(*per_class):
            out.append(dict(zip(keys, combo, strict=True)))
        return out
    # grid: two uniform patterns mixed in fixed fractions, the same rule for every class
    tps = sorted({t for g in sizes for p in pats[g] if len(set(p)) == 1 for t in p})
    for lo, hi in combinations_with_replacement(tps, 2):
        fractions = _fraction_grid(max(sizes.values()))
        for f in fractions:
            prof: dict[int, Counter[Pattern]] = {}
            ok = True
            for g, size in sizes.items():
                if g % lo or g % hi:
                    ok = False
                    break
                p_lo = tuple([lo] * (g // lo))
                p_hi = tuple([hi] * (g // hi))
                if p_lo not in pats[g] or p_hi not in pats[g]:
                    ok = False
                    break
                k = round(f * size)
                # == Counter({p_lo: size - k}) + Counter({p_hi: k}) (positive counts only)
                mix: Counter[Pattern] = Counter()
                for p, c in ((p_lo, size - k), (p_hi, k)):
                    if c > 0:
                        mix[p] += c
                prof[g] = mix
            if ok:
                out.append(prof)
            if lo == hi:
                break
    return out


def _fraction_grid(n: int) -> list[float]:
    ks = {0, n}
    k = 1
    while k < n:
        ks.add(k)
        ks.add(n - k)
        k *= 2
    for j in range(1, 16):
        ks.add(round(j * n / 16))
    return sorted(k / n for k in ks if 0 <= k <= n)


ProfileKey = tuple[tuple[int, tuple[tuple[Pattern, int], ...]], ...]


@dataclass(frozen=True)
class _Candidate:
    """A candidate profile with what does not depend on the requests."""

    key: ProfileKey
    counts: dict[int, int]  # instances per TP degree
    switching_s: float  # the least longest node pause that reaches it
    patterns: int  # distinct (GPU count, pattern) pairs


# how many candidates a plan reports (best first); the fluid scoring may skip the others
REPORTED = 8


def forget_candidates() -> None:
    """Empty the memo of candidate layouts (benchmarks time the first plan at a layout)."""
    _candidates_for.cache_clear()


def _candidates(prob: Problem, cur_key: ProfileKey) -> tuple[_Candidate, ...]:
    classes: dict[int, set[Pattern]] = {}
    for n in prob.nodes:
        classes.setdefault(len(prob.node_gpus[n]), set()).update(prob.options[n])
    pats = tuple((g, tuple(sorted(ps, reverse=True))) for g, ps in sorted(classes.items()))
    return _candidates_for(prob.perf, prob.config.enumerate_limit, cur_key, pats)


# Candidates and their switching costs depend only on the performance model, the
# current profile and the patterns each class of nodes may take, not on the requests:
# re-plans between layout changes (the usual case) reuse them.
@functools.lru_cache(maxsize=64)
def _candidates_for(
    perf: PerfModel,
    enumerate_limit: int,
    cur_key: ProfileKey,
    pats: tuple[tuple[int, tuple[Pattern, ...]], ...],
) -> tuple[_Candidate, ...]:
    supplies = {g: dict(c) for g, c in cur_key}

    def pair_cost(old: Pattern, new: Pattern) -> float:  # as Problem.node_cost
        a, b = tuple(sorted(old)), tuple(sorted(new))
        return 0.0 if a == b else node_pause(perf, a, b)

    seen: set[ProfileKey] = set()
    out: list[_Candidate] = []
    for prof in _profiles(cur_key, dict(pats), enumerate_limit):
        key = _profile_key(prof)
        if key in seen:
            continue
        seen.add(key)
        counts: dict[int, int] = {}
        for _, c in key:
            for p, k in c:
                for t in p:
                    counts[t] = counts.get(t, 0) + k
        sw = 0.0
        for g, supply in supplies.items():
            sw = max(sw, _bottleneck_transport(supply, prof[g], pair_cost))
        out.append(_Candidate(key, counts, sw, sum(len(c) for _, c in key)))
    return tuple(out)


def choose_layout(
    prob: Problem, reqs: Sequence[int]
) -> tuple[dict[str, Pattern], list[LayoutChoice], float]:
    """The target pattern per node, the candidates scored, and the switching time."""
    classes: dict[int, list[str]] = {}
    for n in prob.nodes:
        classes.setdefault(len(prob.node_gpus[n]), []).append(n)
    # state independent: at most one instance per GPU
    n_inst_max = sum(len(prob.node_gpus[n]) for n in prob.nodes)
    exact = len(reqs) * max(1, n_inst_max) <= prob.config.exact_eval_limit
    srt = None if exact else _sorted_requests(prob, reqs)
    supplies = {g: Counter(prob.current_pattern[n] for n in ns) for g, ns in classes.items()}
    cur_key = _profile_key(supplies)
    several = len(classes) > 1
    scored: list[tuple[float, bool, int, ProfileKey, LayoutChoice]] = []

    def score(cand: _Candidate) -> None:
        if exact:
            tps = sorted((t for t, k in cand.counts.items() for _ in range(k)), reverse=True)
            mk = _exact_makespan(prob, tps, reqs)
        else:
            assert srt is not None
            mk = _fluid_makespan(prob, cand.counts, srt)
        is_current = cand.key == cur_key
        choice = LayoutChoice(cand.key, mk, cand.switching_s, is_current, several, prob.floor_s)
        scored.append((choice.score, not is_current, cand.patterns, cand.key, choice))

    cands = _candidates(prob, cur_key)
    if exact:
        for cand in cands:
            score(cand)
    else:
        # Candidates are scored in the order of a lower bound of their score (see
        # _fluid_bounds), and the rest skipped once it exceeds the REPORTED-th best score:
        # they could neither win nor be reported. The current layout is always scored.
        assert srt is not None
        bounds = _fluid_bounds(prob, srt, cands)
        order = sorted(range(len(cands)), key=bounds.__getitem__)
        top: list[float] = []
        # the current first (a stable sort keeps the others in the order of their bounds)
        for i in sorted(order, key=lambda i: cands[i].key != cur_key):
            cand = cands[i]
            if cand.key != cur_key and len(top) >= REPORTED and bounds[i] > top[-1]:
                break
            score(cand)
            insort(top, scored[-1][0])
            del top[REPORTED:]
    # ties: keep the current layout, then prefer fewer distinct patterns (simpler layouts)
    scored.sort(key=_sort_key)
    choices = [x[4] for x in scored]
    current = next(c for c in choices if c.is_current)
    best = choices[0]
    margin = switch_margin(prob, current.score)
    if best.is_current or not current.score - best.score > margin:
        return dict(prob.current_pattern), choices, 0.0
    pair_cost = prob.node_cost
    target: dict[str, Pattern] = {}
    for g, ns in classes.items():
        demand = dict(dict(best.profile)[g])
        tau = _bottleneck_transport(supplies[g], demand, pair_cost)
        target.update(_assign_nodes(ns, prob.current_pattern, demand, pair_cost, tau))
    return target, choices, best.switching_s


def switch_margin(prob: Problem, keep_s: float) -> float:
    """By how much a layout's score must beat keeping the current one (``keep_s``)."""
    margin = max(prob.config.switch_margin_s, EPS)
    # Under partial rollout (carry_tail) the prediction covers work the step will not
    # wait for (its tail is carried into the next step), so a gain on it overstates what
    # the step gets: the relative margin applies whatever holds KV.
    if prob.kv_array.any() or prob.config.carry_tail:
        # The relative margin is a bias toward the layout the planner chose for the work
        # in flight: it keeps a forecast's noise from flapping the layout under running
        # requests. When no request holds KV (a step's batch has just arrived, nothing
        # runs) the current layout is what the previous step's tail left, not a choice
        # for this work, and the switch costs only its pause, already in the score: the
        # absolute margin alone (re-plan stability) decides.
        margin = max(margin, prob.config.switch_margin_rel * keep_s)
    return margin


def _fluid_bounds(prob: Problem, s: _Sorted, cands: Sequence[_Candidate]) -> list[float]:
    """Per candidate, a lower bound of its score (fluid makespan plus switching): the
    longest request's own time on the candidate's fastest instances is the ``tail`` that
    :func:`_fluid_makespan` never goes below, and the least such time over the
    candidate's degrees is never above it."""
    if not s.order:
        return [c.switching_s for c in cands]
    r0 = s.order[0]
    q, m, pre = prob.q[r0], prob.m[r0], prob.pre[r0]
    tail = {t: cost.run(q, m, pre) for t, cost in prob.costs.items()}
    return [min(tail[t] for t in c.counts) + c.switching_s for c in cands]


def _sort_key(x: tuple[float, bool, int, ProfileKey, LayoutChoice]) -> tuple[object, ...]:
    return x[:4]


def _profile_key(prof: Mapping[int, Mapping[Pattern, int]]) -> ProfileKey:
    return tuple(
        (g, tuple(sorted((p, k) for p, k in c.items() if k > 0))) for g, c in sorted(prof.items())
    )
