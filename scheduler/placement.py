"""Placing requests on concrete instances: LPT dispatch and reactive balancing.

Mutable working state private to one planning call (the planner returns frozen values).
Instance totals are exact integers (expected tokens in 1/SCALE units), so a placement
evaluates the same whatever order it was built in: re-planning sees the same numbers.
"""

from __future__ import annotations

import heapq
import math
from bisect import bisect_left, insort
from collections.abc import Iterable, Sequence

import numpy as np

from scheduler.compute_problem import SCALE, MoveCost, Problem, queue_delays
from scheduler.compute_state import Instance


class Placement:
    """Mutable working state of a placement (private to one planning call).

    Hot paths are written out by hand: this runs for thousands of requests per plan.
    """

    def __init__(self, prob: Problem, instances: Sequence[Instance], all_candidates: bool) -> None:
        self.prob = prob
        self.inst = list(instances)
        self.index = {inst.id: k for k, inst in enumerate(self.inst)}
        self.tp = [len(inst.gpus) for inst in self.inst]  # == inst.tp, no property call
        costs = [prob.costs[t] for t in self.tp]
        self.cost = costs
        self.a = [c.iteration_s for c in costs]
        self.c = [c.per_sequence_s for c in costs]
        self.p = [c.prefill_per_token_s for c in costs]
        self.inv_slots = [1.0 / c.slots for c in costs]
        self._a_a = np.array(self.a, dtype=np.float64)
        self._c_a = np.array(self.c, dtype=np.float64)
        self._p_a = np.array(self.p, dtype=np.float64)
        self._inv_slots_a = np.array(self.inv_slots, dtype=np.float64)
        self.node = [inst.node for inst in self.inst]
        self.ids = [inst.id for inst in self.inst]
        self.cap = [c.capacity_tokens for c in costs]
        self.slots = [c.slots for c in costs]
        q_a, _, _, ctx_a = prob.arrays
        self.need: list[float] = (ctx_a + q_a).tolist()  # == ctx + q per request
        n = len(self.inst)
        self.members: list[set[int]] = [set() for _ in range(n)]
        # members holding a KV cache: each has a seat (max_num_seqs) on its instance, and
        # a request moved with its KV cache needs a free one (else the engine preempts it
        # and it is recomputed: the move bought nothing)
        self.kv_count: list[int] = [0] * n
        self.qs: list[list[float]] = [[] for _ in range(n)]
        self.sum_m: list[int] = [0] * n
        self.sum_pre: list[int] = [0] * n
        self.run: list[float] = [0.0] * n
        self.ver: list[int] = [0] * n
        self.where: dict[int, int] = {}
        self.all_candidates = all_candidates
        self.by_node: dict[str, list[int]] = {}
        for k, node in enumerate(self.node):
            self.by_node.setdefault(node, []).append(k)
        self.types = sorted(set(self.tp))
        self.low: dict[int, list[tuple[float, int, int]]] = {t: [] for t in self.types}
        self.high: list[tuple[float, int, int]] = []
        # the heaps are rebuilt lazily: a placement is usually loaded right away, and a
        # rebuilt heap orders its current entries exactly as one with stale entries does
        self._stale = True
        self._sizes: list[int] | None = None  # see _move_size

    def _fresh(self) -> None:
        if self._stale:
            self._rebuild_heaps()

    def _rebuild_heaps(self) -> None:
        low: dict[int, list[tuple[float, int, int]]] = {t: [] for t in self.types}
        high: list[tuple[float, int, int]] = []
        for k, t in enumerate(self.tp):
            v = self.ver[k]
            low[t].append((self.run[k], k, v))
            high.append((-self.run[k], k, v))
        for h in low.values():
            heapq.heapify(h)
        heapq.heapify(high)
        self.low, self.high = low, high
        self._stale = False

    def _eval(self, k: int, qmax: float, sum_m: int, sum_pre: int) -> float:
        if sum_m <= 0 and sum_pre <= 0 and qmax <= 0:
            return 0.0
        m = sum_m / SCALE
        iters = m * self.inv_slots[k]
        if qmax > iters:
            iters = qmax
        return self.a[k] * iters + self.c[k] * m + self.p[k] * sum_pre

    def _attach(self, r_a: np.ndarray, k_a: np.ndarray) -> np.ndarray:
        """Record requests ``r_a`` on instances ``k_a`` (where, members, the sorted q
        lists), grouped by instance with one sort; returns the instances touched."""
        q_a = self.prob.arrays[0][r_a]
        self.where.update(zip(r_a.tolist(), k_a.tolist(), strict=True))
        order = np.lexsort((q_a, k_a))  # by instance, then q ascending
        touched_a, first = np.unique(k_a[order], return_index=True)
        bounds = [*first.tolist()[1:], len(r_a)]
        r_list: list[int] = r_a[order].tolist()
        q_list: list[float] = q_a[order].tolist()
        members, qs, kv_count, has_kv = self.members, self.qs, self.kv_count, self.prob.has_kv
        lo = 0
        for k, hi in zip(touched_a.tolist(), bounds, strict=True):
            members[k].update(r_list[lo:hi])
            kv_count[k] += sum(map(has_kv.__getitem__, r_list[lo:hi]))
            qk = qs[k]
            if qk:
                qk.extend(q_list[lo:hi])
                qk.sort()
            else:
                qs[k] = q_list[lo:hi]
            lo = hi
        return touched_a

    def load(self, pairs: Iterable[tuple[int, int]]) -> None:
        """Place many requests at once (request, instance), then rebuild the heaps.

        Vectorised: the pairs are grouped by instance with one sort, the totals added
        with numpy (exact integers), and the touched instances re-evaluated together
        (the same float operations as ``_eval``)."""
        pairs = list(pairs)
        if pairs:
            rs, ks = zip(*pairs, strict=True)
            self.load_arrays(np.array(rs, dtype=np.int64), np.array(ks, dtype=np.int64))

    def load_arrays(self, r_a: np.ndarray, k_a: np.ndarray) -> None:
        """``load`` of the pairs ``(r_a[i], k_a[i])``."""
        if len(r_a) == 0:
            return
        _, mi_all, pre_all, _ = self.prob.arrays
        touched_a = self._attach(r_a, k_a)
        touched: list[int] = touched_a.tolist()
        qs = self.qs
        n = len(self.inst)
        add_m = np.zeros(n, dtype=np.int64)
        add_pre = np.zeros(n, dtype=np.int64)
        np.add.at(add_m, k_a, mi_all[r_a])
        np.add.at(add_pre, k_a, pre_all[r_a])
        sum_m = np.array(self.sum_m, dtype=np.int64) + add_m
        sum_pre = np.array(self.sum_pre, dtype=np.int64) + add_pre
        self.sum_m = sum_m.tolist()
        self.sum_pre = sum_pre.tolist()
        # _eval for the touched instances at once
        sm = sum_m[touched_a]
        sp = sum_pre[touched_a]
        qmax = np.array([qs[k][-1] for k in touched], dtype=np.float64)
        m = sm / SCALE
        iters = np.maximum(m * self._inv_slots_a[touched_a], qmax)
        value = self._a_a[touched_a] * iters + self._c_a[touched_a] * m
        value = value + self._p_a[touched_a] * sp
        value = np.where((sm <= 0) & (sp <= 0) & (qmax <= 0), 0.0, value)
        run, ver = self.run, self.ver
        for k, v in zip(touched, value.tolist(), strict=True):
            run[k] = v
            ver[k] += 1
        self._stale = True

    def add(self, r: int, k: int) -> None:
        prob = self.prob
        self.members[k].add(r)
        self.kv_count[k] += prob.has_kv[r]
        qs = self.qs[k]
        insort(qs, prob.q[r])
        self.sum_m[k] += prob.mi[r]
        self.sum_pre[k] += prob.pre[r]
        self.where[r] = k
        run = self._eval(k, qs[-1], self.sum_m[k], self.sum_pre[k])
        self.run[k] = run
        v = self.ver[k] + 1
        self.ver[k] = v
        if not self._stale:
            heapq.heappush(self.low[self.tp[k]], (run, k, v))
            heapq.heappush(self.high, (-run, k, v))

    def remove(self, r: int) -> int:
        prob = self.prob
        k = self.where.pop(r)
        self.members[k].discard(r)
        self.kv_count[k] -= prob.has_kv[r]
        qs = self.qs[k]
        del qs[bisect_left(qs, prob.q[r])]
        self.sum_m[k] -= prob.mi[r]
        self.sum_pre[k] -= prob.pre[r]
        run = self._eval(k, qs[-1], self.sum_m[k], self.sum_pre[k]) if qs else 0.0
        self.run[k] = run
        v = self.ver[k] + 1
        self.ver[k] = v
        if not self._stale:
            heapq.heappush(self.low[self.tp[k]], (run, k, v))
            heapq.heappush(self.high, (-run, k, v))
        return k

    def run_with(self, k: int, r: int) -> float:
        prob = self.prob
        qs = self.qs[k]
        qr = prob.q[r]
        qmax = qs[-1] if qs and qs[-1] > qr else qr
        return self._eval(k, qmax, self.sum_m[k] + prob.mi[r], self.sum_pre[k] + prob.pre[r])

    def run_without(self, k: int, r: int) -> float:
        prob = self.prob
        if len(self.members[k]) <= 1:
            return 0.0
        qs = self.qs[k]
        qmax = qs[-2] if prob.q[r] == qs[-1] else qs[-1]
        return self._eval(k, qmax, self.sum_m[k] - prob.mi[r], self.sum_pre[k] - prob.pre[r])

    def fits(self, r: int, k: int) -> bool:
        """The instance's KV cache holds the request (or it runs there already)."""
        return self.need[r] <= self.cap[k] or self.prob.current[r] == self.ids[k]

    def seated(self, r: int, k: int, leaving: int = -1) -> bool:
        """A request with a KV cache finds a free seat on ``k`` (``leaving``: a request of
        ``k`` that leaves it at the same time). Also when it returns to its own instance:
        its seat may have been given away meanwhile."""
        prob = self.prob
        if not prob.has_kv[r]:
            return True
        held = self.kv_count[k] - (prob.has_kv[leaving] if leaving >= 0 else 0)
        return held < self.slots[k]

    def lowest(self, t: int, count: int, exclude: int) -> list[int]:
        self._fresh()
        heap = self.low[t]
        ver = self.ver
        out: list[int] = []
        held: list[tuple[float, int, int]] = []
        while heap and len(out) < count:
            entry = heapq.heappop(heap)
            k = entry[1]
            if entry[2] != ver[k]:
                continue
            held.append(entry)
            if k != exclude:
                out.append(k)
        for entry in held:
            heapq.heappush(heap, entry)
        return out

    def bottleneck(self) -> int:
        self._fresh()
        heap = self.high
        ver = self.ver
        while heap:
            _, k, v = heap[0]
            if v == ver[k]:
                return k
            heapq.heappop(heap)
        return -1

    def makespan(self) -> float:
        return max(self.run, default=0.0)

    def queued_runs(self) -> list[float]:
        """Per instance, its run plus the delay its first-come-first-served queue puts
        on its longest waiting request (:func:`queue_delays`): what a plan predicts."""
        where = self.where
        r_a = np.fromiter(where.keys(), dtype=np.int64, count=len(where))
        k_a = np.fromiter(where.values(), dtype=np.int64, count=len(where))
        delays: list[float] = queue_delays(self.prob, r_a, k_a, self.tp).tolist()
        return [run + d for run, d in zip(self.run, delays, strict=True)]

    def candidates(self, src: int) -> list[int]:
        if self.all_candidates:
            return [k for k in range(len(self.inst)) if k != src]
        out = set(self.by_node.get(self.node[src], ()))
        for t in self.types:
            out.update(self.lowest(t, self.prob.config.candidate_k, src))
        out.discard(src)
        return sorted(out)

    def movable(self, src: int) -> list[int]:
        """Requests of ``src`` that balancing tries to move (a function of the placement):
        all of them on small clusters, else the longest and the cheapest to move."""
        prob = self.prob
        members = self.members[src]
        limit = prob.config.candidate_requests
        rank = prob.rank.__getitem__
        if self.all_candidates or len(members) <= 2 * limit:
            return sorted(members, key=rank)
        # == heapq.nsmallest(limit, ...) (keys are unique), but sorting a few dozen in C
        # is faster than nsmallest's Python loop
        chosen = sorted(members, key=rank)[:limit]
        seen = set(chosen)
        size = self._move_size().__getitem__
        chosen.extend(r for r in sorted(members, key=size)[:limit] if r not in seen)
        return chosen

    def _move_size(self) -> list[int]:
        """Per request, the order (KV tokens a move carries (0 without KV cache), rank) as
        one int (ranks are below the request count): unique, and no tuples to collect."""
        sizes = self._sizes
        if sizes is None:
            prob = self.prob
            ctx_a = prob.arrays[3]
            sizes = (np.where(prob.kv_array, ctx_a, 0) * len(ctx_a) + prob.rank_array).tolist()
            self._sizes = sizes
        return sizes

    # -- algorithms --

    def place_lpt(self, reqs: Sequence[int], cost_of: MoveCost | None = None) -> list[int]:
        """Longest first, each to the instance that would finish earliest (plus its move
        cost). Returns the requests no instance can hold."""
        if not reqs:
            return []
        prob = self.prob
        order = sorted(reqs, key=prob.rank.__getitem__)
        left: list[int] = []
        n = len(self.inst)
        every = self.all_candidates or cost_of is not None
        if not every:
            return self._lpt_by_type(order)
        for r in order:
            best: tuple[float, str, int] | None = None
            for k in range(n):
                if not self.fits(r, k):
                    continue
                extra = cost_of(r, k) if cost_of is not None else 0.0
                key = (self.run_with(k, r) + extra, self.inst[k].id, k)
                if best is None or key < best:
                    best = key
            if best is None:
                left.append(r)
            else:
                self.add(r, best[2])
        return left

    def place_in_line(self, reqs: Sequence[int]) -> list[int]:
        """First come, first served to the shortest line: each request, in the order
        given (arrival), to the instance holding the fewest requests per seat (ties: the
        lowest instance id) among those whose KV cache holds it. On instances alike and
        empty this deals requests out in turn, as a static dispatcher does. Returns the
        requests no instance can hold."""
        if not reqs:
            return []
        n = len(self.inst)
        heap = [(len(self.members[k]) / self.slots[k], self.ids[k], k) for k in range(n)]
        heapq.heapify(heap)
        left: list[int] = []
        for r in reqs:
            held: list[tuple[float, str, int]] = []
            while heap and not self.fits(r, heap[0][2]):
                held.append(heapq.heappop(heap))
            if not heap:
                left.append(r)
            else:
                _, _, k = heapq.heappop(heap)
                self.add(r, k)
                heapq.heappush(heap, (len(self.members[k]) / self.slots[k], self.ids[k], k))
            for entry in held:
                heapq.heappush(heap, entry)
        return left

    def _lpt_by_type(self, order: Sequence[int]) -> list[int]:
        """LPT where the candidates are the least-loaded instance of each TP degree
        (instances of one degree are interchangeable); one heap per degree, updated in
        place, and the shared heaps rebuilt once at the end. A uniform layout (one
        degree) takes the batched form, ``_lpt_uniform``: the same assignment."""
        prob = self.prob
        heaps = {
            t: sorted((self.run[k], k) for k in range(len(self.tp)) if self.tp[k] == t)
            for t in self.types
        }
        caps = {t: prob.costs[t].capacity_tokens for t in self.types}
        qmax = [qs[-1] if qs else 0.0 for qs in self.qs]
        sum_m, sum_pre, run = self.sum_m, self.sum_pre, self.run
        a_, c_, p_, inv = self.a, self.c, self.p, self.inv_slots
        typed = [(caps[t], heaps[t]) for t in self.types]
        if len(typed) == 1 and typed[0][1]:
            # one TP degree (a uniform layout): LPT in batches (see _lpt_uniform)
            cap = typed[0][0]
            r_a, k_a, left = _lpt_uniform(
                prob, order, cap, (a_[0], c_[0], p_[0], inv[0]), qmax, sum_m, sum_pre, run
            )
        else:
            placed: list[tuple[int, int]] = []
            left = _lpt_typed(
                prob, order, typed, (a_, c_, p_, inv), qmax, sum_m, sum_pre, run, placed
            )
            r_a = np.array([r for r, _ in placed], dtype=np.int64)
            k_a = np.array([k for _, k in placed], dtype=np.int64)
        # the totals and runs are updated in place above; the rest of the bookkeeping here
        if len(r_a):
            for k in self._attach(r_a, k_a).tolist():
                self.ver[k] += 1
            self._stale = True
        return left

    def balance(self, cost_of: MoveCost, margin: float) -> int:
        """Move single requests off the bottleneck while a move pays for itself."""
        prob = self.prob
        moves = 0
        limit = prob.config.max_moves
        while moves < limit:
            src = self.bottleneck()
            if src < 0:
                break
            run_src = self.run[src]
            if run_src <= 0:
                break
            dsts = self.candidates(src)
            best: tuple[float, float, str, str, int, int] | None = None
            limit_run = run_src - margin  # a move must bring both ends below this
            need, cap, ids, current = self.need, self.cap, self.ids, prob.current
            has_kv, kv_count, slots = prob.has_kv, self.kv_count, self.slots
            # a destination's run only grows with a request: one already at the limit
            # cannot take any (the same test as below, made before evaluating requests)
            run = self.run
            targets = [k for k in dsts if run[k] < limit_run]
            # a move's result is max(without, with_r + cost) >= both: once a move is found,
            # a candidate above its result cannot win (ties still compare in full)
            qs_, sum_m, sum_pre = self.qs, self.sum_m, self.sum_pre
            a_, c_, p_, inv = self.a, self.c, self.p, self.inv_slots
            for r in self.movable(src) if targets else ():
                without = self.run_without(src, r)
                if without >= limit_run or (best is not None and without > best[0]):
                    continue
                need_r, cur_r = need[r], current[r]
                q_r, m_r, pre_r = prob.q[r], prob.mi[r], prob.pre[r]
                kv_r = has_kv[r]
                for k in targets:
                    if (need_r > cap[k] and cur_r != ids[k]) or (kv_r and kv_count[k] >= slots[k]):
                        continue  # no KV room, or no free seat for its KV cache (even on
                        # its own instance: its seat may have been given away meanwhile)
                    # self.run_with(k, r), inlined (the hot loop of balancing)
                    qs = qs_[k]
                    qm = qs[-1] if qs and qs[-1] > q_r else q_r
                    sm = sum_m[k] + m_r
                    sp = sum_pre[k] + pre_r
                    if sm <= 0 and sp <= 0 and qm <= 0:
                        with_r = 0.0
                    else:
                        mm = sm / SCALE
                        iters = mm * inv[k]
                        if qm > iters:
                            iters = qm
                        with_r = a_[k] * iters + c_[k] * mm + p_[k] * sp
                    if with_r >= limit_run or (best is not None and with_r > best[0]):
                        continue
                    cost = cost_of(r, k)
                    new = without if without > with_r + cost else with_r + cost
                    if new < limit_run:
                        key = (new, cost, ids[k], prob.rids[r], r, k)
                        if best is None or key < best:
                            best = key
            if best is not None:
                r, k = best[4], best[5]
                self.remove(r)
                self.add(r, k)
                moves += 1
                continue
            swap = self._best_swap(src, dsts, cost_of, margin) if self.all_candidates else None
            if swap is None:
                break
            r, k, x = swap
            self.remove(r)
            self.remove(x)
            self.add(r, k)
            self.add(x, src)
            moves += 1
        return moves

    def _best_swap(
        self, src: int, dsts: Sequence[int], cost_of: MoveCost, margin: float
    ) -> tuple[int, int, int] | None:
        """Exchange a request of the bottleneck with one of another instance, when no
        single move helps (small clusters only: it looks at every pair)."""
        prob = self.prob
        q, mi, pre = prob.q, prob.mi, prob.pre
        run_src = self.run[src]
        qs_src = self.qs[src]
        best: tuple[float, str, str, str, int, int, int] | None = None
        for r in sorted(self.members[src], key=prob.rank.__getitem__):
            q_src = (
                qs_src[-2]
                if len(qs_src) > 1 and q[r] == qs_src[-1]
                else (qs_src[-1] if len(qs_src) > 1 else 0.0)
            )
            for k in dsts:
                if not self.fits(r, k):
                    continue
                qs_k = self.qs[k]
                cost_r = cost_of(r, k)
                for x in sorted(self.members[k], key=prob.rank.__getitem__):
                    if q[x] >= q[r] and mi[x] >= mi[r] and pre[x] >= pre[r]:
                        continue  # cannot help the bottleneck
                    if not self.fits(x, src):
                        continue
                    if not (self.seated(r, k, leaving=x) and self.seated(x, src, leaving=r)):
                        continue
                    q_k = (
                        qs_k[-2]
                        if len(qs_k) > 1 and q[x] == qs_k[-1]
                        else (qs_k[-1] if len(qs_k) > 1 else 0.0)
                    )
                    new_src = self._eval(
                        src,
                        max(q_src, q[x]),
                        self.sum_m[src] - mi[r] + mi[x],
                        self.sum_pre[src] - pre[r] + pre[x],
                    )
                    new_k = self._eval(
                        k,
                        max(q_k, q[r]),
                        self.sum_m[k] - mi[x] + mi[r],
                        self.sum_pre[k] - pre[x] + pre[r],
                    )
                    new = max(new_src + cost_of(x, src), new_k + cost_r)
                    if new + margin < run_src:
                        key = (new, self.inst[k].id, prob.rids[r], prob.rids[x], r, k, x)
                        if best is None or key < best:
                            best = key
        if best is None:
            return None
        return best[4], best[5], best[6]


class MoveCostFrom:
    """Cost of moving request r from where its KV is now in a placement to instance k.

    A placed request pays from its current instance; one not yet placed (displaced by a
    reshard: its instance is gone) pays from its original instance, free within its
    resharding node.
    """

    def __init__(self, prob: Problem, placement: Placement) -> None:
        self.prob = prob
        self.pl = placement

    def __call__(self, r: int, k: int) -> float:
        prob, pl = self.prob, self.pl
        if not prob.has_kv[r]:
            return 0.0
        cur = pl.where.get(r)
        dst = pl.inst[k]
        if cur is not None:
            if cur == k:
                return 0.0
            return prob.move_between(r, pl.node[cur], pl.tp[cur], dst, False)[0]
        was = prob.current[r]
        if was is None:
            raise KeyError(r)  # a request without an instance has no KV to move
        src = prob.instances[was]
        return prob.move_between(r, src.node, len(src.gpus), dst, True)[0]


def keep_makespan(prob: Problem, placeable: Sequence[int], all_cand: bool) -> float:
    """Makespan if nothing changes: current placement, queued requests by LPT, each
    instance's run with its queue delay (as :meth:`Placement.queued_runs`)."""
    instances = list(prob.instances.values())  # by id
    n = len(instances)
    plc = np.array(placeable, dtype=np.int64)
    # per request its current instance's index by id (n: queued)
    cur = prob.current_index[plc]
    is_queued = cur == n
    queued: list[int] = plc[is_queued].tolist()
    if not queued:
        # the instance model (TpCost.run) per instance, vectorised: the same operations
        q_all, mi_all, pre_all, _ = prob.arrays
        qmax = np.full(n, -np.inf)
        np.maximum.at(qmax, cur, q_all[plc])
        sum_m = np.zeros(n, dtype=np.int64)
        sum_pre = np.zeros(n, dtype=np.int64)
        np.add.at(sum_m, cur, mi_all[plc])
        np.add.at(sum_pre, cur, pre_all[plc])
        present = np.bincount(cur, minlength=n) > 0
        costs = [prob.costs[len(inst.gpus)] for inst in instances]
        a = np.array([c.iteration_s for c in costs])
        c_ = np.array([c.per_sequence_s for c in costs])
        p = np.array([c.prefill_per_token_s for c in costs])
        slots = np.array([c.slots for c in costs], dtype=np.float64)
        m = sum_m / SCALE
        iters = np.maximum(qmax, m / slots)
        run = a * iters + c_ * m
        run = run + p * sum_pre
        run = np.where((m <= 0) & (sum_pre <= 0) & (qmax <= 0), 0.0, run)
        run = run + queue_delays(prob, plc, cur, [len(inst.gpus) for inst in instances])
        return float(run[present].max()) if present.any() else 0.0
    if all_cand:
        keep = Placement(prob, instances, all_cand)
        keep.load((r, keep.index[c]) for r in placeable if (c := prob.current[r]) is not None)
        keep.place_lpt(queued)
        return max(keep.queued_runs(), default=0.0)
    return _lpt_makespan(prob, instances, placeable, queued)


def _lpt_makespan(
    prob: Problem, instances: Sequence[Instance], placeable: Sequence[int], queued: list[int]
) -> float:
    """``Placement.load`` of the placed requests then ``place_lpt`` of ``queued`` (by TP
    degree, as ``Placement._lpt_by_type``), keeping only what the makespan needs: the
    same arithmetic and tie-breaks, without the bookkeeping of members and heaps.
    ``instances``: the problem's, in its order (``Problem.current_index`` indexes them)."""
    n = len(instances)
    tp = [len(inst.gpus) for inst in instances]
    costs = {t: prob.costs[t] for t in set(tp)}
    # the placed requests' totals per instance, vectorised (exact integers; max of q)
    q_all, mi_all, pre_all, _ = prob.arrays
    cur_all = prob.current_index  # instances are the problem's, in its order
    plc = np.array(placeable, dtype=np.int64)
    on = cur_all[plc] < n
    r_on = plc[on]
    k_on = cur_all[r_on]
    qmax_a = np.zeros(n)
    np.maximum.at(qmax_a, k_on, q_all[r_on])  # q >= 0: the same as starting from the first
    sum_m_a = np.zeros(n, dtype=np.int64)
    sum_pre_a = np.zeros(n, dtype=np.int64)
    np.add.at(sum_m_a, k_on, mi_all[r_on])
    np.add.at(sum_pre_a, k_on, pre_all[r_on])
    qmax: list[float] = qmax_a.tolist()
    sum_m: list[int] = sum_m_a.tolist()
    sum_pre: list[int] = sum_pre_a.tolist()
    count: list[int] = np.bincount(k_on, minlength=n).tolist()
    a_ = [costs[t].iteration_s for t in tp]
    c_ = [costs[t].per_sequence_s for t in tp]
    p_ = [costs[t].prefill_per_token_s for t in tp]
    inv = [1.0 / costs[t].slots for t in tp]

    def evaluate(k: int, qm: float, sm: int, sp: int) -> float:
        if sm <= 0 and sp <= 0 and qm <= 0:
            return 0.0
        m = sm / SCALE
        iters = m * inv[k]
        if qm > iters:
            iters = qm
        return a_[k] * iters + c_[k] * m + p_[k] * sp

    run = [evaluate(k, qmax[k], sum_m[k], sum_pre[k]) if count[k] else 0.0 for k in range(n)]
    types = sorted(costs)
    typed = [
        (costs[t].capacity_tokens, sorted((run[k], k) for k in range(n) if tp[k] == t))
        for t in types
    ]
    order = sorted(queued, key=prob.rank.__getitem__)
    if len(typed) == 1 and typed[0][1]:
        # one TP degree (a uniform layout): LPT in batches (see _lpt_uniform)
        cap = typed[0][0]
        r_lpt, k_lpt, _ = _lpt_uniform(
            prob, order, cap, (a_[0], c_[0], p_[0], inv[0]), qmax, sum_m, sum_pre, run
        )
    else:
        placed: list[tuple[int, int]] = []
        _lpt_typed(prob, order, typed, (a_, c_, p_, inv), qmax, sum_m, sum_pre, run, placed)
        r_lpt = np.array([r for r, _ in placed], dtype=np.int64)
        k_lpt = np.array([k for _, k in placed], dtype=np.int64)
    delays = queue_delays(
        prob, np.concatenate((r_on, r_lpt)), np.concatenate((k_on, k_lpt)), tp
    ).tolist()
    return max((r + d for r, d in zip(run, delays, strict=True)), default=0.0)


def _lpt_typed(
    prob: Problem,
    order: Sequence[int],
    typed: Sequence[tuple[int, list[tuple[float, int]]]],
    coeffs: tuple[Sequence[float], Sequence[float], Sequence[float], Sequence[float]],
    qmax: list[float],
    sum_m: list[int],
    sum_pre: list[int],
    run: list[float],
    placed: list[tuple[int, int]] | None = None,
) -> list[int]:
    """LPT of ``order`` where the candidates are the least-loaded instance of each TP
    degree: ``typed`` holds (KV capacity in tokens, heap of (run, instance)) per degree.
    Updates the per-instance totals and heaps in place, appends (request, instance) to
    ``placed`` when given, and returns the requests that fit nowhere."""
    q, mi, pre, ctx = prob.q, prob.mi, prob.pre, prob.ctx
    a_, c_, p_, inv = coeffs
    heapreplace = heapq.heapreplace
    left: list[int] = []
    for r in order:
        qr, mr, pr = q[r], mi[r], pre[r]
        need = ctx[r] + qr
        best_run = math.inf
        best_k = -1
        best_heap: list[tuple[float, int]] = []
        for cap, heap in typed:
            if need > cap or not heap:
                continue
            k = heap[0][1]
            qm = qmax[k] if qmax[k] > qr else qr
            # Placement._eval, inlined (this loop runs once per queued request)
            sm = sum_m[k] + mr
            sp = sum_pre[k] + pr
            if sm <= 0 and sp <= 0 and qm <= 0:
                value = 0.0
            else:
                m = sm / SCALE
                iters = m * inv[k]
                if qm > iters:
                    iters = qm
                value = a_[k] * iters + c_[k] * m + p_[k] * sp
            if value < best_run or (value == best_run and k < best_k):
                best_run, best_k, best_heap = value, k, heap
        if best_k < 0:
            left.append(r)
            continue
        k = best_k
        if qr > qmax[k]:
            qmax[k] = qr
        sum_m[k] += mr
        sum_pre[k] += pr
        run[k] = best_run
        heapreplace(best_heap, (best_run, k))
        if placed is not None:
            placed.append((r, k))
    return left


def place_on_node(
    pl: Placement, reqs: Sequence[int], pool: Sequence[int]
) -> tuple[list[tuple[int, int]], list[int]]:
    """LPT of ``reqs`` over the instances ``pool`` (no move cost), computed on local
    copies of the pool's totals; returns (request, instance) pairs and the misfits.
    (``solve`` places the requests of a node with one instance itself, at once.)"""
    prob = pl.prob
    qmax = {k: (pl.qs[k][-1] if pl.qs[k] else 0.0) for k in pool}
    sum_m = {k: pl.sum_m[k] for k in pool}
    sum_pre = {k: pl.sum_pre[k] for k in pool}
    run = {k: pl.run[k] for k in pool}
    out: list[tuple[int, int]] = []
    left: list[int] = []
    ids = {k: pl.inst[k].id for k in pool}
    for r in sorted(reqs, key=prob.rank.__getitem__):
        best: tuple[float, str, int] | None = None
        qr, mr, pr = prob.q[r], prob.mi[r], prob.pre[r]
        for k in pool:
            if not prob.feasible(r, pl.tp[k]):
                continue
            q = qmax[k] if qmax[k] > qr else qr
            key = (pl._eval(k, q, sum_m[k] + mr, sum_pre[k] + pr), ids[k], k)
            if best is None or key < best:
                best = key
        if best is None:
            left.append(r)
            continue
        run[best[2]], k = best[0], best[2]
        if qr > qmax[k]:
            qmax[k] = qr
        sum_m[k] += mr
        sum_pre[k] += pr
        out.append((r, k))
    return out, left


def _lpt_uniform(
    prob: Problem,
    order: Sequence[int],
    cap: int,
    coef: tuple[float, float, float, float],
    qmax: list[float],
    sum_m: list[int],
    sum_pre: list[int],
    run: list[float],
) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """LPT of ``order`` (already longest first) over instances of one TP degree (every
    instance ``0..n-1``, same coefficients ``a, c, p, 1/slots``), updating the totals in
    place; returns the (request, instance) assignment in LPT order and the requests no
    instance can hold.

    The same result as one heap step per request (each request to the instance with the
    smallest ``(run, index)``), computed in batches: with the instances sorted by
    ``(run, index)``, requests ``1..J`` go to instances ``1..J`` in that order exactly
    when each instance's run stays below every run updated before it in the batch, so
    each batch evaluates up to ``n`` requests with numpy and keeps its valid prefix
    (always at least one). A batch that keeps few falls back to the heap for a while.
    """
    q_all, mi_all, pre_all, ctx_all = prob.arrays
    a, c, p, inv = coef
    req = np.array(order, dtype=np.int64)
    fit = ctx_all[req] + q_all[req] <= cap
    left: list[int] = req[~fit].tolist()
    req = req[fit]
    n = len(run)
    qm_s = np.array(qmax, dtype=np.float64)
    sm_s = np.array(sum_m, dtype=np.int64)
    sp_s = np.array(sum_pre, dtype=np.int64)
    run_s = np.array(run, dtype=np.float64)
    out_r: list[np.ndarray] = []
    out_k: list[np.ndarray] = []
    pos = 0
    total = len(req)
    while pos < total:
        b = min(n, total - pos)
        ks = np.argsort(run_s, kind="stable")[:b]  # by (run, index): ties keep index order
        rs = req[pos : pos + b]
        qm = np.maximum(qm_s[ks], q_all[rs])
        sm = sm_s[ks] + mi_all[rs]
        sp = sp_s[ks] + pre_all[rs]
        m = sm / SCALE
        iters = np.maximum(m * inv, qm)
        value = a * iters + c * m
        value = value + p * sp
        value = np.where((sm <= 0) & (sp <= 0) & (qm <= 0), 0.0, value)
        if b > 1:
            # instance i of the batch is the next pick if its run is below every value
            # set before it (strictly: a tie would compare indices, so stop there)
            ok = run_s[ks[1:]] < np.minimum.accumulate(value)[:-1]
            j = b if ok.all() else 1 + int(np.argmin(ok))
        else:
            j = 1
        take = ks[:j]
        qm_s[take] = qm[:j]
        sm_s[take] = sm[:j]
        sp_s[take] = sp[:j]
        run_s[take] = value[:j]
        out_r.append(rs[:j])
        out_k.append(take)
        pos += j
        if j < 16 and pos < total:
            # the loads are close: a stretch of single heap steps, then batches again
            stop = min(total, pos + 4 * n)
            heap = sorted(zip(run_s.tolist(), range(n), strict=True))
            qm_l, sm_l, sp_l = qm_s.tolist(), sm_s.tolist(), sp_s.tolist()
            rs_l: list[int] = req[pos:stop].tolist()
            ks_l: list[int] = []
            q, mi, pre = prob.q, prob.mi, prob.pre
            heapreplace = heapq.heapreplace
            for r in rs_l:
                k = heap[0][1]
                qr = q[r]
                qmk = qm_l[k] if qm_l[k] > qr else qr
                smk = sm_l[k] + mi[r]
                spk = sp_l[k] + pre[r]
                if smk <= 0 and spk <= 0 and qmk <= 0:
                    v = 0.0
                else:
                    mm = smk / SCALE
                    it = mm * inv
                    if qmk > it:
                        it = qmk
                    v = a * it + c * mm + p * spk
                qm_l[k], sm_l[k], sp_l[k] = qmk, smk, spk
                heapreplace(heap, (v, k))
                ks_l.append(k)
            for v, k in heap:
                run_s[k] = v
            qm_s = np.array(qm_l, dtype=np.float64)
            sm_s = np.array(sm_l, dtype=np.int64)
            sp_s = np.array(sp_l, dtype=np.int64)
            out_r.append(req[pos:stop])
            out_k.append(np.array(ks_l, dtype=np.int64))
            pos = stop
    qmax[:] = qm_s.tolist()
    sum_m[:] = sm_s.tolist()
    sum_pre[:] = sp_s.tolist()
    run[:] = run_s.tolist()
    empty = np.zeros(0, dtype=np.int64)
    r_out = np.concatenate(out_r) if out_r else empty
    k_out = np.concatenate(out_k) if out_k else empty
    return r_out, k_out, left
