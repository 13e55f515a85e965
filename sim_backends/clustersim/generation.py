"""Generation (rollout) of one RL step on continuous-batching instances.

Every instance is a TP group on one generation node. Time advances analytically from
event to event (a request finishes, the KV cache overflows, a pause ends, a re-plan),
never token by token:

- between events an instance's batch ``b`` is fixed and every running sequence gains
  one token per decode iteration; iteration ``i`` of a segment takes
  ``perf.decode_iteration_time(tp, b, mean context)`` (evaluated through
  :class:`DecodeTimes`) where the mean context grows by one token per iteration. The
  segment's time is the sum over its iterations by the trapezoid rule: exact when the
  iteration time is linear in the context (a memory-bound or compute-bound decode), an
  approximation only in a segment where the two bounds cross;
- admission (continuous batching, vLLM-style): queued requests join while the batch is
  below ``min(config.max_num_seqs, perf.max_num_seqs(tp))`` and their KV fits; joining
  requests are prefilled together (in chunks of ``PREFILL_CHUNK`` tokens, each costed by
  ``perf.prefill_time`` as one sequence, which overstates the attention FLOPs of many
  short prompts by at most ~15%), and decode waits for the prefill (no chunked-prefill
  mixing);
- when the running sequences outgrow the KV cache the newest is preempted back to the
  front of the queue and recomputes its KV when it is admitted again (vLLM's recompute
  preemption); a request that alone does not fit is admitted anyway (the engine would
  offload; rare with the defaults);
- the compute planner of :mod:`scheduler.compute` decides inside the simulation: at the
  step start and every ``replan_interval_s`` it gets the live state (instances, every
  request running/queued with its generated tokens and its GRPO group, the prompt) and
  a length forecast (:func:`scheduler.forecast.build_forecast` over past steps and this
  step so far, with every finished and running sample's group: the sibling signal; and,
  when the workload walks a finite dataset, every group's prior from its prompt's
  previous epoch, :func:`scheduler.forecast.prior_log_scales`, computed once a step) and
  its plan is applied (instance queues sorted by the plan's ``admit_order``):
  resharding nodes pause for the plan's ``pause_s``, requests moved by KV transfer or
  recompute stall their target instance for the plan's ``cost_s``.

Policies: ``static`` (fixed layout, requests split evenly up front), ``proactive``
(``plan_compute`` with reactive moves disabled: ``move_margin_s`` = infinity),
``reactive`` (``balance``: layout fixed, moves off stragglers), ``adaptive`` (both),
``oracle`` (:func:`~sim_backends.clustersim.oracle.oracle_plan`: knows every length;
a clairvoyant baseline charged the same reshard pauses and move costs), ``prompt-oracle``
(``adaptive`` told every prompt's difficulty: :func:`perfect_priors`, as if this very
step had been each prompt's previous epoch; the ceiling of what the epoch prior and the
siblings, group-level signals, can give the adaptive policy, short of each response's
own length).

Only the planner decides; the simulator does what the plan says and keeps time.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from orchestrrl import errors
from scheduler.compute import balance, plan_compute
from scheduler.compute_problem import DEFAULT_CONFIG, PlannerConfig
from scheduler.compute_state import (
    ComputePlan,
    ComputeState,
    Instance,
    MoveMethod,
    NodeGpus,
    Request,
    StepGoal,
    canonical_instances,
)
from scheduler.forecast import PriorLengths, build_forecast, prior_log_scales
from scheduler.perf_model import DecodeBreakdown, PerfModel
from scheduler.rollout import (
    RolloutRule,
    StepEnd,
    StepProgress,
    rule_met,
    step_deadline,
    step_done,
    step_goal,
)
from sim_backends.clustersim.oracle import OracleConfig, oracle_plan
from sim_backends.clustersim.workload import RolloutRequest

PREFILL_CHUNK = 8192  # vLLM max_num_batched_tokens for chunked prefill (V1 default 8192)
HISTORY_STEPS = 4  # past steps the length forecast sees

Pattern = tuple[int, ...]


@dataclass(frozen=True)
class Segment:
    """What a group of GPUs did over ``[start, end)``: ``run`` (an instance of TP ``tp``
    is up; it did its last work at ``busy_end``), or ``pause`` (reshard or KV move)."""

    node: str
    gpus: tuple[int, ...]
    tp: int
    start: float
    end: float
    kind: str
    busy_end: float = 0.0


@dataclass(frozen=True)
class GenStepResult:
    step: int
    seconds: float  # last response done (the step's generation time)
    completions: tuple[float, ...]  # sorted completion times
    lengths: tuple[int, ...]  # response lengths (the forecast's history)
    response_tokens: int
    prompt_tokens: int
    segments: tuple[Segment, ...]
    layout_start: Mapping[str, Pattern]
    layout_end: Mapping[str, Pattern]
    plans: int
    reshards: int
    migrations: int  # requests whose KV moved or was recomputed elsewhere
    preemptions: int
    pause_s: float  # total node pause time of reshards
    reasons: tuple[str, ...]  # the planner's reason for every plan that changed something
    # (plan time, the planner's predicted rest of the step after its plan) per plan
    predicted: tuple[tuple[float, float], ...] = ()
    # partial rollout (a StepStop): the requests finished, in completion order; the
    # unfinished ones at the step's end with the tokens each has generated in all (its
    # carried prefix included); when the rule was first met (None: not before the end)
    finished: tuple[str, ...] = ()
    unfinished: tuple[tuple[str, int], ...] = ()
    ready_s: float | None = None
    chunk_moves: int = 0  # divided rollout: chunks that went on on another instance
    decode_tokens: int = 0  # tokens decoded in the step (every response's, once)


@dataclass(frozen=True)
class StepStop:
    """Partial rollout in one step's simulation (:mod:`scheduler.rollout`): the rule, the
    groups the trainer takes, the earliest end (the previous batch's training), the
    responses each open group still needs to complete, and the complete groups that wait
    from earlier steps."""

    rule: RolloutRule
    groups_per_step: int
    min_end_s: float
    need: Mapping[str, int]
    complete: int = 0


def group_name(r: RolloutRequest) -> str:
    """The request's GRPO group: the samples of one prompt (named across steps when
    partial rollout carries it)."""
    return r.group or f"p{r.prompt}"


def perfect_priors(requests: Sequence[RolloutRequest]) -> dict[str, PriorLengths]:
    """Every prompt's prior as if its previous epoch had drawn exactly this step's
    responses (no drift between the two): the best epoch prior a real RL loop could have,
    which the ``prompt-oracle`` policy is given. It tells how long each prompt's responses
    run on the whole, not which of its samples is the long one."""
    by_group: dict[str, list[int]] = {}
    for r in requests:
        by_group.setdefault(group_name(r), []).append(r.response_tokens)
    step_log_mean = sum(math.log(r.response_tokens) for r in requests) / max(1, len(requests))
    return {g: PriorLengths(tuple(v), step_log_mean) for g, v in by_group.items()}


def gen_node_names(n: int) -> tuple[str, ...]:
    return tuple(f"gen{i:03d}" for i in range(n))


def uniform_layout(nodes: Sequence[str], gpus_per_node: int, tp: int) -> dict[str, Pattern]:
    return {n: tuple([tp] * (gpus_per_node // tp)) for n in nodes}


def uniform_pattern(gpus: int, tp: int) -> Pattern:
    """A node of ``gpus`` GPUs at TP ``tp``, or at the largest power-of-two fraction of
    ``tp`` that divides it (a node with a few GPUs generating: 2 at TP 4 is one TP2)."""
    t = max(1, tp)
    while t > 1 and gpus % t:
        t //= 2
    return tuple([t] * (gpus // t))


def decode_time(perf: PerfModel, tp: int, batch: int, ctx_sum: int, iterations: int) -> float:
    """Time of ``iterations`` decode iterations of ``batch`` sequences whose contexts sum
    to ``ctx_sum`` at the first one (trapezoid rule over the iterations)."""
    return DecodeTimes(perf).segment(tp, batch, ctx_sum, iterations)[0]


class DecodeTimes:
    """``perf.decode_iteration_time`` for the simulator's hot loop.

    The compute and memory terms of a decode iteration are affine in the context
    (FLOPs and KV bytes grow linearly with it) and every other term does not depend on
    it, so per (TP, batch) the breakdown at contexts 0 and 1 gives every context; the
    terms are combined by ``DecodeBreakdown.total_s`` itself. Checked against a direct
    call at a third context per (TP, batch); a model for which that does not hold is
    called directly.
    """

    def __init__(self, perf: PerfModel) -> None:
        self.perf = perf
        self._lines: dict[tuple[int, int], tuple[DecodeBreakdown, float, float] | None] = {}

    def at(self, tp: int, batch: int, ctx: float) -> float:
        key = (tp, batch)
        if key not in self._lines:
            self._lines[key] = self._line(tp, batch)
        line = self._lines[key]
        if line is None:
            return self.perf.decode_iteration_time(tp, batch, ctx)
        b0, dc, dm = line
        return replace(
            b0, compute_s=b0.compute_s + dc * ctx, memory_s=b0.memory_s + dm * ctx
        ).total_s

    def _line(self, tp: int, batch: int) -> tuple[DecodeBreakdown, float, float] | None:
        b0 = self.perf.decode_breakdown(tp, batch, 0.0)
        b1 = self.perf.decode_breakdown(tp, batch, 1.0)
        line = (b0, b1.compute_s - b0.compute_s, b1.memory_s - b0.memory_s)
        probe = 4096.0
        direct = self.perf.decode_breakdown(tp, batch, probe)
        c = b0.compute_s + line[1] * probe
        m = b0.memory_s + line[2] * probe
        same = (
            math.isclose(c, direct.compute_s, rel_tol=1e-9)
            and math.isclose(m, direct.memory_s, rel_tol=1e-9)
            and replace(direct, compute_s=0.0, memory_s=0.0)
            == replace(b0, compute_s=0.0, memory_s=0.0)
        )
        return line if same else None

    def segment(self, tp: int, batch: int, ctx_sum: int, iterations: int) -> tuple[float, float]:
        """(time of the iterations, time of the first one)."""
        if iterations <= 0 or batch <= 0:
            return 0.0, 0.0
        f0 = self.at(tp, batch, ctx_sum / batch)
        if iterations == 1:
            return f0, f0
        f1 = self.at(tp, batch, ctx_sum / batch + (iterations - 1))
        return iterations * (f0 + f1) / 2.0, f0


def static_turns(insts: Sequence[_Inst], n: int) -> list[_Inst]:
    """The static dispatcher's instance for each of ``n`` requests in order: in turn
    (verl splits a batch evenly over its equal instances); when instances differ in size
    (a node shared with training runs smaller ones) each in proportion to its GPUs, by
    smooth weighted round robin (nginx's: the same turns as plain round robin when all
    weigh the same)."""
    if not insts:
        return []
    if len({s.tp for s in insts}) == 1:
        return [insts[i % len(insts)] for i in range(n)]
    total = sum(s.tp for s in insts)
    current = [0] * len(insts)
    out: list[_Inst] = []
    for _ in range(n):
        for k, s in enumerate(insts):
            current[k] += s.tp
        k = max(range(len(insts)), key=lambda j: (current[j], -j))
        current[k] -= total
        out.append(insts[k])
    return out


def prefill_batch_time(perf: PerfModel, tp: int, tokens: int) -> float:
    total = 0.0
    while tokens > 0:
        n = min(PREFILL_CHUNK, tokens)
        total += perf.prefill_time(tp, n)
        tokens -= n
    return total


class _Req:
    __slots__ = (
        "chunk_end",
        "done_at",
        "gen0",
        "generated",
        "group",
        "id",
        "inst",
        "it0",
        "length",
        "prompt",
        "running",
    )

    def __init__(self, r: RolloutRequest) -> None:
        self.id = r.id
        self.group = group_name(r)
        self.prompt = r.prompt_tokens
        self.length = r.response_tokens
        self.generated = r.generated  # tokens generated as of the instance's iteration it0
        self.inst: _Inst | None = None
        self.running = False
        self.it0 = 0
        self.done_at = -1.0
        # divided rollout: the generated count at which its current chunk ends
        self.chunk_end = 1 << 62

    def ctx_at(self, it: int) -> int:
        return self.prompt + self.generated + (it - self.it0)


class _Inst:
    def __init__(self, iid: str, node: str, gpus: tuple[int, ...], now: float, cap: int) -> None:
        self.id = iid
        self.node = node
        self.gpus = gpus
        self.tp = len(gpus)
        self.cap = cap
        self.clock = now
        self.busy_until = now
        self.created = now
        self.last_work = now
        self.it = 0
        self.running: dict[str, _Req] = {}
        self.heap: list[tuple[int, str]] = []
        self.ctx_sum = 0
        self.queue: deque[_Req] = deque()
        self.version = 0
        # the decode segment in flight: start clock, iterations, batch, f0, slope
        self.seg: tuple[float, int, int, float, float] | None = None


class GenerationSim:
    """One step's rollout (mutable working state private to :func:`simulate_step`)."""

    def __init__(
        self,
        perf: PerfModel,
        gpus_per_node: int,
        layout: Mapping[str, Pattern],
        policy: str,
        replan_interval_s: float,
        config: PlannerConfig,
        max_response_tokens: int,
        history: Sequence[Sequence[int]],
        stop: StepStop | None = None,
        chunk_tokens: int = 0,
    ) -> None:
        self.perf = perf
        self.chunk_tokens = chunk_tokens
        self.chunk_moves = 0  # divided rollout: chunks that continued on another instance
        self.decode = DecodeTimes(perf)
        self.policy = policy
        self.interval = replan_interval_s
        self.config = config
        self.max_num_seqs = config.max_num_seqs
        self.max_tokens = max_response_tokens
        self.history = [list(h) for h in history][-HISTORY_STEPS:]
        self.nodes = tuple(sorted(layout))
        # a node's GPUs are its layout's (a node the pools share has fewer than
        # gpus_per_node generating: SplitConfig.unit_gpus)
        self.node_gpus = {n: tuple(range(sum(layout[n]) or gpus_per_node)) for n in self.nodes}
        self.insts: dict[str, _Inst] = {}
        self.cap_of: dict[int, int] = {}
        self.seq_cap_of: dict[int, int] = {}
        self.events: list[tuple[float, int, str, int]] = []
        self.seq = 0
        self.segments: list[Segment] = []
        self.completed: list[int] = []
        self.completed_groups: list[str] = []
        self.completions: list[float] = []
        self.plans = 0
        self.reshards = 0
        self.migrations = 0
        self.preemptions = 0
        self.pause_s = 0.0
        self.reasons: list[str] = []
        self.predicted: list[tuple[float, float]] = []
        self.unfinished = 0
        self.final_layout: dict[str, Pattern] = {}
        self.global_queue: list[_Req] = []
        self.group_prior: dict[str, float] = {}  # per group, the previous epoch's prior
        self.reqs: dict[str, _Req] = {}
        self.lengths: dict[str, int] = {}  # true lengths: read by the oracle policy only
        self.stop = stop
        self.need = dict(stop.need) if stop is not None else {}
        self.complete_groups = stop.complete if stop is not None else 0
        self.finished: list[str] = []
        self.tokens = 0  # decode tokens generated in this step (finished segments)
        self.check_due = False
        self.ready_s: float | None = None
        self.oracle = OracleConfig(
            max_num_seqs=config.max_num_seqs,
            tps=tuple(
                t
                for t in (1, 2, 4, 8, 16)
                if gpus_per_node % t == 0 and perf.model.heads % t == 0 and perf.fits(t)
            ),
            dispatch_ahead_s=replan_interval_s,  # a lane's requests wait for no re-plan
        )
        for n in self.nodes:
            for inst in canonical_instances(n, self.node_gpus[n], layout[n]):
                self._add_instance(inst, 0.0)

    # -- instances --

    def _cap(self, tp: int) -> int:
        cap = self.cap_of.get(tp)
        if cap is None:
            cap = self.cap_of[tp] = self.perf.kv_capacity_tokens(tp)
        return cap

    def _seq_cap(self, tp: int) -> int:
        """Running sequences a TP ``tp`` instance admits: the planner's cap and the
        engine's per-TP cap (``PerfModel.max_num_seqs``), whichever is lower."""
        cap = self.seq_cap_of.get(tp)
        if cap is None:
            cap = self.seq_cap_of[tp] = min(self.max_num_seqs, self.perf.max_num_seqs(tp))
        return cap

    def _add_instance(self, inst: Instance, now: float) -> _Inst:
        s = _Inst(inst.id, inst.node, inst.gpus, now, self._cap(inst.tp))
        self.insts[inst.id] = s
        return s

    def _retire(self, s: _Inst, now: float) -> None:
        self.segments.append(
            Segment(s.node, s.gpus, s.tp, s.created, now, "run", min(s.last_work, now))
        )
        del self.insts[s.id]

    def layout(self) -> dict[str, Pattern]:
        out: dict[str, list[int]] = {n: [] for n in self.nodes}
        for s in self.insts.values():
            out[s.node].append(s.tp)
        return {n: tuple(sorted(v, reverse=True)) for n, v in out.items()}

    # -- running one instance --

    def _schedule(self, s: _Inst) -> None:
        s.version += 1
        s.seg = None
        if s.busy_until > s.clock:
            t = s.busy_until
        else:
            self._admit(s)
            if s.busy_until > s.clock:
                t = s.busy_until
            elif not s.running:
                return  # idle until given work
            else:
                b = len(s.running)
                while s.heap and not self._live(s, s.heap[0]):
                    heapq.heappop(s.heap)
                k = s.heap[0][0] - s.it
                free = s.cap - s.ctx_sum
                if b * k > free and b > 1:  # the KV cache overflows first
                    k = max(1, free // b)
                k = max(1, k)
                dt, f0 = self.decode.segment(s.tp, b, s.ctx_sum, k)
                slope = 0.0 if k == 1 else 2.0 * (dt / k - f0) / (k - 1)
                s.seg = (s.clock, k, b, f0, slope)
                t = s.clock + dt
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, s.id, s.version))

    def _admit(self, s: _Inst) -> None:
        tokens = 0
        while s.queue and len(s.running) < self._seq_cap(s.tp):
            r = s.queue[0]
            need = r.prompt + r.generated
            if s.running and s.ctx_sum + need > s.cap:
                break
            s.queue.popleft()
            self._start(s, r)
            tokens += need
        if tokens:
            s.busy_until = s.clock + prefill_batch_time(self.perf, s.tp, tokens)
            s.last_work = s.busy_until

    def _start(self, s: _Inst, r: _Req) -> None:
        """``r`` (with its KV present on ``s``) joins the running batch."""
        r.inst = s
        r.running = True
        r.it0 = s.it
        s.running[r.id] = r
        s.ctx_sum += r.prompt + r.generated
        if self.chunk_tokens and r.chunk_end > r.length:
            r.chunk_end = r.generated + self.chunk_tokens  # a chunk starts
        stop_at = min(r.length, r.chunk_end)
        heapq.heappush(s.heap, (s.it + stop_at - r.generated, r.id))

    @staticmethod
    def _live(s: _Inst, entry: tuple[int, str]) -> bool:
        """Whether a heap entry of ``s`` is its running request's current end: not one
        that left, nor one from before it was preempted and admitted here again (its
        current entry is later; the stale one had ended such requests early)."""
        r = s.running.get(entry[1])
        return r is not None and entry[0] == r.it0 + min(r.length, r.chunk_end) - r.generated

    def _stop(self, s: _Inst, r: _Req) -> None:
        """``r`` leaves the running batch (its generated count brought up to date)."""
        r.generated += s.it - r.it0
        r.it0 = s.it
        s.ctx_sum -= r.prompt + r.generated
        del s.running[r.id]
        r.running = False

    def _finish_segment(self, s: _Inst, now: float) -> None:
        """Handle the event of ``s`` at ``now``: a pause ended or a decode segment did."""
        if s.seg is None:
            s.clock = max(s.clock, now)
            return
        _, k, b, _, _ = s.seg
        s.it += k
        s.ctx_sum += b * k
        self.tokens += b * k
        s.clock = now
        s.last_work = now
        s.seg = None
        chunked: list[_Req] = []
        while s.heap and s.heap[0][0] <= s.it:
            entry = heapq.heappop(s.heap)
            if not self._live(s, entry):
                continue
            r = s.running[entry[1]]
            self._stop(s, r)
            if r.generated < r.length:  # its chunk ended (divided rollout)
                r.chunk_end = 1 << 62
                chunked.append(r)
                continue
            r.done_at = now
            r.inst = None
            self.completed.append(r.length)
            self.completed_groups.append(r.group)
            self.completions.append(now)
            self.finished.append(r.id)
            self.unfinished -= 1
            if self.stop is not None:
                left = self.need.get(r.group, 0) - 1
                self.need[r.group] = left
                if left == 0:
                    self.complete_groups += 1
                self.check_due = True
        if s.ctx_sum > s.cap and len(s.running) > 1:
            newest = max(s.running.values(), key=lambda r: (r.it0, r.id))
            self._stop(s, newest)
            s.queue.appendleft(newest)
            self.preemptions += 1
        for r in chunked:
            self._next_chunk(s, r, now)

    def _next_chunk(self, s: _Inst, r: _Req, now: float) -> None:
        """Divided rollout (Seer, arXiv 2511.14617, section 3.2): a request whose chunk
        ended on ``s`` goes on where there is most room, the instance with the fewest
        requests (running and waiting) per seat, then the most free KV cache; on ``s``
        itself when it is as free as any. Elsewhere its KV cache follows it as a
        migration's does: moved (NVLink or RDMA) or recomputed, whichever is cheaper,
        stalling the instance it joins for that long; there it starts at once if a seat
        and its KV fit, else it waits first in line (and is recomputed when admitted, as
        an engine would)."""

        def room(x: _Inst) -> tuple[float, float, int, str]:
            load = (len(x.running) + len(x.queue)) / self._seq_cap(x.tp)
            return (load, -(x.cap - x.ctx_sum) / x.cap, x is not s, x.id)

        dst = min(self.insts.values(), key=room)
        if dst is s:
            self._start(s, r)  # its KV stays and its seat is free: it goes on here
            return
        ctx = r.prompt + r.generated
        move = self.perf.kv_move_time(ctx, same_node=dst.node == s.node, src_tp=s.tp, dst_tp=dst.tp)
        cost = min(move, self.perf.recompute_time(dst.tp, ctx))
        self.chunk_moves += 1
        self._sync(dst, now)
        dst.busy_until = max(dst.busy_until, dst.clock, now) + cost
        r.inst = dst
        fits = len(dst.running) < self._seq_cap(dst.tp) and (
            not dst.running or dst.ctx_sum + ctx <= dst.cap
        )
        if fits:
            self._start(dst, r)
        else:
            dst.queue.appendleft(r)
        self._schedule(dst)

    @staticmethod
    def _iterations_done(seg: tuple[float, int, int, float, float], now: float) -> int:
        """Whole iterations of a decode segment done by ``now`` (fewer than all of it)."""
        start, k, _, f0, slope = seg
        elapsed = now - start
        # iterations done: largest j <= k with j*f0 + slope*j*(j-1)/2 <= elapsed
        if slope > 1e-15:
            a = slope / 2.0
            bb = f0 - a
            j = int((-bb + math.sqrt(bb * bb + 4 * a * elapsed)) / (2 * a))
        else:
            j = int(elapsed / f0) if f0 > 0 else k
        j = max(0, min(k - 1, j))
        while j > 0 and j * f0 + slope * j * (j - 1) / 2.0 > elapsed + 1e-12:
            j -= 1
        return j

    def _sync(self, s: _Inst, now: float) -> None:
        """Bring an instance with a decode segment in flight to ``now`` (whole iterations)."""
        if s.seg is None or now <= s.clock:
            return
        start, _, b, f0, slope = s.seg
        j = self._iterations_done(s.seg, now)
        s.it += j
        s.ctx_sum += b * j
        self.tokens += b * j
        s.clock = start + j * f0 + slope * j * (j - 1) / 2.0
        if j:
            s.last_work = s.clock
        s.seg = None
        s.version += 1

    # -- the step --

    def run(self, requests: Sequence[RolloutRequest]) -> float:
        previous: dict[str, PriorLengths] = {}
        for rr in requests:
            r = _Req(rr)
            self.reqs[r.id] = r
            self.lengths[r.id] = r.length
            if rr.previous is not None and r.group not in previous:
                previous[r.group] = PriorLengths(rr.previous.lengths, rr.previous.step_log_mean)
        if self.policy == "prompt-oracle":
            previous = perfect_priors(requests)
        self.group_prior = prior_log_scales(previous)
        self.unfinished = len(self.reqs)
        ordered = [self.reqs[rr.id] for rr in requests]
        if self.policy == "static":
            insts = sorted(self.insts.values(), key=lambda s: s.id)
            for r, s in zip(ordered, static_turns(insts, len(ordered)), strict=True):
                r.inst = s
                s.queue.append(r)
        else:
            self.global_queue = ordered
        now = 0.0
        next_plan = 0.0 if self.policy != "static" else math.inf
        stop = self.stop
        deadline = step_deadline(stop.rule, stop.min_end_s) if stop is not None else math.inf
        ended: float | None = None
        for s in self.insts.values():
            self._schedule(s)
        while self.unfinished > 0:
            t_event = self.events[0][0] if self.events else math.inf
            if deadline <= min(next_plan, t_event):
                now, deadline = deadline, math.inf
                if self._stop_now(now):
                    ended = now
                    break
                continue
            if next_plan <= t_event:
                if math.isinf(next_plan):
                    raise errors.FailedPrecondition(
                        f"generation stalled: {self.unfinished} request(s) left, no instance busy"
                    )
                now = next_plan
                self._replan(now)
                next_plan = now + self.interval
                if not self.events and self.global_queue:
                    raise errors.FailedPrecondition(
                        f"{len(self.global_queue)} request(s) fit no instance's KV cache "
                        f"(e.g. {self.global_queue[0].id}); the planner leaves them queued"
                    )
                continue
            t, _, iid, version = heapq.heappop(self.events)
            live = self.insts.get(iid)
            if live is None or live.version != version:
                continue
            now = t
            self._finish_segment(live, t)
            if self.check_due:
                self.check_due = False
                if self._stop_now(now):
                    ended = now
                    break
            self._schedule(live)
        end = max(self.completions, default=0.0)
        if stop is not None:
            end = ended if ended is not None else max(end, stop.min_end_s)
            if ended is not None:
                for s in self.insts.values():
                    self._sync(s, end)
        self.final_layout = self.layout()
        for s in list(self.insts.values()):
            self._retire(s, max(end, s.busy_until))
        return end

    def _stop_now(self, now: float) -> bool:
        """Whether the step's rule (a ``StepStop``) ends its generation at ``now``."""
        stop = self.stop
        if stop is None:
            return False
        progress = StepProgress(
            elapsed_s=now,
            complete_groups=self.complete_groups,
            tokens=self._tokens_at(now) if stop.rule.end is StepEnd.TOKENS else 0,
            in_flight=self.unfinished,
            min_end_s=stop.min_end_s,
        )
        if self.ready_s is None and rule_met(stop.rule, stop.groups_per_step, progress):
            self.ready_s = now
        return step_done(stop.rule, stop.groups_per_step, progress)

    def _goal(self, now: float) -> StepGoal | None:
        """What ends the step, for the planner (partial rollout; None: full)."""
        stop = self.stop
        if stop is None:
            return None
        progress = StepProgress(
            elapsed_s=now,
            complete_groups=self.complete_groups,
            tokens=self._tokens_at(now) if stop.rule.end is StepEnd.TOKENS else 0,
            in_flight=self.unfinished,
            min_end_s=stop.min_end_s,
        )
        return step_goal(stop.rule, stop.groups_per_step, progress)

    def _tokens_at(self, now: float) -> int:
        """Decode tokens generated in this step by ``now`` (segments in flight included)."""
        return self.tokens + sum(
            self._iterations_done(s.seg, now) * s.seg[2]
            for s in self.insts.values()
            if s.seg is not None and now > s.clock
        )

    def unfinished_tokens(self) -> list[tuple[str, int]]:
        """Every unfinished request and the tokens it has generated in all (after the
        step's end brought the instances up to date)."""
        out: list[tuple[str, int]] = []
        for r in self.reqs.values():
            if r.done_at >= 0:
                continue
            s = r.inst
            g = r.generated + (s.it - r.it0) if r.running and s is not None else r.generated
            out.append((r.id, g))
        return out

    # -- the planner in the loop --

    def _state(self, now: float) -> ComputeState:
        nodes = tuple(NodeGpus(n, self.node_gpus[n]) for n in self.nodes)
        instances = tuple(
            sorted(
                (Instance(s.id, s.node, s.gpus) for s in self.insts.values()), key=lambda i: i.id
            )
        )
        requests: list[Request] = []
        for s in self.insts.values():
            for r in s.running.values():
                g = r.generated + (s.it - r.it0)
                requests.append(Request(r.id, r.prompt, g, s.id, True, r.group))
            for r in s.queue:
                requests.append(Request(r.id, r.prompt, r.generated, s.id, False, r.group))
        for r in self.global_queue:
            requests.append(Request(r.id, r.prompt, r.generated, None, False, r.group))
        return ComputeState(nodes, instances, tuple(requests))

    def _replan(self, now: float) -> None:
        # instances decoding now: their iteration in progress goes on through the plan
        decoding = {s.id for s in self.insts.values() if s.seg is not None and now > s.clock}
        for s in self.insts.values():
            self._sync(s, now)
        state = self._state(now)
        running = [r.generated_tokens for r in state.requests]
        forecast = build_forecast(
            self.history,
            self.completed,
            running,
            max_tokens=self.max_tokens,
            completed_groups=self.completed_groups,
            running_groups=[r.group for r in state.requests],
            group_prior=self.group_prior,
        )
        goal = self._goal(now)
        if self.policy == "oracle":
            plan = oracle_plan(state, self.lengths, self.perf, now, self.oracle)
        elif self.policy == "reactive":
            plan = balance(state, forecast, self.perf, now, self.config, goal=goal)
        else:
            plan = plan_compute(state, forecast, self.perf, now, self.config, goal=goal)
        self.plans += 1
        self.predicted.append((now, plan.prediction.planned_makespan_s))
        if not plan.empty:
            self.reasons.append(f"t={now:.1f}s: {plan.reason}")
        self._apply(plan, now, decoding)

    def _apply(
        self, plan: ComputePlan, now: float, decoding: frozenset[str] | set[str] = frozenset()
    ) -> None:
        """Carry out ``plan`` at ``now``. ``decoding``: instances with a decode iteration
        in progress (brought to its start by ``_sync``): one that keeps running requests
        resumes from there, so a plan that changes nothing on it costs it nothing."""
        # requests leave every instance they are on; the plan says where they go
        where: dict[str, _Req] = {}
        had_kv: dict[str, bool] = {}
        target = dict(plan.assignment)
        resharding = {x.node for x in plan.reshards}
        for s in self.insts.values():
            for r in list(s.running.values()):
                if target.get(r.id) != s.id or s.node in resharding:
                    self._stop(s, r)
                    where[r.id] = r
                    had_kv[r.id] = True
            kept: deque[_Req] = deque()
            for r in s.queue:
                if target.get(r.id) == s.id and s.node not in resharding:
                    kept.append(r)
                else:
                    where[r.id] = r
                    had_kv[r.id] = False
            s.queue = kept
        for r in self.global_queue:
            where[r.id] = r
            had_kv[r.id] = False
        self.global_queue = []
        # reshards: the node pauses; its instances are replaced
        for rs in plan.reshards:
            self.reshards += 1
            self.pause_s += rs.pause_s
            end = now + rs.pause_s
            for s in [x for x in self.insts.values() if x.node == rs.node]:
                if s.id in rs.removed:
                    self._retire(s, now)
                else:
                    s.busy_until = max(s.busy_until, s.clock, end)
            for inst in rs.added:
                new = self._add_instance(inst, now)
                new.busy_until = end
            self.segments.append(
                Segment(rs.node, self.node_gpus[rs.node], 0, now, end, "pause", end)
            )
        stall = {
            m.request: m.cost_s for m in plan.migrations if m.method is not MoveMethod.DISPATCH
        }
        self.migrations += len(stall)
        for rid, r in where.items():
            iid = target.get(rid)
            dst = self.insts.get(iid) if iid is not None else None
            if dst is None:
                r.inst = None
                self.global_queue.append(r)
                continue
            r.inst = dst
            fits = len(dst.running) < self._seq_cap(dst.tp) and (
                not dst.running or dst.ctx_sum + r.prompt + r.generated <= dst.cap
            )
            if had_kv[rid]:
                cost = stall.get(rid, 0.0)
                if cost > 0:
                    dst.busy_until = max(dst.busy_until, dst.clock, now) + cost
                if fits:
                    self._start(dst, r)
                else:  # no seat or no KV room: it waits first in line, recomputed when
                    dst.queue.appendleft(r)  # admitted (as an engine preempts it)
            else:
                dst.queue.append(r)
        # queues run in the plan's order (predicted longest first; the oracle's
        # assignment is in its longest-first order); unranked requests keep their place
        # after the ranked ones
        order = plan.admit_order or (
            tuple(rid for rid, _ in plan.assignment) if self.policy == "oracle" else ()
        )
        if order:
            rank = {rid: i for i, rid in enumerate(order)}
            for s in self.insts.values():
                s.queue = deque(sorted(s.queue, key=lambda r: rank.get(r.id, len(rank))))
        for s in self.insts.values():
            if s.busy_until < now and s.seg is None and not (s.id in decoding and s.running):
                s.clock = max(s.clock, now)
            self._schedule(s)


def simulate_step(
    perf: PerfModel,
    requests: Sequence[RolloutRequest],
    layout: Mapping[str, Pattern],
    *,
    step: int = 0,
    gpus_per_node: int = 8,
    policy: str = "static",
    replan_interval_s: float = 5.0,
    config: PlannerConfig = DEFAULT_CONFIG,
    max_response_tokens: int = 20480,
    history: Sequence[Sequence[int]] = (),
    stop: StepStop | None = None,
    chunk_tokens: int = 0,
) -> GenStepResult:
    """Simulate one step's generation from a starting layout (node -> TP pattern; a
    node's GPUs are its pattern's); with ``stop``, until its partial-rollout rule ends the
    step (requests may carry a prefix generated in earlier steps:
    ``RolloutRequest.generated``); ``chunk_tokens`` > 0: divided rollout
    (:meth:`GenerationSim._next_chunk`)."""
    if policy == "proactive":
        config = replace(config, move_margin_s=math.inf)
    sim = GenerationSim(
        perf,
        gpus_per_node,
        layout,
        policy,
        replan_interval_s,
        config,
        max_response_tokens,
        history,
        stop,
        chunk_tokens,
    )
    start = sim.layout()
    seconds = sim.run(requests)
    return GenStepResult(
        step=step,
        seconds=seconds,
        completions=tuple(sorted(sim.completions)),
        lengths=tuple(sim.completed),
        response_tokens=sum(r.response_tokens for r in requests),
        prompt_tokens=sum(r.prompt_tokens for r in requests),
        segments=tuple(sim.segments),
        layout_start=start,
        layout_end=sim.final_layout,
        plans=sim.plans,
        reshards=sim.reshards,
        migrations=sim.migrations,
        preemptions=sim.preemptions,
        pause_s=sim.pause_s,
        reasons=tuple(sim.reasons),
        predicted=tuple(sim.predicted),
        finished=tuple(sim.finished),
        unfinished=tuple(sim.unfinished_tokens()) if stop is not None else (),
        ready_s=sim.ready_s,
        chunk_moves=sim.chunk_moves,
        decode_tokens=sim.tokens,
    )
