"""The compute planner's problem: configuration, the instance model, the inputs.

Built once per plan from the state, the forecast and the performance model; read by the
heuristic (:mod:`scheduler.compute`) and the exact MILP (:mod:`scheduler.milp`), so
both optimise the same model.

Instance model (linear, so the MILP can share it). An instance of TP ``t`` running
request set ``R`` finishes after::

    run = a_t * max(max_r q_r, sum_r m_r / slots_t) + c_t * sum_r m_r + p_t * sum_r pre_r

``q_r``: the request's critical path, the ``N/(N+1)`` quantile of its remaining tokens
(``N``: the requests of the step still to finish; never below ``tail_quantile`` nor the
mean), see :func:`critical_level`; ``m_r``: its expected remaining tokens (the work);
``pre_r``: tokens to prefill (a request without KV cache). ``a_t + c_t * b`` is a
least-squares line through the performance model's decode iteration time for batches
``1..slots_t`` at the context the step's remaining tokens are decoded at, averaged over
tokens (long responses hold most tokens, so under a long tail this is about twice the
average over requests: :func:`scheduler.forecast.remaining_square_groups`; at the
average over requests the model ran 1.14-1.38x faster than the simulator's static
layouts, now 1.00-1.11x), and ``slots_t`` is how many sequences the
instance's KV cache holds at the step's mean final context (capped by the engine's
``max_num_seqs``): continuous batching runs ``max(longest, work / slots)`` iterations and
each sequence-iteration costs ``c_t``.

The model has every request of an instance start at once. Engines admit a queue longer
than their seats first come, first served, so layout scoring for large cases and the
plan's predicted times add the delay of an instance's longest waiting request
(:func:`fcfs_late`, with ``Problem.late_place``); placement and balancing, which move
requests between instances, use the model as it is.
"""

from __future__ import annotations

import functools
import math
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from operator import attrgetter

import numpy as np

from orchestrrl import errors
from scheduler.compute_state import (
    ComputeState,
    Instance,
    MoveMethod,
    StepGoal,
    canonical_instances,
)
from scheduler.forecast import (
    LengthForecast,
    finish_probability_groups,
    predict_remaining_groups,
    reach_probability_groups,
    remaining_square_groups,
    truncated_remaining_groups,
)
from scheduler.perf_model import PerfModel

Pattern = tuple[int, ...]  # TP degrees of a node's instances, descending
MoveCost = Callable[[int, int], float]  # (request, instance index) -> seconds


@dataclass(frozen=True)
class PlannerConfig:
    """Knobs of the compute planner (defaults are stated, not tuned)."""

    # the lowest quantile of a request's remaining tokens taken as its critical path; the
    # level actually used grows with the requests left in the step (critical_level)
    tail_quantile: float = 0.5
    # switch layouts only when the gain beats the cost by max(margin_s, margin_rel * keep);
    # the relative part only while some request holds KV (see layout.choose_layout)
    switch_margin_s: float = 0.5
    switch_margin_rel: float = 0.05
    # move a request only when the bottleneck's finish improves by more than its cost + this
    move_margin_s: float = 0.05
    # vLLM's default cap on concurrently running sequences (EngineArgs.max_num_seqs)
    max_num_seqs: int = 256
    allowed_tp: tuple[int, ...] | None = None  # None: powers of two up to the node size
    exact_eval_limit: int = 1024  # requests x GPUs up to which layouts are scored exactly
    enumerate_limit: int = 200  # profiles enumerated exhaustively up to this count
    candidate_k: int = 2  # balancing looks at this many least-loaded instances per TP
    candidate_requests: int = 4  # ... and moves one of the 4 longest or 4 smallest requests
    all_candidates_limit: int = 64  # ... or at every instance when there are this few
    # ... and when both the requests x instances (the moves balancing looks at) and the
    # requests x requests per instance (the exchanges of two requests it also tries) are at
    # most this: without the bound, 57 instances with 1500 requests took 94 s to plan
    all_candidates_work: int = 4096
    max_moves: int = 1_000_000
    # partial rollout (scheduler.rollout): the step's tail is carried into the next step
    # rather than waited for. No group is admitted ahead of its turn for being predicted
    # long (it would be carried anyway), requests without KV are dispatched in arrival
    # order to the shortest line rather than longest first (groups complete in arrival
    # order; Placement.place_in_line), no request is moved off a straggler (the step does
    # not wait for its last instance), and a layout change must beat the relative
    # switching margin whatever holds KV (scheduler.layout). What ends the step is the
    # plan's StepGoal (build_problem: work and critical paths cut where it is met; layouts
    # only at the step's start, compute.layout_frozen); without one a request's critical
    # path is its expected remaining tokens
    carry_tail: bool = False

    def __post_init__(self) -> None:
        if not 0.0 < self.tail_quantile < 1.0:
            raise errors.field_error("tail_quantile", self.tail_quantile, "a fraction in (0, 1)")
        for name in ("switch_margin_s", "switch_margin_rel", "move_margin_s"):
            if getattr(self, name) < 0:
                raise errors.field_error(name, getattr(self, name), "a number >= 0")
        if self.max_num_seqs < 1:
            raise errors.field_error("max_num_seqs", self.max_num_seqs, ">= 1")


DEFAULT_CONFIG = PlannerConfig()


def critical_level(requests: int, floor: float) -> float:
    """The quantile of a request's remaining tokens that the planner takes as its
    critical path when ``requests`` requests of the step are still to finish.

    A step ends with its longest response. The largest of ``N`` lengths drawn from one
    distribution sits, in expectation, at its ``N/(N+1)`` quantile (``E[F(X_(N))] =
    N/(N+1)``, Weibull's plotting position; Gumbel, *Statistics of Extremes*, 1958,
    section 2.1), so a request's critical path is that quantile of its remaining length.
    Taking each request's median instead makes the predicted step the median request's:
    under a long, capped tail it was a quarter of the real step, and layouts were chosen
    for a bulk that is not what decides the step. Every instance is scored as if it may
    hold the step's longest request: before lengths are known, any instance may.
    """
    if requests < 1:
        return floor
    level = requests / (requests + 1.0)
    return level if level > floor else floor


# tiny floor so float noise can never flip a decision on re-plan
EPS = 1e-9
# expected remaining tokens are kept as integers in units of 1/SCALE token, so that an
# instance's total is exact whatever order requests arrived in (re-plans see the same)
SCALE = 1024


@dataclass(frozen=True)
class TpCost:
    """The linear instance model for one TP degree (see module docstring)."""

    tp: int
    iteration_s: float  # a_t
    per_sequence_s: float  # c_t
    prefill_per_token_s: float  # p_t
    slots: int
    capacity_tokens: int

    def run(self, max_q: float, sum_m: float, sum_pre: float) -> float:
        if sum_m <= 0 and sum_pre <= 0 and max_q <= 0:
            return 0.0
        iters = max(max_q, sum_m / self.slots)
        return (
            self.iteration_s * iters
            + self.per_sequence_s * sum_m
            + self.prefill_per_token_s * sum_pre
        )

    @property
    def token_latency_s(self) -> float:
        return self.iteration_s + self.per_sequence_s


def tp_costs(
    perf: PerfModel,
    tps: Iterable[int],
    token_context: float,
    mean_context: float,
    mean_final_context: float,
    max_num_seqs: int,
) -> dict[int, TpCost]:
    out: dict[int, TpCost] = {}
    for t in sorted(set(tps)):
        cap = perf.kv_capacity_tokens(t)
        # the planner's cap and the model's per-TP engine cap (Efficiency.max_num_seqs)
        seqs = min(max_num_seqs, perf.max_num_seqs(t))
        slots = max(1, min(seqs, int(cap / max(1.0, mean_final_context))))
        grid = sorted({1, 2, *(2**k for k in range(1, 20) if 2**k < slots), slots})
        ys = [perf.decode_iteration_time(t, b, token_context) for b in grid]
        n = len(grid)
        mx = sum(grid) / n
        my = sum(ys) / n
        var = sum((b - mx) ** 2 for b in grid)
        slope = sum((b - mx) * (y - my) for b, y in zip(grid, ys, strict=True)) / var
        slope = max(0.0, slope)
        intercept = max(0.0, my - slope * mx)
        chunk = 2048
        p = perf.prefill_time(t, chunk, int(mean_context)) / chunk
        out[t] = TpCost(t, intercept, slope, p, slots, cap)
    return out


def expand(pattern: Sequence[int]) -> tuple[int, ...]:
    """Per-GPU TP degrees of a pattern: (4, 2, 2) -> (4, 4, 4, 4, 2, 2, 2, 2)."""
    return tuple(t for t in pattern for _ in range(t))


def pattern_label(p: Pattern) -> str:
    c = Counter(p)
    return "+".join(f"{n}xTP{t}" if n > 1 else f"TP{t}" for t, n in sorted(c.items(), reverse=True))


# --------------------------------------------------------------------------------------
# The problem: everything both solvers (heuristic and MILP) need, from the state
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Problem:
    state: ComputeState
    perf: PerfModel
    config: PlannerConfig
    rids: tuple[str, ...]
    ctx: tuple[int, ...]
    has_kv: tuple[bool, ...]
    q: tuple[float, ...]
    m: tuple[float, ...]  # == mi / SCALE
    mi: tuple[int, ...]  # expected remaining tokens in 1/SCALE units (exact integer sums)
    pre: tuple[int, ...]
    current: tuple[str | None, ...]  # instance id per request
    rank: tuple[int, ...]  # position in the order (longest q, then m, then id) first
    by_length: tuple[int, ...]  # requests in that order
    costs: Mapping[int, TpCost]
    nodes: tuple[str, ...]
    node_gpus: Mapping[str, tuple[int, ...]]
    current_pattern: Mapping[str, Pattern]
    options: Mapping[str, tuple[Pattern, ...]]  # layouts a node may take (current first)
    instances: Mapping[str, Instance]  # current instances by id, in the order of their ids
    by_node: Mapping[str, tuple[Instance, ...]]  # current instances per node, sorted
    # KV bytes/token, KV heads, NVLink latency and B/s per GPU pair, network latency and B/s
    # per NIC (see PerfModel.kv_move_time)
    links: tuple[float, int, float, float, float, float]
    # nodes whose engines cannot take a moved KV cache: moves to them recompute it
    recompute_only: frozenset[str] = frozenset()
    # q, mi, pre and ctx as numpy arrays (float64, then int64), for the vectorised passes
    arrays: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] = field(
        default=(
            np.zeros(0),
            np.zeros(0, np.int64),
            np.zeros(0, np.int64),
            np.zeros(0, np.int64),
        ),
        compare=False,
        repr=False,
    )
    # per request, its current instance's position in ``instances`` (len(instances):
    # none, queued), its ``rank`` and ``has_kv``, as numpy arrays
    current_index: np.ndarray = field(
        default_factory=lambda: np.zeros(0, np.int64), compare=False, repr=False
    )
    rank_array: np.ndarray = field(
        default_factory=lambda: np.zeros(0, np.int64), compare=False, repr=False
    )
    kv_array: np.ndarray = field(
        default_factory=lambda: np.zeros(0, np.bool_), compare=False, repr=False
    )
    # per request, whether its sample group is predicted longer than the pooled forecast
    # (its finished or long-running siblings say so): such requests are admitted first
    long_group_array: np.ndarray = field(
        default_factory=lambda: np.zeros(0, np.bool_), compare=False, repr=False
    )
    # where, as a fraction of an instance's waiting requests, the one that decides its
    # finish waits in line: the expected last of the K waiting requests that may reach
    # their critical path, K / (K + 1) (see layout._fcfs_finish)
    late_place: float = 0.5
    # partial rollout (a StepGoal): decode iterations from now until the step's goal is
    # met (inf: every request must finish), and the seconds before the step may end
    # per request, its position in ``state.requests`` (the order requests arrived in)
    arrival: tuple[int, ...] = ()
    horizon_tokens: float = math.inf
    floor_s: float = 0.0
    # node_cost per (old, new) pattern pair, filled on use (a plan asks for few pairs, often)
    pauses: dict[tuple[Pattern, Pattern], float] = field(
        default_factory=dict, compare=False, repr=False
    )
    # per node, the pause its last reshard took as its agent measured it (nodes measured
    # so far only): see node_pause_at
    measured_pause: Mapping[str, float] = field(default_factory=dict)

    def feasible(self, r: int, tp: int) -> bool:
        cost = self.costs.get(tp)
        return cost is not None and self.ctx[r] + self.q[r] <= cost.capacity_tokens

    def node_cost(self, old: Pattern, new: Pattern) -> float:
        memo = self.pauses
        hit = memo.get((old, new))
        if hit is None:
            a, b = tuple(sorted(old)), tuple(sorted(new))
            hit = memo[(old, new)] = 0.0 if a == b else node_pause(self.perf, a, b)
        return hit

    def node_pause_at(self, node: str, old: Pattern, new: Pattern) -> float:
        """The pause of ``node`` going from ``old`` to ``new``: the model's estimate
        (:meth:`node_cost`), or the node's measured pause when that is longer."""
        cost = self.node_cost(old, new)
        if sorted(old) == sorted(new):
            return cost
        measured = self.measured_pause.get(node, 0.0)
        return measured if measured > cost else cost

    def instances_for(self, node: str, pattern: Pattern) -> tuple[Instance, ...]:
        """Current instances when the pattern is kept, canonical ones otherwise."""
        current = self.current_pattern[node]
        if pattern == current or sorted(pattern) == sorted(current):
            return self.by_node[node]
        return canonical_instances(node, self.node_gpus[node], pattern)

    def move(self, r: int, dst: Instance, node_changes: bool) -> tuple[float, MoveMethod]:
        """Cost of request ``r`` ending on ``dst``, from where it is in the state.

        ``node_changes``: whether the request's current node reshards (its KV is then
        re-laid out inside the node during the pause, at no extra cost).
        """
        src_id = self.current[r]
        if src_id is None or not self.has_kv[r]:
            return 0.0, MoveMethod.DISPATCH
        if src_id == dst.id and not node_changes:
            return 0.0, MoveMethod.DISPATCH
        src = self.instances[src_id]
        return self.move_between(r, src.node, src.tp, dst, node_changes)

    def move_between(
        self, r: int, src_node: str, src_tp: int, dst: Instance, src_node_changes: bool
    ) -> tuple[float, MoveMethod]:
        if not self.has_kv[r]:
            return 0.0, MoveMethod.DISPATCH
        same_node = src_node == dst.node
        if dst.node in self.recompute_only:
            # its engine rebuilds the KV cache of whatever arrives, by prefill; across the
            # node's own reshard the request stays and is recomputed there
            cost = self.costs.get(len(dst.gpus))
            rec = cost.prefill_per_token_s * self.ctx[r] if cost is not None else math.inf
            if same_node and src_node_changes:
                return rec, MoveMethod.RELAYOUT
            return rec, MoveMethod.RECOMPUTE
        if same_node and src_node_changes:
            return 0.0, MoveMethod.RELAYOUT
        # PerfModel.kv_move_time, with its constants hoisted (this runs per candidate move)
        kv_bytes, kv_heads, nvl_lat, nvl_bw, net_lat, net_bw = self.links
        dst_tp = len(dst.gpus)
        streams = min(src_tp, dst_tp, kv_heads)
        if streams < 1:
            streams = 1
        nbytes = self.ctx[r] * kv_bytes
        if nbytes <= 0:
            kv = 0.0
        elif same_node:
            kv = nvl_lat + nbytes / (streams * nvl_bw)
        else:
            kv = net_lat + nbytes / (streams * net_bw)
        cost = self.costs.get(dst_tp)
        rec = cost.prefill_per_token_s * self.ctx[r] if cost is not None else math.inf
        if rec < kv:
            return rec, MoveMethod.RECOMPUTE
        return kv, (MoveMethod.KV_NVLINK if same_node else MoveMethod.KV_NETWORK)

    def run(self, tp: int, members: Iterable[int]) -> float:
        ms = list(members)
        if not ms:
            return 0.0
        return self.costs[tp].run(
            max(self.q[r] for r in ms),
            sum(self.mi[r] for r in ms) / SCALE,
            sum(self.pre[r] for r in ms),
        )


def fcfs_late(
    n: np.ndarray,
    ranked: np.ndarray,
    q: np.ndarray,
    q_wait: np.ndarray,
    work: np.ndarray,
    slots: np.ndarray | float,
    place: float,
) -> np.ndarray:
    """Iterations by which instances end past the instance model's ``max(q, work /
    slots)`` because their queue is first come, first served (0 or less: none).

    An instance with ``n`` requests (``ranked`` of them start ahead: they hold KV, or
    the plan admits them first), ``work`` expected tokens and ``slots`` seats keeps its
    batch full until its queue drains, so the ``k``-th in line starts after about
    ``max(0, k - slots) / n * work / slots`` iterations. Its longest waiting request
    (critical path ``q_wait``; 0: none waits) is taken at place ``k = ranked + place *
    (n - ranked)``, ``place`` being ``Problem.late_place``, and ends ``q_wait`` later.
    """
    past = np.maximum(0.0, ranked + place * (n - ranked) - slots)
    delay = np.where(q_wait > 0, past / np.maximum(n, 1.0) * work / slots, 0.0)
    late: np.ndarray = q_wait + delay - np.maximum(q, work / slots)
    return late


def queue_delays(prob: Problem, r_a: np.ndarray, k_a: np.ndarray, tps: Sequence[int]) -> np.ndarray:
    """Per instance (``tps``: their TP degrees), the seconds :func:`fcfs_late` adds to
    its run when it holds requests ``r_a[i]`` on instances ``k_a[i]``."""
    n_inst = len(tps)
    q_all, mi_all, _, _ = prob.arrays
    starts = (prob.kv_array | prob.long_group_array)[r_a]
    q_r = q_all[r_a]
    n = np.bincount(k_a, minlength=n_inst).astype(np.float64)
    ranked = np.bincount(k_a, weights=starts.astype(np.float64), minlength=n_inst)
    work = np.bincount(k_a, weights=mi_all[r_a].astype(np.float64), minlength=n_inst) / SCALE
    q = np.zeros(n_inst)
    np.maximum.at(q, k_a, q_r)
    q_wait = np.zeros(n_inst)
    np.maximum.at(q_wait, k_a[~starts], q_r[~starts])
    costs = [prob.costs[t] for t in tps]
    a = np.array([c.iteration_s for c in costs])
    slots = np.array([c.slots for c in costs], dtype=np.float64)
    late = fcfs_late(n, ranked, q, q_wait, work, slots, prob.late_place)
    delays: np.ndarray = a * np.maximum(0.0, late)
    return delays


@functools.lru_cache(maxsize=4096)  # a pure value, asked for again at every re-plan
def node_pause(perf: PerfModel, old: Pattern, new: Pattern) -> float:
    return perf.reshard_time(expand(old), expand(new))


def _links(perf: PerfModel) -> tuple[float, int, float, float, float, float]:
    e, h = perf.efficiency, perf.hardware
    return (
        perf.kv_bytes_per_token(),
        perf.model.kv_heads,
        e.allreduce_base_s,
        h.nvlink_bandwidth * e.link_efficiency,
        e.network_latency_s,
        h.nic_bandwidth * e.network_efficiency,
    )


def _group_by_node(
    instances: Iterable[Instance], nodes: Iterable[str]
) -> tuple[dict[str, tuple[Instance, ...]], dict[str, Pattern]]:
    """Per node its instances sorted by id, and its pattern (TP degrees, descending: the
    same as ``ComputeState.layout``), in one pass over the instances."""
    out: dict[str, list[Instance]] = {n: [] for n in nodes}
    for inst in instances:
        out[inst.node].append(inst)
    by_id = attrgetter("id")
    by_node = {n: tuple(sorted(v, key=by_id)) for n, v in out.items()}
    pattern = {n: tuple(sorted((len(i.gpus) for i in v), reverse=True)) for n, v in out.items()}
    return by_node, pattern


def allowed_tps(perf: PerfModel, gpus: int, config: PlannerConfig) -> tuple[int, ...]:
    cands = config.allowed_tp or tuple(2**k for k in range(0, 12) if 2**k <= gpus)
    heads = perf.model.heads
    return tuple(
        t
        for t in sorted(set(cands))
        if t <= gpus and gpus % t == 0 and heads % t == 0 and perf.fits(t)
    )


def goal_tokens(
    forecast: LengthForecast,
    generated: Sequence[int],
    groups: Sequence[str | None],
    goal: StepGoal,
) -> float:
    """Decode iterations from now until the step's ``goal`` is met in expectation, every
    request decoding one token per iteration from now (inf: the goal waits for every
    request, or the requests in flight cannot meet it).

    ``end = groups``: the least ``w`` at which the expected number of complete groups,
    ``sum_g prod_(r in g) P(R_r <= w)`` over the groups in flight (a request without a
    group is one), reaches ``goal.groups``; ``end = tokens``: the least ``w`` at which
    the expected tokens decoded, ``sum_r E[min(R_r, w)]``, reach ``goal.tokens``. Both
    are non-decreasing in ``w``: bisection to one token."""
    n = len(generated)
    if goal.groups is None and goal.tokens is None:
        return math.inf
    need = goal.groups if goal.groups is not None else goal.tokens
    assert need is not None
    if need <= 0:
        return 0.0
    if n == 0:
        return math.inf
    codes: dict[str, int] = {}
    group_code = np.array(
        [codes.setdefault(g, len(codes)) if g is not None else -1 for g in groups],
        dtype=np.int64,
    )
    alone = group_code < 0
    group_code[alone] = len(codes) + np.arange(int(alone.sum()))
    n_groups = len(codes) + int(alone.sum())

    def reached(w: float) -> bool:
        if goal.groups is not None:
            p = finish_probability_groups(forecast, generated, groups, w)
            with np.errstate(divide="ignore"):
                log_p = np.log(np.clip(p, 0.0, 1.0))
            done = np.exp(np.bincount(group_code, weights=log_p, minlength=n_groups))
            return float(done.sum()) >= need - 1e-9
        mean, _ = truncated_remaining_groups(forecast, generated, groups, w)
        return float(mean.sum()) >= need - 1e-9

    if goal.groups is not None and need > n_groups:
        return math.inf
    cap = forecast.max_tokens
    hi = float(cap) if cap is not None else max(1.0, forecast.mean_length())
    for _ in range(64):
        if reached(hi):
            break
        if cap is not None:
            return math.inf  # at the cap every request is done: the goal is out of reach
        hi *= 2.0
    else:
        return math.inf
    lo = 0.0
    while hi - lo > 1.0:
        mid = math.floor((lo + hi) / 2.0)
        if reached(mid):
            hi = mid
        else:
            lo = mid
    return hi


def build_problem(
    state: ComputeState,
    forecast: LengthForecast,
    perf: PerfModel,
    config: PlannerConfig = PlannerConfig(),
    goal: StepGoal | None = None,
) -> Problem:
    """The problem of one plan. ``goal`` (partial rollout): the step ends when it is met,
    not when its last request does (:func:`goal_tokens`): each request's work is what it
    decodes until then, ``E[min(R, w)]``, and its critical path at most ``w``; layouts are
    scored no lower than ``goal.floor_s``, before which the step cannot end anyway."""
    reqs = sorted(state.requests, key=attrgetter("id"))
    arrival = {r.id: i for i, r in enumerate(state.requests)}
    n_req = len(reqs)
    gens = list(map(attrgetter("generated_tokens"), reqs))
    instance_of = tuple(map(attrgetter("instance"), reqs))
    groups = list(map(attrgetter("group"), reqs))
    scales = forecast.group_log_scale
    long_group = np.array(
        [scales.get(g, 0.0) > 0.0 if g is not None else False for g in groups]
        if scales and not config.carry_tail
        else np.zeros(n_req, np.bool_),
        dtype=np.bool_,
    )
    means, quants = predict_remaining_groups(
        forecast, gens, groups, critical_level(n_req, config.tail_quantile)
    )
    horizon = math.inf if goal is None else goal_tokens(forecast, gens, groups, goal)
    truncated_square: np.ndarray | None = None
    if math.isfinite(horizon):
        within, truncated_square = truncated_remaining_groups(forecast, gens, groups, horizon)
        means = np.minimum(means, within)
    # per-request arrays in numpy (the same float operations as the scalar forms noted)
    prompt = np.array(list(map(attrgetter("prompt_tokens"), reqs)), dtype=np.int64)
    ctx_a = prompt + np.array(gens, dtype=np.int64)
    running = np.array(list(map(attrgetter("running"), reqs)), dtype=np.bool_)
    # per request its current instance's position among the instances by id (n: none)
    instances = {i.id: i for i in sorted(state.instances, key=attrgetter("id"))}
    n_inst = len(instances)
    position: dict[str | None, int] = {iid: k for k, iid in enumerate(instances)}
    get = position.get
    current_index = np.array([get(i, n_inst) for i in instance_of], dtype=np.int64)
    kv_a = running & (current_index < n_inst)
    # int(x * SCALE + 0.5) for x >= 0 (means are never negative)
    mi_a = np.floor(means * SCALE + 0.5).astype(np.int64)
    m_a = mi_a / SCALE
    if goal is not None:
        # the request that ends the step may sit on any instance: its critical path is
        # the full rollout's, cut where the goal is met
        q_a = np.minimum(np.maximum(quants, m_a), np.maximum(horizon, m_a))
    else:
        q_a = m_a if config.carry_tail else np.maximum(quants, m_a)  # q if q > m else m
    ctx = tuple(ctx_a.tolist())
    has_kv = tuple(kv_a.tolist())
    pre_a = np.where(kv_a, 0, ctx_a)
    pre = tuple(pre_a.tolist())
    mi = tuple(mi_a.tolist())
    m = tuple(m_a.tolist())
    q = tuple(q_a.tolist())
    # waiting requests start in arrival order (only ranked ones go first, see compute.py)
    waiting = np.flatnonzero(~kv_a & ~long_group).tolist()
    critical = float(
        reach_probability_groups(
            forecast, [gens[i] for i in waiting], [groups[i] for i in waiting], q_a[waiting]
        ).sum()
    )

    nodes = tuple(sorted(n.name for n in state.nodes))
    node_gpus = {n.name: tuple(sorted(n.gpus)) for n in state.nodes}
    by_node, current_pattern = _group_by_node(state.instances, nodes)
    tps: set[int] = {t for p in current_pattern.values() for t in p}
    options: dict[str, tuple[Pattern, ...]] = {}
    by_size: dict[int, set[Pattern]] = {}
    for n in nodes:
        by_size.setdefault(len(node_gpus[n]), set()).add(current_pattern[n])
    allowed = {g: allowed_tps(perf, g, config) for g in by_size}
    # a node's options depend only on its size and current pattern: built once per pair
    seen_options: dict[tuple[int, Pattern], tuple[Pattern, ...]] = {}
    for n in nodes:
        g = len(node_gpus[n])
        key = (g, current_pattern[n])
        opts = seen_options.get(key)
        if opts is None:
            uniform = [tuple([t] * (g // t)) for t in allowed[g]]
            extra = sorted(by_size[g], reverse=True)
            pats: list[Pattern] = [current_pattern[n]]
            for p in [*uniform, *extra]:
                if p not in pats:
                    pats.append(p)
            opts = tuple(pats)
            seen_options[key] = opts
            tps.update(t for p in pats for t in p)
        options[n] = opts

    if reqs:
        total_ctx = math.fsum(ctx)
        total_m = math.fsum(m)
        mean_ctx = (total_ctx + total_m / 2.0) / len(reqs)
        mean_final = (total_ctx + total_m) / len(reqs)
        # the context the tokens still to come are decoded at, on average over tokens
        square = (
            truncated_square
            if truncated_square is not None
            else remaining_square_groups(forecast, gens, groups)
        )
        token_ctx = (
            float((ctx_a * m_a).sum() + square.sum() / 2.0) / total_m if total_m > 0 else mean_ctx
        )
    else:
        mean_ctx = mean_final = token_ctx = 1.0
    costs = tp_costs(perf, tps, token_ctx, mean_ctx, mean_final, config.max_num_seqs)
    # the order (-q, -mi, position in its group, index): lexsort is stable, so ties keep
    # the index order; among equals the groups take turns (the first sample of every
    # group before the second of any), so LPT spreads the samples of one prompt, whose
    # lengths go together, over the instances instead of stacking them on one
    sibling = np.zeros(n_req, dtype=np.int64)
    if any(g is not None for g in groups):
        seen: dict[str | None, int] = {}
        for k, g in enumerate(groups):
            if g is not None:
                sibling[k] = seen[g] = seen.get(g, -1) + 1
    by_length_a = np.lexsort((sibling, -mi_a, -q_a)) if n_req else np.zeros(0, dtype=np.int64)
    rank_a = np.empty(n_req, dtype=np.int64)
    rank_a[by_length_a] = np.arange(n_req)
    by_length = by_length_a.tolist()
    rank = rank_a.tolist()
    return Problem(
        state=state,
        perf=perf,
        config=config,
        rids=tuple(map(attrgetter("id"), reqs)),
        ctx=ctx,
        has_kv=has_kv,
        q=q,
        m=m,
        mi=mi,
        pre=pre,
        current=instance_of,
        rank=tuple(rank),
        by_length=tuple(by_length),
        costs=costs,
        nodes=nodes,
        node_gpus=node_gpus,
        current_pattern=current_pattern,
        options=options,
        instances=instances,
        by_node=by_node,
        links=_links(perf),
        recompute_only=frozenset(n.name for n in state.nodes if not n.kv_import),
        arrays=(q_a, mi_a, pre_a, ctx_a),
        current_index=current_index,
        rank_array=rank_a,
        kv_array=kv_a,
        long_group_array=long_group,
        late_place=critical / (critical + 1.0),
        arrival=tuple(arrival[r.id] for r in reqs),
        horizon_tokens=horizon,
        floor_s=0.0 if goal is None else goal.floor_s,
        measured_pause={n.name: n.reshard_pause_s for n in state.nodes if n.reshard_pause_s > 0},
    )
