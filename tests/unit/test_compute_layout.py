"""Layout scoring: the fluid makespan estimate follows the instance model."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler.compute_problem import SCALE, Problem, build_problem
from scheduler.compute_state import ComputeState, NodeGpus, Request, canonical_instances
from scheduler.forecast import build_forecast
from scheduler.layout import (
    REPORTED,
    ProfileKey,
    _candidates,
    _fluid_makespan,
    _profile_key,
    _sorted_requests,
    choose_layout,
)
from scheduler.perf_model import H800, QWEN25_14B, PerfModel

pytestmark = pytest.mark.unit

PM = PerfModel(QWEN25_14B, H800)
RNG = random.Random(5)
HISTORY = [[min(16384, int(RNG.lognormvariate(7.6, 0.9))) for _ in range(512)] for _ in range(3)]


def problem(n_nodes: int, gens: list[int], prompts: list[int]) -> Problem:
    nodes = tuple(NodeGpus(f"n{i}", tuple(range(8))) for i in range(n_nodes))
    insts = [i for n in nodes for i in canonical_instances(n.name, n.gpus, (1,) * 8)]
    reqs = tuple(
        Request(f"r{i:04d}", p, g, insts[i % len(insts)].id, True)
        for i, (g, p) in enumerate(zip(gens, prompts, strict=True))
    )
    state = ComputeState(nodes, tuple(insts), reqs)
    fc = build_forecast(HISTORY, [], gens, max_tokens=16384)
    return build_problem(state, fc, PM)


def fluid_by_bisection(prob: Problem, counts: dict[int, int]) -> float:
    """The fluid relaxation solved the slow way: the longest requests one per instance
    (fastest instances first), the rest a divisible load; bisect on the common finish
    ``T`` of ``sum_i x_i(T) = 1``, each instance's time from the instance model itself."""
    order = list(prob.by_length)
    types = sorted(
        ((prob.costs[t], n) for t, n in counts.items() if n > 0),
        key=lambda x: (x[0].token_latency_s, -x[0].tp),
    )
    own: list[tuple[int, int]] = []  # (tp, request)
    for cost, n in types:
        for _ in range(n):
            if len(own) < len(order):
                own.append((cost.tp, order[len(own)]))
    tail = max(prob.costs[t].run(prob.q[r], prob.m[r], prob.pre[r]) for t, r in own)
    bulk = order[len(own) :]
    if not bulk:
        return tail
    wm = sum(prob.mi[r] for r in bulk) / SCALE
    wp = sum(prob.pre[r] for r in bulk)

    def time(t: int, r: int, x: float) -> float:
        return prob.costs[t].run(prob.q[r], prob.m[r] + x * wm, prob.pre[r] + x * wp)

    def share(t: int, r: int, finish: float) -> float:
        if time(t, r, 0.0) >= finish:
            return 0.0
        lo, hi = 0.0, 1.0
        while time(t, r, hi) < finish:
            hi *= 2
        for _ in range(60):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if time(t, r, mid) < finish else (lo, mid)
        return lo

    lo, hi = 0.0, max(time(t, r, 1.0) for t, r in own)
    for _ in range(60):
        mid = (lo + hi) / 2
        if sum(share(t, r, mid) for t, r in own) < 1.0:
            lo = mid
        else:
            hi = mid
    return max(tail, hi)


def test_one_instance_runs_exactly_the_instance_model() -> None:
    """With one instance the fluid estimate is that instance running every request: its
    critical path and the bulk's iterations overlap (the larger counts, not the sum)."""
    rng = random.Random(3)
    for gens in (
        [0] + [rng.randint(14000, 16000) for _ in range(40)],  # one long request dominates
        [rng.randint(0, 3000) for _ in range(600)],  # iteration-bound: the batch is wide
    ):
        prob = problem(1, gens, [rng.randint(200, 1500) for _ in gens])
        everyone = range(len(gens))
        expected = prob.run(8, everyone)
        srt = _sorted_requests(prob, list(everyone))
        for closed_form in (True, False):
            got = _fluid_makespan(prob, {8: 1}, srt, closed_form=closed_form)
            assert got == pytest.approx(expected, rel=1e-9)


@settings(max_examples=25)
@given(
    n_req=st.integers(1, 120),
    counts=st.dictionaries(st.sampled_from([1, 2, 4, 8]), st.integers(0, 6), min_size=1),
    seed=st.integers(0, 10_000),
)
def test_fluid_estimate_solves_the_divisible_load_exactly(
    n_req: int, counts: dict[int, int], seed: int
) -> None:
    rng = random.Random(seed)
    gens = [rng.choice([0, rng.randint(0, 16000)]) for _ in range(n_req)]
    prob = problem(2, gens, [rng.randint(100, 4000) for _ in range(n_req)])
    if sum(counts.values()) == 0:
        return
    srt = _sorted_requests(prob, list(range(n_req)))
    want = fluid_by_bisection(prob, counts)
    for closed_form in (True, False):  # the closed form when it holds, and the sweep
        got = _fluid_makespan(prob, counts, srt, closed_form=closed_form)
        assert math.isfinite(got)
        assert got == pytest.approx(want, rel=1e-6, abs=1e-6)


def test_mixed_layouts_take_the_closed_form_only_when_it_is_exact() -> None:
    """Mid-step requests on mixed layouts: some blocks of slow instances take no share
    of the bulk, some instances are iteration-bound; whichever path the estimate takes
    (closed form or sweep), it is the divisible-load solution."""
    for seed in range(8):
        rng = random.Random(seed)
        n_req = rng.randint(20, 200)
        gens = [min(16000, int(rng.lognormvariate(6.8, 1.2))) for _ in range(n_req)]
        prob = problem(2, gens, [rng.randint(100, 4000) for _ in range(n_req)])
        srt = _sorted_requests(prob, list(range(n_req)))
        for counts in ({1: 16}, {8: 2}, {1: 8, 8: 1}, {2: 4, 4: 2}, {1: 4, 2: 2, 4: 1, 8: 1}):
            want = fluid_by_bisection(prob, counts)
            assert _fluid_makespan(prob, counts, srt) == pytest.approx(want, rel=1e-6, abs=1e-6)


@given(
    n_req=st.integers(1, 80),
    seed=st.integers(0, 10_000),
    bounds=st.lists(st.tuples(st.integers(0, 79), st.integers(1, 80)), min_size=1, max_size=8),
)
def test_own_max_is_the_range_maximum(n_req: int, seed: int, bounds: list[tuple[int, int]]) -> None:
    rng = random.Random(seed)
    gens = [rng.randint(0, 16000) for _ in range(n_req)]
    prob = problem(1, gens, [rng.randint(100, 4000) for _ in range(n_req)])
    srt = _sorted_requests(prob, list(range(n_req)))
    for cost in prob.costs.values():
        own = srt.own_all(cost)
        for a, b in bounds:
            lo = a % n_req
            hi = lo + 1 + b % (n_req - lo)
            assert srt.own_max(cost, lo, hi) == float(own[lo:hi].max())


def test_pruned_scoring_reports_the_same_best_candidates_as_scoring_every_one() -> None:
    """Candidates whose lower bound (longest request on their fastest instances, plus
    switching) cannot reach the reported few are skipped: the reported ones, in order,
    are those of scoring every candidate."""
    for seed in range(6):
        rng = random.Random(seed)
        n_req = rng.randint(300, 900)
        gens = [min(16000, int(rng.lognormvariate(6.8, 1.2))) for _ in range(n_req)]
        prob = problem(rng.randint(16, 40), gens, [rng.randint(100, 4000) for _ in range(n_req)])
        reqs = list(range(n_req))
        _, choices, _ = choose_layout(prob, reqs)
        srt = _sorted_requests(prob, reqs)
        cur = choices_key(prob)
        every = sorted(
            (c.switching_s + _fluid_makespan(prob, c.counts, srt), c.key != cur)
            for c in _candidates(prob, cur)
        )
        got = [(c.score, not c.is_current) for c in choices[:REPORTED]]
        assert got == every[:REPORTED]
        assert any(c.is_current for c in choices)
        assert len(choices) < len(every)  # it did skip some


def choices_key(prob: Problem) -> ProfileKey:
    from collections import Counter

    return _profile_key({8: Counter(prob.current_pattern.values())})


def fresh_problem(n_nodes: int, n_req: int, pattern: tuple[int, ...], seed: int = 0) -> Problem:
    """``n_req`` requests just arrived (queued, no KV), on nodes of ``pattern``."""
    rng = random.Random(seed)
    nodes = tuple(NodeGpus(f"n{i}", tuple(range(8))) for i in range(n_nodes))
    insts = [i for n in nodes for i in canonical_instances(n.name, n.gpus, pattern)]
    reqs = tuple(Request(f"r{i:04d}", rng.randint(200, 1500)) for i in range(n_req))
    state = ComputeState(nodes, tuple(insts), reqs)
    return build_problem(state, build_forecast(HISTORY, [], [0] * n_req, max_tokens=16384), PM)


def test_a_queue_first_come_first_served_delays_the_longest_waiting_request() -> None:
    """One TP8 instance, fresh requests: within its seats every request starts at once
    and the estimate is the instance model's; beyond them the step's longest request,
    at its place ``late_place`` in the queue, starts once the requests ahead of it have
    freed a seat, ``max(0, place * n - slots) / n * W / slots`` iterations in."""
    for n_req in (100, 250, 600, 1500):
        prob = fresh_problem(1, n_req, (8,), seed=n_req)
        cost = prob.costs[8]
        everyone = range(n_req)
        srt = _sorted_requests(prob, list(everyone))
        model = prob.run(8, everyone)
        got = _fluid_makespan(prob, {8: 1}, srt)
        work = sum(prob.m) / cost.slots
        q = max(prob.q)
        delay = max(0.0, prob.late_place * n_req - cost.slots) / n_req * work
        want = model + cost.iteration_s * max(0.0, q + delay - max(q, work))
        assert got == pytest.approx(want, rel=1e-9), n_req
        if n_req <= cost.slots:
            assert got == pytest.approx(model, rel=1e-9)
        elif delay > 0:
            assert got > model


def test_the_queue_delay_favours_more_instances_for_a_long_queue() -> None:
    """1,024 fresh requests on 2 nodes: TP8 queues 512 per instance for its seats, TP4
    256 (within its seats: no delay). Holding KV (running),
    the same requests start at once and the estimate is the divisible load's."""
    prob = fresh_problem(2, 1024, (8,))
    srt = _sorted_requests(prob, list(range(1024)))
    assert prob.late_place > 0.5  # several requests may reach the cap: the last of them
    assert prob.costs[4].slots == 256 < 512 <= prob.costs[8].slots * 2
    tp8 = _fluid_makespan(prob, {8: 2}, srt) - fluid_by_bisection(prob, {8: 2})
    tp4 = _fluid_makespan(prob, {4: 4}, srt) - fluid_by_bisection(prob, {4: 4})
    assert tp8 > 10.0  # seconds
    assert tp4 == pytest.approx(0.0, abs=1e-6)
    running = problem(2, [0] * 1024, [700] * 1024)
    srt = _sorted_requests(running, list(range(1024)))
    for counts in ({8: 2}, {4: 4}):
        want = fluid_by_bisection(running, counts)
        assert _fluid_makespan(running, counts, srt) == pytest.approx(want, rel=1e-6)
