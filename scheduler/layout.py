"""Choosing TP layouts: candidate profiles, their makespan and their switching cost.

A candidate layout is a *profile*: how many nodes of each GPU count use each pattern.
Its makespan ``M`` is scored from the requests alone (not from where they sit): exactly
by LPT + local search for small cases, by a fluid bound for large ones (the longest
requests one per instance on the fastest instances, the rest spread by throughput). Its
switching cost ``C`` is the exact minimum, over which node takes which pattern, of the
longest node pause (a bottleneck transportation problem on the few patterns, solved by
Hall's condition; the concrete mapping keeps as many nodes unchanged as possible). Node
pauses satisfy the triangle inequality, so ``M + C`` of any layout seen from the chosen
one is never below the chosen layout's own makespan: re-planning keeps it.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import accumulate, combinations, combinations_with_replacement, product

from orchestrrl import errors
from scheduler.compute_problem import EPS, Pattern, Problem, TpCost, pattern_label
from scheduler.compute_state import Instance
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
    """Requests sorted by q descending, with prefix sums (for the fluid estimate)."""

    order: tuple[int, ...]
    q: tuple[float, ...]
    pm: tuple[float, ...]  # prefix sums of m
    pq: tuple[float, ...]
    pp: tuple[float, ...]  # prefix sums of pre


def _sorted_requests(prob: Problem, reqs: Sequence[int]) -> _Sorted:
    if len(reqs) == len(prob.by_length):  # every request (requests are distinct)
        order = list(prob.by_length)
    else:
        wanted = set(reqs)
        order = [r for r in prob.by_length if r in wanted]
    q, m, pre = prob.q, prob.m, prob.pre
    qo = [q[r] for r in order]
    pm = [0.0, *accumulate([m[r] for r in order])]
    pq = [0.0, *accumulate(qo)]
    pp = [0.0, *accumulate([float(pre[r]) for r in order])]
    return _Sorted(tuple(order), tuple(qo), tuple(pm), tuple(pq), tuple(pp))


def _fluid_makespan(prob: Problem, counts: Mapping[int, int], s: _Sorted) -> float:
    """The longest requests one per instance on the fastest instances; the rest spread
    over every instance in proportion to its throughput."""
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
    blocks: list[tuple[TpCost, int, float]] = []  # (cost, instances, sum of own times)
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
        blocks.append((cost, n, own_sum))
        start = end
    if start >= n_req:
        return tail
    work_m = s.pm[n_req] - s.pm[start]
    work_p = s.pp[n_req] - s.pp[start]
    # each instance of type t does a share of the bulk at cost D_t per whole bulk
    num = 1.0
    den = 0.0
    for cost, n, own_sum in blocks:
        d = (cost.per_sequence_s + cost.iteration_s / cost.slots) * work_m
        d += cost.prefill_per_token_s * work_p
        if d <= 0:
            continue
        num += own_sum / d
        den += n / d
    bulk = num / den if den > 0 else math.inf
    return max(tail, bulk)


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


class _PairCost:
    def __init__(self, prob: Problem) -> None:
        self.prob = prob
        self.memo: dict[tuple[Pattern, Pattern], float] = {}

    def __call__(self, a: Pattern, b: Pattern) -> float:
        hit = self.memo.get((a, b))
        if hit is None:
            hit = self.prob.node_cost(a, b)
            self.memo[(a, b)] = hit
        return hit


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
        return self.makespan_s + self.switching_s


def _profiles(prob: Problem) -> list[dict[int, Counter[Pattern]]]:
    """Candidate profiles: per GPU count, how many nodes take each pattern."""
    classes: dict[int, list[str]] = {}
    for n in prob.nodes:
        classes.setdefault(len(prob.node_gpus[n]), []).append(n)
    cur = {g: Counter(prob.current_pattern[n] for n in ns) for g, ns in classes.items()}
    pats = {
        g: sorted({p for n in ns for p in prob.options[n]}, reverse=True)
        for g, ns in classes.items()
    }
    out: list[dict[int, Counter[Pattern]]] = [cur]
    # exhaustive when small
    total = 1
    for g, ns in classes.items():
        total *= math.comb(len(ns) + len(pats[g]) - 1, len(pats[g]) - 1)
        if total > prob.config.enumerate_limit:
            break
    if total <= prob.config.enumerate_limit:
        per_class = [
            [Counter(c) for c in combinations_with_replacement(pats[g], len(ns))]
            for g, ns in sorted(classes.items())
        ]
        keys = sorted(classes)
        for combo in product(*per_class):
            out.append(dict(zip(keys, combo, strict=True)))
        return out
    # grid: two uniform patterns mixed in fixed fractions, the same rule for every class
    tps = sorted({t for g in classes for p in pats[g] if len(set(p)) == 1 for t in p})
    for lo, hi in combinations_with_replacement(tps, 2):
        fractions = _fraction_grid(max(len(ns) for ns in classes.values()))
        for f in fractions:
            prof: dict[int, Counter[Pattern]] = {}
            ok = True
            for g, ns in classes.items():
                size = len(ns)
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


def choose_layout(
    prob: Problem, reqs: Sequence[int]
) -> tuple[dict[str, Pattern], list[LayoutChoice], float]:
    """The target pattern per node, the candidates scored, and the switching time."""
    classes: dict[int, list[str]] = {}
    for n in prob.nodes:
        classes.setdefault(len(prob.node_gpus[n]), []).append(n)
    pair_cost = _PairCost(prob)
    # state independent: at most one instance per GPU
    n_inst_max = sum(len(prob.node_gpus[n]) for n in prob.nodes)
    exact = len(reqs) * max(1, n_inst_max) <= prob.config.exact_eval_limit
    srt = None if exact else _sorted_requests(prob, reqs)
    seen: set[tuple[tuple[int, tuple[tuple[Pattern, int], ...]], ...]] = set()
    choices: list[LayoutChoice] = []
    supplies = {g: Counter(prob.current_pattern[n] for n in ns) for g, ns in classes.items()}
    cur_key = _profile_key(supplies)
    for prof in _profiles(prob):
        key = _profile_key(prof)
        if key in seen:
            continue
        seen.add(key)
        counts: Counter[int] = Counter()
        for c in prof.values():
            for p, k in c.items():
                for t in p:
                    counts[t] += k
        if exact:
            tps = sorted((t for t, k in counts.items() for _ in range(k)), reverse=True)
            mk = _exact_makespan(prob, tps, reqs)
        else:
            assert srt is not None
            mk = _fluid_makespan(prob, counts, srt)
        sw = 0.0
        for g, supply in supplies.items():
            sw = max(sw, _bottleneck_transport(supply, prof[g], pair_cost))
        choices.append(LayoutChoice(key, mk, sw, key == cur_key, len(classes) > 1))
    # ties: keep the current layout, then prefer fewer distinct patterns (simpler layouts)
    choices.sort(key=lambda c: (c.score, not c.is_current, c.patterns, c.profile))
    current = next(c for c in choices if c.is_current)
    best = choices[0]
    margin = max(prob.config.switch_margin_s, prob.config.switch_margin_rel * current.score, EPS)
    if best.is_current or not current.score - best.score > margin:
        return dict(prob.current_pattern), choices, 0.0
    target: dict[str, Pattern] = {}
    for g, ns in classes.items():
        demand = dict(dict(best.profile)[g])
        supply = Counter(prob.current_pattern[n] for n in ns)
        tau = _bottleneck_transport(supply, demand, pair_cost)
        target.update(_assign_nodes(ns, prob.current_pattern, demand, pair_cost, tau))
    return target, choices, best.switching_s


def _profile_key(
    prof: Mapping[int, Counter[Pattern]],
) -> tuple[tuple[int, tuple[tuple[Pattern, int], ...]], ...]:
    return tuple(
        (g, tuple(sorted((p, k) for p, k in c.items() if k > 0))) for g, c in sorted(prof.items())
    )
